"""What a test cannot run on a backend because of MLX itself, skipped there only (no fixtures)."""

from __future__ import annotations

import mlx.core as mx
import pytest

ON_CUDA = mx.default_device().type == mx.DeviceType.gpu and not mx.metal.is_available()

# MLX's CUDA backend has no quantized_matmul kernel for the tiny models' shapes (head dim 32,
# group 32): the model cannot run a QuantizedKVCache there, with or without paged-cache
needs_quantized_matmul = pytest.mark.skipif(
    ON_CUDA, reason="MLX's CUDA quantized_matmul has no kernel for the tiny model's shapes")
