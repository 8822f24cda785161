"""Block-aligned prefill chunk plan: the Scheduler's chunks, and the forward a fetch sizes its
rebuilt buffers for (the caller's next one)."""

from __future__ import annotations


def next_chunk_end(start: int, stop: int, block_size: int, chunk_size: int) -> int:
    """End of the prefill chunk that starts at ``start`` when the prompt is prefilled up to ``stop``.

    Chunks end on the absolute grid of ``chunk_size`` (a multiple of ``block_size``), so a request
    resuming from a cached prefix chunks the rest exactly as a cold run does. The final chunk is
    cut at the last block boundary before ``stop`` so that boundary gets a snapshot too.
    """
    if not 0 <= start < stop:
        raise ValueError(f"start: expected 0 <= start < stop={stop}, got {start}")
    end = min((start // chunk_size + 1) * chunk_size, stop)
    if end == stop:
        boundary = stop // block_size * block_size
        if start < boundary < stop:
            end = boundary
    return end


def next_forward_end(n: int, total: int, block_size: int, chunk_size: int) -> int:
    """Where the next forward on a cache covering the first ``n`` of a prompt's ``total`` tokens
    ends, when the prompt is prefilled up to its last token in the chunks of ``next_chunk_end``
    and the first decode step feeds that token (the Scheduler; with ``chunk_size`` equal to the
    block size, any caller feeding chunks that end on block boundaries, for a block size that
    divides mlx-lm's 256-row growth step, grows its cache alike)."""
    return next_chunk_end(n, total - 1, block_size, chunk_size) if n < total - 1 else total
