"""Offline test helpers: tiny random-weight models of real mlx-lm architectures."""

from paged_cache.testing.models import ARCHS, build_model, model_config, tiny_model

__all__ = ["ARCHS", "build_model", "model_config", "tiny_model"]
