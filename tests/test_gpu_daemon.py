"""GPU lanes through the daemon (device only): two logical cards on one GPU (STRATAD_TEST_CARDS=0,1: on two GPUs),
peers through CUDA IPC.

Greedy generations are bit-identical (logits digests) to a solo GPU card holding every expert, across lead + peer,
independent lanes, mutual help, a split and a rejoin in the middle of a generation, adaptive swaps while the other
lane computes, a peer lane killed mid-generation, and the experts no card holds read by the card from the arena;
a split model (shards) serves the one-file model's tokens and bits.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from daemon_harness import Daemon, max_tokens_of, rejoined_after_split, run_chats, split_then_rejoin
from stratad.model.generator import make_model

pytestmark = pytest.mark.gpu
PROMPTS = {"A": list(range(2, 200, 6)), "B": list(range(3, 200, 6))}  # two topics: even and odd ids
CARDS = os.environ.get("STRATAD_TEST_CARDS", "0,0")  # the lanes' cards ("0,1": a peer on another GPU)


@pytest.fixture(scope="module")
def model(tmp_path_factory, cp):
    path = tmp_path_factory.mktemp("m") / "mini-topics.gguf"
    make_model(path, "mini", expert_quant="IQ3_S", router_skew=0.7, topics=2)
    return path


def toml_value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else str(v)


def start(model, tmp_path, cards: str, cache: str, gpu: dict | None = None, **cfg) -> Daemon:
    """A daemon on these cards; cfg: top-level config keys, gpu: the [gpu] table's. prefix_cache off unless cfg says:
    the tests compare fresh reads of a prompt (a kept prefix is not read bit-identically, README)."""
    cfg = {"mutual_help": False, "rejoin_idle_s": 3600.0, "prefix_cache": False} | cfg
    conf = tmp_path / f"{cards}-{len(list(tmp_path.iterdir()))}.toml"
    conf.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in cfg.items()) +
                    "[gpu]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in (gpu or {}).items()))
    return Daemon(model, tmp_path / f"run-{conf.stem}", cards=cards, config=conf,
                  extra=["--expert-cache", cache]).start(timeout_s=300)


@pytest.fixture(scope="module")
def want(model, tmp_path_factory):
    """digest(name, n): a solo GPU card with every expert cached, n greedy tokens (kept running for the module)."""
    solo = start(model, tmp_path_factory.mktemp("solo"), "0", "1.0")
    memo = {}

    def digest(name: str, n: int, ignore_eos: bool = False) -> str:
        if (name, n, ignore_eos) not in memo:
            with solo.client(stream_timeout_s=600) as c:
                s = c.generate(tokens=PROMPTS[name], max_tokens=n, digest=True, ignore_eos=ignore_eos)
                s.result()
                memo[name, n, ignore_eos] = s.stats.logits_sha256
        return memo[name, n, ignore_eos]

    yield digest
    solo.stop()


def run(d: Daemon, jobs: list[tuple[str, int]]) -> dict:
    """name -> the request's stats, the chats run at once (the first streaming before the others start)."""
    return {k: s.stats for k, s in run_chats(d, jobs, lambda name: {"tokens": PROMPTS[name]}, timeout_s=600).items()}


def test_modes_bit_identical_on_gpu_cards(model, tmp_path, want):
    pair = start(model, tmp_path, CARDS, "0.3")
    try:
        one = run(pair, [("A", 48)])  # lead + peer: the idle card lends its slots through CUDA IPC
        assert one["A"].logits_sha256 == want("A", 48) and one["A"].experts_peer > 0
        two = run(pair, [("A", 96), ("B", 48)])  # B splits a peer off in the middle of A
        assert two["A"].logits_sha256 == want("A", 96) and two["B"].logits_sha256 == want("B", 48)
    finally:
        pair.stop()
    mutual = start(model, tmp_path, CARDS, "0.3", mutual_help=True)
    try:
        two = run(mutual, [("A", 48), ("B", 48)])
        assert all(two[k].logits_sha256 == want(k, 48) and two[k].experts_peer > 0 for k in "AB")
    finally:
        mutual.stop()


@pytest.mark.parametrize("remote", [False, True])
def test_steps_ahead_through_the_daemon(model, tmp_path, remote):
    """Without a digest a GPU lane launches each decode step before it has read the last token (also computing
    on a peer's slots, in place or, remote, through the other-GPU path): greedy tokens equal the solo card's with a
    digest (one step at a time), for lead + peer and for two chats in mutual help, views changing while steps run
    ahead."""
    solo_tokens = {}
    d = start(model, tmp_path, "0", "1.0")
    try:
        for name in "AB":
            with d.client(stream_timeout_s=600) as c:
                for digest in (True, False):
                    s = c.generate(tokens=PROMPTS[name], max_tokens=48, digest=digest)
                    s.result()
                    solo_tokens.setdefault(name, []).append(list(s.tokens))
    finally:
        d.stop()
    assert all(a == b for a, b in solo_tokens.values())
    mutual = start(model, tmp_path, CARDS, "0.3", gpu={"peers_as_remote": remote}, mutual_help=True)
    try:
        jobs = {"one": [("A", 48)], "two": [("A", 48), ("B", 48)]}
        for runs in jobs.values():
            got = run_chats(mutual, runs, lambda name: {"tokens": PROMPTS[name]}, timeout_s=600, digest=False)
            for name, s in got.items():
                assert list(s.tokens) == solo_tokens[name][0] and s.stats.experts_peer > 0, name
    finally:
        mutual.stop()


@pytest.mark.parametrize("copy", ["auto", "host"])
def test_peer_computed_on_its_own_gpu(model, tmp_path, want, copy):
    """The path for a peer on another GPU (pool opened on its device, input copied over, rows back, in the
    captured step; peer to peer, or through page-locked host memory), taken here between two logical cards of one
    GPU (STRATAD_TEST_CARDS=0,1: two GPUs): the bits are those of the solo card."""
    d = start(model, tmp_path, CARDS, "0.3", gpu={"peers_as_remote": True, "peer_copy": copy}, mutual_help=True)
    try:
        one = run(d, [("A", 48)])
        assert one["A"].logits_sha256 == want("A", 48) and one["A"].experts_peer > 0
        two = run(d, [("A", 48), ("B", 48)])
        assert all(two[k].logits_sha256 == want(k, 48) and two[k].experts_peer > 0 for k in "AB")
    finally:
        d.stop()


@pytest.mark.parametrize("cpu_share", [0.0, 0.5])
def test_host_experts_read_by_the_card(model, tmp_path, want, cpu_share):
    """host_experts = "card": lead + peer hold 60 % of the experts, the rest are read by the lead's card from the
    page-locked arena (host_cpu_share 0.5: part of them computed by the CPU pool meanwhile); the bits are those of
    the solo card."""
    d = start(model, tmp_path, CARDS, "0.3", host_experts="card", host_cpu_share=cpu_share)
    try:
        one = run(d, [("A", 48)])["A"]
        assert one.logits_sha256 == want("A", 48)
        assert one.experts_peer > 0 and one.experts_host_read > 0
        assert (one.experts_cpu > one.experts_host_read) == (cpu_share > 0)  # the CPU pool's part
    finally:
        d.stop()


def test_split_model_served_like_the_one_file(model, tmp_path, want):
    """The module's model written again as llama.cpp split shards (make_model's split_max_size, as
    tests/test_split_model.py and test_model_daemon.py on CPU cards) and served from its first shard: every shard
    mapped into one arena, which the card page-locks and reads the experts no card holds from (host_experts card),
    lead + peer. The greedy tokens and logits (digest) are those of the one-file model served the same way, and
    the solo card's."""
    (tmp_path / "split").mkdir()
    files = make_model(tmp_path / "split" / "mini-topics.gguf", "mini", expert_quant="IQ3_S", router_skew=0.7,
                       topics=2, split_max_size=12_000_000)["files"]  # the module's model: 4 shards
    assert len(files) >= 3 and files[0].endswith(f"-00001-of-{len(files):05d}.gguf")
    got = {}
    for name, path in (("one file", str(model)), ("split", files[0])):
        d = start(path, tmp_path, CARDS, "0.3")
        try:
            out = run_chats(d, [("A", 48)], lambda k: {"tokens": PROMPTS[k]}, timeout_s=600)["A"]
            assert d.status().model == path
            got[name] = (list(out.tokens), out.stats.logits_sha256, out.stats.experts_peer > 0,
                         out.stats.experts_host_read > 0)
        finally:
            d.stop()
    assert got["split"] == got["one file"] and got["split"][2:] == (True, True), got
    assert got["split"][1] == want("A", 48)


def test_rejoin_mid_generation_on_gpu_cards(model, tmp_path, want):
    d = start(model, tmp_path, CARDS, "0.3", rejoin_idle_s=0.3)
    try:
        a, b, seen = split_then_rejoin(d, {"tokens": PROMPTS["A"]}, {"tokens": PROMPTS["B"]}, timeout_s=120)
        assert b.stats.logits_sha256 == want("B", 5)
        assert a.stats.logits_sha256 == want("A", max_tokens_of(a), ignore_eos=True)
        assert rejoined_after_split(seen), seen[-5:]
    finally:
        d.stop()


def test_adaptive_swaps_while_other_lane_computes_on_gpu_cards(model, tmp_path, want):
    """Slots are reloaded in the background (copy stream) while both lanes compute from both pools."""
    d = start(model, tmp_path, CARDS, "0.3", mutual_help=True, replan_interval_s=0.05, replan_min_gain=0.0)
    try:
        before = sum(ln.slots_loaded for ln in d.status().lanes)
        out = run(d, [("A", 150), ("B", 150)])
        assert sum(ln.slots_loaded for ln in d.status().lanes) > before
        assert d.status().epoch > 4
        assert all(out[k].logits_sha256 == want(k, 150) and out[k].experts_peer > 0 for k in "AB")
    finally:
        d.stop()


def test_peer_lane_killed_mid_generation_on_gpu_cards(model, tmp_path, want):
    d = start(model, tmp_path, CARDS, "0.3", rejoin_idle_s=0.2)
    try:
        res = {}

        def go():
            with d.client(stream_timeout_s=600) as c:
                s = c.generate(tokens=PROMPTS["A"], max_tokens=300, digest=True)
                s.result()
                res["A"] = s.stats

        t = threading.Thread(target=go)
        t.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(ln.req_id for ln in d.status().lanes):
            time.sleep(0.02)
        peer = next(ln for ln in d.status().lanes if ln.req_id is None)
        time.sleep(0.5)
        os.kill(peer.pid, signal.SIGKILL)
        t.join(600)
        assert res["A"].logits_sha256 == want("A", 300)
        d.wait_ready(300, restarts=1)
        assert d.status().lanes[peer.lane].restarts == 1
    finally:
        d.stop()


def test_host_conversation_cache_on_gpu_lanes(model, tmp_path):
    """The host conversation cache on GPU lanes ([gpu] host_kv_cache, on by default): three conversations on two
    lanes. Each follow-up restored from the host cache (its lane having served another conversation meanwhile)
    gives the tokens and logits bits of the same follow-up served right after its first turn from the KV kept on
    its lane."""
    convs = {name: [(7 * k + 3 * i) % 900 + 20 for i in range(n)] for k, (name, n) in
             enumerate([("A", 297), ("B", 265), ("C", 329)])}
    gen = 8  # prompt + gen - 1 tokens kept: whole blocks of 16, all of which the host cache can restore

    def turn(c, tokens):
        s = c.generate(tokens=tokens, max_tokens=gen, ignore_eos=True, digest=True)
        s.result()
        return s

    def follow(name, first):
        return convs[name] + list(first.tokens) + [11, 12, 13, 14]

    cfg = {"prefix_cache": True, "kv_cache_host": "1GiB"}
    ref = start(model, tmp_path, CARDS, "1.0", **cfg)
    kept = {}
    try:
        with ref.client(stream_timeout_s=600) as c:
            for name in convs:
                first = turn(c, convs[name])
                nxt = turn(c, follow(name, first))
                assert nxt.stats.prompt_cached_tokens == len(convs[name]) + gen - 1
                kept[name] = (first, nxt)
    finally:
        ref.stop()
    d = start(model, tmp_path, CARDS, "1.0", **cfg)
    try:
        with d.client(stream_timeout_s=600) as c:
            firsts = {name: turn(c, convs[name]) for name in convs}
            for name in convs:
                s = turn(c, follow(name, firsts[name]))
                assert s.stats.prompt_cached_tokens == len(convs[name]) + gen - 1, name
                assert s.tokens == kept[name][1].tokens and s.stats.logits_sha256 == kept[name][1].stats.logits_sha256
        k = d.status().kv_cache
        assert k.hits >= 1 and k.blocks_written > 0, k
    finally:
        d.stop()
    assert d.leftovers() == []
