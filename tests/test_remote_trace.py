"""A short replay of the shipped trace through the remote tier on a real server whose
``maxmemory`` makes it evict by its own policy: every block restored is the one stored, the
server stays within its limit, the blocks it strands (held, their parent not) are counted
exactly, and with ``remote_ttl`` a chain lookup renews its blocks' TTLs, a parent's never
shorter than its children's (what lets ``volatile-ttl`` evict leaves first)."""

from __future__ import annotations

import time

from benchmarks import trace_remote, trace_stream
from benchmarks.trace_cost import Chains
from paged_cache import CacheConfig, PagedSSDCacheManager
from paged_cache.block import Block
from paged_cache.testing.server import ValkeyServer, client
from paged_cache.tiers.remote.client import block_name

REQUESTS = 60
CAPACITY_BLOCKS = 150
TTL_S = 30.0


def test_a_trace_replay_under_the_server_s_eviction_counts_stranded_blocks() -> None:
    requests = trace_stream.load(limit=REQUESTS)
    chains = Chains()
    distinct = {k for r in requests for k, _ in chains.of(r)}
    per_block = trace_remote.server_bytes_per_block(chains, requests)
    assert per_block > trace_remote.PAYLOAD  # the value's header and its listing entry
    maxmemory = int(CAPACITY_BLOCKS * per_block) + (1 << 20)
    with ValkeyServer(maxmemory=maxmemory, maxmemory_policy="volatile-ttl") as srv:
        config = CacheConfig(block_size=trace_remote.BLOCK, hot_cache_only=True,
                             remote_url=srv.url, remote_ttl=TTL_S,
                             remote_timeout=trace_remote.TIMEOUT_S,
                             hot_cache_max_bytes=2 * trace_remote.PAYLOAD)
        out = trace_remote.replay(config, requests, chains, "volatile-ttl")  # bytes checked
        assert 0 < out.served < out.requested
        c = client(srv.url)
        assert srv.settles_within(maxmemory + per_block) <= maxmemory + per_block
        assert c.info("stats")["evicted_keys"] > 0
        trace_remote.stranded(srv.url, chains, out)
        held = {k for k in distinct if c.exists(block_name(k))}
        assert out.server_blocks == len(held) < len(distinct)
        orphans = [k for k in held if chains.parents[k] and chains.parents[k] not in held]
        assert out.stranded_blocks == len(orphans)
        assert out.stranded_bytes == sum(c.memory_usage(block_name(k)) for k in orphans)

        # a lookup renews the TTLs of the chain it finds, deeper blocks a little shorter
        chain = [k for k, _ in chains.of(requests[0])]
        with PagedSSDCacheManager(config) as manager:
            metas = dict(chains.of(requests[0]))
            for key in chain:
                manager.put(Block(key, {"kv": trace_remote.payload(key)}, metas[key]))
        time.sleep(1.0)
        aged = c.pttl(block_name(chain[0]))
        with PagedSSDCacheManager(config) as other_host:
            tiers, _ = other_host.chain(chain, chains.fingerprint)
        assert tiers == ["remote"] * len(chain)
        ttls = [c.pttl(block_name(k)) for k in chain]
        assert ttls[0] > aged + 500  # renewed by the lookup
        assert all(a >= b for a, b in zip(ttls, ttls[1:])), ttls


def test_a_paced_replay_keeps_the_trace_s_time_between_requests() -> None:
    """The server's policies are clocked (LRU seconds, LFU decay by the minute), so the shared
    tier's replays start each request at its time in the trace: the first 12 requests arrive
    at 0 s (ten) and 3 s (two), so the paced replay of them lasts at least 3 s; unpaced, it is
    over in well under that."""
    requests = trace_stream.load(limit=12)
    assert [r.timestamp_ms for r in requests][-3:] == [0, 3000, 3000]
    config = CacheConfig(block_size=trace_remote.BLOCK, hot_cache_only=True,
                         hot_cache_max_bytes=64 * trace_remote.PAYLOAD)
    timed = []
    for paced in (True, False):
        started = time.monotonic()
        out = trace_remote.replay(config, requests, Chains(), "local", paced=paced)
        timed.append(time.monotonic() - started)
        assert out.requested == sum(r.input_length // trace_remote.BLOCK for r in requests)
    assert timed[0] >= 3.0 > timed[1], timed
