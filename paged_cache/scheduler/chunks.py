"""Block-aligned prefill chunk plan."""

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
