"""The numpy float32 reference forward pass of qwen3moe: the oracle for every other engine.

Experts run through an `ExpertRunner`: `CanonicalExperts` (the bit-exact function of canonical.py, what every
card must reproduce) or `FloatExperts` (plain float32 on dequantised weights, for comparison with transformers).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np
from threadpoolctl import ThreadpoolController

from stratad.engine.chunks import PROMPT_CHUNK, chunks
from stratad.engine import canonical
from stratad.engine.card import HostSampled
from stratad.engine.generation import Generation
from stratad.engine.sampling import SamplingParams
from stratad.model import quants
from stratad.model import rope as rope_tables
from stratad.model.gguf_file import ModelFile
from stratad.model.rope import RopeScaling

F32 = np.float32
_BLAS = ThreadpoolController()


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(np.square(x, dtype=F32), axis=-1, keepdims=True, dtype=F32)
    return (x / np.sqrt(ms + F32(eps))) * w


def rope(x: np.ndarray, pos: np.ndarray, base: float, scaling: RopeScaling = rope_tables.NONE) -> np.ndarray:
    """NEOX-style rotary embedding (Qwen3): pairs (i, i + head_dim/2). x: (T, heads, head_dim). cos / sin from
    the table function the GPU card uploads (stratad/model/rope.py), scaling included."""
    half = x.shape[-1] // 2
    cos, sin = rope_tables.tables(pos, x.shape[-1], base, scaling)
    cos, sin = cos[:, None, :], sin[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """softmax -> top-k (descending, ties to the lower index) -> renormalised weights. Returns (ids, weights)."""
    p = softmax(logits.astype(F32))
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=-1)
    return ids, (w / w.sum(axis=-1, keepdims=True)).astype(F32)


class ExpertRunner(Protocol):
    def __call__(self, layer: int, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """x: (T, d_model) normalised input, ids: (T, k) -> outputs (T, k, d_model) float32."""


class _ExpertCache:
    """Decoded experts by (layer, expert), least recently used dropped first; bounded in count and in bytes
    (an a3b expert is 19 MB as float32: 4096 of them would be 77 GB)."""

    def __init__(self, model: ModelFile, decode, capacity: int, max_bytes: int = 2 << 30):
        self.model, self.decode, self.capacity, self.max_bytes = model, decode, capacity, max_bytes
        self.items: OrderedDict = OrderedDict()
        self.nbytes = 0

    @staticmethod
    def _size(v) -> int:
        parts = [a for m in v for a in ((m.q, m.scale, m.minimum, m.mweight) if isinstance(m, quants.IntBlocks)
                                        else (m,))]
        return sum(a.nbytes for a in parts if a is not None)

    def get(self, layer: int, e: int):
        key = (layer, e)
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        m = self.model
        v = tuple(self.decode(m.expert_type(layer, kind), m.expert_raw(layer, kind, e))
                  for kind in ("gate", "up", "down"))
        self.items[key] = v
        self.nbytes += self._size(v)
        while len(self.items) > 1 and (len(self.items) > self.capacity or self.nbytes > self.max_bytes):
            self.nbytes -= self._size(self.items.popitem(last=False)[1])
        return v


class CanonicalExperts:
    def __init__(self, model: ModelFile, cache_experts: int = 4096):
        self.cache = _ExpertCache(model, quants.decode_int, cache_experts)

    def __call__(self, layer, x, ids):
        qa, da = canonical.quantize_act(x)
        out = np.zeros(ids.shape + (x.shape[-1],), F32)
        for e in np.unique(ids):
            t, j = np.nonzero(ids == e)
            out[t, j] = canonical.expert(*self.cache.get(layer, int(e)), qa[t], da[t])
        return out


class FloatExperts:
    def __init__(self, model: ModelFile, cache_experts: int = 4096):
        self.cache = _ExpertCache(model, quants.dequantize, cache_experts)

    def __call__(self, layer, x, ids):
        out = np.zeros(ids.shape + (x.shape[-1],), F32)
        for e in np.unique(ids):
            t, j = np.nonzero(ids == e)
            g, u, d = self.cache.get(layer, int(e))
            xe = x[t]
            gv = xe @ g.T
            out[t, j] = ((gv / (F32(1) + np.exp(-gv))) * (xe @ u.T)) @ d.T
        return out


@dataclass
class KVCache:
    k: list[np.ndarray]  # per layer (capacity, n_kv, head_dim)
    v: list[np.ndarray]
    length: int = 0

    @classmethod
    def empty(cls, n_layer: int, n_kv: int, head_dim: int) -> "KVCache":
        z = lambda: np.zeros((0, n_kv, head_dim), F32)  # noqa: E731
        return cls([z() for _ in range(n_layer)], [z() for _ in range(n_layer)])

    def truncate(self, n: int) -> None:
        """Keep the first n positions (the next tokens are written after them)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot keep {n} of {self.length} positions")
        self.length = n

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        end = self.length + k.shape[0]
        if end > self.k[layer].shape[0]:  # grow geometrically
            cap = max(end, 2 * self.k[layer].shape[0], 256)
            for buf in (self.k, self.v):
                old = buf[layer]
                buf[layer] = np.zeros((cap,) + old.shape[1:], F32)
                buf[layer][: old.shape[0]] = old
        self.k[layer][self.length:end] = k
        self.v[layer][self.length:end] = v
        return self.k[layer][:end], self.v[layer][:end]


@dataclass
class Trace:
    """What a forward pass saw, for tests and profiling: routed experts and the hidden state's RMS per layer."""
    ids: list[np.ndarray] = field(default_factory=list)
    rms: list[float] = field(default_factory=list)


class ReferenceEngine(HostSampled):
    """The numpy forward pass: the oracle every card is checked against, and a Card of its own (stratad generate)."""

    prompt_chunk = PROMPT_CHUNK

    def __init__(self, model: ModelFile, experts: str | ExpertRunner = "canonical", cache_dense: bool = True):
        self.model, self.c = model, model.config
        if isinstance(experts, str):
            experts = {"canonical": CanonicalExperts, "float": FloatExperts}[experts](model)
        self.experts = experts
        self.cache_dense = cache_dense
        self._dense: dict[str, np.ndarray] = {}

    def w(self, name: str) -> np.ndarray:
        if name in self._dense:
            return self._dense[name]
        v = self.model.dense(name)
        if self.cache_dense:
            self._dense[name] = v
        return v

    def new_kv(self) -> KVCache:
        return KVCache.empty(self.c.n_layer, self.c.n_head_kv, self.c.head_dim)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        ti = self.model.info("token_embd.weight")
        return quants.dequantize(ti.qtype, self.model.raw(ti.name)[tokens])

    def attention(self, i: int, x: np.ndarray, kv: KVCache) -> np.ndarray:
        c, b = self.c, f"blk.{i}."
        T = x.shape[0]
        h = rms_norm(x, self.w(b + "attn_norm.weight"), c.rms_eps)
        q = (h @ self.w(b + "attn_q.weight").T).reshape(T, c.n_head, c.head_dim)
        k = (h @ self.w(b + "attn_k.weight").T).reshape(T, c.n_head_kv, c.head_dim)
        v = (h @ self.w(b + "attn_v.weight").T).reshape(T, c.n_head_kv, c.head_dim)
        q = rms_norm(q, self.w(b + "attn_q_norm.weight"), c.rms_eps)
        k = rms_norm(k, self.w(b + "attn_k_norm.weight"), c.rms_eps)
        pos = np.arange(kv.length, kv.length + T)
        q, k = rope(q, pos, c.rope_base, c.rope_scaling), rope(k, pos, c.rope_base, c.rope_scaling)
        K, V = kv.append(i, k, v)
        g = c.n_head // c.n_head_kv
        qg = q.reshape(T, c.n_head_kv, g, c.head_dim)
        s = np.einsum("tkgd,skd->kgts", qg, K) * F32(1 / np.sqrt(c.head_dim))
        s = np.where(pos[:, None] >= np.arange(K.shape[0])[None, :], s, F32(-np.inf))
        o = np.einsum("kgts,skd->tkgd", softmax(s), V).reshape(T, c.q_dim)
        return o @ self.w(b + "attn_output.weight").T

    def moe(self, i: int, x: np.ndarray, trace: Trace | None = None) -> np.ndarray:
        b = f"blk.{i}."
        h = rms_norm(x, self.w(b + "ffn_norm.weight"), self.c.rms_eps)
        ids, wts = route(h @ self.w(b + "ffn_gate_inp.weight").T, self.c.n_expert_used)
        if trace is not None:
            trace.ids.append(ids)
        return canonical.combine(wts, self.experts(i, h, ids))

    def forward(self, tokens, kv: KVCache, logits: str = "last", trace: Trace | None = None) -> np.ndarray:
        """Run new tokens (appended to kv). logits: "last" (1, vocab), "all" (T, vocab) or "none" (the hidden
        states, (T, d_model)). Many tokens are read in chunks of prompt_chunk, as a CPU card reads a prompt: a
        read's rounding depends on its length (matmul shapes, the softmax's sum), so this gives a card's bits."""
        # a multi-threaded BLAS splits sums differently with its thread count: one thread keeps the bits the
        # same in every process (lanes, the reference in a test), whatever the machine's cores
        with _BLAS.limit(limits=1, user_api="blas"):
            if len(tokens) <= self.prompt_chunk:
                return self._forward(tokens, kv, logits, trace)
            outs = [self._forward(c, kv, logits if logits != "last" or last else "none", trace)
                    for c, _, last in chunks(tokens, logits, self.prompt_chunk)]
            return outs[-1] if logits == "last" else np.concatenate(outs)

    def _forward(self, tokens, kv: KVCache, logits: str, trace: Trace | None) -> np.ndarray:
        tokens = np.asarray(tokens, np.int64)
        x = self.embed(tokens)
        for i in range(self.c.n_layer):
            x = x + self.attention(i, x, kv)
            x = x + self.moe(i, x, trace)
            if trace is not None:
                trace.rms.append(float(np.sqrt(np.mean(np.square(x.astype(np.float64))))))
        kv.length += len(tokens)
        if logits == "none":
            return x
        x = x[-1:] if logits == "last" else x
        h = rms_norm(x, self.w("output_norm.weight"), self.c.rms_eps)
        return h @ self.w("output.weight").T

    def generate(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        """Sampled token ids; stops at a stop token (not yielded), a stop string or max_tokens."""
        g = Generation(self, self.model.tokenizer, prompt, params, self.c.max_context)
        return (t for t, _ in g if t is not None)
