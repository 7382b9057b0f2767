"""Programmatic dependent launch (device only): every kernel waits for its predecessor, so a decode step captured
with programmatic edges gives the bits of the same step launched normally."""
from __future__ import annotations

import pytest

from stratad.engine.generation import Generation
from stratad.engine.sampling import SamplingParams
from stratad.model.generator import make_model
from stratad.model.gguf_file import ModelFile

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tmp_path_factory, cp):
    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    make_model(path, "tiny", expert_quant="IQ3_S", router_skew=1.0, seed=5)
    return ModelFile(path)


def digest(model, graphs: bool, frac: float) -> str:
    from lane.cupy_card import CupyCard

    c = model.config
    n = int(frac * c.n_layer * c.n_expert)
    card = CupyCard(model, 0, n, 4096, graphs=graphs)
    card.pool.fill([(layer, e) for layer in range(c.n_layer) for e in range(c.n_expert)][:n])
    g = Generation(card, model.tokenizer, model.tokenizer.encode("Launch them early, wait for the data."),
                   SamplingParams(max_tokens=24), c.context_length, digest=True)
    for _ in g:
        pass
    card.close()
    return g.digest.hexdigest()


@pytest.mark.parametrize("frac", [1.0, 0.5])
def test_pdl_changes_no_bit(model, monkeypatch, frac):
    from lane.kernels import launch

    monkeypatch.setattr(launch, "PDL", False)
    want = digest(model, True, frac)
    monkeypatch.setattr(launch, "PDL", True)
    assert digest(model, True, frac) == want  # captured graphs with programmatic edges
    assert digest(model, False, frac) == want  # eager launches (plain: PDL is for captured graphs only)


def test_bad_argument_is_named(cp, monkeypatch):
    from lane.kernels import device, launch

    monkeypatch.setattr(launch, "PDL", True)
    fn, pos, s = device.module("rope_kv.cu").fn("advance_pos"), cp.zeros(1, cp.int32), cp.cuda.Stream(non_blocking=True)
    with s, pytest.raises(TypeError, match="kernel argument of type int"):
        s.begin_capture()  # PDL launches are the captured ones
        try:
            launch.launch(fn, (1,), (1,), (pos, 1))
        finally:
            s.end_capture()
