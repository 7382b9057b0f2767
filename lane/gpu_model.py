"""qwen3moe on one GPU: its dense weights on the card and a step's work as a list of launches (lane/kernels), for
the GPU card (lane/cupy_card.py) to run directly or capture as CUDA graphs.

Dense weights stay in their GGUF encoding (mat-vecs read the rows directly; prompt chunks use cuBLAS on a fp16 copy
made once). A step for T tokens is: the embedding; per layer, attention (the decode step's q/k norm, RoPE and KV
append folded into its split kernel) and the router, then the experts (GpuExperts: on this card, its peers', from
host memory or on the CPU pool at a host break); the final norm, the LM head and, where asked, the sample on the
card. Every launch reads positions from the device, so a decode step's list can be captured once and replayed.
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy as cp
import numpy as np

from lane.gpu_experts import D2H, GpuExperts, pinned
from lane.kernels import attention, embedding, gemm, matvec, norm, rope_kv, router, sampling, weights
from stratad.model.gguf_file import ModelFile


class Work:
    """One step's buffers for T tokens (the decode step's stay put: its graphs point at them)."""

    def __init__(self, c, T: int, logit_rows: int, slots: int = 1):
        """slots: host copies of the routed ids (a step launched ahead writes the other one)."""
        self.T = T
        self.pos0 = 0  # where a prompt chunk starts (host side; decode steps read the device's pos)
        self.long_ctx = False  # a decode step at ATTN_PDL_MAX_CTX or more (its attention: no PDL, plain loads)
        self.tokens = cp.zeros((T,), cp.int32)
        self.x, self.h = cp.empty((T, c.d_model), cp.float32), cp.empty((T, c.d_model), cp.float32)
        self.qkv = cp.empty((T, c.q_dim + 2 * c.kv_dim), cp.float32)
        self.q = cp.empty((T, c.n_head, c.head_dim), cp.float32)
        self.att = cp.empty((T, c.q_dim), cp.float32)
        self.att_q = cp.empty((matvec.q8_row_bytes(c.q_dim),), cp.int8)  # a decode step's, for the o mat-vec on 8 bits
        self.router = cp.empty((T, c.n_expert), cp.float32)
        self.ids = cp.empty((c.n_layer, T, c.n_expert_used), cp.int32)
        self.w = cp.empty((T, c.n_expert_used), cp.float32)
        self.hl = cp.empty((max(1, logit_rows), c.d_model), cp.float32)
        self.logits = cp.empty((max(1, logit_rows), c.vocab_size), cp.float32)
        self.ids_h = [pinned(self.ids.shape, np.int32) for _ in range(slots)]
        self.logits_h = pinned(self.logits.shape, np.float32)


@dataclass(frozen=True)
class DeviceSample:
    """A step's last logits row sampled on the card: by argmax (greedy), the top-k sampler (also top-p without a
    top-k, the host sampling where its nucleus is wider than the candidates) or the whole-vocabulary sampler
    ("argmax", "top-k", "cdf"); logits: they come back to the host as well."""
    kind: str
    logits: bool


class Break:
    """A host break in a step: the CPU pool serves this layer's misses."""

    def __init__(self, layer: int):
        self.layer = layer


class Qwen3MoeGpu:
    """The model's weights on the card and the launches of a step (ops). kv: each layer's (K, V) caches and pos:
    the device position, both the card's (it owns the sequence's state); token and sparams: the device sampler's
    output and parameters."""

    def __init__(self, model: ModelFile, stream: cp.cuda.Stream, experts: GpuExperts, kv: list, pos: cp.ndarray,
                 max_ctx: int):
        c = self.c = model.config
        self.stream, self.experts, self.kv, self.pos = stream, experts, kv, pos
        up = weights.DenseWeight.upload

        def w(name, pack=True):
            ti = model.info(name)
            return up(model.raw(name).reshape(-1, ti.row_bytes), ti.qtype, ti.shape[-1], pack=pack)

        def f32(name):
            return cp.asarray(model.dense(name).astype(np.float32))

        self.embed_w, self.out_w = w("token_embd.weight", pack=False), w("output.weight")  # the table: rows by id
        self.out_norm = f32("output_norm.weight")
        self.layers = []
        for i in range(c.n_layer):
            b = f"blk.{i}."
            self.layers.append(dict(
                qkv=weights.DenseWeight.concat([w(b + "attn_q.weight"), w(b + "attn_k.weight"), w(b + "attn_v.weight")]),
                o=w(b + "attn_output.weight"), router=w(b + "ffn_gate_inp.weight"),
                attn_norm=f32(b + "attn_norm.weight"), ffn_norm=f32(b + "ffn_norm.weight"),
                q_norm=f32(b + "attn_q_norm.weight"), k_norm=f32(b + "attn_k_norm.weight")))
        self.rope = rope_kv.RopeTable(max_ctx, c.head_dim, c.rope_base, c.rope_scaling)
        # decode steps' attention, by long context (Work.long_ctx): each with its own load path and splits
        self.attn = {long: attention.DecodeAttention(c.n_head, c.n_head_kv, c.head_dim, max_ctx, pipelined=not long)
                     for long in (False, True)}
        self.prefill_attn = attention.PrefillAttention(c.n_head, c.n_head_kv, c.head_dim, max_ctx)
        self._set_o_qx()
        self.packed_bytes = 0  # what pack_layers added
        self.argmax, self.topk, self.cdf = sampling.Argmax(c.vocab_size), sampling.DeviceSampler(c.vocab_size), \
            sampling.CdfSampler(c.vocab_size)
        # the sampler's parameters and its token; host copies by slot (a step launched ahead uses the other one)
        self.sparams, self.sparams_h = cp.zeros((4,), cp.float64), pinned((2, 4), np.float64)
        self.token, self.token_h = cp.zeros((1,), cp.int32), pinned((2,), np.int32)

    def _set_o_qx(self) -> None:
        # decode steps: the o mat-vec on the attention output quantised to 8 bits by the combine
        self.o_qx = bool(self.layers and self.layers[0]["o"].takes_qx and all(a.quantizes() for a in self.attn.values()))

    def pack_layers(self, dry: bool = False) -> int:
        """Pack the layers' and the LM head's K- and I-quant file rows (weights.DenseWeight.to_packed: faster decode
        steps, the same numbers; steps captured before must be captured again); dry: only say. Returns the bytes it
        adds. (The head's Q6_K file rows decode slower than the bus: packed, the largest single read of a step runs
        near the copy rate.)"""
        added = sum(L[k].to_packed(dry) for L in self.layers for k in ("qkv", "o", "router"))
        added += self.out_w.to_packed(dry)
        if not dry:
            self._set_o_qx()
            self.packed_bytes += added
        return added

    def ops(self, w: Work, logit_rows: int, sample: DeviceSample | None = None) -> list:
        """The step for w.T tokens: callables that only launch work on the card's stream, and Breaks (a decode
        step's layers whose misses the CPU pool serves; a prompt chunk stages them on the card instead)."""
        export = not self.experts.full and w.T == 1
        ops = [lambda: embedding.embed(self.embed_w, w.tokens, w.x, stream=self.stream)]
        for i in range(self.c.n_layer):
            ops.append(lambda i=i: self._attend_and_route(i, w, export))
            if export:
                ops.append(Break(i))
            ops.append(lambda i=i: self.experts.back(i, w.w, w.x))
        ops.append(lambda: self._finish(w, logit_rows, sample))
        return ops

    def _proj(self, W: weights.DenseWeight, X: cp.ndarray, Y: cp.ndarray, residual: cp.ndarray | None = None) -> None:
        """Y = X W^T (+ residual; Y may be residual): the mat-vec kernel for one token, cuBLAS fp16 for more."""
        if X.shape[0] == 1:
            r = None if residual is None else residual[0]
            matvec.matvec(W, X[0], Y[0], residual=r, stream=self.stream)
        else:
            gemm.dense_batched(W, X, Y, residual=residual, cache=True, stream=self.stream)

    def _norm_proj(self, norm_w: cp.ndarray, W: weights.DenseWeight, w: Work, Y: cp.ndarray, quant=None) -> None:
        """Y = W rms_norm(w.x) (quant: also the experts' quantised input): one launch for a decode step where the
        kernel takes W, else the norm into w.h, then the projection (same bits)."""
        if w.T == 1 and matvec.norm_matvec_ok(W):
            matvec.norm_matvec(W, w.x[0], norm_w, self.c.rms_eps, Y[0], quant=quant, stream=self.stream)
        else:
            norm.rms_norm(w.x, norm_w, self.c.rms_eps, w.h, quant=quant, stream=self.stream)
            self._proj(W, w.h, Y)

    def _attend_and_route(self, i: int, w: Work, export: bool) -> None:
        c, L, s = self.c, self.layers[i], self.stream
        self._norm_proj(L["attn_norm"], L["qkv"], w, w.qkv)
        qx = w.T == 1 and self.o_qx
        if w.T == 1:  # pos on the device: graph-safe; q/k norm, RoPE and the KV append in the split launch
            self.attn[w.long_ctx].step(w.qkv, L["q_norm"], L["k_norm"], c.rms_eps, self.rope, self.pos, *self.kv[i],
                                       w.att, out_q=w.att_q if qx else None, pdl=not w.long_ctx, stream=s)
        else:  # a prompt chunk, run eagerly: the host knows where it starts
            rope_kv.qk_norm_rope_kv(w.qkv, L["q_norm"], L["k_norm"], c.rms_eps, self.rope, self.pos, w.q, *self.kv[i],
                              n_head=c.n_head, n_kv=c.n_head_kv, stream=s)
            self.prefill_attn(w.q, *self.kv[i], w.pos0, w.att, stream=s)
        if qx:
            matvec.matvec(L["o"], w.att_q, w.x[0], residual=w.x[0], qx=True, stream=s)
        else:
            self._proj(L["o"], w.att, w.x, residual=w.x)
        self._norm_proj(L["ffn_norm"], L["router"], w, w.router, quant=self.experts.inputs(w.T))
        if w.T == 1:  # a decode step: routed in the launch that builds the pair lists
            nx = self.layers[i + 1] if i + 1 < c.n_layer else None
            if nx is not None and matvec.norm_matvec_ok(nx["router"]):  # the next layer's misses fetched ahead
                self.experts.predict(i + 1, lambda out, st: matvec.norm_matvec(nx["router"], w.x[0], nx["ffn_norm"],
                                                                               c.rms_eps, out[0], stream=st))
            self.experts.front(i, 1, w.ids[i], export, router=(w.router, w.w), x=w.x)
        else:
            router.route(w.router, c.n_expert_used, w.ids[i], w.w, stream=s)
            self.experts.front(i, w.T, w.ids[i], export)

    def _finish(self, w: Work, logit_rows: int, sample: DeviceSample | None) -> None:
        s, rt = self.stream, cp.cuda.runtime
        rope_kv.advance_pos(self.pos, w.T, stream=s)
        if logit_rows:
            norm.rms_norm(w.x[w.T - logit_rows:], self.out_norm, self.c.rms_eps, w.hl, stream=s)
            self._proj(self.out_w, w.hl, w.logits)
            if sample is None or sample.logits:
                rt.memcpyAsync(w.logits_h.ctypes.data, w.logits.data.ptr, w.logits.nbytes, D2H, s.ptr)
            if sample is not None:
                last = w.logits[logit_rows - 1]
                if sample.kind == "argmax":
                    self.argmax(last, self.token, stream=s)
                else:
                    (self.topk if sample.kind == "top-k" else self.cdf)(last, self.sparams, self.token, stream=s)

