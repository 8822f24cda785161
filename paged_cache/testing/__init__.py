"""Offline test helpers: tiny random-weight models of real mlx-lm architectures."""

from paged_cache.testing.model_dir import (CHAT_TEMPLATE, TOKENIZER_VOCAB_SIZE, byte_tokenizer,
                                           dir_model_config, is_model_dir, write_model_dir)
from paged_cache.testing.models import ARCHS, build_model, model_config, tiny_model

__all__ = ["ARCHS", "CHAT_TEMPLATE", "TOKENIZER_VOCAB_SIZE", "build_model", "byte_tokenizer",
           "dir_model_config", "is_model_dir", "model_config", "tiny_model", "write_model_dir"]
