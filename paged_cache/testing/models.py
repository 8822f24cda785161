"""Tiny random-weight models of real mlx-lm architectures, built offline for tests and demos.

The weights are random, so generated text is meaningless; the cache classes, shapes and code
paths are exactly those of the real architectures.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

VOCAB = 256

# Small but real configurations: each builds the architecture's own cache mix. Mixture-of-experts
# layers are turned off (dense MLPs) because MLX's CPU GatherMM only supports float32.
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        tie_word_embeddings=False,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=VOCAB,
        sliding_window=64, sliding_window_pattern=2, query_pre_attn_scalar=32,
    ),
    "qwen3_next": dict(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        shared_expert_intermediate_size=64, mlp_only_layers=[0, 1, 2, 3], moe_intermediate_size=32,
        rms_norm_eps=1e-6, vocab_size=VOCAB, rope_theta=10000.0, partial_rotary_factor=0.5,
        max_position_embeddings=4096, full_attention_interval=2,
    ),
    # Tensor parallel (shard) and pipeline stages both; dense MLPs (no experts)
    "qwen3_5": dict(
        model_type="qwen3_5",
        text_config=dict(
            model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=4,
            intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=3, full_attention_interval=2,
            rms_norm_eps=1e-6, vocab_size=VOCAB, tie_word_embeddings=True,
            max_position_embeddings=4096,
            rope_parameters=dict(type="default", mrope_section=[2, 1, 1], rope_theta=10000.0,
                                 partial_rotary_factor=0.5),
        ),
    ),
    # Sliding window + full attention, split by heads or by layers (pipeline stages in every
    # supported mlx-lm, unlike qwen3_next / qwen3_5)
    "ministral3": dict(
        model_type="ministral3", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=64,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, llama_4_scaling_beta=0.1,
                             original_max_position_embeddings=4096),
    ),
    "mamba": dict(
        model_type="mamba", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        state_size=16, num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
        time_step_rank=8,
    ),
    "baichuan_m1": dict(
        model_type="baichuan_m1", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
        sliding_window=32, sliding_window_layers=[0], conv_window=2, rms_norm_eps=1e-5,
    ),
    "llama4": dict(
        model_type="llama4",
        text_config=dict(
            model_type="llama4_text", hidden_size=64, num_hidden_layers=4,
            intermediate_size=128, intermediate_size_mlp=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=VOCAB,
            rope_theta=10000.0, num_local_experts=2, num_experts_per_tok=1,
            interleave_moe_layer_step=1000, attention_chunk_size=32, use_qk_norm=True,
            attention_bias=False, max_position_embeddings=4096, rope_scaling=None,
            floor_scale=8192, attn_scale=0.1, attn_temperature_tuning=4,
            no_rope_layers=[], moe_layers=None,
        ),
    ),
    "mamba2": dict(
        model_type="mamba2", num_heads=4, head_dim=16, vocab_size=VOCAB, hidden_size=32,
        intermediate_size=64, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5,
        conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
        time_step_limit=(0.0, float("inf")), time_step_rank="auto",
    ),
    "nemotron_h": dict(
        model_type="nemotron_h", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, max_position_embeddings=4096, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attention_bias=False, mamba_num_heads=4,
        mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1,
        mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
        hybrid_override_pattern=["M", "*", "-", "M"],
    ),
    "falcon_h1": dict(
        model_type="falcon_h1", hidden_size=64, head_dim=16, intermediate_size=128,
        mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16, mamba_n_groups=1,
        mamba_n_heads=4, mamba_chunk_size=32, num_attention_heads=4, num_hidden_layers=2,
        num_key_value_heads=2, vocab_size=VOCAB, rope_theta=10000.0, max_position_embeddings=4096,
    ),
    "granitemoehybrid": dict(
        model_type="granitemoehybrid", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, max_position_embeddings=4096, num_attention_heads=4,
        num_key_value_heads=2, attention_bias=False, embedding_multiplier=1.0,
        attention_multiplier=0.25, logits_scaling=1.0, residual_multiplier=1.0,
        layer_types=["mamba", "attention", "mamba"], rms_norm_eps=1e-5,
        shared_intermediate_size=128, mamba_n_heads=4, mamba_d_head=32, mamba_proj_bias=False,
        mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True,
        rope_theta=10000.0,
    ),
    "jamba": dict(
        model_type="jamba", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_offset=1, attn_layer_period=2,
        expert_layer_offset=1, expert_layer_period=1000, mamba_d_conv=4, mamba_d_state=16,
        mamba_expand=2, num_experts=1, num_experts_per_tok=1, rms_norm_eps=1e-6,
        max_position_embeddings=4096, vocab_size=VOCAB,
    ),
    "lfm2": dict(
        model_type="lfm2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5,
        conv_bias=False, conv_L_cache=3, block_dim=64, block_multiple_of=16,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, block_ff_dim=128,
        full_attn_idxs=[1], rope_theta=10000.0,
    ),
    # Entry 0 is an ArraysCache of the last token ids (the n-gram embedding's context).
    # (mla_scale_* False leaves attributes unset in mlx-lm 0.32.2: the model cannot run.)
    "longcat_flash_ngram": dict(
        model_type="longcat_flash_ngram", hidden_size=64, ffn_hidden_size=128, moe_topk=1,
        expert_ffn_hidden_size=64, n_routed_experts=2, zero_expert_num=0, num_layers=1,
        vocab_size=VOCAB, max_position_embeddings=4096, num_attention_heads=2, kv_lora_rank=32,
        q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        routed_scaling_factor=1.0, rms_norm_eps=1e-5, rope_theta=10000.0, mla_scale_q_lora=True,
        mla_scale_kv_lora=True, ngram_vocab_size_ratio=4, emb_neighbor_num=3, emb_split_num=2,
    ),
    # DeepSeek-V4 (mlx-lm 0.32+): a 128-token sliding window on every layer, compressed groups of
    # 4 tokens (layer 1, with index keys; layer 2 reads them) and of 128 tokens (layer 3, with
    # index keys, and picking candidate blocks), layer 0 window only; hyper-connections, Sinkhorn mixing, sparse top-k attention.
    "deepseek_v41": dict(
        model_type="deepseek_v41", vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4,
        num_attention_heads=4, head_dim=64, q_lora_rank=32, qk_rope_head_dim=16, o_groups=2,
        o_lora_rank=32, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
        sliding_window=128, compress_ratios=(0, 4, 4, 128), kv_source_layer_ids=(1, 3),
        index_source_layer_ids=(1, 2, 3), index_n_heads=4, index_head_dim=32, index_topk=4,
        candidate_source_layer_id=3, candidate_topk_blocks=2, candidate_block_size=2,
        rms_norm_eps=1e-6,
    ),
}

# the architectures the installed mlx-lm has (deepseek_v41 arrived in 0.32)
ARCHS = tuple(a for a, c in ARCH_CONFIGS.items()
              if importlib.util.find_spec(f"mlx_lm.models.{c['model_type']}") is not None)


def model_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """Return the config dict for ``arch`` with ``overrides`` applied (top level keys)."""
    if arch not in ARCH_CONFIGS:
        raise ValueError(f"arch: unknown architecture {arch!r}; expected one of {', '.join(ARCHS)}")
    config = dict(ARCH_CONFIGS[arch])
    config.update(overrides)
    return config


def build_model(config: dict[str, Any], *, seed: int = 0, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """Instantiate an mlx-lm model from a config dict with seeded random weights in ``dtype``."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    model.eval()
    mx.eval(model.parameters())
    return model


def tiny_model(arch: str = "llama", *, seed: int = 0, dtype: mx.Dtype = mx.float32,
               **overrides: Any) -> nn.Module:
    """A tiny random-weight model of ``arch`` (see ``ARCHS``), ready for ``model(tokens, cache)``."""
    return build_model(model_config(arch, **overrides), seed=seed, dtype=dtype)
