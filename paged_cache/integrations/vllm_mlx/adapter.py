"""paged-cache as vllm-mlx's prefix cache: ``PagedPrefixCache`` has the interface vllm-mlx's
continuous-batching ``Scheduler`` uses of its ``MemoryAwarePrefixCache`` and serves it from the
tiered block cache; ``serve_main`` runs ``vllm-mlx serve`` with it (see docs/integration.md).

The Scheduler keeps everything it does (BatchGenerator batching, sampling, streaming, aborts,
its own store points); the cache behind those calls becomes block-shared, exact for every layout
paged-cache supports, written to SSD (surviving restarts), optionally shared through
the remote tier, and bounded by ``--cache-memory-mb`` in RAM. Tenants' cache salts
(``tenants``) keep their prefixes apart, as in ``paged-cache serve``. Each prefill step of the
Scheduler's BatchGenerator is a sample of the model's prefill rate (``prefill_samples``), so the
fetch plan weighs a restore against the prefill it saves, as in ``paged-cache serve``; chats
opening together over one system prompt share its prefill (``prefills``).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any, Callable, Sequence

from paged_cache.config import CacheConfig, format_size
from paged_cache.integrations.vllm_mlx import compat
from paged_cache.integrations.shared import prefill_samples
from paged_cache.integrations.mlx_lm import PagedPromptCache
from paged_cache.integrations.shared.stats_http import HISTOGRAMS
from paged_cache.integrations.shared.tenants import CURRENT_SALT
from paged_cache.integrations.shared.tenants_asgi import SaltMiddleware
from paged_cache.integrations.vllm_mlx.prefills import SchedulerPrefills
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.metrics import histograms

logger = logging.getLogger("paged_cache.integrations.vllm_mlx")

MODEL_KEY = "model"   # one PagedPrefixCache serves one Scheduler, i.e. one model
BYTES_PER_MB = 1024 * 1024
# Re-take the Scheduler's post-prefill snapshot on every request: a store only cuts the blocks
# the cache does not hold yet, so the copy vllm-mlx throttles (whole-context) costs a block here.
REFRESH_TOKENS = 0
# vllm-mlx options that select another prefix cache (or none) and would leave paged-cache unused.
OTHER_CACHE_FLAGS = ("--use-paged-cache", "--no-memory-aware-cache", "--disable-prefix-cache")
# vllm-mlx's vision path: its own scheduler and cache, which know no cache salt.
VISION_FLAG = "--mllm"


class ServeError(RuntimeError):
    """`paged-cache vllm-mlx` cannot start as asked; the message says why."""


_installed: dict[str, Any] = {}


def install(manager: PagedSSDCacheManager, *, max_kv_size: int | None = None) -> None:
    """THE patch point: every vllm-mlx Scheduler built from now on gets a ``PagedPrefixCache``
    over ``manager`` (``max_kv_size``: the ``--max-kv-size`` the Scheduler bounds its caches
    with, so the stored layout is the one it builds), and each request's cache salt (its
    ``cache_salt`` field, its ``X-Cache-Salt`` header, with ``cache_salt_from_user`` in the
    manager's config its ``user`` field) reaches the fetch of its cache."""
    if not isinstance(manager, PagedSSDCacheManager):
        raise TypeError(f"manager: expected a PagedSSDCacheManager, got {type(manager).__name__}")
    if max_kv_size is not None and (isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int)
                                    or max_kv_size < 0):
        raise ValueError(f"max_kv_size: expected an int >= 0 or None, got {max_kv_size!r}")
    _installed.update(manager=manager, max_kv_size=max_kv_size or None)
    histograms.set_process_labels(engine="vllm_mlx")
    compat.install(PagedPrefixCache, REFRESH_TOKENS)
    compat.on_batch_generator(_on_generator)
    compat.hold_back(_held)
    compat.after_responses(_first_tokens)
    compat.carry_salts(SaltMiddleware, _on_vision_path,
                       from_user=manager.config.cache_salt_from_user,
                       refusal=lambda: _installed.get("vision"))


def _on_generator(generator: Any, cache: Any) -> None:
    """A new BatchGenerator of a Scheduler with paged-cache as ``cache``: its prefills are
    samples of the prefill rate, and its leaders' prompts are split at their chat prefix
    (``SchedulerPrefills``)."""
    if isinstance(cache, PagedPrefixCache):
        prefill_samples.metered(generator, cache.record_prefill)
        cache.prefills.split_prompts(generator)


def _first_tokens(scheduler: Any, cache: Any) -> None:
    """After a Scheduler's step: the time to first token of the requests it started."""
    if isinstance(cache, PagedPrefixCache):
        cache.first_tokens(scheduler)


def _held(scheduler: Any, cache: Any) -> list:
    """The waiting requests a Scheduler with ``cache`` must leave out of its round."""
    return cache.prefills.held(scheduler) if isinstance(cache, PagedPrefixCache) else []


def _on_vision_path() -> None:
    """vllm-mlx serves its model on the vision path, whose cache knows no salt: with
    ``cache_salt_from_user`` the start is refused (ServeError), else salted requests are (400)."""
    config = _installed["manager"].config
    if config.cache_salt_from_user:
        raise ServeError(vision_refusal(config))
    _installed["vision"] = ("this server's model runs on vllm-mlx's vision path, whose prefix "
                            "cache knows no cache salt; send none")


def vision_refusal(config: CacheConfig) -> str:
    """Why ``--cache-salt-from-user`` cannot be served on vllm-mlx's vision path."""
    return (f"--cache-salt-from-user (from {config.sources['cache_salt_from_user']}): the model "
            f"runs on vllm-mlx's vision path ({VISION_FLAG}, or a vision model), which keeps a "
            "prefix cache of its own that knows no cache salt, so its tenants would share "
            f"prefixes; serve a text model without {VISION_FLAG}, or drop the flag")


def uninstall() -> None:
    """Give vllm-mlx its own prefix cache back (for Schedulers built from now on), and its
    requests and path choice without salts."""
    _installed.clear()
    compat.uninstall()


class PagedPrefixCache:
    """vllm-mlx's ``MemoryAwarePrefixCache`` interface (what its Scheduler calls) over a
    ``PagedPromptCache`` for the Scheduler's model.

    ``fetch`` returns a freshly rebuilt cache list and the tokens left to prefill (always at least
    one, so the Scheduler never takes its exact-hit path); ``store`` cuts the blocks the cache does
    not hold yet (the Scheduler's post-prefill snapshot of a hybrid or windowed model, or its
    prompt + reply at the end of a request). ``config.compute_memory_limit()``
    (``--cache-memory-mb``) bounds this model's bytes in the hot tier, ``config.max_entries`` its
    sequences there; blocks leaving RAM stay on SSD (or go, with ``hot_cache_only``).
    """

    def __init__(self, model: Any, config: Any = None) -> None:
        manager = _installed.get("manager")
        if manager is None:
            raise RuntimeError("PagedPrefixCache: call paged_cache.integrations.vllm_mlx.adapter.install("
                               "manager) before vllm-mlx builds its Scheduler")
        max_kv_size = _installed.get("max_kv_size")
        self._max_memory = compat.memory_limit_bytes(config)
        self._cache = PagedPromptCache.for_model(
            manager, model, max_size=getattr(config, "max_entries", None),
            max_bytes=self._max_memory, make_cache=lambda: compat.layout(model, max_kv_size))
        self.prefills = SchedulerPrefills(self._cache, MODEL_KEY,
                                          enabled=manager.config.shared_prefill)
        self._last_match_type: str | None = None
        self._last_matched_key: tuple[int, ...] | None = None
        self._awaiting: dict[str, tuple[Any, str]] = {}  # request id -> (request, its tier)
        self._ssd_tier = None      # vllm-mlx's own SSD tier is never attached (see serve_main)
        if getattr(config, "kv_quantize", False):
            logger.warning("--kv-cache-quantization has no effect with paged-cache: blocks are "
                           "stored exactly as the model computed them")
        logger.info("vllm-mlx prefix cache: paged-cache (hot tier budget for this model %s)",
                    "unbounded" if self._max_memory is None else format_size(self._max_memory))

    # ------------------------------------------------------------------ what the Scheduler calls

    def fetch(self, tokens: Sequence[int]) -> tuple[list | None, list[int]]:
        """``(cache, remaining)``: a fresh cache list covering ``tokens[:len(tokens) -
        len(remaining)]`` with ``remaining`` never empty, or ``(None, tokens)``; from the space
        of the request's salt (``CURRENT_SALT``, which the Scheduler's admission sets). A
        request held back for a shared prefill gets ``(None, tokens)``, uncounted: it is
        fetched again when admitted again."""
        request = compat.ADMITTING.get()
        if self.prefills.hold(request):
            self._last_match_type, self._last_matched_key = "miss", None
            return None, list(tokens)
        cache, rest = self._cache.fetch_as(MODEL_KEY, tokens, CURRENT_SALT.get())
        rest = list(rest)
        self.prefills.fetched(request, tokens, rest)
        if request is not None:
            self._awaiting[request.request_id] = (request, self._cache.tier_of(tokens))
        if cache is None:
            self._last_match_type, self._last_matched_key = "miss", None
            return None, rest
        self._last_match_type = "prefix"
        self._last_matched_key = tuple(tokens[:len(tokens) - len(rest)])
        return cache, rest

    def first_tokens(self, scheduler: Any) -> None:
        """Observe the time to first token (arrival to first token, as vllm-mlx timed it) of the
        fetched requests that have one, by the tier their cache came from; forget those that
        left ``scheduler`` without one (aborted)."""
        for request_id, (request, tier) in list(self._awaiting.items()):
            seconds = compat.first_token_seconds(request)
            if seconds is not None:
                self._cache.record_first_token(tier, seconds)
            elif not compat.prompt_done(scheduler, request):
                continue
            del self._awaiting[request_id]

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """The Scheduler prefilled ``tokens`` (those its fetches did not cover) in ``seconds``: a
        sample of the model's prefill rate."""
        self._cache.record_prefill(tokens, seconds)

    def store(self, tokens: Sequence[int], cache: list, evict_prefixes: bool = True) -> bool:
        """Store ``cache`` (positioned at ``len(tokens)``, or one short of it) as blocks; the list
        is consumed (its entries are None after). ``evict_prefixes`` has nothing to do here: a
        prefix's blocks are the longer sequence's first blocks. False when it was not stored
        (logged and counted, never raised)."""
        failed = self._cache.counters["store_errors"]
        self._cache.insert_cache(MODEL_KEY, tokens, cache)
        return self._cache.counters["store_errors"] == failed

    def remove(self, tokens: Sequence[int], *, include_ssd: bool = False) -> bool:
        """Nothing to remove: a stored sequence is a chain of shared blocks (a shorter entry the
        Scheduler replaces costs no extra bytes), and no fetch hands out a cache the Scheduler
        could reject. Always False."""
        return False

    def clear(self) -> None:
        """Empty this model's share of the RAM tier (``DELETE /v1/cache/prefix``, or the Scheduler
        recovering from an error); blocks on SSD stay (``paged-cache prune`` deletes them)."""
        self._cache.trim_to(n_sequences=0, n_bytes=0)

    def get_stats(self) -> dict[str, Any]:
        """vllm-mlx's cache statistics (``/v1/cache/stats``, ``/v1/status``), computed from
        paged-cache's counters, plus every paged-cache section under ``paged_cache`` (and the
        process's histograms there, as in ``paged-cache serve``'s stats document, less each
        series' +Inf bucket, whose count is its ``count``: vllm-mlx answers strict JSON)."""
        stats = self._cache.stats()
        requests = stats["requests"]
        hits = requests["requests"] - requests["requests_miss"]
        hot = self._cache.nbytes
        return {
            "hits": hits,
            "misses": requests["requests_miss"],
            "hit_rate": round(hits / requests["requests"], 4) if requests["requests"] else 0.0,
            "evictions": requests["demote_evictions"],
            "tokens_saved": requests["cached_tokens"],
            "current_memory_mb": round(hot / BYTES_PER_MB, 2),
            "max_memory_mb": round((self._max_memory or 0) / BYTES_PER_MB, 2),
            "memory_utilization": round(hot / self._max_memory, 4) if self._max_memory else 0.0,
            "entry_count": len(self),
            "store_rejections": requests["store_errors"],
            "paged_cache": {**stats, HISTOGRAMS: _finite_summary()},
        }

    def save_to_disk(self, cache_dir: str) -> bool:
        """Called by vllm-mlx at shutdown: every stored block is already queued for the SSD tier
        (not for ``cache_dir``); wait until they are written. False with ``hot_cache_only``."""
        manager = self._cache.manager
        manager.flush()
        return not manager.config.hot_cache_only

    def load_from_disk(self, cache_dir: str) -> int:
        """Called by vllm-mlx at start: nothing to load, blocks are read from SSD when a request
        needs them. Always 0."""
        return 0

    def set_ssd_tier(self, ssd_tier: Any) -> None:
        """vllm-mlx's SSD tier is not used (``--ssd-cache-dir`` configures paged-cache's)."""
        if ssd_tier is not None:
            logger.warning("vllm-mlx's SSD tier is not used with paged-cache; ignoring it")

    def check_ssd(self, tokens: Sequence[int]) -> None:
        """No separate SSD lookup: ``fetch`` already reads blocks from SSD."""
        return None

    @property
    def _entries(self) -> dict:
        """Sequences with blocks in RAM (the Scheduler only takes its ``len``)."""
        return dict.fromkeys(range(len(self)))

    @property
    def _current_memory(self) -> int:
        return self._cache.nbytes

    @property
    def memory_usage_mb(self) -> float:
        return self._cache.nbytes / BYTES_PER_MB

    @property
    def memory_limit_mb(self) -> float:
        return (self._max_memory or 0) / BYTES_PER_MB

    def __len__(self) -> int:
        return len(self._cache)

    def stats(self) -> dict[str, Any]:
        """paged-cache's sections (manager, prefix, requests), as ``PagedPromptCache.stats``."""
        return self._cache.stats()


def _finite_summary() -> dict[str, list[dict[str, Any]]]:
    """``histograms.summary()`` with the finite buckets only (strict JSON has no infinity)."""
    summary = histograms.summary()
    for series in summary.values():
        for entry in series:
            entry["buckets"] = [b for b in entry["buckets"] if b[0] != float("inf")]
    return summary


# ---------------------------------------------------------------------------- vllm-mlx serve

def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``), else None."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def engine_argv(config: CacheConfig, argv: Sequence[str]) -> tuple[CacheConfig, list[str], int | None]:
    """Check a ``vllm-mlx serve ...`` command line for paged-cache and adapt it: vllm-mlx's
    ``--ssd-cache-dir`` / ``--ssd-cache-max-gb`` become paged-cache's SSD tier (and leave the
    command line, so vllm-mlx opens no SSD tier of its own). Returns the cache config, the
    command line for vllm-mlx and its ``--max-kv-size``; ServeError on a command line paged-cache
    cannot serve."""
    argv = list(argv)
    if not argv or argv[0] != "serve":
        raise ServeError("expected `paged-cache vllm-mlx serve MODEL [vllm-mlx options] "
                         "[cache options]`")
    if "--continuous-batching" not in argv:
        raise ServeError("vllm-mlx keeps its prefix cache in its continuous-batching scheduler: "
                         "add --continuous-batching")
    for flag in OTHER_CACHE_FLAGS:
        if flag in argv:
            raise ServeError(f"{flag} selects another prefix cache than paged-cache; remove it")
    if config.cache_salt_from_user and VISION_FLAG in argv:
        raise ServeError(vision_refusal(config))
    overrides: dict[str, Any] = {}
    for flag, field, convert in (("--ssd-cache-dir", "ssd_dir", str),
                                 ("--ssd-cache-max-gb", "ssd_max_bytes",
                                  lambda v: int(float(v) * 10**9))):
        value = _flag_value(argv, flag)
        if value is None:
            continue
        if field in config.explicit:
            raise ServeError(f"{flag} and paged-cache's --{field.replace('_', '-')} (from "
                             f"{config.sources[field]}) both set the SSD tier; give one")
        try:
            overrides[field] = convert(value)
        except ValueError:
            raise ServeError(f"{flag}: expected a number, got {value!r}") from None
        argv = _without(argv, flag)
    if overrides:
        try:
            config = CacheConfig.layered(
                overrides={**{n: getattr(config, n) for n in config.explicit}, **overrides},
                override_source={**{n: config.sources[n] for n in config.explicit},
                                 **{n: "vllm-mlx flag" for n in overrides}})
        except ValueError as error:
            raise ServeError(str(error)) from None
    kv = _flag_value(argv, "--max-kv-size")
    try:
        max_kv_size = int(kv) if kv is not None else None
    except ValueError:
        raise ServeError(f"--max-kv-size: expected an int, got {kv!r}") from None
    return config, argv, max_kv_size


def serve_main(config: CacheConfig, argv: Sequence[str],
               run: Callable[[list[str]], None] = compat.run_cli) -> int:
    """Run ``vllm-mlx`` with ``argv`` (``serve MODEL ... --continuous-batching``) and paged-cache
    as its prefix cache; returns the exit status. The manager is opened first (a bad SSD
    directory fails before the model loads) and closed, every block written, when the server
    stops."""
    config, argv, max_kv_size = engine_argv(config, argv)
    with ExitStack() as stack:
        try:
            manager = stack.enter_context(PagedSSDCacheManager(config))
        except (OSError, ValueError) as error:
            raise ServeError(f"cannot open the SSD tier at {config.ssd_dir}: {error}") from error
        stack.callback(uninstall)
        install(manager, max_kv_size=max_kv_size)
        where = "hot tier only" if config.hot_cache_only else f"SSD tier at {config.ssd_dir}"
        logger.info("vllm-mlx with paged-cache: block size %d, hot tier %s, %s",
                    config.block_size, format_size(config.hot_cache_max_bytes), where)
        logging.getLogger().setLevel(logging.INFO)   # vllm-mlx's own default level
        run(argv)
    return 0
