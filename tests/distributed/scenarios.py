"""Rank side of tests/test_distributed.py: every rank of an ``mlx.launch`` job loads its shard of
a tiny model, runs the named scenarios on it and writes what it saw to ``<out>/rank<r>.json``.

Each scenario stores a 256-token prompt (snapshots at every 32-token block boundary), disturbs
the stored blocks of rank 1 only (lost, damaged, discarded) or restarts, then fetches a 300-token
prompt sharing those 256 tokens, prefills the rest on the same 32-token grid as a cold run and
compares the next-token logits with a cold prefill of the same shard.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import sharded_load

from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.hashing import chain_keys
from paged_cache.scheduler import Scheduler

BS = 32
STORED = 256
PROMPT = [(i * 7 + 3) % 250 for i in range(300)]
DAMAGED_BLOCK = 3  # rank 1's block [96, 128) is lost or damaged: the group agrees on 96


class Rank:
    """One rank's model, group and scratch directory."""

    def __init__(self, model_dir: str, mode: str, work: Path) -> None:
        self.group = mx.distributed.init()
        self.rank = self.group.rank()
        groups = {"pipeline_group": self.group} if mode == "pipeline" else {"tensor_group": self.group}
        self.model, self.tokenizer = sharded_load(model_dir, **groups)
        self.work = work
        self.cold = self.prefill(make_prompt_cache(self.model), PROMPT, 0)

    def barrier(self) -> None:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=self.group, stream=mx.cpu))

    def prefill(self, cache: list, tokens: list[int], start: int,
                prefix: BlockAwarePrefixCache | None = None, snaps: dict | None = None) -> mx.array:
        """Prefill ``tokens[start:]`` in chunks ending on the 32-token grid; last logits."""
        logits = None
        at = start
        while at < len(tokens):
            end = min((at // BS + 1) * BS, len(tokens))
            logits = self.model(mx.array(tokens[at:end])[None], cache=cache)
            mx.eval(logits, [c.state for c in cache])
            if prefix is not None and snaps is not None:
                snap = prefix.capture_boundary(cache, at)
                if snap is not None:
                    snaps[end] = snap
            at = end
        return logits[0, -1]

    def ssd(self, name: str, shared: bool) -> Path:
        base = self.work / name
        return base if shared else base / f"rank{self.rank}"

    def store(self, config: CacheConfig, manager: PagedSSDCacheManager | None = None) -> None:
        """Store PROMPT[:256] (with boundary snapshots) through ``manager`` or a fresh one."""
        own = manager is None
        manager = manager or PagedSSDCacheManager(config)
        try:
            prefix = BlockAwarePrefixCache(manager, self.model, model_id="tiny", model_name="tiny")
            cache, snaps = make_prompt_cache(self.model), {}
            self.prefill(cache, PROMPT[:STORED], 0, prefix, snaps)
            prefix.store(PROMPT[:STORED], cache, snapshots=snaps)
        finally:
            if own:
                manager.close()

    def fetch(self, manager: PagedSSDCacheManager) -> dict[str, Any]:
        """Fetch PROMPT, finish its prefill, compare with the cold run."""
        prefix = BlockAwarePrefixCache(manager, self.model, model_id="tiny", model_name="tiny")
        cache, n = prefix.fetch(PROMPT)
        logits = self.prefill(cache if cache is not None else make_prompt_cache(self.model),
                              PROMPT, n)
        return {"n": n, "diff": mx.abs(logits - self.cold).max().item(),
                "stats": {k: v for k, v in prefix.stats().items()
                          if k in ("agreements", "agreement_rounds", "tokens_given_up_to_group",
                                   "fetch_errors", "rank", "group_size", "shard",
                                   "blocks_taken", "recomputed_tokens")}}

    def keys(self, manager: PagedSSDCacheManager) -> list[str]:
        prefix = BlockAwarePrefixCache(manager, self.model, model_id="tiny", model_name="tiny")
        prefix.layout.ready()
        return chain_keys(prefix.fingerprint, "", PROMPT[:STORED], BS)


def restart(r: Rank, shared: bool, disturb: Callable[[CacheConfig, list[str]], None] | None = None,
            name: str = "") -> dict[str, Any]:
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="64MB",
                         ssd_dir=r.ssd(name, shared))
    r.store(config)
    with PagedSSDCacheManager(config) as manager:
        keys = r.keys(manager)  # on every rank: the prefix cache's first use runs the model
    if disturb is not None and r.rank == 1:
        disturb(config, keys)
    r.barrier()
    with PagedSSDCacheManager(config) as manager:
        return r.fetch(manager)


def lose_dir(config: CacheConfig, keys: list[str]) -> None:
    shutil.rmtree(config.ssd_dir)


def discard_blocks(config: CacheConfig, keys: list[str]) -> None:
    with PagedSSDCacheManager(config) as manager:
        for key in keys:
            manager.discard(key)


def damage_block(config: CacheConfig, keys: list[str]) -> None:
    (path,) = Path(config.ssd_dir).rglob(f"{keys[DAMAGED_BLOCK]}.safetensors*")
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)  # payload bytes: the checksum fails when the block is read
    path.write_bytes(bytes(data))


def hot_discarded(r: Rank) -> dict[str, Any]:
    """hot_cache_only, no restart: rank 1 drops one block; rank 0 rebuilt 256 (and took its
    blocks out of the hot tier), the group agrees on 96, and rank 0 keeps every block."""
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="64MB", hot_cache_only=True)
    with PagedSSDCacheManager(config) as manager:
        r.store(config, manager)
        keys = r.keys(manager)
        if r.rank == 1:
            manager.discard(keys[DAMAGED_BLOCK])
        out = r.fetch(manager)
        out["held_after"] = sum(manager.contains(k) for k in keys)
        return out


def scheduler_turns(r: Rank) -> dict[str, Any]:
    """Three turns of one conversation through the Scheduler on every rank, against the same
    turns run uncached: the replies must be equal and every rank reuses the same tokens."""
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="64MB", ssd_dir=r.ssd("sched", True),
                         fetch_policy="always-restore")  # the tiny model's prefill may be faster
    turns = [PROMPT[:150], [5, 6, 7] * 20, [9, 8] * 25]
    cold = Scheduler(r.model, None, block_size=BS)
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, r.model, model_id="tiny")
        try:
            Scheduler(r.model, prefix, group=None)  # the prefix cache agrees with a group
            refused = False
        except ValueError:
            refused = True
        sched = Scheduler(r.model, prefix)
        history, cached, same = [], [], True
        for turn in turns:
            history = history + turn
            hit = sched.generate(history, max_tokens=12)
            ref = cold.generate(history, max_tokens=12)
            same &= hit.tokens == ref.tokens
            cached.append(hit.cached_tokens)
            history = history + hit.tokens
    return {"same": same, "cached": cached, "refused": refused}


def remote_store(r: Rank) -> dict[str, Any]:
    """Deployment A: store through hot + SSD + the remote server (REMOTE_URL), and wait for the
    remote writer."""
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="64MB", ssd_dir=r.ssd("remote", False),
                         remote_url=REMOTE_URL[0])
    with PagedSSDCacheManager(config) as manager:
        r.store(config, manager)
        manager.flush()
        return {"remote": manager.stats()["remote"]["writes"]}


def plan_on_one_rank(r: Rank) -> dict[str, Any]:
    """Rank 1's fetch plan finds prefilling faster (its prefill rate seeded far above any read):
    its first fetch after a restart restores (no read rate yet; its cut-off may stop the read
    early) and measures the SSD tier, its second declines; the group then prefills on every
    rank."""
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="64MB", ssd_dir=r.ssd("plan", False))
    r.store(config)
    seeded = CacheConfig(block_size=BS, hot_cache_max_bytes="64MB", ssd_dir=config.ssd_dir,
                         fetch_policy="cost", prefill_tokens_per_s=1e12 if r.rank == 1 else 0)
    r.barrier()
    with PagedSSDCacheManager(seeded) as manager:
        first = r.fetch(manager)
        return {**r.fetch(manager), "first": first["n"]}


def remote_fetch(r: Rank) -> dict[str, Any]:
    """Deployment B, with empty local tiers: every block comes from the remote server."""
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="64MB", hot_cache_only=True,
                         remote_url=REMOTE_URL[0])
    with PagedSSDCacheManager(config) as manager:
        out = r.fetch(manager)
        out["remote_hits"] = manager.stats()["hits"]["remote"]
        return out


REMOTE_URL = [""]  # --remote-url

SCENARIOS: dict[str, Callable[[Rank], dict[str, Any]]] = {
    "shared_dir": lambda r: restart(r, True, name="shared"),
    "dir_per_rank": lambda r: restart(r, False, name="per_rank"),
    "dir_lost": lambda r: restart(r, False, lose_dir, name="lost"),
    "blocks_lost_shared_dir": lambda r: restart(r, True, discard_blocks, name="discarded"),
    "block_damaged": lambda r: restart(r, False, damage_block, name="damaged"),
    "hot_only_block_dropped": hot_discarded,
    "scheduler": scheduler_turns,
    "plan_on_one_rank": plan_on_one_rank,
}
REMOTE_SCENARIOS = {"remote_store": remote_store, "remote_fetch": remote_fetch}  # named only


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=("tensor", "pipeline"), required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--remote-url", default="")
    args = parser.parse_args(argv)
    REMOTE_URL[0] = args.remote_url
    r = Rank(args.model, args.mode, args.work)
    results = {}
    for name in args.scenarios.split(","):
        r.barrier()
        results[name] = {**SCENARIOS, **REMOTE_SCENARIOS}[name](r)
        print(f"rank {r.rank} {name}: {results[name]}", flush=True)
    (args.work / f"rank{r.rank}.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
