"""Shared test set-up: the `slow` marker's opt-in, hypothesis' examples fixed, a tiny model built once per session,
host caches of small slots."""
from __future__ import annotations

import os

import pytest
from hypothesis import settings

SLOW_ENV = "STRATAD_SLOW"
# The property tests draw the same examples every run, so that CI does not fail on an input one run happened to
# draw; HYPOTHESIS_EXPLORE=1 (with more examples) looks for new ones
settings.register_profile("stratad", derandomize=not os.environ.get("HYPOTHESIS_EXPLORE"))
settings.load_profile("stratad")


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` (the full a3b shape: minutes, ~14 GB of disk) run only with STRATAD_SLOW=1."""
    if os.environ.get(SLOW_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"slow test: set {SLOW_ENV}=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """The tiny preset (IQ3_S experts, Q8_0 dense, router skew 1.0, seed 0), generated once for the session."""
    from stratad.model.generator import make_model

    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    make_model(path, "tiny", expert_quant="IQ3_S", dense_quant="Q8_0", router_skew=1.0, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path):
    """The session's tiny model, opened once (read-only: do not close it in a test)."""
    from stratad.model.gguf_file import ModelFile

    m = ModelFile(tiny_model_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def card(tiny_model):
    """A numpy card holding every expert of the tiny model."""
    import numpy as np

    from lane.numpy_card import NumpyCard
    from lane.slot_pool import SlotPool
    from stratad.model.slot_layout import slot_bytes

    c = tiny_model.config
    n = c.n_layer * c.n_expert
    pool = SlotPool(tiny_model, np.zeros(n * slot_bytes(tiny_model), np.uint8), n)
    pool.fill([(layer, e) for layer in range(c.n_layer) for e in range(c.n_expert)])
    return NumpyCard(tiny_model, pool)


@pytest.fixture(scope="session")
def cp():
    """CuPy, or a skip where there is no CUDA device (CI): the GPU tests' entry point."""
    try:
        import cupy
    except Exception:  # noqa: BLE001 - any import failure means no GPU path here
        pytest.skip("cupy is not installed")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception:  # noqa: BLE001
        pytest.skip("no CUDA device")
    return cupy


@pytest.fixture
def host_cache(tmp_path):
    """make(n_slots): a host conversation cache (stratad/kv_store.py) of n slots of 256 bytes, made by this process
    (lane 0); each is closed after the test, which checks its creator unlinked it."""
    from stratad import kv_store, shm

    made = []

    def make(n_slots: int):
        name = kv_store.segment_name(shm.prefix_for(tmp_path / f"cache{len(made)}"))
        st = kv_store.KvStore(name, create=True, limit_bytes=n_slots * 256, slot_bytes=256, lane=0)
        made.append((st, name))
        return st
    yield make
    for st, name in made:
        st.close()
        assert not shm.unlink(name)  # the creator unlinked it
