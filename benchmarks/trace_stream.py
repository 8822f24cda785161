"""A request trace of the Mooncake format as a stream of token prompts.

Each line of the file is a request: ``timestamp`` (ms), ``input_length`` and ``output_length``
(tokens) and ``hash_ids``, the prompt as 512-token prefix blocks where equal ids mean equal
prefixes. The trace holds no text: each id stands for 512 token ids derived from it alone
(``block_tokens``), the last block cut to ``input_length``, so two prompts share exactly the
leading tokens of their shared leading ids and the prefix structure is the trace's.

The shipped trace (``benchmarks/traces/conversation_trace.jsonl``, with its NOTICE.txt) is one
hour of a chat service; ``PAGED_CACHE_TRACE=FILE`` names another file of the same format.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

TRACE_BLOCK = 512  # tokens per trace block (the format's hash_ids granularity)
SHIPPED = Path(__file__).parent / "traces" / "conversation_trace.jsonl"
ENV = "PAGED_CACHE_TRACE"


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrived, its prompt's blocks and lengths."""

    index: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def tokens(self, vocab: int) -> np.ndarray:
        """The prompt's ``input_length`` token ids (int32), below ``vocab``."""
        blocks = [block_tokens(h, vocab) for h in self.hash_ids]
        return np.concatenate(blocks)[:self.input_length] if blocks else np.zeros(0, np.int32)


def block_tokens(hash_id: int, vocab: int) -> np.ndarray:
    """The 512 token ids trace block ``hash_id`` stands for: drawn from a generator seeded by
    the id alone, so the same id always gives the same tokens and two ids (almost surely)
    differ in their first few tokens."""
    rng = np.random.Generator(np.random.PCG64(hash_id))
    return rng.integers(0, vocab, TRACE_BLOCK, dtype=np.int32)


def trace_path() -> Path:
    """The trace to replay: ``$PAGED_CACHE_TRACE`` when set, else the shipped one."""
    named = os.environ.get(ENV)
    return Path(named) if named else SHIPPED


def load(path: Path | None = None, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests (all when None) of the trace at ``path`` (``trace_path()``
    by default); a malformed line is a ValueError naming the file and line."""
    return list(_read(path or trace_path(), limit))


def _read(path: Path, limit: int | None) -> Iterator[TraceRequest]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and line_no > limit:
                return
            if not line.strip():
                continue
            try:
                yield _request(line_no - 1, json.loads(line))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a trace request ({e})") from None


def _request(index: int, row: dict) -> TraceRequest:
    ids = tuple(int(h) for h in row["hash_ids"])
    length = int(row["input_length"])
    if any(h < 0 for h in ids):
        raise ValueError("a negative hash id")
    if not (len(ids) - 1) * TRACE_BLOCK < length <= len(ids) * TRACE_BLOCK:
        raise ValueError(f"input_length {length} does not fit {len(ids)} blocks of "
                         f"{TRACE_BLOCK} tokens")
    return TraceRequest(index, int(row["timestamp"]), length, int(row["output_length"]), ids)
