"""Tiny random-weight models of real mlx-lm architectures, built offline for tests and demos.

The weights are random, so generated text is meaningless; the cache classes, shapes and code
paths are exactly those of the real architectures.
"""

from __future__ import annotations

import importlib
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
}

ARCHS = tuple(ARCH_CONFIGS)


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
