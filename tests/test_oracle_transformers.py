"""The numpy reference engine checked against code nobody here wrote: Hugging Face transformers' Qwen3-MoE.

Both run on the CPU in float32 on the same weights: (1) a random HF model (fixed torch seed) mapped to llama.cpp's
qwen3moe GGUF names and written with our writer (dense tensors F32; experts Q8_0, since our loader takes only
IQ3_S / Q4_K / Q8_0 experts, with HF then given the stored expert values); (2) a generated quantised model
(IQ3_S / Q4_K experts, Q8_0 dense) whose dequantised weights are loaded into an HF model. Our engine runs its
"float" expert path. Logits of every position must agree to float32 rounding, routing must pick the same experts
in the same order, and 32-token greedy streams must be identical. Measured numbers are in comments by each bound;
`pytest -s` prints them ("[oracle] ..." lines). Last, our "canonical" expert path is measured against the float one.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from stratad.engine.reference import ReferenceEngine, Trace, rope  # noqa: E402
from stratad.engine.sampling import SamplingParams  # noqa: E402
from stratad.model import quants  # noqa: E402
from stratad.model.config import PRESETS, ModelConfig  # noqa: E402
from stratad.model.generator import make_model  # noqa: E402
from stratad.model.gguf_file import ModelFile  # noqa: E402
from stratad.model.hf_config import qwen3moe_kwargs  # noqa: E402
from stratad.model.rope import RopeScaling  # noqa: E402
from stratad.model.generated_vocab import build_vocab  # noqa: E402
from stratad.model.writer import TensorSource, write_model  # noqa: E402

PROMPT_LEN = 24
GEN = 32


def hf_config(c: ModelConfig):
    # the plain reference implementations: eager attention, a python loop over experts
    return transformers.Qwen3MoeConfig(**qwen3moe_kwargs(c), attn_implementation="eager",
                                       experts_implementation="eager")


def hf_model(c: ModelConfig):
    with torch.device("cpu"):
        m = transformers.Qwen3MoeForCausalLM(hf_config(c)).to(torch.float32).eval()
    assert m.config._attn_implementation == "eager" and m.config._experts_implementation == "eager"
    return m


# transformers 5.24 fuses each layer's experts into 3-D parameters: mlp.experts.gate_up_proj (E, 2*ff, d), gate
# rows first then up rows (forward: linear(x, gate_up_proj[e]).chunk(2)), and mlp.experts.down_proj (E, d, ff).
# llama.cpp's names: ffn_gate_exps / ffn_up_exps (E, ff, d), ffn_down_exps (E, d, ff) in numpy order.
# Qwen3 uses NEOX rope (rotate_half), which is also what llama.cpp expects for qwen3moe: no q/k permutation.
_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
_TOP_MAP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}


def hf_to_gguf(state: dict, c: ModelConfig) -> dict[str, np.ndarray]:
    out, seen = {}, set()
    for k, g in _TOP_MAP.items():
        out[g] = state[k].detach().numpy().astype(np.float32)
        seen.add(k)
    ff = c.d_ff_expert
    for i in range(c.n_layer):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for k, g in _LAYER_MAP.items():
            out[b + g] = state[p + k].detach().numpy().astype(np.float32)
            seen.add(p + k)
        gu = state[p + "mlp.experts.gate_up_proj"].detach().numpy().astype(np.float32)
        assert gu.shape == (c.n_expert, 2 * ff, c.d_model)
        out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = gu[:, :ff], gu[:, ff:]
        seen.add(p + "mlp.experts.gate_up_proj")
    assert seen == set(state), f"unmapped HF parameters: {sorted(set(state) - seen)}"
    return out


def gguf_to_hf(arrays: dict[str, np.ndarray], c: ModelConfig) -> dict:
    st = {k: torch.from_numpy(np.ascontiguousarray(arrays[g])) for k, g in _TOP_MAP.items()}
    for i in range(c.n_layer):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for k, g in _LAYER_MAP.items():
            st[p + k] = torch.from_numpy(np.ascontiguousarray(arrays[b + g]))
        st[p + "mlp.experts.gate_up_proj"] = torch.from_numpy(
            np.concatenate([arrays[b + "ffn_gate_exps.weight"], arrays[b + "ffn_up_exps.weight"]], axis=1))
    return st


EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def write_gguf(path, c: ModelConfig, arrays: dict[str, np.ndarray], expert_type: T = T.Q8_0) -> None:
    """Dense tensors as F32 (exact), experts as `expert_type`: our loader accepts only IQ3_S / Q4_K / Q8_0 there."""
    ts = [TensorSource.of(n, expert_type if n.endswith(EXPERT_TENSORS) else T.F32, a) for n, a in arrays.items()]
    write_model(path, c, ts, build_vocab(c.vocab_size), name="hf-oracle", file_type=expert_type)


def load_all(model: ModelFile) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF, dequantised to float32 (experts too: (E, rows, cols))."""
    return {n: quants.dequantize(ti.qtype, model.raw(n)) for n, ti in model.tensors.items()}


# ---- running both sides ---------------------------------------------------------------------------------------


def hf_logits(m, tokens) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits of every position and, per layer, the router's chosen experts (T, k) in its order."""
    routed = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, inp, out: routed.append(out[2].numpy().copy()))
             for layer in m.model.layers]
    try:
        with torch.no_grad():
            return m(torch.tensor([list(tokens)]), use_cache=False).logits[0].numpy(), routed
    finally:
        for h in hooks:
            h.remove()


def hf_greedy(m, prompt, n: int) -> list[int]:
    with torch.no_grad():
        out = m(torch.tensor([list(prompt)]), use_cache=True)
        cache, toks = out.cache, []
        for _ in range(n):
            t = int(torch.argmax(out.logits[0, -1]))
            toks.append(t)
            out = m(torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = out.cache
    return toks


def our_greedy(eng: ReferenceEngine, prompt, n: int) -> tuple[list[int], float]:
    """Greedy tokens via forward(); also the smallest top-1/top-2 logit margin seen (how robust the match is)."""
    kv, toks, margin = eng.new_kv(), [], np.inf
    logits = eng.forward(prompt, kv, logits="last")[-1]
    for _ in range(n):
        top2 = np.sort(logits)[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        t = int(np.argmax(logits))
        toks.append(t)
        logits = eng.forward([t], kv, logits="last")[-1]
    return toks, margin


def errors(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max abs error, max abs error relative to the largest reference logit)."""
    d = float(np.max(np.abs(ours.astype(np.float64) - ref.astype(np.float64))))
    return d, d / float(np.max(np.abs(ref)))


def incremental_logits(eng: ReferenceEngine, tokens, split: int) -> np.ndarray:
    """Prefill tokens[:split] then decode the rest one at a time: logits of every position."""
    kv = eng.new_kv()
    rows = [eng.forward(tokens[:split], kv, logits="all")]
    for t in tokens[split:]:
        rows.append(eng.forward([t], kv, logits="last"))
    return np.concatenate(rows)


def same_config(got: ModelConfig, want: ModelConfig) -> bool:
    """GGUF stores rms_eps as float32: 1e-6 reads back as 9.99999997e-07 (the same float32, which both sides use)."""
    return np.float32(got.rms_eps) == np.float32(want.rms_eps) and replace(got, rms_eps=want.rms_eps) == want


def report(name: str, **vals) -> None:
    print(f"\n[oracle] {name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in vals.items()))


# ---- test 1: a random HF model, written as a GGUF ---------------------------------------------------------------

ORACLE_CFG = ModelConfig(n_layer=3, d_model=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=12, n_expert_used=3,
                         d_ff_expert=256, vocab_size=len(build_vocab(1024)), context_length=4096)


def _scale_random(m, c: ModelConfig, seed: int) -> None:
    """Replace HF's init (std 0.02, unit norms: near-uniform logits and routing) with well-scaled random values:
    unit-variance projections, damped residual writes, spread router logits, logits of std ~2."""
    g = torch.Generator().manual_seed(seed)
    d, ff = c.d_model, c.d_ff_expert
    std = {"embed_tokens": 1.0, "q_proj": d ** -0.5, "k_proj": d ** -0.5, "v_proj": d ** -0.5,
           "o_proj": 0.5 * c.q_dim ** -0.5, "gate_up_proj": d ** -0.5, "down_proj": ff ** -0.5,
           "gate": 2.0 * d ** -0.5, "lm_head": 2.0 * d ** -0.5}
    with torch.no_grad():
        for name, p in m.named_parameters():
            kind = name.split(".")[-1] if name.endswith("_proj") else name.split(".")[-2]
            if kind in std:
                p.copy_(torch.randn(p.shape, generator=g) * std[kind])
            else:  # RMSNorm weights: around 1, not exactly 1, so a missing / misplaced norm weight shows
                assert "norm" in kind, name
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))


def compare(eng: ReferenceEngine, m, prompt, name: str, bounds: dict[str, float]) -> dict:
    """Logits of all positions (ours vs HF), prefill+decode vs full forward, 32-token greedy streams."""
    ref, hf_routed = hf_logits(m, prompt)
    trace = Trace()
    ours = eng.forward(prompt, eng.new_kv(), logits="all", trace=trace)
    assert ours.shape == ref.shape == (len(prompt), eng.c.vocab_size)
    # the same experts, in the same (descending weight) order, for every token of every layer
    assert len(trace.ids) == len(hf_routed) == eng.c.n_layer
    for i, (a, b) in enumerate(zip(trace.ids, hf_routed)):
        assert np.array_equal(a, b), f"layer {i}: routing differs"
    experts_used = min(len(np.unique(a)) for a in trace.ids)
    abs_err, rel_err = errors(ours, ref)
    inc_err, _ = errors(incremental_logits(eng, prompt, len(prompt) // 2), ours)
    hf_toks = hf_greedy(m, prompt, GEN)
    our_toks, margin = our_greedy(eng, prompt, GEN)
    stops_hit = bool(set(our_toks) & eng.model.tokenizer.stop_ids)
    got = dict(logits_std=float(ref.std()), abs_err=abs_err, rel_err=rel_err, prefill_decode_err=inc_err,
               min_greedy_margin=margin, distinct_tokens=len(set(our_toks)), min_experts_used=experts_used,
               stop_in_stream=stops_hit)
    report(name, **got)
    assert 1.0 < got["logits_std"] < 5.0  # logits are not degenerate
    assert abs_err < bounds["abs"] and rel_err < bounds["rel"], got
    assert inc_err < bounds["inc"], got
    assert our_toks == hf_toks, (our_toks, hf_toks)
    assert len(set(our_toks)) > 3  # a real stream, not one token repeated
    assert experts_used > eng.c.n_expert // 2  # routing spreads over the experts in every layer
    with torch.no_grad():  # HF's own generate() agrees with its manual cached loop
        gen = m.generate(torch.tensor([list(prompt)]), do_sample=False, max_new_tokens=GEN, min_new_tokens=GEN)
    assert gen[0, len(prompt):].tolist() == hf_toks
    # our generate() gives the same stream, up to (not including) the first stop token
    stops = eng.model.tokenizer.stop_ids
    until = next((i for i, t in enumerate(our_toks) if t in stops), GEN)
    assert list(eng.generate(prompt, SamplingParams(max_tokens=GEN))) == our_toks[:until]
    return got | {"tokens": our_toks}


@pytest.mark.parametrize("scaling", [None, RopeScaling("yarn", 4.0, 16)], ids=["plain", "yarn"])
def test_random_hf_model_matches_reference(tmp_path, scaling):
    """With YaRN (transformers' rope_type "yarn", factor 4, original_max_position_embeddings 16): every position
    of the 24-token prompt and the 32 generated past 16, the original length, under the same bounds."""
    c = ORACLE_CFG if scaling is None else replace(ORACLE_CFG, rope_scaling=scaling)
    torch.manual_seed(1234)
    m = hf_model(c)
    _scale_random(m, c, seed=1234)
    state = m.state_dict()
    arrays = hf_to_gguf(state, c)
    # the inverse mapping (used by the second test) must give back exactly HF's parameters
    back = gguf_to_hf(arrays, c)
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())

    path = tmp_path / "oracle.gguf"
    write_gguf(path, c, arrays)
    model = ModelFile(path)
    assert same_config(model.config, c)
    stored = load_all(model)
    for n, a in arrays.items():
        if n.endswith(EXPERT_TENSORS):  # Q8_0: HF gets the stored values, so both sides use identical weights
            assert np.max(np.abs(stored[n] - a)) <= np.max(np.abs(a)) / 100
        else:
            assert np.array_equal(stored[n], a), n
    m.load_state_dict(gguf_to_hf(stored, c))

    prompt = np.random.default_rng(7).integers(0, c.vocab_size, PROMPT_LEN).tolist()
    # measured (2 cores, OpenBLAS + torch CPU): abs 5.9e-6, rel 6.6e-7, prefill+decode vs full 6.2e-6
    compare(ReferenceEngine(model, experts="float"), m, prompt, f"random HF model ({scaling or 'no scaling'})",
            dict(abs=3e-5, rel=3e-6, inc=3e-5))
    model.close()


# ---- test 2: a generated quantised model, dequantised into HF --------------------------------------------------


@pytest.mark.parametrize("expert_quant", ["IQ3_S", "Q4_K"])
def test_generated_quantised_model_matches_transformers(tmp_path, expert_quant):
    c = PRESETS["tiny"]
    path = tmp_path / f"tiny-{expert_quant}.gguf"
    make_model(path, c, expert_quant=expert_quant, dense_quant="Q8_0", router_skew=1.0)
    model = ModelFile(path)
    assert same_config(model.config, c) and model.expert_type(0, "gate") == quants.parse_type(expert_quant)
    torch.manual_seed(0)
    m = hf_model(c)
    m.load_state_dict(gguf_to_hf(load_all(model), c))

    prompt = np.random.default_rng(11).integers(0, c.vocab_size, PROMPT_LEN).tolist()
    # measured: IQ3_S abs 9.5e-6, rel 7.5e-7, prefill+decode 9.1e-6; Q4_K abs 9.5e-6, rel 8.2e-7, 8.6e-6
    float_eng = ReferenceEngine(model, experts="float")
    float_toks = compare(float_eng, m, prompt, f"tiny {expert_quant}", dict(abs=3e-5, rel=3e-6, inc=3e-5))["tokens"]

    # canonical experts (int8 activations per 32 values, integer block dots) vs the float path. The gap is the
    # activation quantisation by design: each expert's output moves by ~1.3 % of its largest value (0.04 of ~3);
    # measured separately, a float expert fed the dequantised int8 activations (x, then h) agrees with the
    # canonical one to ~2e-6 (a few outputs by one rounding step of h, ~4e-3). Measured on the logits: IQ3_S abs 0.116 (rel 0.0092),
    # Q4_K abs 0.121 (rel 0.0105); same routing and the same top-1 at all 24 prompt positions; the 32-token
    # greedy streams agree for 32 (IQ3_S) and 21 (Q4_K) tokens, then part at a near tie. The bounds allow
    # ~4x the measured error, about what one routing flip in a late layer costs (0.31, measured).
    canon = ReferenceEngine(model, experts="canonical")
    f = float_eng.forward(prompt, float_eng.new_kv(), logits="all")
    g = canon.forward(prompt, canon.new_kv(), logits="all")
    abs_err, rel_err = errors(g, f)
    top1 = float(np.mean(np.argmax(g, -1) == np.argmax(f, -1)))
    canon_toks, _ = our_greedy(canon, prompt, GEN)
    agree = next((i for i, (a, b) in enumerate(zip(canon_toks, float_toks)) if a != b), GEN)
    report(f"tiny {expert_quant}, canonical vs float", abs_err=abs_err, rel_err=rel_err, top1_agree=top1,
           greedy_prefix_agree=agree)
    assert abs_err < 0.5 and rel_err < 0.05
    assert top1 >= 0.9
    model.close()


def test_rope_matches_transformers():
    """Our RoPE against HF's rotary embedding and the exact (float64) rotation, out to long positions.

    HF computes the angle pos * inv_freq in float32, so its error grows with the position (one float32 rounding
    of the angle: ~pos * 2^-24 rad); ours computes angles in float64 and stays at float32 rounding. Measured
    max |ours - HF| on values of |x| <= ~4.5: 4.1e-6 at positions 56-63, 2.4e-4 at 4000, 2.4e-3 at 32000,
    9.2e-3 at 131000; |ours - exact| <= 2.8e-7 everywhere. Long-context comparisons with HF (or llama.cpp,
    which also builds its angles in float32) must allow for this; it is not an error of ours.
    """
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding, apply_rotary_pos_emb

    c = replace(PRESETS["tiny"], context_length=131072 + 64)
    rot = Qwen3MoeRotaryEmbedding(hf_config(c))
    rng = np.random.default_rng(3)
    half = c.head_dim // 2
    for start in (0, 24, 56, 1000, 4000, 32000, 131000):
        pos = np.arange(start, start + 8)
        x = rng.standard_normal((8, c.n_head, c.head_dim)).astype(np.float32)
        ours = rope(x, pos, c.rope_base)
        xt = torch.from_numpy(x).transpose(0, 1)[None]  # (batch, heads, T, head_dim)
        cos, sin = rot(xt, torch.from_numpy(pos)[None])
        hf = apply_rotary_pos_emb(xt, xt, cos, sin)[0][0].transpose(0, 1).numpy()
        ang = pos[:, None].astype(np.float64) * c.rope_base ** (-np.arange(half) * 2.0 / c.head_dim)
        co, si = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
        exact = np.concatenate([a * co - b * si, b * co + a * si], axis=-1)
        amax = float(np.abs(x).max())
        assert np.abs(ours - exact).max() < 1e-6  # measured <= 2.8e-7
        assert np.abs(ours - hf).max() <= 1e-6 + 2 * (start + 8) * 2.0 ** -24 * amax  # measured: see above


@pytest.mark.parametrize("scaling", [RopeScaling("yarn", 4.0, 32768), RopeScaling("yarn", 4.0, 16),
                                     RopeScaling("linear", 2.0)], ids=["yarn-32k", "yarn-16", "linear"])
def test_scaled_rope_matches_transformers(scaling):
    """Our scaled RoPE against HF's rotary embedding with the same rope_parameters (cos and sin times its
    attention_factor, as llama.cpp multiplies by mscale), past the original length; the bound allows HF's float32
    angles as test_rope_matches_transformers does."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding, apply_rotary_pos_emb

    c = replace(PRESETS["a3b"], context_length=40960, rope_scaling=scaling)
    rot = Qwen3MoeRotaryEmbedding(hf_config(c))
    assert rot.attention_scaling == pytest.approx(scaling.mscale(), rel=1e-12)
    rng = np.random.default_rng(5)
    for start in (0, 20, 1000, 40000, 131000):
        pos = np.arange(start, start + 8)
        x = rng.standard_normal((8, 4, c.head_dim)).astype(np.float32)
        ours = rope(x, pos, c.rope_base, scaling)
        xt = torch.from_numpy(x).transpose(0, 1)[None]
        cos, sin = rot(xt, torch.from_numpy(pos)[None])
        hf = apply_rotary_pos_emb(xt, xt, cos, sin)[0][0].transpose(0, 1).numpy()
        amax = float(np.abs(x).max()) * scaling.mscale()
        assert np.abs(ours - hf).max() <= 2e-6 + 2 * (start + 8) * 2.0 ** -24 * amax, start
