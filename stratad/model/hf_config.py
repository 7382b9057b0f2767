"""A qwen3moe shape as Hugging Face transformers' Qwen3MoeConfig arguments (no import of transformers here): the
oracle test builds transformers' model from our GGUF with it, the tiny model's trainer the other way round."""
from __future__ import annotations

from stratad.model.config import ModelConfig


def rope_parameters(c: ModelConfig) -> dict:
    """transformers' rope_parameters for our RoPE scaling."""
    r = c.rope_scaling
    if r.kind == "none":
        return {"rope_type": "default", "rope_theta": c.rope_base}
    out = {"rope_type": r.kind, "rope_theta": c.rope_base, "factor": r.factor}
    if r.kind == "yarn":
        out |= {"original_max_position_embeddings": r.orig_ctx, "beta_fast": r.beta_fast, "beta_slow": r.beta_slow}
    return out


def max_positions(c: ModelConfig) -> int:
    """YaRN's scaled length, as transformers expects it (original length x factor); else the trained one."""
    r = c.rope_scaling
    return int(r.orig_ctx * r.factor) if r.kind == "yarn" else c.context_length


def qwen3moe_kwargs(c: ModelConfig) -> dict:
    """Qwen3MoeConfig's arguments for this shape (add the attention / experts implementations and any training
    options)."""
    return dict(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff_expert * c.n_expert_used,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_head_kv,
        head_dim=c.head_dim, num_experts=c.n_expert, num_experts_per_tok=c.n_expert_used,
        moe_intermediate_size=c.d_ff_expert, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, rope_parameters=rope_parameters(c),
        rms_norm_eps=c.rms_eps, attention_bias=False, max_position_embeddings=max_positions(c),
        use_sliding_window=False, hidden_act="silu", bos_token_id=None, eos_token_id=None, pad_token_id=None)
