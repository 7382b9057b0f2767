"""The model generator (`stratad make-model`): every quant combination loads and generates, output is a pure
function of the seed, the router skew makes expert popularity uneven, activations stay well-scaled; the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from stratad.engine.reference import ReferenceEngine, Trace
from stratad.engine.sampling import SamplingParams
from stratad.model import quants
from stratad.model.config import PRESETS
from stratad.model.generator import make_model
from stratad.model.gguf_file import ModelFile

REPO = Path(__file__).resolve().parents[1]
TINY = PRESETS["tiny"]
PROMPT = "The expert cache on the cards holds the popular experts; the rest run on the CPU pool. " * 4

EXPERT_QUANTS = ["IQ3_S", "Q4_K", "Q8_0"]
DENSE_QUANTS = ["Q8_0", "F16", "BF16", "F32"]


@pytest.fixture(scope="module")
def skewed_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("skew")
    out = {}
    for skew in (0.0, 2.0):
        out[skew] = d / f"skew{skew}.gguf"
        make_model(out[skew], "tiny", router_skew=skew, seed=4)
    return out


@pytest.mark.parametrize("dense", DENSE_QUANTS)
@pytest.mark.parametrize("experts", EXPERT_QUANTS)
def test_each_quant_loads_and_generates(tmp_path, experts, dense):
    p = tmp_path / "m.gguf"
    rep = make_model(p, "tiny", experts, dense, router_skew=1.0, seed=1)
    assert rep["path"] == str(p) and rep["bytes"] == p.stat().st_size and rep["seconds"] >= 0
    assert not Path(f"{p}.part").exists()
    m = ModelFile(p)
    assert m.config == TINY
    assert m.expert_type(0, "gate") == T[experts] and m.expert_type(3, "down") == T[experts]
    for name in ("token_embd.weight", "output.weight", "blk.2.attn_v.weight"):
        assert m.info(name).qtype == T[dense]
    assert m.info("blk.0.ffn_gate_inp.weight").qtype == T.F32  # the router stays F32, as llama.cpp leaves it
    # file size: the tensors' bytes plus a small header
    tensor_bytes = sum(ti.nbytes for ti in m.tensors.values())
    assert tensor_bytes < m.size < tensor_bytes + (1 << 20)
    eng = ReferenceEngine(m, "canonical")
    prompt = m.tokenizer.encode("Hello experts")
    out = list(eng.generate(prompt, SamplingParams(max_tokens=4)))
    assert 1 <= len(out) <= 4 and all(0 <= t < TINY.vocab_size for t in out)
    logits = eng.forward(prompt, eng.new_kv())
    assert np.all(np.isfinite(logits)) and logits.std() > 0.1
    m.close()


def test_unsupported_quant_choices(tmp_path):
    with pytest.raises(ValueError, match="dense quant IQ2_XS: token_embd.weight would be IQ2_XS; with a router skew"):
        make_model(tmp_path / "b.gguf", "tiny", "IQ3_S", "IQ2_XS", router_skew=1.0)
    with pytest.raises(ValueError, match="unsupported tensor type TQ1_0"):
        make_model(tmp_path / "c.gguf", "tiny", "TQ1_0")
    with pytest.raises(ValueError, match="unknown mix 'q4_k_x'; llama.cpp file types: q4_0, "):
        make_model(tmp_path / "e.gguf", "tiny", mix="q4_k_x")

    import dataclasses

    odd = dataclasses.replace(TINY, d_model=288)  # not a whole number of 256-value IQ3_S blocks
    with pytest.raises(ValueError, match="IQ3_S rows must be multiples of 256 values, got 288"):
        make_model(tmp_path / "d.gguf", odd, "IQ3_S")
    assert not list(tmp_path.iterdir())  # nothing left behind, not even a .part file


def test_same_seed_same_bytes(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    make_model(a, "tiny", router_skew=1.0, seed=7)
    make_model(b, "tiny", router_skew=1.0, seed=7)
    make_model(c, "tiny", router_skew=1.0, seed=8)
    da, db, dc = a.read_bytes(), b.read_bytes(), c.read_bytes()
    assert da == db
    assert len(dc) == len(da) and dc != da
    ma, mc = ModelFile(a), ModelFile(c)
    for name in ("token_embd.weight", "blk.0.ffn_up_exps.weight", "blk.3.attn_q.weight"):
        assert not np.array_equal(ma.raw(name), mc.raw(name)), name
    ma.close()
    mc.close()


def _routing(path: Path) -> tuple[list[float], list[float]]:
    """Per layer: the most popular expert's share of the routed slots, and the popularity entropy (nats)."""
    m = ModelFile(path)
    eng = ReferenceEngine(m, "canonical")
    ids = m.tokenizer.encode(PROMPT)
    assert 90 <= len(ids) <= 130
    trace = Trace()
    eng.forward(ids, eng.new_kv(), trace=trace)
    assert len(trace.ids) == TINY.n_layer
    top, ent = [], []
    for layer_ids in trace.ids:
        assert layer_ids.shape == (len(ids), TINY.n_expert_used)
        counts = np.bincount(layer_ids.ravel(), minlength=TINY.n_expert)
        p = counts / counts.sum()
        top.append(float(p.max()))
        ent.append(float(-(p[p > 0] * np.log(p[p > 0])).sum()))
    m.close()
    return top, ent


def test_router_skew_makes_popularity_uneven(skewed_models):
    """Measured (seed 4, 101 tokens, top-4 of 16): the top expert takes ~11-14 % of the routed slots per layer
    with skew 0, ~20-25 % with skew 2 (25 % is the ceiling: a token picks an expert once)."""
    top0, ent0 = _routing(skewed_models[0.0])
    top2, ent2 = _routing(skewed_models[2.0])
    print(f"[router skew] top-expert share per layer: skew 0 {np.round(top0, 3).tolist()}, "
          f"skew 2 {np.round(top2, 3).tolist()}")
    assert np.mean(top2) > 1.5 * np.mean(top0)
    assert min(top2) > max(top0)
    assert np.mean(ent2) < np.mean(ent0) - 0.3
    assert max(top0) < 0.2  # without skew, no expert dominates


def test_hidden_state_rms_bounded(tiny_model):
    """Measured for tiny (skew 1): the residual stream's RMS grows slowly, ~1.1 after layer 0 to ~1.35 after 3."""
    eng = ReferenceEngine(tiny_model, "canonical")
    trace = Trace()
    eng.forward(tiny_model.tokenizer.encode(PROMPT), eng.new_kv(), trace=trace)
    rms = np.array(trace.rms)
    print(f"[tiny] hidden RMS per layer {np.round(rms, 3).tolist()}")
    assert len(rms) == TINY.n_layer
    assert np.all((rms > 0.5) & (rms < 4.0))
    assert np.all(rms[1:] / rms[:-1] < 1.5) and np.all(rms[1:] / rms[:-1] > 0.67)


def test_tensor_rms_as_documented(tiny_model):
    """Projection weights have RMS 1/sqrt(fan_in) (output projections damped by half)."""
    d, ff = TINY.d_model, TINY.d_ff_expert
    want = {"blk.1.attn_q.weight": 1 / np.sqrt(d), "blk.1.attn_output.weight": 0.5 / np.sqrt(TINY.q_dim),
            "blk.1.ffn_gate_exps.weight": 1 / np.sqrt(d), "blk.1.ffn_down_exps.weight": 1 / np.sqrt(ff)}
    for name, rms in want.items():
        ti = tiny_model.info(name)
        v = quants.dequantize(ti.qtype, tiny_model.raw(name)).astype(np.float64)
        assert np.sqrt(np.mean(v * v)) == pytest.approx(rms, rel=0.08), name


# ---- the command line -----------------------------------------------------------------------------------------


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "stratad.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def test_cli_make_model_and_generate(tmp_path):
    out = tmp_path / "cli.gguf"
    r = cli("make-model", "--preset", "tiny", "--expert-quant", "Q4_K", "--dense-quant", "F16",
            "--router-skew", "1.5", "--seed", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["path"] == str(out) and rep["bytes"] == out.stat().st_size
    # the same as the library call
    lib = tmp_path / "lib.gguf"
    make_model(lib, "tiny", "Q4_K", "F16", router_skew=1.5, seed=3)
    assert lib.read_bytes() == out.read_bytes()

    r = cli("generate", "Tell me about the experts.", "--model", str(out), "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    m = ModelFile(out)
    tok = m.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about the experts."}]))
    want = list(ReferenceEngine(m, "canonical").generate(prompt, SamplingParams(max_tokens=6)))
    assert r.stdout.rstrip("\n") == tok.decode(want, skip_special=True)
    assert f"[{len(prompt)} prompt tokens, {len(want)} generated" in r.stderr
    assert "tok/s" in r.stderr and "canonical experts" in r.stderr
    m.close()


def test_cli_generate_raw_sampled_float(tiny_model_path):
    args = ("generate", "once upon a time", "--model", str(tiny_model_path), "--raw", "--max-tokens", "5",
            "--temperature", "0.8", "--top-k", "40", "--top-p", "0.9", "--seed", "11", "--experts", "float")
    r1, r2 = cli(*args), cli(*args)
    assert r1.returncode == 0, r1.stderr
    assert r1.stdout == r2.stdout  # seeded sampling is reproducible
    assert "float experts" in r1.stderr


def test_cli_generate_bad_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a model\n")
    r = cli("generate", "hi", "--model", str(bad))
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {bad}: not a GGUF file (bad magic)"
    assert "Traceback" not in r.stderr and r.stdout == ""
    r = cli("generate", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert r.returncode == 2 and f"{tmp_path / 'missing.gguf'}: no such model file" in r.stderr


def test_cli_generate_bad_params(tiny_model_path):
    r = cli("generate", "hi", "--model", str(tiny_model_path), "--top-p", "0", "--max-tokens", "0")
    assert r.returncode == 2
    assert "top_p must be in (0, 1]" in r.stderr and "max_tokens must be at least 1" in r.stderr


def test_cli_make_model_rejects_unknown_choice(tmp_path):
    r = cli("make-model", "--preset", "huge", "--out", str(tmp_path / "x.gguf"))
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = cli("make-model", "--expert-quant", "TQ1_0", "--out", str(tmp_path / "x.gguf"))
    assert r.returncode == 2 and "invalid choice" in r.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_two_topics_keep_their_kind_and_route_to_different_experts(tmp_path):
    """topics=2: a chat of even ids stays even and one of odd ids odd (for its first 20 tokens always; later the
    LM head's finite topic bias lets some streams flip: 0.82 of 661 sampled tokens kept their kind when measured),
    and the two kinds use different hot experts."""
    path = tmp_path / "topics.gguf"
    make_model(path, "tiny", router_skew=1.5, topics=2)
    m = ModelFile(path)
    eng = ReferenceEngine(m, "canonical")
    dist, kept = [], []
    for topic in (0, 1):
        prompt = list(range(2 + topic, 400, 2))[:40]
        for seed in range(6):
            out = list(eng.generate(prompt, SamplingParams(max_tokens=60, temperature=0.7, seed=seed)))
            assert out and all(t % 2 == topic for t in out[:20])  # a stream may end early on a stop token
            kept += [t % 2 == topic for t in out]
            if seed == 0:
                tr = Trace()
                eng.forward(prompt + out, eng.new_kv(), logits="none", trace=tr)
                counts = np.bincount(np.concatenate([i.ravel() for i in tr.ids]), minlength=16).astype(float)
                dist.append(counts / counts.sum())
    assert np.mean(kept) >= 0.75
    assert np.minimum(*dist).sum() < 0.8  # the two kinds of traffic overlap far from fully
    with pytest.raises(ValueError, match="router skew"):
        make_model(tmp_path / "x.gguf", "tiny", topics=2)


def test_cli_make_model_split(tmp_path, tiny_model_path):
    """--split-max-size as gguf-split takes it: shards named from --out, the first is the model, the same tensors
    and bytes as one file."""
    out = tmp_path / "m" / "tiny.gguf"
    r = cli("make-model", "--preset", "tiny", "--router-skew", "1.0", "--split-max-size", "2M", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    n = len(rep["files"])
    assert n >= 2 and rep["path"] == str(tmp_path / "m" / f"tiny-00001-of-{n:05d}.gguf") and not out.exists()
    assert rep["bytes"] == sum(Path(f).stat().st_size for f in rep["files"])
    m, one = ModelFile(rep["path"]), ModelFile(tiny_model_path)
    assert len(m.shards) == n and all(np.array_equal(m.raw(t), one.raw(t)) for t in one.tensors)
    m.close()
    one.close()
    for bad in ("2X", "0", "-5M"):
        r = cli("make-model", "--preset", "tiny", f"--split-max-size={bad}", "--out", str(tmp_path / "bad.gguf"))
        assert r.returncode == 2 and "split size" in r.stderr and bad in r.stderr, r.stderr


def test_a235b_preset_is_the_qwen3_235b_shape():
    c = PRESETS["a235b"]
    assert (c.n_layer, c.d_model, c.n_head, c.n_head_kv, c.head_dim, c.n_expert, c.n_expert_used, c.d_ff_expert,
            c.vocab_size, c.context_length) == (94, 4096, 64, 4, 128, 128, 8, 1536, 151936, 40960)
    assert c.n_layer * c.n_expert == 12032 and not c.problems()


# ---- llama.cpp mixes -------------------------------------------------------------------------------------------


def _a3b_types(mix: str) -> dict:
    from stratad.model import mixes
    from stratad.model.gguf_file import expected_tensors

    c = PRESETS["a3b"]
    return mixes.mix_types(mixes.parse_mix(mix), {n: s for n, (s, _) in expected_tensors(c).items()}, c)


def test_mix_table_facts_a3b():
    """Types llama.cpp's quantiser gives Qwen3-30B-A3B (48 layers, 32 / 4 heads) in a few file types, from
    llama_tensor_get_type's rules; router and norms are not quantised."""
    t = _a3b_types("q4_k_m")
    assert t["token_embd.weight"] == T.Q4_K and t["output.weight"] == T.Q6_K
    # use_more_bits: first and last eighth of the layers, every third between
    more = [i for i in range(48) if t[f"blk.{i}.ffn_down_exps.weight"] == T.Q6_K]
    assert more == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47]
    assert [i for i in range(48) if t[f"blk.{i}.attn_v.weight"] == T.Q6_K] == more
    assert t["blk.7.ffn_gate_exps.weight"] == t["blk.7.ffn_up_exps.weight"] == t["blk.7.ffn_down_exps.weight"] == T.Q4_K
    assert "blk.0.ffn_gate_inp.weight" not in t and "blk.0.attn_norm.weight" not in t
    t = _a3b_types("iq3_s")
    assert t["blk.3.attn_v.weight"] == T.Q4_K and t["blk.3.ffn_down_exps.weight"] == T.IQ3_S  # n_gqa 8 >= 4
    t = _a3b_types("q3_k_m")
    assert [t[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2)] == [T.Q5_K, T.Q5_K, T.Q4_K]
    assert [t[f"blk.{i}.ffn_down_exps.weight"] for i in (2, 3)] == [T.Q5_K, T.Q4_K]  # first sixteenth: Q5_K
    assert t["blk.9.attn_output.weight"] == T.Q4_K and t["blk.9.ffn_up_exps.weight"] == T.Q3_K
    t = _a3b_types("q2_k")
    assert t["blk.9.ffn_down_exps.weight"] == T.Q3_K and t["blk.9.attn_v.weight"] == T.Q4_K
    assert t["blk.9.ffn_gate_exps.weight"] == T.Q2_K and t["blk.9.attn_output.weight"] == T.Q3_K
    t = _a3b_types("iq1_m")
    assert t["token_embd.weight"] == T.Q2_K and t["output.weight"] == T.Q5_K
    assert [t[f"blk.{i}.ffn_down_exps.weight"] for i in (5, 6)] == [T.Q2_K, T.IQ1_M]
    assert t["blk.9.attn_output.weight"] == T.IQ2_XXS and t["blk.9.ffn_up_exps.weight"] == T.IQ1_M
    t = _a3b_types("iq3_xs")
    assert [t[f"blk.{i}.ffn_gate_exps.weight"] for i in (5, 6, 41, 42)] == [T.IQ3_S, T.IQ3_XXS, T.IQ3_XXS, T.IQ3_S]
    assert t["blk.0.attn_q.weight"] == T.IQ3_XXS
    t = _a3b_types("iq4_xs")
    assert t["blk.0.ffn_down_exps.weight"] == T.IQ4_XS and t["blk.0.attn_v.weight"] == T.Q5_K
    t = _a3b_types("mxfp4_moe")  # experts MXFP4, every other quantised tensor Q8_0, the head included
    assert {n for n, ty in t.items() if ty == T.MXFP4} == {n for n in t if n.endswith("_exps.weight")}
    assert {ty for n, ty in t.items() if not n.endswith("_exps.weight")} == {T.Q8_0} and "output.weight" in t
    for mix, ty in (("f16", T.F16), ("bf16", T.BF16), ("f32", T.F32)):  # the converter's output: no rule applies
        t = _a3b_types(mix)
        assert t["output.weight"] == t["token_embd.weight"] == t["blk.0.ffn_down_exps.weight"] == ty
        assert set(t.values()) == {ty} and "blk.0.ffn_gate_inp.weight" not in t


def test_mix_fallback_for_rows_that_are_not_whole_blocks():
    from stratad.model import mixes

    c = PRESETS["tiny"]
    f = mixes.parse_mix("q4_k_m")
    assert mixes.tensor_type(f, "blk.1.ffn_up_exps.weight", 288, c) == T.Q5_0
    assert mixes.tensor_type(f, "output.weight", 288, c) == T.Q8_0
    assert mixes.tensor_type(mixes.parse_mix("iq3_s"), "blk.1.ffn_up_exps.weight", 288, c) == T.IQ4_NL
    assert mixes.tensor_type(mixes.parse_mix("iq3_s"), "blk.1.ffn_up_exps.weight", 48, c) == T.F16


def _mix_names():
    from stratad.model import mixes

    return list(mixes.MIXES)


@pytest.mark.parametrize("mix", _mix_names())
def test_each_mix_loads_and_generates(tmp_path, mix):
    """Every llama.cpp file type: the file holds the table's types and generates through the canonical engine."""
    from stratad.model import mixes

    p = tmp_path / f"{mix}.gguf"
    make_model(p, "tiny", mix=mix, seed=2)
    m = ModelFile(p)
    from stratad.model.gguf_file import expected_tensors

    want = mixes.mix_types(mixes.parse_mix(mix), {n: s for n, (s, _) in expected_tensors(TINY).items()}, TINY)
    assert {n: ti.qtype for n, ti in m.tensors.items() if n in want} == want
    assert m.meta("general.file_type") == int(mixes.parse_mix(mix))
    eng = ReferenceEngine(m, "canonical")
    logits = eng.forward(m.tokenizer.encode("Mixed types"), eng.new_kv())
    assert np.all(np.isfinite(logits)) and logits.std() > 0.1
    m.close()


def test_cli_mix(tmp_path):
    out = tmp_path / "mix.gguf"
    r = cli("make-model", "--preset", "tiny", "--mix", "q3_k_m", "--out", str(out))
    assert r.returncode == 0, r.stderr
    m = ModelFile(out)
    assert m.expert_type(0, "down") == T.Q4_K and m.expert_type(1, "gate") == T.Q3_K  # 4 layers: no sixteenth
    assert m.info("blk.1.attn_v.weight").qtype == T.Q5_K and m.info("blk.2.attn_v.weight").qtype == T.Q4_K
    r = cli("make-model", "--mix", "q3_k_m", "--expert-quant", "Q4_K", "--out", str(tmp_path / "x.gguf"))
    assert r.returncode == 2 and "--mix gives every tensor its type" in r.stderr


def test_types_summary_names_the_file_type_and_each_roles_types(tmp_path):
    """What stratactl status prints of a file (ModelFile.types_summary): its llama.cpp file type and each role's
    types with their counts, most frequent first; norms and the router left out."""
    for mix, want in (("q4_k_m", "Q4_K_M file; experts Q4_K x10, Q6_K x2; attention Q4_K x14, Q6_K x2; "
                                 "embedding Q4_K; head Q6_K"),
                      ("mxfp4_moe", "MXFP4_MOE file; experts MXFP4 x12; attention Q8_0 x16; embedding Q8_0; "
                                    "head Q8_0")):
        make_model(tmp_path / f"{mix}.gguf", "tiny", mix=mix)
        m = ModelFile(tmp_path / f"{mix}.gguf")
        assert m.types_summary == want
        m.close()


def test_mxfp4_rows_with_set_columns(tmp_path):
    """MXFP4 embedding and LM head under a router skew and two topics: encoded by gguf.quants (its power-of-two
    scales hold the set values 3 and 8 exactly); the file loads and generates."""
    from stratad.model.generator import SKEW_DIM_VALUE, TOPIC_STICKINESS

    p = tmp_path / "mx.gguf"
    make_model(p, "tiny", expert_quant="MXFP4", dense_quant="MXFP4", router_skew=1.5, topics=2, seed=3)
    m = ModelFile(p)
    e, head = m.dense("token_embd.weight"), m.dense("output.weight")
    odd = np.arange(len(e)) % 2 == 1
    assert float(np.median(e[:, 0])) == SKEW_DIM_VALUE and float(np.median(e[odd, 2])) == SKEW_DIM_VALUE
    assert float(np.median(head[~odd, 1])) == TOPIC_STICKINESS
    eng = ReferenceEngine(m, "canonical")
    assert len(list(eng.generate(m.tokenizer.encode("hi"), SamplingParams(max_tokens=4)))) == 4
    m.close()


@pytest.mark.parametrize("mix", ["q4_k_m", "iq3_s", "q2_k"])
def test_mix_with_router_skew_and_topics(tmp_path, mix):
    """The embedding's set columns (skew on dimension 0, the topic on 1 and 2) survive its mix type's encoding
    (Q4_K, IQ3_S, Q2_K here), and the LM head's topic columns too (Q6_K)."""
    from stratad.model.generator import SKEW_DIM_VALUE, TOPIC_STICKINESS

    p = tmp_path / f"{mix}.gguf"
    make_model(p, "tiny", mix=mix, router_skew=1.5, topics=2, seed=3)
    m = ModelFile(p)
    e = m.dense("token_embd.weight")
    tol = {"q4_k_m": 0.3, "iq3_s": 1.0, "q2_k": 1.0}[mix] * SKEW_DIM_VALUE / 3
    assert abs(float(np.median(e[:, 0])) - SKEW_DIM_VALUE) < tol
    odd = np.arange(len(e)) % 2 == 1  # topic B: dimension 2 set, dimension 1 zero
    assert float(np.median(e[odd, 2])) > SKEW_DIM_VALUE - tol and float(np.median(np.abs(e[odd, 1]))) < tol
    rest = e[:, 3:]
    assert 0.7 < float(np.sqrt(np.mean(rest * rest))) < 1.3
    head = m.dense("output.weight")
    assert float(np.median(head[~odd, 1])) == pytest.approx(TOPIC_STICKINESS, rel=0.1)
    m.close()
