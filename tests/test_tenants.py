"""Tenants never share a prefix: a namespace (library) or a cache salt (`paged-cache serve`)
makes a tenant's nodes its own, of every kind (blocks, partial tails, checkpoints) and in every
tier (RAM, SSD after a restart, another host through the remote tier); the same tenant reuses
all of them."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from paged_cache.testing.server import ValkeyServer, client
from helpers.managers import new_manager
from helpers.prefix import assert_exact, prompt, store_prompt

BLOCK = 16
OTHERS = ("bob", None, "alice ", "ALICE")


@pytest.fixture(scope="module")
def server() -> Iterator[ValkeyServer]:
    with ValkeyServer() as srv:
        yield srv


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "gemma3_text"])
def test_a_namespace_isolates_every_node_kind_in_every_tier(tmp_path: Path, server: ValkeyServer,
                                                           arch: str) -> None:
    """alice stores a conversation with a partial tail (and, for qwen3_next, checkpoints at its
    end, in a block and after it); nobody else reuses a token of it, from RAM, from SSD after a
    restart, or from the server on another host; alice reuses all of it everywhere."""
    client(server.url).flushall()
    model = tiny_model(arch)
    tokens = prompt(4 * BLOCK + 7)
    query = tokens + [3]

    def manager(name: str, **kw: object) -> PagedSSDCacheManager:
        return new_manager(tmp_path / name, block_size=BLOCK, remote_url=server.url,
                           remote_timeout=5.0, **kw)

    def reuse(m: PagedSSDCacheManager, namespace: str | None) -> int:
        return assert_exact(model, BlockAwarePrefixCache(m, model, namespace=namespace), query)

    with manager("a") as a:
        alice = BlockAwarePrefixCache(a, model, namespace="alice")
        store_prompt(model, alice, tokens)
        store_prompt(model, alice, tokens[:3 * BLOCK + 2])        # a second tail, a checkpoint
        assert alice.stats()["checkpoints_written"] > 0 or arch != "qwen3_next"
        a.flush()
        assert [reuse(a, ns) for ns in OTHERS] == [0] * len(OTHERS)          # RAM
        assert reuse(a, "alice") == len(tokens)
    with manager("a", hot_cache_max_bytes=0) as a:                             # SSD, restarted
        assert [reuse(a, ns) for ns in OTHERS] == [0] * len(OTHERS)
        assert reuse(a, "alice") == len(tokens) and a.stats()["hits"]["ssd"] > 0
    with manager("b", hot_cache_max_bytes=0) as b:                             # another host
        assert [reuse(b, ns) for ns in OTHERS] == [0] * len(OTHERS)
        assert b.stats()["hits"]["remote"] == 0
        assert reuse(b, "alice") == len(tokens) and b.stats()["hits"]["remote"] > 0
