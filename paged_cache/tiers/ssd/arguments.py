"""The SSD tier's arguments checked: a ValueError naming the argument and the value refused."""

from __future__ import annotations

from typing import Sequence

from paged_cache.config import QUEUE_FULL_POLICIES
from paged_cache.tiers import format as fmt


def check_arguments(max_bytes: int, queue_max_bytes: int, compression: str,
                    queue_full_policy: str) -> None:
    """Check ``SSDTier``'s budget, queue bound, compression and queue-full policy."""
    check_size("max_bytes", max_bytes, minimum=1)
    check_size("queue_max_bytes", queue_max_bytes, minimum=0)
    _check_choice("compression", compression, fmt.COMPRESSIONS)
    _check_choice("queue_full_policy", queue_full_policy, QUEUE_FULL_POLICIES)


def check_size(name: str, value: int, *, minimum: int) -> None:
    """``value`` must be an integer number of bytes (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer number of bytes >= {minimum}, "
                         f"got {value!r}")


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")
