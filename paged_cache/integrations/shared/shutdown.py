"""What a server logs when it stops: the blocks and bytes that closing its cache manager wrote
(the SSD write queue drained, blocks only RAM held written out), so a log shows the flush did."""

from __future__ import annotations

import logging
import time
from typing import Any

from paged_cache.config import format_size
from paged_cache.manager import PagedSSDCacheManager

TIERS = {"ssd": "SSD tier", "remote": "remote tier"}   # stats section -> name in the line


def _written(stats: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """{section: (blocks written, bytes written)} of each lower tier, as counted since open."""
    return {name: (stats[name].get("writes", 0), stats[name].get("write_bytes", 0))
            for name in TIERS if name in stats}


def close_logged(manager: PagedSSDCacheManager, why: str, log: logging.Logger) -> None:
    """Close ``manager`` (every queued and RAM-only block is written) and log at INFO what that
    wrote to each lower tier and how long it took; ``why`` names the stop (e.g. "SIGTERM")."""
    before = manager.stats()
    start = time.monotonic()
    manager.close()
    seconds = time.monotonic() - start
    after = _written(manager.stats())
    hot = before.get("hot", {})
    if not after:   # hot tier only: nothing outlives the process
        log.info("stopped (%s): hot tier only, nothing to write; %d blocks (%s) in RAM dropped",
                 why, hot.get("blocks", 0), format_size(hot.get("bytes", 0)))
        return
    was = _written(before)
    parts = [f"{TIERS[name]} {blocks - was[name][0]} blocks ({format_size(nbytes - was[name][1])})"
             for name, (blocks, nbytes) in after.items()]
    log.info("stopped (%s): cache flushed in %.2f s, written: %s", why, seconds, ", ".join(parts))
