"""What reaches exo's runner process: the cache configuration, carried in one environment
variable, and the one manager a process opens from it (closed when the process exits).

exo starts its runner with multiprocessing's spawn: a fresh interpreter that inherits the
environment and nothing else. The launcher puts the configuration it resolved (flags, TOML,
``PAGED_CACHE_*``) into ``ENV`` as JSON with each value's source; the runner rebuilds the same
``CacheConfig`` from it. No exo import here.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from pathlib import Path
from typing import Mapping

from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager

logger = logging.getLogger("paged_cache.integrations.exo")

ENV = "PAGED_CACHE_EXO"   # set: paged-cache is exo's prefix cache in this process and its children

_lock = threading.Lock()
_manager: PagedSSDCacheManager | None = None


def config_to_environ(config: CacheConfig) -> str:
    """``config``'s explicitly set values and their sources, as ``ENV``'s JSON value (a secret
    travels as it came, through the environment, never through a command line)."""
    values = {name: str(v) if isinstance(v, Path) else v
              for name in sorted(config.explicit) for v in [getattr(config, name)]}
    return json.dumps({"values": values,
                       "sources": {name: config.sources[name] for name in values}})


def config_from_environ(environ: Mapping[str, str] | None = None) -> CacheConfig | None:
    """The configuration the launcher passed in ``ENV``; None when it is not set. ValueError,
    naming the variable, when its value is not what ``config_to_environ`` writes."""
    raw = (os.environ if environ is None else environ).get(ENV)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        values, sources = data["values"], data["sources"]
        if not isinstance(values, dict) or not isinstance(sources, dict):
            raise TypeError("values and sources must be objects")
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{ENV}: expected the JSON paged-cache's launcher writes "
                         f"({{\"values\": ..., \"sources\": ...}}): {exc}") from None
    return CacheConfig.layered(overrides=values,
                               override_source={k: sources.get(k, f"env:{ENV}") for k in values})


def process_manager() -> PagedSSDCacheManager:
    """This process's manager, opened on first use from ``ENV`` (defaults when unset) and
    closed (every pending SSD write flushed) when the process exits."""
    global _manager
    with _lock:
        if _manager is None:
            config = config_from_environ() or CacheConfig()
            _manager = PagedSSDCacheManager(config)
            atexit.register(_close)
            logger.info("paged-cache is exo's prefix cache in process %d (hot budget %d bytes, %s)",
                        os.getpid(), config.hot_cache_max_bytes,
                        "no SSD tier" if config.hot_cache_only else f"SSD tier {config.ssd_dir}")
        return _manager


def _close() -> None:
    global _manager
    with _lock:
        manager, _manager = _manager, None
    if manager is not None:
        manager.close()

