"""GPU lanes through the daemon (device only): two logical cards on one GPU, peers through CUDA IPC.

Greedy generations are bit-identical (logits digests) across solo, lead + peer, independent lanes and mutual help.
"""
from __future__ import annotations

import threading

import pytest

from daemon_harness import Daemon
from stratad.model.generator import make_model

pytestmark = pytest.mark.gpu
PROMPTS = {"A": list(range(2, 200, 6)), "B": list(range(3, 200, 6))}  # two topics: even and odd ids


@pytest.fixture(scope="module")
def model(tmp_path_factory, cp):
    path = tmp_path_factory.mktemp("m") / "mini-topics.gguf"
    make_model(path, "mini", expert_quant="IQ3_S", router_skew=0.7, topics=2)
    return path


def run(d: Daemon, names: list[str], n: int = 48) -> dict:
    out = {}

    def go(name):
        with d.client(stream_timeout_s=600) as c:
            s = c.generate(tokens=PROMPTS[name], max_tokens=n, digest=True)
            s.result()
            out[name] = s.stats

    ts = [threading.Thread(target=go, args=(nm,)) for nm in names]
    for t in ts:
        t.start()
    for t in ts:
        t.join(600)
    return out


def start(model, tmp_path, cards: str, cache: str, mutual: bool) -> Daemon:
    conf = tmp_path / f"{cards}-{mutual}.toml"
    conf.write_text(f"mutual_help = {str(mutual).lower()}\nrejoin_idle_s = 3600.0\n")
    return Daemon(model, tmp_path / f"run-{cards}-{mutual}", cards=cards, config=conf,
                  extra=["--expert-cache", cache]).start(timeout_s=300)


def test_modes_bit_identical_on_gpu_cards(model, tmp_path):
    solo = start(model, tmp_path, "0", "1.0", False)
    try:
        want = {k: v.logits_sha256 for k, v in run(solo, ["A"]).items()} | \
            {k: v.logits_sha256 for k, v in run(solo, ["B"]).items()}
    finally:
        solo.stop()
    pair = start(model, tmp_path, "0,0", "0.3", False)
    try:
        one = run(pair, ["A"])  # lead + peer: the idle card lends its slots through CUDA IPC
        assert one["A"].logits_sha256 == want["A"] and one["A"].experts_peer > 0
        two = run(pair, ["A", "B"])  # independent lanes
        assert all(two[k].logits_sha256 == want[k] for k in "AB")
    finally:
        pair.stop()
    mutual = start(model, tmp_path, "0,0", "0.3", True)
    try:
        two = run(mutual, ["A", "B"])
        assert all(two[k].logits_sha256 == want[k] and two[k].experts_peer > 0 for k in "AB")
    finally:
        mutual.stop()
