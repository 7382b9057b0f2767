"""llama.cpp's file types as tensor-type mixes: which type its quantiser gives each tensor of a qwen3moe model.

Source: llama.cpp src/llama-quant.cpp, `llama_tensor_get_type` and `llama_model_quantize_impl` (the default type of
each file type, which tensors are quantised at all, the fallback for rows that are not whole blocks), read at
ggerganov/llama.cpp commit 059325d9, then checked tensor by tensor against llama.cpp b11434's llama-quantize
(scripts/llama_quantize_check.py, tests/test_llama_quantize.py; the fallbacks updated to it). The rules are
restated here as a table for this architecture: qwen3moe has n_expert = 128 (so none of the 8-expert or Falcon
rows apply), experts are 3-D tensors whose layer is the name's, and attn_v's running index is its layer (the loader
orders tensors by layer). Files are assumed quantised with an
importance matrix (as most published files are, and as the IQ1 / IQ2 types require). Not quantised: norms (1-D),
the router (ffn_gate_inp), so they stay F32 as the converter writes them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType as F

from stratad.model import quants
from stratad.model.config import ModelConfig

# file type -> the default type of its quantised tensors
DEFAULT = {
    F.MOSTLY_Q4_0: T.Q4_0, F.MOSTLY_Q4_1: T.Q4_1, F.MOSTLY_Q5_0: T.Q5_0, F.MOSTLY_Q5_1: T.Q5_1,
    F.MOSTLY_Q8_0: T.Q8_0, F.MOSTLY_Q2_K: T.Q2_K, F.MOSTLY_Q2_K_S: T.Q2_K, F.MOSTLY_Q3_K_S: T.Q3_K,
    F.MOSTLY_Q3_K_M: T.Q3_K, F.MOSTLY_Q3_K_L: T.Q3_K, F.MOSTLY_Q4_K_S: T.Q4_K, F.MOSTLY_Q4_K_M: T.Q4_K,
    F.MOSTLY_Q5_K_S: T.Q5_K, F.MOSTLY_Q5_K_M: T.Q5_K, F.MOSTLY_Q6_K: T.Q6_K, F.MOSTLY_IQ2_XXS: T.IQ2_XXS,
    F.MOSTLY_IQ2_XS: T.IQ2_XS, F.MOSTLY_IQ2_S: T.IQ2_XS, F.MOSTLY_IQ2_M: T.IQ2_S, F.MOSTLY_IQ3_XXS: T.IQ3_XXS,
    F.MOSTLY_IQ3_XS: T.IQ3_S, F.MOSTLY_IQ3_S: T.IQ3_S, F.MOSTLY_IQ3_M: T.IQ3_S, F.MOSTLY_IQ1_S: T.IQ1_S,
    F.MOSTLY_IQ1_M: T.IQ1_M, F.MOSTLY_IQ4_NL: T.IQ4_NL, F.MOSTLY_IQ4_XS: T.IQ4_XS,
    F.MOSTLY_MXFP4_MOE: T.MXFP4,  # the experts' type: every other quantised tensor Q8_0 (RULES)
    # the converter's output (convert_hf_to_gguf --outtype): every matrix of the type, no rule applies
    F.MOSTLY_F16: T.F16, F.MOSTLY_BF16: T.BF16, F.ALL_F32: T.F32,
}
# --mix names: q4_k_m, iq3_s, ..., f16, bf16, f32
MIXES = {f.name.removeprefix("MOSTLY_").removeprefix("ALL_").lower(): f for f in DEFAULT}
FLOAT_FILES = {F.MOSTLY_F16, F.MOSTLY_BF16, F.ALL_F32}

LOW_BIT = {F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M, F.MOSTLY_IQ1_M}


@dataclass(frozen=True)
class Where:
    layer: int
    n_layer: int
    n_gqa: int


Cond = Callable[[Where], bool]
ALWAYS: Cond = lambda w: True  # noqa: E731
FIRST_EIGHTH: Cond = lambda w: w.layer < w.n_layer // 8  # noqa: E731
FIRST_SIXTEENTH: Cond = lambda w: w.layer < w.n_layer // 16  # noqa: E731
MIDDLE: Cond = lambda w: w.n_layer // 8 <= w.layer < 7 * w.n_layer // 8  # noqa: E731
GQA4: Cond = lambda w: w.n_gqa >= 4  # noqa: E731
# llama.cpp's use_more_bits: the first and last eighth of the layers and every third layer between
MORE_BITS: Cond = lambda w: (w.layer < w.n_layer // 8 or w.layer >= 7 * w.n_layer // 8  # noqa: E731
                             or (w.layer - w.n_layer // 8) % 3 == 2)


def _below(k: int) -> Cond:
    return lambda w: w.layer < k


# (role, file types, condition, type): for a tensor of that role, the first row whose file type and condition
# match gives its type; no row: the file type's default. Mirrors llama_tensor_get_type's if / else-if chains.
RULES: list[tuple[str, set, Cond, T]] = [
    # MXFP4_MOE: the 3-D (expert) tensors MXFP4, every other one Q8_0, ahead of every other rule (read from
    # llama-quant.cpp; not yet checked against a llama-quantize binary)
    *((role, {F.MOSTLY_MXFP4_MOE}, ALWAYS, T.Q8_0) for role in ("output", "token_embd", "attn_q", "attn_k",
                                                                "attn_v", "attn_output")),
    ("output", {F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ3_XXS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M,
                F.MOSTLY_IQ1_M}, ALWAYS, T.Q5_K),
    ("output", set(DEFAULT) - {F.MOSTLY_Q8_0} - FLOAT_FILES, ALWAYS, T.Q6_K),
    ("token_embd", {F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M}, ALWAYS, T.Q2_K),
    ("token_embd", {F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M, F.MOSTLY_IQ3_XXS}, ALWAYS, T.IQ3_S),
    # the lowest-bit file types have their own chain
    ("attn_v", LOW_BIT, ALWAYS, T.Q4_K),  # n_expert >= 4
    ("ffn_down_exps", {F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M}, FIRST_EIGHTH, T.IQ3_S),
    ("ffn_down_exps", LOW_BIT, FIRST_EIGHTH, T.Q2_K),
    ("attn_output", {F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M}, ALWAYS, T.IQ2_XXS),
    ("attn_output", {F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M}, ALWAYS, T.IQ3_S),
    # every other file type
    ("attn_v", {F.MOSTLY_Q2_K}, GQA4, T.Q4_K),
    ("attn_v", {F.MOSTLY_Q2_K}, ALWAYS, T.Q3_K),
    ("attn_v", {F.MOSTLY_Q2_K_S}, GQA4, T.Q4_K),
    ("attn_v", {F.MOSTLY_IQ3_XXS}, GQA4, T.Q4_K),
    ("attn_v", {F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_S}, GQA4, T.Q4_K),
    ("attn_v", {F.MOSTLY_IQ3_M}, ALWAYS, T.Q4_K),
    ("attn_v", {F.MOSTLY_Q3_K_M}, _below(2), T.Q5_K),
    ("attn_v", {F.MOSTLY_Q3_K_M}, ALWAYS, T.Q4_K),
    ("attn_v", {F.MOSTLY_Q3_K_L}, ALWAYS, T.Q5_K),
    ("attn_v", {F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS}, GQA4, T.Q5_K),
    ("attn_v", {F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M}, MORE_BITS, T.Q6_K),
    ("attn_v", {F.MOSTLY_Q4_K_S}, _below(4), T.Q5_K),
    ("attn_k", {F.MOSTLY_IQ3_XS}, ALWAYS, T.IQ3_XXS),
    ("attn_k", {F.MOSTLY_IQ3_XXS}, ALWAYS, T.IQ2_S),
    ("attn_q", {F.MOSTLY_IQ3_XS}, ALWAYS, T.IQ3_XXS),
    ("attn_q", {F.MOSTLY_IQ3_XXS}, ALWAYS, T.IQ2_S),
    ("ffn_down_exps", {F.MOSTLY_Q2_K}, ALWAYS, T.Q3_K),
    ("ffn_down_exps", {F.MOSTLY_Q2_K_S}, FIRST_EIGHTH, T.Q4_K),
    ("ffn_down_exps", {F.MOSTLY_Q3_K_M}, FIRST_SIXTEENTH, T.Q5_K),
    ("ffn_down_exps", {F.MOSTLY_Q3_K_M}, ALWAYS, T.Q4_K),
    ("ffn_down_exps", {F.MOSTLY_IQ3_M}, FIRST_EIGHTH, T.Q4_K),
    ("ffn_down_exps", {F.MOSTLY_Q3_K_L}, ALWAYS, T.Q5_K),
    ("ffn_down_exps", {F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M}, MORE_BITS, T.Q6_K),
    ("ffn_down_exps", {F.MOSTLY_Q4_K_S}, FIRST_EIGHTH, T.Q5_K),
    ("ffn_down_exps", {F.MOSTLY_Q4_0}, FIRST_EIGHTH, T.Q4_1),  # with an importance matrix
    ("ffn_down_exps", {F.MOSTLY_Q5_0}, FIRST_EIGHTH, T.Q5_1),
    ("attn_output", {F.MOSTLY_Q2_K}, ALWAYS, T.Q3_K),
    ("attn_output", {F.MOSTLY_IQ3_XXS}, ALWAYS, T.IQ3_S),
    ("attn_output", {F.MOSTLY_Q3_K_M, F.MOSTLY_IQ3_M}, ALWAYS, T.Q4_K),
    ("attn_output", {F.MOSTLY_Q3_K_L}, ALWAYS, T.Q5_K),
    ("ffn_gate_exps", {F.MOSTLY_IQ3_XS}, MIDDLE, T.IQ3_XXS),
    ("ffn_up_exps", {F.MOSTLY_IQ3_XS}, MIDDLE, T.IQ3_XXS),
]

# a row that is not a whole number of the chosen type's blocks falls back to these (then to F16): llama.cpp's
# tensor_type_fallback as of b11434 (checked against its llama-quantize: scripts/llama_quantize_check.py); older
# builds, the code this table was first read from among them, sent Q2_K and Q3_K to IQ4_NL instead of Q4_0
FALLBACK = {T.IQ2_XXS: T.IQ4_NL, T.IQ2_XS: T.IQ4_NL, T.IQ2_S: T.IQ4_NL, T.IQ3_XXS: T.IQ4_NL, T.IQ3_S: T.IQ4_NL,
            T.IQ1_S: T.IQ4_NL, T.IQ1_M: T.IQ4_NL, T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.IQ4_XS: T.IQ4_NL,
            T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def parse_mix(name: str) -> F:
    try:
        return MIXES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown mix {name!r}; llama.cpp file types: {', '.join(MIXES)}") from None


def _role(name: str) -> str | None:
    """The rules' role of a tensor name, or None for tensors the quantiser leaves as they are."""
    base = name.removesuffix(".weight")
    role = base.split(".")[-1]
    if name.endswith("_norm.weight") or role == "ffn_gate_inp":
        return None
    return role


def tensor_type(ftype: F, name: str, row_values: int, c: ModelConfig) -> T | None:
    """The type llama.cpp's quantiser gives tensor `name` (rows of row_values) in a file of type ftype, or None
    for a tensor it does not quantise."""
    role = _role(name)
    if role is None:
        return None
    if ftype in FLOAT_FILES:  # llama_tensor_get_type is only consulted for quantised file types
        return DEFAULT[ftype]
    where = Where(int(name.split(".")[1]) if name.startswith("blk.") else 0, c.n_layer, c.n_head // c.n_head_kv)
    t = next((t for r, fts, cond, t in RULES if r == role and ftype in fts and cond(where)), DEFAULT[ftype])
    if role == "output" and row_values % quants.fmt(DEFAULT[ftype]).block_values:
        t = T.Q8_0
    if row_values % quants.fmt(t).block_values:
        t = FALLBACK.get(t, T.F16)
        if row_values % quants.fmt(t).block_values:
            t = T.F16
    return t


def mix_types(ftype: F, shapes: dict[str, tuple[int, ...]], c: ModelConfig) -> dict[str, T]:
    """name -> type for every tensor the quantiser changes (shapes in numpy order, values)."""
    out = {}
    for name, shape in shapes.items():
        t = tensor_type(ftype, name, shape[-1], c)
        if t is not None:
            out[name] = t
    return out
