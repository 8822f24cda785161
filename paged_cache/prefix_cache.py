"""BlockAwarePrefixCache: store a live cache list as chained token blocks, rebuild it for a prefix.

The facade over three jobs, each in its own module: layout discovery and checks (layout.py),
store into blocks and checkpoints (store.py), and fetch of the longest prefix every layer can be
rebuilt at, searched over every stored branch (fetch.py). Boundary snapshots (what a later store
cannot cut from the live cache) are taken here. See docs/architecture.md and docs/cache-types.md.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from paged_cache.bounds import NodeBounds
from paged_cache.compile_guard import guard_thread
from paged_cache.distributed import WORLD, Agreement, resolve_group, shard_of
from paged_cache.fetch import Found, find
from paged_cache.handlers import UnsupportedCacheError, layer_needs_snapshots
from paged_cache.handlers.base import Captured
from paged_cache.hashing import ChainKeys, model_identity, token_ids
from paged_cache.layout import CacheLayout, layer_arrays
from paged_cache.loans import Loans
from paged_cache.metrics import histograms
from paged_cache.store import put_back, store_chain

logger = logging.getLogger("paged_cache.prefix_cache")



@dataclass
class BoundarySnapshot:
    """Owning copies, at block boundary ``boundary``, of what a later store cannot slice."""

    boundary: int
    since: int
    fingerprint: str
    layers: dict[int, Captured] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held (what a SnapshotStore budgets)."""
        return sum(a.nbytes for arrays, _ in self.layers.values() for a in arrays.values())

    def release(self) -> None:
        """Drop the arrays now (the store has copied what it needed into blocks)."""
        self.layers.clear()


@dataclass(frozen=True)
class FetchInfo:
    """What the last fetch did."""

    tokens_requested: int
    tokens_matched: int
    tier: str  # "hot" | "ssd" | "remote" | "mixed" | "miss"
    seconds: float
    blocks: int
    tokens_shared: int = 0  # longest run of the request's tokens some stored node holds
    tokens_recomputed: int = 0  # stored tokens the fetch plan left to prefill (faster so)
    recompute_reason: str | None = None  # why: fetch_plan's "cost", "policy" or "cut"
    tokens_prefilled: int = 0  # of tokens_matched, the head the fetch prefilled (both at once)
    predicted_seconds: float | None = None  # the plan's prediction of its reads (None: none)


def as_tokens(tokens: Any, name: str = "tokens") -> list[int]:
    """A list of Python ints from a sequence / 1-D numpy or mx array of integers; else TypeError
    (ValueError for an id outside int64; validated by ``token_ids``, no per-token Python work)."""
    ids = token_ids(tokens, name)
    return list(tokens) if isinstance(tokens, (list, tuple)) else ids.tolist()


class BlockAwarePrefixCache:
    """Exact block-level prefix reuse for mlx-lm cache lists, over a PagedSSDCacheManager."""

    def __init__(self, manager: Any, model: Any, *, model_id: str | None = None,
                 namespace: str | None = None, make_cache: Callable[[], list] | None = None,
                 model_name: str | None = None, group: Any = WORLD) -> None:
        if namespace is not None and not isinstance(namespace, str):
            raise TypeError(f"namespace: expected a str or None, got {type(namespace).__name__}")
        if make_cache is not None and not callable(make_cache):
            raise TypeError(f"make_cache: expected a callable returning a cache list, got {make_cache!r}")
        if not callable(model):
            raise TypeError(f"model: expected an mlx-lm model (callable as model(tokens, "
                            f"cache=...)), got {model!r:.60}")
        self.manager = manager
        self.model = model
        self.namespace = namespace or ""
        self.model_name = model_name or model_id or ""  # shown by the CLI beside the fingerprint
        if make_cache is None:
            from mlx_lm.models.cache import make_prompt_cache
            make_cache = lambda: make_prompt_cache(model)  # noqa: E731
        # A model split over several ranks: this rank's shard is part of every key, and each
        # fetch ends where every rank of the group can rebuild (distributed.py)
        self.group = resolve_group(group)
        self.shard = shard_of(model, self.group)
        self._agreement = Agreement(self.group) if self.group is not None else None
        self.layout = CacheLayout(model, model_identity(model, model_id), make_cache,
                                  manager.config.block_size, self.shard)
        self._stats = dict.fromkeys(
            ("hits", "misses", "tokens_requested", "tokens_matched", "tokens_saved",
             "partial_block_tokens_lost", "walkbacks", "walkback_tokens_lost", "stores",
             "blocks_written", "checkpoints_written", "blocks_deduplicated", "blocks_taken",
             "blocks_rejected", "store_seconds", "restore_seconds", "recomputed_fetches",
             "recomputed_tokens", "recomputed_cost_tokens", "recomputed_policy_tokens",
             "recomputed_cut_tokens", "cut_fetches", "overlapped_fetches",
             "overlapped_head_tokens", "prefill_probes", "prefill_probe_seconds",
             "lookups_skipped", "refused_unsupported"), 0)
        self.last_fetch = FetchInfo(0, 0, "miss", 0.0, 0)
        self._loans = self._new_loans()
        self._bounds: NodeBounds | None = None
        self._chain = ChainKeys()  # shared with namespace views: the namespace is in its scope

    def in_namespace(self, namespace: str | None) -> "BlockAwarePrefixCache":
        """This prefix cache for another namespace (a tenant's: no node is shared with any other
        namespace): the same manager, model, layout (no second dry run) and counters, its own
        loans."""
        if namespace is not None and not isinstance(namespace, str):
            raise TypeError(f"namespace: expected a str or None, got {type(namespace).__name__}")
        view = copy.copy(self)
        view.namespace = namespace or ""
        view._loans = view._new_loans()
        view._bounds = None
        return view

    def _new_loans(self) -> Loans:
        """Loans whose blocks go back into this prefix cache's namespace."""
        return Loans(lambda layers, lent: put_back(self, layers, lent))

    # ------------------------------------------------------------------ layout / fingerprint

    @property
    def block_size(self) -> int:
        """Tokens per block (the manager's configured block size)."""
        return self.manager.config.block_size

    def make_cache(self) -> list:
        """A fresh cache list of the layout this prefix cache stores and rebuilds."""
        return list(self.layout.make_cache())

    @property
    def fingerprint(self) -> str | None:
        """Model + layout fingerprint (learned by a 1-token dry run), None if unsupported."""
        return self.layout.fingerprint if self.layout.ready() else None

    def chain_keys(self, tokens: Any) -> list[str]:
        """The chained keys of ``tokens``' blocks in this namespace (the last may be partial),
        each block hashed once however many stages of a request ask (hashing.ChainKeys)."""
        return self._chain.keys(self.layout.fingerprint, self.namespace, tokens, self.block_size)

    @property
    def unsupported(self) -> str | None:
        """Why nothing is cached for this model (a cache type no handler supports, or whose
        handler is off here, e.g. TurboQuant with an mlx-vlm outside its range); None if cached."""
        return None if self.layout.ready() else self.layout.unsupported

    def _supported(self) -> bool:
        """Whether this model's layout is cached; a store or fetch refused for it is counted
        (``refused_unsupported``), its reason logged once (CacheLayout.ready)."""
        if self.layout.ready():
            return True
        self._stats["refused_unsupported"] += 1
        return False

    @property
    def bounds(self) -> NodeBounds:
        """What a node of this prefix cache read from SSD or the remote tier can be (checked on
        its header before anything is allocated for it). The layout is learned first if no fetch
        or store has yet: bounds made without it would call every stored block too large, and a
        read removes a block it calls damaged. UnsupportedCacheError for a model whose layout is
        not cached."""
        if self._bounds is None:
            if not self.layout.ready():
                raise UnsupportedCacheError(f"bounds: this model's cache layout is not supported "
                                            f"({self.layout.unsupported})")
            names = len(self.namespace.encode()) + len(self.model_name.encode())
            self._bounds = NodeBounds(self.layout, names)
        return self._bounds

    def read(self, key: str, *, take: bool = False, in_place: bool = False) -> Any:
        """``manager.get`` of a node of this prefix cache, checked against ``bounds``."""
        return self.manager.get(key, take=take, in_place=in_place, expect=self.bounds)

    @property
    def needs_snapshots(self) -> bool:
        """True when some layer cannot be sliced by token after the fact (capture boundaries)."""
        return self.layout.ready() and not self.layout.full_history

    # ------------------------------------------------------------------ boundary snapshots

    def capture_boundary(self, cache: list, since: int, *,
                         boundary: int | None = None) -> BoundarySnapshot | None:
        """Copy, right after a prefill chunk, what store cannot slice from the cache later.

        Taken at a block boundary it lets the store give that block its state; taken anywhere
        else it becomes a checkpoint at that position. ``boundary`` defaults to the cache's offset;
        pass it for caches that track no offset (recurrent only, e.g. mamba). Returns None when no
        layer needs a snapshot.
        """
        if not self.layout.ready():
            return None
        layout = self.layout
        offsets = [h.offset(layer) for h, layer in zip(layout.handlers, cache)]
        known = next((o for o in offsets if o is not None), None)
        b = known if boundary is None else boundary
        if b is None:
            raise ValueError("boundary: this cache tracks no offset; pass boundary=<token count>")
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"boundary: expected a positive int, got {b!r}")
        if isinstance(since, bool) or not isinstance(since, int) or not 0 <= since <= b:
            raise ValueError(f"since: expected an int in [0, {b}], got {since!r}")
        layout.check(cache, b)
        if layout.full_history:
            return None
        layers: dict[int, Captured] = {}
        for i, (h, layer) in enumerate(zip(layout.handlers, cache)):
            if layer_needs_snapshots(layer):
                got = h.capture(layer, since, b)
                if got is not None:
                    layers[i] = got
        if not layers:
            return None
        mx.eval([a for arrays, _ in layers.values() for a in arrays.values()])
        return BoundarySnapshot(boundary=b, since=since, fingerprint=layout.fingerprint,
                                layers=layers)

    def _check_snapshots(self, snapshots: Any, n_tokens: int) -> dict[int, BoundarySnapshot]:
        if snapshots is None:
            return {}
        if not isinstance(snapshots, dict):
            raise TypeError(f"snapshots: expected a dict boundary -> BoundarySnapshot, got "
                            f"{type(snapshots).__name__}")
        for b, snap in snapshots.items():
            if not isinstance(snap, BoundarySnapshot) or snap.boundary != b:
                raise ValueError(f"snapshots: entry {b!r} is not a BoundarySnapshot taken at {b!r}")
            if snap.fingerprint != self.layout.fingerprint:
                raise ValueError(f"snapshots: entry {b} was captured for another model/layout")
            if b > n_tokens:
                raise ValueError(f"snapshots: boundary {b} lies past len(tokens) = {n_tokens}")
        return snapshots

    # ------------------------------------------------------------------ store

    def store(self, tokens: Any, cache: list, *, snapshots: dict | None = None,
              consume: bool = False, prefill_grid: tuple[int, int] | None = None) -> int:
        """Store ``cache`` (positioned at ``len(tokens)``) as chained blocks; return new blocks.

        Also leaves a checkpoint (the state of layers that cannot be cut by token) at the end and
        at every snapshot position where no stored node restores every layer yet.
        ``consume=True``: the caller hands the cache over (as mlx_lm.server does at insert time);
        each layer is released (its list entry set to None) as soon as its blocks are cut, so the
        store holds at most one layer twice instead of the whole sequence.
        ``prefill_grid=(chunk, until)``: this cache's tokens ``[0, until)`` were prefilled from
        position 0 in chunks ending on the absolute grid of ``chunk`` tokens (nothing restored);
        a fetch may then prefill a head of them instead of reading it (docs/fetch-plan.md).
        """
        t0 = time.perf_counter()
        guard_thread()
        tokens = token_ids(tokens)
        if not self._supported():
            return 0
        self.layout.check(cache, len(tokens))
        snaps = self._check_snapshots(snapshots, len(tokens))
        grid = self._check_grid(prefill_grid, len(tokens))
        if len(tokens) == 0:
            return 0
        result = store_chain(self, tokens, cache, snaps, consume, grid)
        if len(self._loans):
            self._loans.settle(self._held, stored=tokens)
        seconds = time.perf_counter() - t0
        st = self._stats
        st["stores"] += 1
        st["blocks_written"] += result.written
        st["checkpoints_written"] += result.checkpoints
        st["blocks_deduplicated"] += result.deduplicated
        st["store_seconds"] += seconds
        histograms.observe_store(seconds)
        logger.debug("store: %d tokens, %d new blocks, %d checkpoints, %d held in %.1f ms",
                     len(tokens), result.written, result.checkpoints, result.deduplicated,
                     seconds * 1e3)
        return result.written

    # ------------------------------------------------------------------ fetch

    def fetch(self, tokens: Any, *, prefill_chunk: int | None = None) -> tuple[list | None, int]:
        """A fresh cache list covering ``tokens[:n]`` with ``n <= len(tokens) - 1``, or (None, 0).

        ``prefill_chunk``: the caller prefills in chunks ending on the absolute grid of this many
        tokens (a multiple of the block size), as the Scheduler does. The fetch plan may then
        prefill a head of the prefix itself, on that grid, while the rest is read from disk
        (docs/fetch-plan.md, both at once); ``last_fetch.tokens_prefilled`` says how much.
        Each rebuilt buffer is sized for the caller's next forward: the request's next chunk on
        that grid (the block size's without one), up to its last token, or that token alone
        (``chunks.next_forward_end``), so the forward runs in place on a cold cache's layout.
        """
        t0 = time.perf_counter()
        guard_thread()
        tokens = token_ids(tokens)
        chunk = self._check_chunk(prefill_chunk)
        grid = chunk if self._agreement is None and self.manager.config.fetch_overlap else 0
        total = len(tokens)
        st = self._stats
        st["tokens_requested"] += total
        if len(self._loans):
            self._loans.settle(self._held, tokens)
        found = self._find(tokens, prefill=self._head_prefill(tokens, grid) if grid else None,
                           grid=grid, chunk=chunk)
        if self._agreement is not None:
            found = self._agree(tokens, found, chunk)
        n = found.n if found is not None else 0
        plan = found.plan if found is not None else None
        if plan is not None and plan.recomputed:
            st["recomputed_fetches"] += 1
            st["recomputed_tokens"] += plan.recomputed
            if plan.recomputed > plan.cut:
                st[f"recomputed_{plan.reason}_tokens"] += plan.recomputed - plan.cut
            if plan.cut:
                st["cut_fetches"] += 1
                st["recomputed_cut_tokens"] += plan.cut
            logger.debug("fetch plan: %d stored tokens prefilled instead (%s)", plan.recomputed,
                         plan.detail)
        if found is not None:
            planned = min(found.shared, total - 1) - (plan.recomputed if plan else 0)
            self._count_loss(planned, n)
            st["blocks_taken"] += len(found.taken)
            if n and found.lent:
                found.cache = self._loans.lend(tokens[:n], found.cache, found.lent)
        head = found.head if found is not None and n else 0
        if head:
            st["overlapped_fetches"] += 1
            st["overlapped_head_tokens"] += head
            logger.debug("fetch plan: %s", plan.detail)
        seconds = time.perf_counter() - t0
        st["hits" if n > head else "misses"] += 1
        st["tokens_matched"] += n
        st["tokens_saved"] += n - head
        st["restore_seconds"] += seconds
        self.last_fetch = FetchInfo(total, n, found.tier if n else "miss", seconds,
                                    found.used if n else 0,
                                    found.shared if found is not None else 0,
                                    plan.recomputed if plan else 0, plan.why if plan else None,
                                    head, plan.predicted if plan else None)
        histograms.observe_fetch(self.last_fetch)
        logger.debug("fetch: %d/%d tokens from %s (%d nodes) in %.1f ms",
                     n, total, self.last_fetch.tier, self.last_fetch.blocks, seconds * 1e3)
        return (found.cache, n) if n else (None, 0)

    def _check_grid(self, grid: Any, n_tokens: int) -> tuple[int, int] | None:
        """A store's ``prefill_grid``: None, or (chunk, until) with chunk a positive multiple
        of the block size and until in [1, n_tokens]."""
        if grid is None:
            return None
        ok = (isinstance(grid, tuple) and len(grid) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) for v in grid))
        if not ok or grid[0] < 1 or grid[0] % self.block_size or not 0 < grid[1] <= n_tokens:
            raise ValueError(f"prefill_grid: expected (chunk, until) with chunk a positive "
                             f"multiple of the block size {self.block_size} and until in "
                             f"[1, {n_tokens}], got {grid!r:.60}")
        return grid

    def _check_chunk(self, prefill_chunk: Any) -> int:
        """The caller's prefill grid (0: none given). The fetch plan prefills a head on it only
        with ``fetch_overlap`` on and outside a group, whose ranks would have to prefill the
        same head together."""
        if prefill_chunk is None:
            return 0
        if (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                or prefill_chunk < 1 or prefill_chunk % self.block_size):
            raise ValueError(f"prefill_chunk: expected a positive multiple of the block size "
                             f"{self.block_size}, got {prefill_chunk!r}")
        return prefill_chunk

    def _head_prefill(self, tokens: np.ndarray, grid: int) -> Callable[[int], list]:
        """The prefill of ``tokens[:h]`` into a fresh cache, in chunks of ``grid`` from 0 (a cold
        run's chunks up to ``h``, a multiple of ``grid``); a sample of the rate."""
        def prefill(h: int) -> list:
            cache, t0 = self.make_cache(), time.perf_counter()
            for start in range(0, h, grid):
                self.model(mx.array(tokens[start:start + grid])[None], cache=cache)
                mx.eval([a for layer in cache for a in layer_arrays(layer)])
            self.record_prefill(h, time.perf_counter() - t0)
            return cache
        return prefill

    def count_whole_hit(self, tokens_requested: int, n: int, seconds: float) -> None:
        """Count a fetch its caller served from a whole cache of this layout it had not stored
        yet (``PagedPromptCache``'s deferred inserts) as a RAM hit of ``n`` tokens."""
        st = self._stats
        st["tokens_requested"] += tokens_requested
        st["hits"] += 1
        st["tokens_matched"] += n
        st["tokens_saved"] += n
        st["restore_seconds"] += seconds
        self.last_fetch = FetchInfo(tokens_requested, n, "hot", seconds, 0, n)
        histograms.observe_fetch(self.last_fetch)

    def _find(self, tokens: np.ndarray, limit: int | None = None,
              prefill: Callable[[int], list] | None = None, grid: int = 0,
              chunk: int = 0) -> Found | None:
        """This rank's longest rebuild of ``tokens`` (at most ``limit`` tokens), or None. In a
        group an error is a miss (logged, counted): a rank must never leave the collective."""
        if len(tokens) < 2 or not self._supported():
            return None
        if self._agreement is None:
            return find(self, tokens, limit, prefill, grid, chunk)
        try:
            return find(self, tokens, limit, chunk=chunk)
        except Exception as exc:  # noqa: BLE001 - the other ranks wait in the agreement
            self._agreement.counters["fetch_errors"] += 1
            logger.warning("fetch failed on rank %d, proposing a miss to the group: %r",
                           self.group.rank(), exc, exc_info=exc)
            return None

    def _agree(self, tokens: np.ndarray, found: Found | None, chunk: int) -> Found | None:
        """The group's fetch: the longest prefix every rank rebuilt. A rank above the shortest
        proposal gives back what it took and searches again below it, until all agree."""
        agreement = self._agreement
        agreement.counters["agreements"] += 1
        n, shared = (found.n, found.shared) if found is not None else (0, 0)
        mine = n
        longest, shortest, shared = agreement.propose(n, shared)
        while longest != shortest:
            if n > shortest:
                self._drop(tokens, found)
                found = self._find(tokens, shortest, chunk=chunk) if shortest else None
                n = found.n if found is not None else 0
            longest, shortest, _ = agreement.propose(n, 0)
        agreement.counters["tokens_given_up_to_group"] += mine - n
        if found is None:
            return Found(None, 0, "miss", 0, shared)
        found.shared = shared  # the shortest stored match of the group: chunking stays in step
        return found

    def _drop(self, tokens: np.ndarray, found: Found | None) -> None:
        """Discard a rebuilt cache the group did not agree on, storing back the blocks it took
        from the hot tier (its live cache was their only copy)."""
        if found is None or found.cache is None or not found.taken:
            return
        try:
            store_chain(self, tokens[:found.n], found.cache, {}, consume=True)
        except Exception as exc:  # noqa: BLE001 - a lost block costs reuse, never the group
            logger.warning("could not store back the blocks of a dropped fetch: %r", exc)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """This model prefilled ``tokens`` in ``seconds`` (a Scheduler chunk, a server's request):
        a sample of the prefill rate the fetch plan weighs."""
        self.manager.rates.add_prefill(self.layout.identity, tokens, seconds)

    def count(self, name: str, amount: float = 1) -> None:
        """Add ``amount`` to the counter ``name`` in ``stats()`` (fetch.py's rejected blocks,
        prefill_probe.py's timed forwards)."""
        self._stats[name] += amount

    def _held(self, keys: list[str]) -> bool:
        return all(t is not None for t in self.manager.tiers_of(keys))

    def _count_loss(self, matched: int, n: int) -> None:
        lost = matched - n
        if lost <= 0:
            return
        partial = min(lost, matched % self.block_size)
        st = self._stats
        st["partial_block_tokens_lost"] += partial
        if lost > partial:
            st["walkbacks"] += 1
            st["walkback_tokens_lost"] += lost - partial

    # ------------------------------------------------------------------ stats

    # stats(): the rest count
    STAT_GAUGES = frozenset({"loans_open", "rank", "group_size", "prefill_tokens_per_s"})
    GROUP_STATS = ("rank", "group_size", "shard")  # in a group: who this rank is, not counts
    MODEL_STATS = ("prefill_tokens_per_s", "prefill_samples")  # the model's, whatever the layout

    def stats(self) -> dict:
        """Counters: hits/misses, tokens requested/matched/saved/lost/recomputed, blocks, loans,
        timings; the loans open now and the model's prefill rate estimate (gauges). In a group,
        also the rank, the group's size, this rank's shard and the agreement's counters."""
        out = {**self._stats, **self._loans.counters, "loans_open": len(self._loans),
               **self.manager.rates.prefill_stats(self.layout.identity)}
        if self._agreement is not None:
            out.update(self._agreement.counters, rank=self.group.rank(),
                       group_size=self.group.size(), shard=self.shard.describe())
        return out
