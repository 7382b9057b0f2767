"""Rotary position embedding: the scaling a model file or the config asks for, and the one cos / sin table
function every engine uses (the reference applies it, the GPU card uploads it).

Scaling as llama.cpp defines it (and transformers' "linear" / "yarn" rope types compute the same):
- linear: every frequency divided by `factor`.
- yarn: frequencies whose wavelength is long against the original context (pair index past `high`) are divided
  by `factor`, short ones (before `low`) kept, a linear ramp between; low / high are where a pair turns
  beta_fast / beta_slow times over the original context. cos and sin are multiplied by
  mscale = attn_factor * (1 + 0.1 ln factor) (llama.cpp's rope_yarn multiplies both, as transformers multiplies
  cos and sin by its attention_factor): q and k each carry it, so the attention scores carry mscale^2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("none", "linear", "yarn")
F32 = np.float32


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"
    factor: float = 1.0  # context expansion (llama.cpp's 1 / freq_scale)
    orig_ctx: int = 0  # the context the model was trained at before scaling (yarn: required)
    attn_factor: float = 1.0  # rope.scaling.attn_factor: a further factor on mscale
    ext_factor: float = 1.0  # yarn: weight of the ramp's extrapolation (llama.cpp's yarn_ext_factor)
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def problems(self) -> list[str]:
        out = [f"rope scaling {name} must be finite, got {getattr(self, name)}" for name in
               ("factor", "attn_factor", "ext_factor", "beta_fast", "beta_slow") if not math.isfinite(getattr(self, name))]
        if out:
            return out
        if self.kind not in KINDS:
            out.append(f"rope scaling type {self.kind!r} is not supported (supported: {', '.join(KINDS)})")
        if not self.factor >= 1.0:
            out.append(f"rope scaling factor must be >= 1, got {self.factor}")
        if self.orig_ctx < 0 or (self.kind == "yarn" and self.orig_ctx == 0):
            out.append(f"rope scaling original context length must be positive, got {self.orig_ctx}")
        if not self.attn_factor > 0:
            out.append(f"rope scaling attn_factor must be positive, got {self.attn_factor}")
        if self.kind == "yarn" and not self.beta_fast > self.beta_slow > 0:
            out.append(f"yarn beta_fast ({self.beta_fast}) must exceed beta_slow ({self.beta_slow}) > 0")
        return out

    @property
    def scaled(self) -> bool:
        return self.kind != "none"

    def mscale(self) -> float:
        """The factor on cos and sin (1 unless yarn or an attn_factor)."""
        m = self.attn_factor if self.scaled else 1.0
        if self.kind == "yarn" and self.ext_factor != 0 and self.factor > 1:
            m *= 1.0 + 0.1 * math.log(self.factor)
        return m


NONE = RopeScaling()


def yarn_corr_dims(head_dim: int, base: float, orig_ctx: int, beta_fast: float, beta_slow: float) -> tuple[int, int]:
    """The pair indices where the ramp starts and ends: where a pair turns beta_fast / beta_slow times."""
    def dim(n_rot: float) -> float:
        return head_dim * math.log(orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    return max(0, math.floor(dim(beta_fast))), min(head_dim - 1, math.ceil(dim(beta_slow)))


def inv_freq(head_dim: int, base: float, scaling: RopeScaling = NONE) -> np.ndarray:
    """float64 (head_dim / 2,): each pair's angle per position."""
    half = head_dim // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2 / head_dim)
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "yarn":
        low, high = yarn_corr_dims(head_dim, base, scaling.orig_ctx, scaling.beta_fast,
                                   scaling.beta_slow)
        ramp = 1 - np.clip((np.arange(half, dtype=np.float64) - low) / max(0.001, high - low), 0, 1)
        mix = ramp * scaling.ext_factor
        return (inv / scaling.factor) * (1 - mix) + inv * mix
    return inv


def tables(pos: np.ndarray, head_dim: int, base: float, scaling: RopeScaling = NONE) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 (len(pos), head_dim / 2): angles in float64, times mscale, one rounding to float32."""
    ang = np.asarray(pos)[:, None].astype(np.float64) * inv_freq(head_dim, base, scaling)[None, :]
    m = scaling.mscale()
    if m == 1.0:
        return np.cos(ang).astype(F32), np.sin(ang).astype(F32)
    return (np.cos(ang) * m).astype(F32), (np.sin(ang) * m).astype(F32)
