"""What a Valkey / Redis server holds for paged-cache and how it evicts, for
``paged-cache inspect --remote-url`` (a bounded SCAN and INFO; nothing is changed)."""

from __future__ import annotations

from typing import Any

from paged_cache.tiers.remote.client import KEY_PREFIX, TLSFiles, client_module, connect, shown

SUMMARY_SCAN_LIMIT = 1_000_000  # keys `inspect` counts at most


def server_summary(url: str, timeout: float = 2.0, cluster: bool = False,
                   tls: TLSFiles | None = None) -> dict[str, Any]:
    """What the server at ``url`` holds and how it evicts (``paged-cache inspect --remote-url``):
    paged-cache's block and listing keys (a bounded SCAN), memory, maxmemory and its policy,
    evictions, expiries (a cluster's primaries added up). OSError when the server does not answer
    (or refuses us)."""
    valkey = client_module()
    db = None
    try:
        db = connect(url, timeout=timeout, cluster=cluster, tls=tls)
        return _summary(db, url, valkey.ResponseError, cluster)
    except (valkey.ValkeyError, valkey.exceptions.ValkeyClusterException, OSError) as exc:
        raise OSError(str(exc)) from exc
    finally:
        if db is not None:
            db.close()


def _summary(db: Any, url: str, response_error: type[BaseException],
             cluster: bool) -> dict[str, Any]:
    """The summary of ``server_summary`` read through an open client ``db``."""
    info = db.info(target_nodes=db.PRIMARIES) if cluster else db.info()
    if cluster:  # {node: info}: add the counts up
        nodes = list(info.values())
        info = dict(nodes[0])
        for name in ("used_memory", "maxmemory", "evicted_keys", "expired_keys"):
            info[name] = sum(node.get(name) or 0 for node in nodes)
    counts = {b"b": 0, b"c": 0}  # block values, child listings
    scanned = 0
    for name in db.scan_iter(match=f"{KEY_PREFIX}:*", count=1000):
        kind = bytes(name).split(b":")[2:3]
        if kind and kind[0] in counts:
            counts[kind[0]] += 1
        scanned += 1
        if scanned >= SUMMARY_SCAN_LIMIT:
            break
    try:
        policy = info.get("maxmemory_policy") or \
            db.config_get("maxmemory-policy").get("maxmemory-policy")
    except response_error:  # CONFIG is often disabled on managed servers
        policy = info.get("maxmemory_policy")
    return {"url": shown(url), "server": f"{'valkey' if 'valkey_version' in info else 'redis'} "
                                          f"{info.get('valkey_version') or info.get('redis_version')}",
            "blocks": counts[b"b"], "listings": counts[b"c"],
            "counted_all": scanned < SUMMARY_SCAN_LIMIT,
            "used_memory": info.get("used_memory"), "maxmemory": info.get("maxmemory"),
            "maxmemory_policy": policy, "evicted_keys": info.get("evicted_keys"),
            "expired_keys": info.get("expired_keys")}

