"""The typed shape of a qwen3moe model, read from (and written to) GGUF metadata."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from stratad.model.rope import NONE, RopeScaling

ARCH = "qwen3moe"


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int
    d_model: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    d_ff_expert: int
    vocab_size: int
    context_length: int
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    rope_scaling: RopeScaling = NONE
    arch: str = ARCH

    # GGUF metadata key (without the "qwen3moe." prefix) -> field
    KEYS = {
        "block_count": "n_layer",
        "embedding_length": "d_model",
        "attention.head_count": "n_head",
        "attention.head_count_kv": "n_head_kv",
        "attention.key_length": "head_dim",
        "expert_count": "n_expert",
        "expert_used_count": "n_expert_used",
        "expert_feed_forward_length": "d_ff_expert",
        "context_length": "context_length",
        "rope.freq_base": "rope_base",
        "attention.layer_norm_rms_epsilon": "rms_eps",
    }
    FLOAT_FIELDS = ("rope_base", "rms_eps")
    # llama.cpp's rope scaling keys (all optional) -> RopeScaling field
    ROPE_KEYS = {
        "rope.scaling.type": "kind",
        "rope.scaling.factor": "factor",
        "rope.scaling.original_context_length": "orig_ctx",
        "rope.scaling.attn_factor": "attn_factor",
        "rope.scaling.yarn_ext_factor": "ext_factor",
        "rope.scaling.yarn_beta_fast": "beta_fast",
        "rope.scaling.yarn_beta_slow": "beta_slow",
    }

    def problems(self) -> list[str]:
        """What makes this shape unservable; empty when it is fine."""
        out = []
        for name, v in asdict(self).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not 0 < v < math.inf:  # nan too
                out.append(f"{name} must be positive{' and finite' * isinstance(v, float)}, got {v}")
        if out:
            return out
        if self.n_head % self.n_head_kv:
            out.append(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if self.head_dim % 2:
            out.append(f"key_length {self.head_dim} must be even for RoPE")
        if self.n_expert_used > self.n_expert:
            out.append(f"expert_used_count {self.n_expert_used} exceeds expert_count {self.n_expert}")
        if self.d_model % 32 or self.d_ff_expert % 32:
            out.append("embedding_length and expert_feed_forward_length must be multiples of 32")
        return out + self.rope_scaling.problems()

    @property
    def max_context(self) -> int:
        """The longest context the model serves: its trained length, or with RoPE scaling the original length
        times the factor when that is more."""
        r = self.rope_scaling
        return max(self.context_length, int((r.orig_ctx or self.context_length) * r.factor)) if r.scaled \
            else self.context_length

    def with_rope_overrides(self, scaling: str | None = None, scale: float | None = None,
                            orig_ctx: int | None = None) -> "ModelConfig":
        """This shape with the config's rope_scaling / rope_scale / yarn_orig_ctx (None: the file's), as
        llama-server's --rope-scaling / --rope-scale / --yarn-orig-ctx. ValueError names the setting."""
        r = self.rope_scaling
        kind = scaling if scaling is not None else r.kind
        if kind not in ("none", "linear", "yarn"):
            raise ValueError(f"rope_scaling must be none, linear or yarn, got {kind!r}")
        if kind == "none":
            given = [n for n, v in (("rope_scale", scale), ("yarn_orig_ctx", orig_ctx)) if v is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} need rope_scaling linear or yarn (the model "
                                 f"{'has none' if scaling is None else 'is set to none'})")
            return replace(self, rope_scaling=NONE)
        if kind == "linear" and orig_ctx is not None:
            raise ValueError("yarn_orig_ctx applies to rope_scaling = 'yarn' only")
        factor = scale if scale is not None else (r.factor if r.scaled else None)
        if factor is None or factor <= 1.0:
            raise ValueError(f"rope_scaling = '{kind}' needs rope_scale > 1 (the context expansion factor"
                             f"{'; the model file has none' if scale is None else f', got {scale}'})")
        keep = r if r.scaled else RopeScaling()  # a file's yarn details (attn_factor, betas) stay
        new = replace(keep, kind=kind, factor=float(factor),
                      orig_ctx=int(orig_ctx or r.orig_ctx or (self.context_length if kind == "yarn" else 0)))
        if probs := new.problems():
            raise ValueError("; ".join(probs))
        return replace(self, rope_scaling=new)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def effective_context_length(requested: int, model: ModelConfig, explicit: bool = True) -> int:
    """The lanes' KV capacity: `requested` (the config's context_length) if the model serves it. Above the
    model's length an explicit setting is refused naming the settings; the default is capped."""
    limit = model.max_context
    if requested <= limit:
        return requested
    if not explicit:
        return limit
    r = model.rope_scaling
    why = (f"{r.kind} RoPE scaling: original length {r.orig_ctx or model.context_length} x rope_scale {r.factor:g})"
           f"; lower context_length or raise rope_scale" if r.scaled else
           "its trained length); lower context_length, or extend it with rope_scaling = 'yarn' and rope_scale")
    raise ValueError(f"context_length {requested} exceeds the model's {limit} tokens ({why}")


PRESETS = {
    # small enough for CI and the demo (a few MB), still a real MoE: 16 experts, top 4, several layers
    "tiny": ModelConfig(n_layer=4, d_model=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=16, n_expert_used=4,
                        d_ff_expert=256, vocab_size=1024, context_length=8192),
    # tiny's width with a3b's routing (64 experts, top 8) and more layers: placement and shares on CPU cards
    "mini": ModelConfig(n_layer=8, d_model=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=64, n_expert_used=8,
                        d_ff_expert=256, vocab_size=1024, context_length=8192),
    # Qwen3-30B-A3B
    "a3b": ModelConfig(n_layer=48, d_model=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=128,
                       n_expert_used=8, d_ff_expert=768, vocab_size=151936, context_length=131072),
    # Qwen3-235B-A22B: 94 layers x 128 experts = 12,032 experts, 40960 tokens native
    "a235b": ModelConfig(n_layer=94, d_model=4096, n_head=64, n_head_kv=4, head_dim=128, n_expert=128,
                         n_expert_used=8, d_ff_expert=1536, vocab_size=151936, context_length=40960),
}
