"""The tiers a configuration asks for, fastest first: the hot (RAM) tier, the SSD tier (unless
``hot_cache_only``) and the shared remote tier (with ``remote_url``). A new kind of tier is one
more entry here; the manager routes through the tier interface (tiers/base.py) only."""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

from paged_cache.config import ENV_PREFIX, CacheConfig, filesystem_space, format_size
from paged_cache.stats import nested_gauges
from paged_cache.tiers.base import Tier
from paged_cache.tiers.ssd.files import CacheDirError
from paged_cache.tiers.hot import EvictCallback, HotTier
from paged_cache.tiers.ssd.manifest import ManifestError
from paged_cache.tiers.remote.tier import RemoteTier
from paged_cache.tiers.remote.client import TLSFiles
from paged_cache.tiers.ssd.tier import SSDTier

log = logging.getLogger("paged_cache.manager")

# Every label a hit can be counted under (tier.holds / tier.read labels), fastest first.
HIT_LABELS = ("hot", "pending", "ssd", "remote")
# The stats() gauges of every tier, each in its own section.
TIER_GAUGES = (nested_gauges("hot", HotTier.STAT_GAUGES) | nested_gauges("ssd", SSDTier.STAT_GAUGES)
               | nested_gauges("remote", RemoteTier.STAT_GAUGES))


def open_tiers(config: CacheConfig, *, lock: Any,
               on_evict: EvictCallback) -> tuple[list[Tier], str | None]:
    """The tiers ``config`` asks for, the hot tier first (guarded by ``lock``, its evicted
    blocks handed to ``on_evict``), and why the SSD tier could not be opened (None when it was,
    or none was asked for: the hot tier then serves alone). A bad ``ssd_dir`` raises ValueError."""
    tiers: list[Tier] = []
    ssd_error = None
    if not config.hot_cache_only:
        ssd, ssd_error = _open_ssd(config)
        tiers += [ssd] if ssd is not None else []
    if config.remote_url:
        log.info("remote tier at %r", config.remote_url)
        if config.remote_secret is None and config.remote_insecure:  # at every start
            log.warning("remote tier %s without remote_secret (remote_insecure from %s): anyone "
                        "who can write to that server can change what this host serves; give "
                        "every host the same secret (%sREMOTE_SECRET)", config.remote_url.redacted(),
                        config.sources["remote_insecure"], ENV_PREFIX)
        tiers.append(RemoteTier(config.remote_url, timeout=config.remote_timeout,
                                ttl=config.remote_ttl, queue_max_bytes=config.remote_queue_max_bytes,
                                compression=config.compression, cluster=config.remote_cluster,
                                secret=config.remote_secret, tls=TLSFiles.of(config)))
    hot = HotTier(config.hot_cache_max_bytes, on_evict=on_evict, lock=lock)
    return [hot, *tiers], ssd_error


def _open_ssd(cfg: CacheConfig) -> tuple[SSDTier | None, str | None]:
    """The SSD tier; (None, why) with a WARNING when the directory cannot be opened for a reason
    other than a bad ``ssd_dir`` (out of space, I/O error, a manifest locked by another process
    past the wait): the manager then serves from the hot tier only."""
    auto = cfg.ssd_max_bytes == "auto"
    try:
        # "auto" counts the cache's own files as free space, so it is sized after opening (with
        # the filesystem size as the opening budget, nothing is evicted at startup for it).
        opening = filesystem_space(cfg.ssd_dir)[0] if auto else cfg.ssd_budget_bytes()
    except OSError as exc:  # e.g. a parent directory this user may not search
        where = "" if exc.filename in (None, str(cfg.ssd_dir)) else f" at {exc.filename!r}"
        raise CacheDirError(cfg.ssd_dir, f"cannot be reached: {exc.strerror}{where}",
                            "ssd_dir") from None
    try:
        ssd = SSDTier(cfg.ssd_dir, max_bytes=max(opening, 1), compression=cfg.compression,
                      queue_max_bytes=cfg.write_queue_max_bytes,
                      queue_full_policy=cfg.queue_full_policy,
                      writes_new=cfg.write_policy == "write-through")
    except CacheDirError as exc:
        raise exc.naming("ssd_dir") from None
    except (OSError, sqlite3.Error, ManifestError) as exc:
        try:
            free = f"{filesystem_space(cfg.ssd_dir)[1]} bytes free on its filesystem"
        except OSError as space_exc:
            free = f"free space unknown: {space_exc}"
        error = f"{type(exc).__name__}: {exc} ({free})"
        log.warning("SSD tier at %s unavailable (%s): serving from the hot tier only",
                    cfg.ssd_dir, error)
        return None, error
    ssd.test_read_bytes_per_s = cfg.test_ssd_read_bytes_per_s
    if auto:
        ssd.max_bytes = max(cfg.ssd_budget_bytes(cache_bytes=ssd.stats()["bytes"] or 0), 1)
    log.info("SSD tier at %s: budget %s", cfg.ssd_dir, format_size(ssd.max_bytes))
    return ssd, None
