"""The benchmarks run end to end on CPU cards and report what they promise (figures are not asserted: speed is
measured, not tested)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from stratad.model.generator import make_model


def test_seed_bench_modes_and_shares(tmp_path):
    """Two chats of different topics on two CPU cards: the JSON names each requested mode, each chat's shares
    add up, the pooled modes keep the work on the cards, each conversation's next turn reuses its lane's kept
    sequence, and modes can be run in separate jobs."""
    model = tmp_path / "tiny-topics.gguf"
    make_model(model, "tiny", router_skew=1.5, topics=2)
    out = tmp_path / "seed.json"
    r = subprocess.run([sys.executable, "-m", "stratad.cli", "bench", "--scenario", "seed", "--model", str(model),
                        "--cards", "cpu,cpu", "--contexts", "80", "--tokens", "12", "--modes", "1,3",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert set(d["modes"]) == {"1_one_chat_lead_peer", "3_two_chats_mutual_help"}
    assert [c["topic"] for c in d["modes"]["3_two_chats_mutual_help"]] == ["A", "B"]
    for chats in d["modes"].values():
        for c in chats:
            assert c["generated"] == 12
            assert abs(c["share_own_card"] + c["share_peer"] + c["share_cpu"] - 1) < 1e-3
            assert c["share_peer"] > 0  # the other card's cache is used in both pooled modes
            assert c["share_host_read"] == 0  # CPU cards compute their misses on the CPU pool
            # the next turn goes back to the conversation's lane and reads only what is new
            assert c["cached_tokens"] == 0 and c["next_turn"]["lane"] == c["lane"]
            assert c["next_turn"]["cached_tokens"] >= c["prompt_tokens"]
    assert len(d["targets"]["mode3_speed_vs_mode1"]) == 2
    assert d["note"] == "one card per device" and d["hardware"]["cores"] >= 1 and d["host_experts"] == "cpu"


def test_prompt_flops_per_token(tmp_path):
    """The engine bench's prefill floor counts dense projections, k experts and causal attention per prompt token."""
    from stratad.bench.engine import prompt_flops_per_token
    from stratad.model.generator import make_model
    from stratad.model.gguf_file import ModelFile

    path = tmp_path / "tiny.gguf"
    make_model(path, "tiny", "Q8_0", "Q8_0", 1.0, 0)
    m = ModelFile(path)
    c = m.config
    per_layer_dense = (c.n_head + 2 * c.n_head_kv) * c.head_dim * c.d_model + c.d_model * c.n_head * c.head_dim \
        + c.n_expert * c.d_model  # q, k, v; o; router
    experts = c.n_expert_used * 3 * c.d_model * c.d_ff_expert
    for ctx in (1, 1024):
        attention = 2 * c.n_head * c.head_dim * (ctx + 1) / 2
        want = 2.0 * c.n_layer * (per_layer_dense + experts + attention)
        assert prompt_flops_per_token(m, ctx) == want


def test_gpu_scenarios_without_a_gpu_name_the_scenario_and_the_cause(tmp_path):
    """engine and experts need a CUDA GPU: where CuPy cannot reach one, one line naming the benchmark and why,
    exit 2, and no model made (skipped where a GPU answers)."""
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        pytest.skip("a GPU answers here")
    except Exception:  # noqa: BLE001 - no CuPy, or no device
        pass
    for scenario in ("experts", "engine"):
        r = subprocess.run([sys.executable, "-m", "stratad.cli", "bench", "--scenario", scenario, "--cache-dir",
                            str(tmp_path)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.startswith(f"error: the {scenario} benchmark runs on a CUDA GPU"), r.stderr
        assert "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())


def test_experts_summary_names_the_types_whose_default_kernels_miss_the_target():
    """The per-type expert bench's JSON: the floor and target beside the results; a type is below the target by
    its default kernels' decode fraction (a slower tuning of a type that passes does not flag it)."""
    from stratad.bench import experts

    results = [{"qtype": "IQ1_S", "variant": "default", "fraction": 0.157},
               {"qtype": "Q4_K", "variant": "default", "fraction": 0.504},
               {"qtype": "Q4_K", "variant": "gu8w", "fraction": 0.19},
               {"qtype": "IQ2_XXS", "variant": "default", "fraction": 0.195}]
    out = experts.summary(results, experts.Options(), 3012.6, [3012.6, 3000.2])
    assert out["below_target"] == ["IQ1_S", "IQ2_XXS"]
    assert out["targets"] == {"fraction_min": 0.2} and "copy rate" in out["floor"]
    assert out["results"] is results and out["options"]["types"] == "all"
    assert "below_target" not in experts.summary([], experts.Options(prompt=True), 1.0, [1.0])
    assert "below_target" not in experts.summary([], experts.Options(cases="tok8x8"), 1.0, [1.0])  # no decode8
    assert [experts.layer_name(t) for t in experts.expert_types("Q6_K,IQ1_M")] == ["Q6_K", "IQ1_M"]


def test_experts_types_name_mixed_layers_as_gate_up_plus_down():
    """--types Q4_K+Q6_K benches a layer of Q4_K gate / up and Q6_K down (a q4_k_m file's); a bad entry names
    itself."""
    from stratad.bench import experts
    from stratad.model.quants import parse_type

    got = experts.expert_types("Q4_K+Q6_K,Q8_0")
    assert got == [(parse_type("Q4_K"), parse_type("Q6_K")), (parse_type("Q8_0"), parse_type("Q8_0"))]
    assert [experts.layer_name(t) for t in got] == ["Q4_K+Q6_K", "Q8_0"]
    for bad, says in (("Q4_K+Q6_K+Q8_0", r"GATE_UP\+DOWN"), ("Q4_K+FOO", "FOO"), ("Q4_K+Q4_0_4_4", "Q4_0_4_4")):
        with pytest.raises(ValueError, match=says):
            experts.expert_types(bad)


def test_experts_flags_not_given_take_the_options_defaults():
    from stratad.bench import experts
    from stratad.cli import build_parser

    parse = build_parser().parse_args
    assert experts.Options.from_args(parse(["bench", "--scenario", "experts"])) == experts.Options()
    got = experts.Options.from_args(parse(["bench", "--scenario", "experts", "--reps", "3", "--types", "Q6_K",
                                           "--prompt"]))
    assert got == experts.Options(reps=3, types="Q6_K", prompt=True)


def test_experts_bus_cases_read_n_experts_of_one_token_from_an_arena_layer():
    """bus1 / bus2 / bus8: one token's n distinct experts, read from host memory laid out as an arena layer (three
    expert-major tensors, each 4 KiB-aligned): the bytes of expert e are where ExpertKernels.layout looks."""
    import types

    from stratad.bench import experts

    rng = np.random.default_rng(3)
    perm = rng.permutation(16)
    for case in ("bus1", "bus2", "bus8", "decode5", "decode11", "decode16"):  # 11 x 5 wraps round the 16 slots
        n = int(experts.ONE_TOKEN.fullmatch(case).group(2))
        pr, count, distinct = experts.make_pairs(rng, case, perm, 5, 256)
        assert count == distinct == n and (pr[:n, 0] == 0).all() and (pr[n:] == -1).all()
    fake_cp = types.SimpleNamespace(cuda=types.SimpleNamespace(alloc_pinned_memory=bytearray))
    slots = [tuple(rng.integers(0, 256, shape, dtype=np.uint8) for shape in ((6, 40), (6, 40), (8, 18)))
             for _ in range(5)]
    mem, (gate, stride, up, down, down_stride) = experts.arena_layer(fake_cp, slots, gap=4096)
    buf = np.frombuffer(mem, np.uint8)
    at = lambda ptr, e, n: buf[ptr - buf.ctypes.data + e * n:ptr - buf.ctypes.data + (e + 1) * n]  # noqa: E731
    assert (stride, down_stride) == (240, 144) and all((p - buf.ctypes.data) % 4096 == 0 for p in (gate, up, down))
    for e, (g, u, d) in enumerate(slots):
        assert (at(gate, e, stride) == g.ravel()).all() and (at(up, e, stride) == u.ravel()).all()
        assert (at(down, e, down_stride) == d.ravel()).all()


@pytest.mark.parametrize("flag,value,says", [("--types", "Q4_K,Q9_X", "unknown tensor type 'Q9_X'"),
                                              ("--variants", "gu8w,Q4_K:bogus", "unknown variant Q4_K:bogus"),
                                              ("--cases", "decode8,tok8x8c", "unknown case tok8x8c"),
                                              ("--cases", "decode11,decode65", "unknown case decode65")])
def test_experts_bench_refuses_a_bad_option_before_measuring(flag, value, says):
    r = subprocess.run([sys.executable, "-m", "stratad.cli", "bench", "--scenario", "experts", flag, value],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"argument {flag}: {says}" in r.stderr, r.stderr


@pytest.mark.parametrize("args,rc,says", [(["--host-cpu-share", "0,1.5"], 2, "argument --host-cpu-share: expected"),
                                           (["--host-cpu-share", "x"], 2, "argument --host-cpu-share: expected"),
                                           (["--host-experts", "cpu", "--host-cpu-share", "0.3"], 1,
                                            "with --host-experts cpu the CPU pool computes all of them")])
def test_engine_bench_refuses_a_bad_host_share_before_measuring(args, rc, says):
    r = subprocess.run([sys.executable, "-m", "stratad.cli", "bench", "--scenario", "engine", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == rc and says in r.stderr, r.stderr


@pytest.mark.parametrize("qt", ["F16", "IQ3_S"])
def test_cpu_pool_bench_layers_of_float_and_quantised_experts(qt):
    """The CPU pool bench's random layer holds each expert's rows as bytes, a float type's too (its rows come as
    floats), decoding to the values drawn."""
    from gguf import GGMLQuantizationType as T

    from stratad.bench.cpu_pool import random_layer
    from stratad.model import quants

    t = T[qt]
    gate, up, down = random_layer(t, 3, 512, 256)
    f = quants.fmt(t)
    assert gate.shape == up.shape == (3, 256, f.row_bytes(512)) and down.shape == (3, 512, f.row_bytes(256))
    assert gate.dtype == np.uint8
    w = quants.dequantize(t, gate[1])
    assert w.shape == (256, 512) and np.isfinite(w).all() and 0 < np.abs(w).max() < 1
