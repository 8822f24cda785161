"""paged-cache as mlx-openai-server's prompt cache: ``OpenAIServerPromptCache`` has the interface
of its ``LRUPromptCache`` (mlx-lm's, with ``allowed_sources`` / ``source`` and ``close``) and
serves it from the tiered block cache; ``serve_main`` runs ``mlx-openai-server launch`` with it
(see docs/integration.md).

mlx-openai-server runs every model handler in a spawned process. ``serve_main`` makes that process
start with ``handler_worker`` (carrying the cache configuration), which opens the manager there
and makes language-model handlers ``PagedMLXLMHandler``: the same handler, whose prompt cache is
an ``OpenAIServerPromptCache`` bound to its model. Its batch scheduler, non-batched path,
streaming, cancellation and sampling are unchanged. Tenants' cache salts (``tenants``) keep
their prefixes apart, as in ``paged-cache serve``: the server process reads each request's salt
(``SaltMiddleware``) and sends it with the request; the handler makes it current for the
request's task and its batch scheduler carries it to the fetch (``compat``). Both
generation paths give the model's prefill rate samples (``prefill_samples``: each prefill step of
the batch scheduler's BatchGenerator, each single request's reported prompt rate), so the fetch
plan weighs a restore against the prefill it saves. Each streamed request's time to first token
(from its arrival in the handler process) goes to the histogram by the tier its fetch came from,
and the handler logs their counts and means when it stops.

Requests the batch scheduler admits together with a prefix nobody has cached yet (chats opening
at once over one system prompt) share one prefill (``SharedPrefills``, as in ``paged-cache
serve``): each batched request's prompt is split where its last user message begins, so the
scheduler inserts its cache there while prefilling, and a request sharing such a split with one
being prefilled waits at admission until that insert (or the other's first output), then
restores the prefix.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from paged_cache.config import CacheConfig, format_size
from paged_cache.integrations.openai_server import compat
from paged_cache.integrations.shared import prefill_samples
from paged_cache.integrations.mlx_lm import ModelWithDraft, PagedPromptCache, model_id_for
from paged_cache.integrations.shared.prefills import SharedPrefills
from paged_cache.integrations.shared.tenants import CURRENT_SALT, salt_of_args
from paged_cache.integrations.shared.tenants_asgi import SaltMiddleware
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.metrics import histograms

logger = logging.getLogger("paged_cache.integrations.openai_server")

MODEL_KEY = "model"           # one cache per handler, i.e. per model
UNBOUNDED = 1 << 62           # mlx-openai-server's default --max-bytes (1 << 63) means no limit
MAX_AWAITING = 256            # fetched requests kept for their first token (the oldest go first)


class ServeError(RuntimeError):
    """`paged-cache openai-server` cannot start as asked; the message says why."""


class OpenAIServerPromptCache:
    """mlx-openai-server's ``LRUPromptCache`` interface over a ``PagedPromptCache`` of one model.

    Every fetch is rebuilt into new arrays on the calling thread, so ``allowed_sources`` (which
    keeps its LRUPromptCache from handing a cache made on one worker thread to another) has
    nothing to restrict; ``source`` is accepted and ignored likewise. ``max_size`` / ``max_bytes``
    (``--prompt-cache-size`` / ``--max-bytes``) bound this model's sequences and bytes in the hot
    tier, as in ``PagedPromptCache``. ``sharing``: the batch scheduler's admission of requests
    sharing a prefix with one being prefilled (off with the ``shared_prefill`` setting).
    """

    def __init__(self, manager: PagedSSDCacheManager, model: Any, *, draft: Any = None,
                 make_cache: Callable[[], list] | None = None, model_path: str | None = None,
                 max_size: int | None = None, max_bytes: int | None = None) -> None:
        bound = model if draft is None else ModelWithDraft(model, draft)
        self.max_size = max_size
        self.max_bytes = max_bytes if max_bytes is not None and max_bytes < UNBOUNDED else None
        self._cache = PagedPromptCache.for_model(
            manager, bound, max_size=max_size, max_bytes=self.max_bytes, make_cache=make_cache,
            model_id=model_id_for(model_path) if model_path else None, model_name=model_path)
        config = manager.config
        self.sharing = SharedPrefills(
            lambda _stream, item: compat.queued_prompt(item),
            lambda tokens, salt: self._cache.reach(MODEL_KEY, tokens, salt),
            self._cache.counters, min_tokens=config.block_size, enabled=config.shared_prefill)
        self._cache.on_insert = self.sharing.inserted
        self._awaiting: list[tuple[list[int], float, str]] = []  # (prompt, arrived, tier)
        self._awaiting_lock = threading.Lock()

    def fetch_nearest_cache(self, tokens_ids: Sequence[int], *,
                            allowed_sources: set[str] | None = None) -> tuple[list | None, list[int]]:
        """``(cache, rest)``: a fresh cache list covering ``tokens_ids[:len(tokens_ids) -
        len(rest)]`` (never all of it), or ``(None, tokens_ids)``; from the space of the
        request's salt (``CURRENT_SALT``: the request's task, or the batch scheduler's thread
        while it admits the request)."""
        cache, rest = self._cache.fetch_as(MODEL_KEY, tokens_ids, CURRENT_SALT.get())
        arrived = compat.ARRIVED.get()
        if arrived is not None:
            with self._awaiting_lock:
                self._awaiting.append((list(tokens_ids), arrived, self._cache.tier_of(tokens_ids)))
                del self._awaiting[:-MAX_AWAITING]
        return cache, list(rest)

    def first_token(self, prompt: Sequence[int]) -> None:
        """The request of ``prompt`` has its first token out now: its time from arrival goes to
        the time-to-first-token histogram by the tier of its latest fetch (the longest one
        ``prompt`` extends; the scheduler may fetch a request twice)."""
        now, prompt = time.perf_counter(), list(prompt)
        with self._awaiting_lock:
            found = [a for a in self._awaiting if prompt[:len(a[0])] == a[0]]
            if not found:
                return
            _, arrived, tier = found[-1]
            self._awaiting = [a for a in self._awaiting if a[1] != arrived]
        self._cache.record_first_token(tier, now - arrived)

    def insert_cache(self, tokens_ids: Sequence[int], prompt_cache: list, *,
                     cache_type: str = "assistant", source: str = "nonbatch") -> None:
        """Store ``prompt_cache`` (positioned at ``len(tokens_ids)``, or one short) as blocks; the
        list is consumed. Errors are logged and counted, never raised."""
        self._cache.insert_cache(MODEL_KEY, tokens_ids, prompt_cache, cache_type=cache_type)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """The handler prefilled ``tokens`` (those the fetch did not cover) in ``seconds``: a
        sample of the model's prefill rate."""
        self._cache.record_prefill(tokens, seconds)

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        self._cache.trim_to(n_sequences=n_sequences, n_bytes=n_bytes)

    def clear(self) -> None:
        """Empty this model's share of the RAM tier; blocks on SSD stay."""
        self._cache.trim_to(n_sequences=0, n_bytes=0)

    def close(self) -> None:
        """Called when the handler shuts down: wait until every stored block is written (blocks
        stay on SSD for the next start, unlike LRUPromptCache's temporary files); logs the
        times to first token observed, by outcome."""
        self._cache.manager.flush()
        series = histograms.summary().get("time_to_first_token_seconds", [])
        logger.info("time to first token: %s", "; ".join(
            f"{s['labels']['outcome']} {s['labels']['tier']} {s['count']:.0f} requests, mean "
            f"{s['sum'] / s['count'] * 1e3:.1f} ms" for s in series) or "no request timed")

    @property
    def nbytes(self) -> int:
        return self._cache.nbytes

    def __len__(self) -> int:
        return len(self._cache)

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        return self._cache.stats_by_type()

    def stats(self) -> dict[str, Any]:
        """paged-cache's sections (manager, prefix, requests), as ``PagedPromptCache.stats``."""
        return self._cache.stats()

    def log_cache_stats(self) -> None:
        requests = self._cache.stats()["requests"]
        logger.info("prompt cache: %d sequences, hot tier %s; %d/%d prompt tokens cached so far",
                    len(self), format_size(self.nbytes), requests["cached_tokens"],
                    requests["prompt_tokens"])


def paged_handler_class(base: type, manager: PagedSSDCacheManager) -> type:
    """``base`` (mlx-openai-server's MLXLMHandler) with an ``OpenAIServerPromptCache`` over
    ``manager`` in place of the LRUPromptCache its ``__init__`` builds (which is closed, removing
    its temporary directory)."""

    class PagedMLXLMHandler(base):  # type: ignore[misc, valid-type]
        """mlx-openai-server's language-model handler with paged-cache as its prompt cache."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            own = self.prompt_cache
            model, draft, make_cache, path = compat.handler_model(self)
            self.prompt_cache = OpenAIServerPromptCache(
                manager, model, draft=draft, make_cache=make_cache, model_path=path,
                max_size=own.max_size, max_bytes=own.max_bytes)
            own.close()
            compat.watch_prompts(self)
            logger.info("%s: prompt cache is paged-cache", path)

        # The salt is set in the task mlx-openai-server runs for this one request, never reset:
        # the tasks streaming the reply copy that task's context, and it ends with the request.
        def generate_text_stream(self, request: Any) -> Any:
            CURRENT_SALT.set(salt_of_args(request))
            compat.ARRIVED.set(time.perf_counter())
            return super().generate_text_stream(request)

        def generate_text_response(self, request: Any) -> Any:
            CURRENT_SALT.set(salt_of_args(request))
            compat.ARRIVED.set(time.perf_counter())
            return super().generate_text_response(request)

    compat.observe_single_requests(PagedMLXLMHandler, _observe)
    compat.segment_batched_prompts(PagedMLXLMHandler, lambda h: _gate(h.prompt_cache) is not None)
    return PagedMLXLMHandler


def _gate(cache: Any) -> SharedPrefills | None:
    """The admission gate of a batch scheduler over ``cache``: its shared prefills, when on."""
    if isinstance(cache, OpenAIServerPromptCache) and cache.sharing.enabled:
        return cache.sharing
    return None


def _first_output(cache: Any, prompt: list[int]) -> None:
    """A batched request of ``prompt`` has its first token out: its time to first token."""
    if isinstance(cache, OpenAIServerPromptCache):
        cache.first_token(prompt)


def _observe(handler: Any, prompt: list[int], returned: Any) -> Any:
    """What the single-request path generated for ``prompt`` (a stream of responses or one
    response), giving the handler's prompt cache the prefill sample it reports and, for a
    stream, its time to first token (one response: the first token's time is not known)."""
    cache = handler.prompt_cache
    if not isinstance(cache, OpenAIServerPromptCache):
        return returned
    if isinstance(returned, Iterator):
        return prefill_samples.from_responses(returned, cache.record_prefill,
                                              lambda: cache.first_token(prompt))
    prefill_samples.sample_response(returned, cache.record_prefill)
    return returned


def handler_worker(config: CacheConfig, *args: Any) -> None:
    """Entry point of a spawned handler process (``functools.partial(handler_worker, config)``):
    open the manager, make language-model handlers use it, run mlx-openai-server's own worker;
    the manager is closed (every block written) when the worker returns, and the process ends
    there (``os._exit``: MLX's threads can hang interpreter finalization past the server's
    5-second join). SIGTERM is ignored like SIGINT: the server process shuts its handlers down
    in order."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.getLogger("paged_cache").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    status = 1
    try:
        histograms.set_process_labels(engine="openai_server")
        with PagedSSDCacheManager(config) as manager:
            compat.set_handler_class(paged_handler_class(compat.ORIGINAL_HANDLER, manager))
            compat.paged_batches(prefill_samples.meter_for(OpenAIServerPromptCache), _gate,
                                 _first_output)
            compat.ORIGINAL_WORKER(*args)
        status = 0
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve_main(config: CacheConfig, argv: Sequence[str],
               run: Callable[[list[str]], int] = compat.run_cli) -> int:
    """Run ``mlx-openai-server`` with ``argv`` (``launch --model-path MODEL ...``; a command line
    starting with an option means ``launch``, as for mlx-openai-server) and paged-cache as the
    prompt cache of its language models; returns the exit status. The cache configuration is
    checked, and the SSD tier opened once, before any model loads."""
    argv = list(argv)
    if not argv or argv[0].startswith("-"):
        argv.insert(0, "launch")
    if argv[0] != "launch":
        raise ServeError("expected `paged-cache openai-server launch --model-path MODEL "
                         "[mlx-openai-server options] [cache options]`")
    try:
        with PagedSSDCacheManager(config):
            pass
    except (OSError, ValueError) as error:
        raise ServeError(f"cannot open the SSD tier at {config.ssd_dir}: {error}") from error
    where = "hot tier only" if config.hot_cache_only else f"SSD tier at {config.ssd_dir}"
    logger.info("mlx-openai-server with paged-cache: block size %d, hot tier %s, %s",
                config.block_size, format_size(config.hot_cache_max_bytes), where)
    compat.set_worker(functools.partial(handler_worker, config))
    compat.carry_salts(SaltMiddleware, from_user=config.cache_salt_from_user)
    try:
        return run(argv)
    finally:
        compat.restore()
