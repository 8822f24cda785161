"""What differs by MLX backend or version because of MLX itself: what a test cannot run on a
backend (skipped there only), and what MLX's allocator does (no fixtures)."""

from __future__ import annotations

import mlx.core as mx
import pytest

ON_GPU = mx.default_device().type == mx.DeviceType.gpu
ON_CUDA = ON_GPU and not mx.metal.is_available()

# MLX's CUDA backend has no quantized_matmul kernel for the tiny models' shapes (head dim 32,
# group 32): the model cannot run a QuantizedKVCache there, with or without paged-cache
needs_quantized_matmul = pytest.mark.skipif(
    ON_CUDA, reason="MLX's CUDA quantized_matmul has no kernel for the tiny model's shapes")

# A GPU multiplies a batch of rows with other kernels than one row (a matrix product against a
# vector product), so greedy tokens decoded in a batch may differ from one request's alone there:
# batched against one-by-one is an exact oracle on the CPU backend only
batch_equals_alone = pytest.mark.skipif(
    ON_GPU, reason="a GPU decodes a batch with other matmul kernels than one request")


def mlx_keeps_freed_buffers() -> bool:
    """Whether MLX's allocator keeps freed buffers in its cache (``mx.get_cache_memory``) under
    the current cache limit: on the CPU backend of mlx 0.31.2 it keeps none."""
    probe = mx.zeros((1 << 18,))
    mx.eval(probe)
    del probe
    kept = mx.get_cache_memory() > 0
    mx.clear_cache()
    return kept
