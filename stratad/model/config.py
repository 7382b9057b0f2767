"""The typed shape of a qwen3moe model, read from (and written to) GGUF metadata."""
from __future__ import annotations

from dataclasses import asdict, dataclass

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

    def problems(self) -> list[str]:
        """What makes this shape unservable; empty when it is fine."""
        out = []
        for name, v in asdict(self).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
                out.append(f"{name} must be positive, got {v}")
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
        return out

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


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
}
