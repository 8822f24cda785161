"""A tiny mlx-vlm model whose attention handles TurboQuantKVCache (needs the turboquant extra)."""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm.models.llama.config import ModelConfig
from mlx_vlm.models.llama.language import Model

from paged_cache.testing.models import VOCAB


def tiny_vlm_llama(dtype: mx.Dtype = mx.float32) -> Model:
    """mlx-vlm's llama language model (its attention handles TurboQuant), random weights."""
    cfg = ModelConfig(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                      vocab_size=VOCAB, tie_word_embeddings=False)
    mx.random.seed(0)
    model = Model(cfg)
    model.set_dtype(dtype)
    model.eval()
    return model
