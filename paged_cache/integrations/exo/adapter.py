"""``PagedKVPrefixCache``: a subclass of exo's ``KVPrefixCache`` served by paged-cache.

What it does is ``prefix.ExoPrefixCache``; this module joins it to exo's class (the installed
exo is checked by ``compat`` on import). exo's runner builds one per model as
``KVPrefixCache(group)``; it opens (once per process) the manager the launcher configured
(``settings``), keeps a plain ``KVPrefixCache`` as the fallback for the requests paged-cache
does not serve, and passes exo's group, so ranks of a sharded model agree on every fetch.
"""

from __future__ import annotations

from typing import Any

from paged_cache.integrations.exo import compat
from paged_cache.integrations.exo.prefix import ExoPrefixCache
from paged_cache.integrations.exo.settings import process_manager


class PagedKVPrefixCache(ExoPrefixCache, compat.KVPrefixCache):
    """exo's ``KVPrefixCache(group)``, its four members served from paged-cache's tiers."""

    def __init__(self, group: Any, *, manager: Any = None) -> None:
        compat.KVPrefixCache.__init__(self, group)
        self.setup(manager if manager is not None else process_manager(), group=group,
                   make_cache=compat.make_kv_cache, cache_length=compat.cache_length,
                   fallback=compat.KVPrefixCache(group))
