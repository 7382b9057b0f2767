"""`stratad make-model`: a valid qwen3moe GGUF with random, well-scaled weights, streamed to disk.

Scales keep the hidden state well-conditioned through every layer: each projection's weights have RMS
1/sqrt(fan_in) (unit-variance outputs), the blocks' output projections are damped so that the residual stream
grows slowly with depth. Router skew: every token's embedding carries a constant component on dimension 0
(real models have such "massive activation" dimensions); router column 0 gives expert e the logit bonus
skew * (-log(1 + rank_e)) along it, with a per-layer random ranking, so popularity is Zipf-like per layer.
With two topics, dimensions 1 and 2 carry the token's topic with their own rankings, so two chats of different
topics have different hot experts (the seed's two-chat measurement needs that).
"""
from __future__ import annotations

import os
import time

import numpy as np
from gguf import GGMLQuantizationType as T

from stratad.model import mixes, quants
from stratad.model.quants.encode import ENCODED, encode
from stratad.model.config import PRESETS, ModelConfig
from stratad.model.writer import TensorSource, row_chunks, write_model

CHUNK_BYTES = 64 << 20  # rows generated per write: bounds peak memory
SKEW_DIM_VALUE = 3.0  # constant embedding component on dimension 0
OUT_DAMP = 0.5  # attention / expert output projections: keeps the residual growth slow
TOPIC_STICKINESS = 8.0  # LM-head weight on the topic dimensions
# the embedding with a router skew and the LM head with two topics have columns set by value: their rows are encoded
# from floats, which quants.encode does for these types
FLOAT_ENCODED = ENCODED


def _seed(seed: int, name: str) -> np.random.Generator:
    # each tensor has its own stream: a tensor's values do not depend on which others were generated
    return np.random.default_rng([seed, *name.encode()])


def _random(name: str, qtype: T, shape: tuple[int, ...], rms: float, seed: int) -> TensorSource:
    rows, n = int(np.prod(shape[:-1])), shape[-1]
    per = max(1, CHUNK_BYTES // quants.fmt(qtype).row_bytes(n))

    def chunks():
        rng = _seed(seed, name)
        return row_chunks(rows, per, lambda s, k: quants.random_rows(qtype, rng, k, n, rms))

    return TensorSource(name, qtype, shape, chunks)


def _fixed(name: str, qtype: T, values: np.ndarray) -> TensorSource:
    return TensorSource.of(name, qtype, values)


def _float_rows(name: str, qtype: T, shape: tuple[int, int], rms: float, seed: int, columns) -> TensorSource:
    """Gaussian rows with some columns set by `columns(block, first_row)`, then encoded as `qtype` (quants.encode)."""
    per = max(1, (CHUNK_BYTES // 4) // shape[1])

    def make(rng):
        def rows(s, k):
            v = rng.standard_normal((k, shape[1]), dtype=np.float32) * np.float32(rms)
            columns(v, s)
            return encode(qtype, v)
        return rows

    return TensorSource(name, qtype, shape, lambda: row_chunks(shape[0], per, make(_seed(seed, name))))


def _topic(first: int, k: int) -> np.ndarray:
    """Token classes of rows first..first+k: even ids are topic A, odd ids topic B."""
    return (np.arange(first, first + k) % 2).astype(bool)


def _embedding(c: ModelConfig, qtype: T, seed: int, skew: float, topics: int) -> TensorSource:
    name = "token_embd.weight"
    if skew == 0:
        return _random(name, qtype, (c.vocab_size, c.d_model), 1.0, seed)

    def columns(v, s):
        v[:, 0] = SKEW_DIM_VALUE
        if topics == 2:  # the token's topic on its own dimension: 1 for A, 2 for B
            b = _topic(s, len(v))
            v[:, 1] = np.where(b, 0.0, SKEW_DIM_VALUE)
            v[:, 2] = np.where(b, SKEW_DIM_VALUE, 0.0)

    return _float_rows(name, qtype, (c.vocab_size, c.d_model), 1.0, seed, columns)


def _lm_head(c: ModelConfig, qtype: T, seed: int, topics: int) -> TensorSource:
    name, rms = "output.weight", 3.0 / np.sqrt(c.d_model)
    if topics != 2:
        return _random(name, qtype, (c.vocab_size, c.d_model), rms, seed)

    def columns(v, s):  # a topic-A context favours topic-A tokens and B favours B: a chat keeps its topic
        b = _topic(s, len(v))
        v[:, 1] = np.where(b, -TOPIC_STICKINESS, TOPIC_STICKINESS)
        v[:, 2] = -v[:, 1]

    return _float_rows(name, qtype, (c.vocab_size, c.d_model), rms, seed, columns)


def _router(c: ModelConfig, layer: int, seed: int, skew: float, topics: int) -> np.ndarray:
    rng = _seed(seed, f"router.{layer}")
    w = rng.standard_normal((c.n_expert, c.d_model), dtype=np.float32) / np.float32(np.sqrt(c.d_model))
    if skew:
        for dim in range(1 + (topics == 2) * 2):  # dimension 0: all traffic; 1, 2: each topic's own ranking
            w[:, dim] = skew * -np.log1p(rng.permutation(c.n_expert)) / SKEW_DIM_VALUE
    return w


def _norm(rng_name: str, n: int, seed: int) -> np.ndarray:
    return (1.0 + 0.05 * _seed(seed, rng_name).standard_normal(n)).astype(np.float32)


def model_tensors(c: ModelConfig, expert_q: T, dense_q: T, skew: float, seed: int,
                  topics: int = 1, types: dict[str, T] | None = None) -> list[TensorSource]:
    """types: a type per tensor name (a llama.cpp mix, stratad.model.mixes) over expert_q / dense_q."""
    d, ff, E = c.d_model, c.d_ff_expert, c.n_expert
    types = types or {}

    def dq(name: str) -> T:
        return types.get(name, dense_q)

    def eq(name: str) -> T:
        return types.get(name, expert_q)

    ts = [_embedding(c, dq("token_embd.weight"), seed, skew, topics),
          _fixed("output_norm.weight", T.F32, _norm("output_norm", d, seed)),
          _lm_head(c, dq("output.weight"), seed, topics)]
    for i in range(c.n_layer):
        b = f"blk.{i}."
        ts += [
            _fixed(b + "attn_norm.weight", T.F32, _norm(b + "attn_norm", d, seed)),
            _random(b + "attn_q.weight", dq(b + "attn_q.weight"), (c.q_dim, d), 1 / np.sqrt(d), seed),
            _random(b + "attn_k.weight", dq(b + "attn_k.weight"), (c.kv_dim, d), 1 / np.sqrt(d), seed),
            _random(b + "attn_v.weight", dq(b + "attn_v.weight"), (c.kv_dim, d), 1 / np.sqrt(d), seed),
            _random(b + "attn_output.weight", dq(b + "attn_output.weight"), (d, c.q_dim), OUT_DAMP / np.sqrt(c.q_dim),
                    seed),
            _fixed(b + "attn_q_norm.weight", T.F32, _norm(b + "attn_q_norm", c.head_dim, seed)),
            _fixed(b + "attn_k_norm.weight", T.F32, _norm(b + "attn_k_norm", c.head_dim, seed)),
            _fixed(b + "ffn_norm.weight", T.F32, _norm(b + "ffn_norm", d, seed)),
            # llama.cpp's quantiser leaves the router in F32 too
            _fixed(b + "ffn_gate_inp.weight", T.F32, _router(c, i, seed, skew, topics)),
            _random(b + "ffn_gate_exps.weight", eq(b + "ffn_gate_exps.weight"), (E, ff, d), 1 / np.sqrt(d), seed),
            _random(b + "ffn_up_exps.weight", eq(b + "ffn_up_exps.weight"), (E, ff, d), 1 / np.sqrt(d), seed),
            _random(b + "ffn_down_exps.weight", eq(b + "ffn_down_exps.weight"), (E, d, ff), 2 * OUT_DAMP / np.sqrt(ff),
                    seed),
        ]
    return ts


def split_size(text: str) -> int:
    """A shard size as llama.cpp's gguf-split --split-max-size takes it: bytes, or a number with M or G
    (10^6, 10^9 bytes)."""
    t = text.strip().upper()
    scale = {"M": 10**6, "G": 10**9}.get(t[-1:], 1)
    try:
        n = int(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise ValueError(f"a split size is a number of bytes or a number with M or G (gguf-split's), got {text!r}") \
            from None
    if n <= 0:
        raise ValueError(f"a split size must be positive, got {text!r}")
    return n


def make_model(out: str | os.PathLike, preset: str | ModelConfig = "tiny", expert_quant: str = "IQ3_S",
               dense_quant: str = "Q8_0", router_skew: float = 0.0, seed: int = 0, topics: int = 1,
               split_max_size: int = 0, mix: str | None = None) -> dict:
    """Write the model; returns a small report (path, files, bytes, seconds). topics=2: two kinds of traffic with
    different hot experts (even / odd token ids), each chat keeping to the kind its prompt has. split_max_size:
    llama.cpp's split shards of at most that many bytes (the first, `path` -00001-of-N, is the model to load).
    mix: a llama.cpp file type (q4_k_m, iq3_s, ...): each tensor gets the type llama.cpp's quantiser gives it in
    such a file (stratad.model.mixes); expert_quant / dense_quant are then not used."""
    if topics not in (1, 2):
        raise ValueError(f"topics must be 1 or 2, got {topics}")
    if topics == 2 and not router_skew:
        raise ValueError("topics=2 needs a router skew (it gives each topic its own hot experts)")
    from stratad.model.gguf_file import expected_tensors
    from stratad.model.generated_vocab import build_vocab

    c = preset if isinstance(preset, ModelConfig) else PRESETS[preset]
    eq, dq = quants.parse_type(expert_quant), quants.parse_type(dense_quant)
    types, file_type, label = {}, eq, eq.name
    if mix is not None:
        ftype = mixes.parse_mix(mix)
        types = mixes.mix_types(ftype, {n: s for n, (s, _) in expected_tensors(c).items()}, c)
        file_type, label = ftype, mix.upper()
    pinned = (["token_embd.weight"] if router_skew else []) + (["output.weight"] if topics == 2 else [])
    for name in pinned:  # rows with set columns are encoded from floats (quants.encode)
        if types.get(name, dq) not in FLOAT_ENCODED:
            raise ValueError(f"{f'mix {mix}' if mix else f'dense quant {dq.name}'}: {name} would be {types.get(name, dq).name}; with a router skew or two topics the "
                             f"generator sets some of its columns and can encode those rows only as "
                             f"{quants.supported_names(FLOAT_ENCODED)}")
    if not types:
        for n in (c.d_model, c.d_ff_expert):
            quants.fmt(eq).row_bytes(n)
            quants.fmt(dq).row_bytes(n)
    if split_max_size < 0:
        raise ValueError(f"split_max_size must be >= 0, got {split_max_size}")
    t0 = time.monotonic()
    files = write_model(out, c, model_tensors(c, eq, dq, router_skew, seed, topics, types), build_vocab(c.vocab_size),
                        name=f"stratad-{preset if isinstance(preset, str) else 'custom'}-{label}", file_type=file_type,
                        split_max_size=split_max_size)
    return {"path": files[0], "files": files, "bytes": sum(os.path.getsize(f) for f in files),
            "seconds": round(time.monotonic() - t0, 2)}
