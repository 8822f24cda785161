"""The shared tier under the server's own eviction, on the trace (``trace_stream``).

A Valkey / Redis server with ``maxmemory`` evicts by its own policy, which knows nothing of
chains: a parent evicted before its children strands them (a lookup stops at the parent, so
their bytes are never reached again). The trace (two 256-token cache blocks per trace block, as
in ``trace_cost``) is replayed through a host whose only store is the remote tier (a RAM tier of
two blocks in front), on a real server started for each policy (``allkeys-lru``,
``allkeys-lfu``, ``volatile-ttl`` with the tier's ``remote_ttl``), its ``maxmemory`` at the
capacity's blocks times the server's bytes per block (value, key and child listing entry, as
measured on the same server with no limit). Each request is served as the prefix cache drives
the manager (``trace_cost.serve``: its leading held run taken, every block's bytes checked against
what was stored, then what no local tier holds put); the writes are flushed before the next
request. The baseline is the same replay through a
local RAM tier of the same number of blocks (leaves first, least recently used first).
Stranded: blocks on the server whose parent is not, at the end of the replay.

The replays through a server keep the trace's own pace: each request starts as long after the
first as it arrived after it in the trace (the first 3,000 requests span 16.5 minutes). The
server's policies are clocked: its LRU clock ticks once a second and its LFU counts decay by the
minute, so a replay as fast as the machine goes (about 100 requests a second here, 30 times the
trace's rate) crowds a hundred requests into each LRU second and leaves a returning
conversation's blocks looking as old as the ones it should outlive (``allkeys-lru`` served
0.81x of the local tier so, 0.96x at a quarter of the trace's pace). The three policies run at
once, each on its own server (the replays mostly wait); the local tier's order counts uses, not
seconds, so its baseline runs unpaced.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from benchmarks.common import Context, Figure, figure
from benchmarks.trace_cost import BLOCK, Chains, serve
from benchmarks.trace_stream import TraceRequest
from paged_cache import CacheConfig, PagedSSDCacheManager
from paged_cache.block import Block
from paged_cache.testing.server import ValkeyServer, client
from paged_cache.tiers.remote.client import block_name

FAMILY = "trace"
PAYLOAD = 4096                 # bytes of each block's array (the server's bytes per block add
# the value's header and the child listing entry)
POLICIES = ("allkeys-lru", "allkeys-lfu", "volatile-ttl")
TTL_S = 3600.0                 # remote_ttl under volatile-ttl
TIMEOUT_S = 30.0               # remote_timeout: a loaded machine's server is no outage
SAMPLE_BLOCKS = 400            # blocks written to measure the server's bytes per block


def payload(key: str) -> mx.array:
    """The block's bytes, made from its key (so a restored block can be checked exactly)."""
    seed = np.frombuffer(bytes.fromhex(key[:16]), dtype=np.uint8)
    return mx.array(np.resize(seed, PAYLOAD))


@dataclass
class Served:
    """What one replay served: blocks served / requested, and what the server held at the end."""

    name: str
    served: int = 0
    requested: int = 0
    stranded_blocks: int = 0
    stranded_bytes: int = 0
    server_blocks: int = 0
    server_bytes: int = 0
    behind_s: float = 0.0  # paced: the most a request started after its time

    @property
    def ratio(self) -> float:
        return self.served / max(1, self.requested)


def replay(config: CacheConfig, requests: Sequence[TraceRequest], chains: Chains,
           name: str, *, paced: bool = False) -> Served:
    """Replay ``requests`` through a manager on ``config``; blocks served and requested.
    ``paced``: each request starts at its time in the trace after the first's (module doc)."""
    out = Served(name)
    first, started = requests[0].timestamp_ms if requests else 0, time.monotonic()
    with PagedSSDCacheManager(config) as manager:
        for request in requests:
            if paced:
                due = started + (request.timestamp_ms - first) / 1000
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                else:
                    out.behind_s = max(out.behind_s, -wait)
            nodes = chains.of(request)
            metas = dict(nodes)
            got, _ = serve(manager, nodes,
                           lambda key: Block(key, {"kv": payload(key)}, metas[key]),
                           chains.tokens(request))
            for block in got:
                if not np.array_equal(np.array(block.arrays["kv"]), np.array(payload(block.key))):
                    raise AssertionError(f"trace remote: block {block.key[:12]} restored with "
                                         "other bytes than were stored")
            out.served += len(got)
            out.requested += len(nodes)
            manager.flush()
    return out


def server_bytes_per_block(chains: Chains, requests: Sequence[TraceRequest]) -> float:
    """The server's memory per block (value, key, child listing entry): SAMPLE_BLOCKS blocks
    of the trace written to a server without a limit, its used_memory before and after."""
    sample, seen = [], set()
    for request in requests:
        for key, meta in chains.of(request):
            if key not in seen and len(sample) < SAMPLE_BLOCKS:
                seen.add(key)
                sample.append((key, meta))
    with ValkeyServer() as srv:
        before = client(srv.url).info("memory")["used_memory"]
        config = CacheConfig(block_size=BLOCK, hot_cache_only=True, remote_url=srv.url,
                             hot_cache_max_bytes=2 * PAYLOAD, remote_timeout=TIMEOUT_S)
        with PagedSSDCacheManager(config) as manager:
            for key, meta in sample:
                manager.put(Block(key, {"kv": payload(key)}, meta))
            manager.flush()
        after = client(srv.url).info("memory")["used_memory"]
    return (after - before) / len(sample)


def stranded(url: str, chains: Chains, out: Served) -> None:
    """Count the blocks the server holds and those of them whose parent it does not hold. The
    server's limit is lifted first: one at its limit evicts before any command, reads too."""
    c = client(url)
    c.config_set("maxmemory", 0)
    held = {}
    for name in c.scan_iter(match=block_name("0" * 64)[:-64] + "*", count=1000):
        held[name.decode()[-64:]] = c.memory_usage(name) or 0
    out.server_blocks, out.server_bytes = len(held), sum(held.values())
    for key, nbytes in held.items():
        parent = chains.parents.get(key, "")
        if parent and parent not in held:
            out.stranded_blocks += 1
            out.stranded_bytes += nbytes


def remote_replay(srv: ValkeyServer, policy: str, requests: Sequence[TraceRequest],
                  chains: Chains, *, paced: bool = True, **tier: Any) -> Served:
    """The replay (``paced`` by default) through the remote tier of ``srv``, a server evicting
    by ``policy``; then its stranded blocks."""
    ttl = TTL_S if policy.startswith("volatile") else 0.0
    config = CacheConfig(block_size=BLOCK, hot_cache_only=True, remote_url=srv.url,
                         hot_cache_max_bytes=2 * PAYLOAD, remote_ttl=ttl,
                         remote_timeout=TIMEOUT_S, **tier)
    out = replay(config, requests, chains, policy, paced=paced)
    stranded(srv.url, chains, out)
    return out


def figures(ctx: Context, requests: Sequence[TraceRequest]) -> list[Figure]:
    """Hit ratio of the shared tier under each server policy against a local RAM tier of the
    same blocks (1M tokens; --quick: 0.25M tokens on the first 1,500 requests)."""
    requests = list(requests)[:ctx.pick(1_500, None)]
    capacity_tokens = ctx.pick(250_000, 1_000_000)
    blocks = capacity_tokens // BLOCK
    chains = Chains()
    per_block = server_bytes_per_block(chains, requests)
    local = replay(CacheConfig(block_size=BLOCK, hot_cache_only=True,
                               hot_cache_max_bytes=blocks * PAYLOAD), requests, chains, "local")
    maxmemory = int(blocks * per_block) + (1 << 20)  # + an empty server's own used memory
    # the local replay made every chain: the paced replays' threads only read ``chains``
    with ExitStack() as stack, ThreadPoolExecutor(len(POLICIES)) as pool:
        servers = [stack.enter_context(ValkeyServer(maxmemory=maxmemory, maxmemory_policy=p))
                   for p in POLICIES]
        runs = [pool.submit(remote_replay, srv, policy, requests, chains)
                for srv, policy in zip(servers, POLICIES)]
        results = [run.result() for run in runs]
    out = []
    for policy, got in zip(POLICIES, results):
        out.append(figure(
            FAMILY, f"shared tier, {policy}, {capacity_tokens / 1e6:g}M tokens",
            measured=got.ratio, baseline=local.ratio, unit="", goal=0.9, goal_op=">=",
            meaning="hit ratio on the server's eviction / hit ratio of a local leaves-first "
                    "tier of the same blocks",
            configuration="remote", capacity_tokens=capacity_tokens, policy=policy,
            maxmemory=maxmemory, server_bytes_per_block=per_block, payload_bytes=PAYLOAD,
            served=got.served, requested=got.requested, local_served=local.served,
            stranded_blocks=got.stranded_blocks, stranded_bytes=got.stranded_bytes,
            server_blocks=got.server_blocks, server_bytes=got.server_bytes,
            paced=True, behind_s=got.behind_s))
    return out
