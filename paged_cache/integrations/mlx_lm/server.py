"""The one patch point that puts ``PagedPromptCache`` into ``mlx_lm.server`` (``patch_server``)
and ``paged-cache serve`` (``serve_main``: address check, model load, then the manager)."""

from __future__ import annotations

import io
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import ExitStack
from typing import Any, Callable, Iterator, Sequence

from mlx.utils import tree_flatten

from paged_cache import compat
from paged_cache.config import CacheConfig, format_size
from paged_cache.distributed import WORLD, resolve_group
from paged_cache.integrations.mlx_lm.adapter import PagedPromptCache
from paged_cache.integrations.mlx_lm.binding import provider_resolver
from paged_cache.integrations.shared.prefills import SharedPrefills, Tokenized
from paged_cache.integrations.shared.shutdown import close_logged
from paged_cache.integrations.shared.tenants import (SaltError, attach_salt, error_body, request_salt,
                                                     salt_of_args)
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.metrics import histograms

logger = logging.getLogger("paged_cache.integrations.mlx_lm")

# Tokenizations kept for the server's own (``_segments``) at most: beyond, the oldest goes.
MAX_TOKENIZED = 256


class ServeError(RuntimeError):
    """The server could not start (e.g. its port is in use); the message says why."""


def patch_server(manager: PagedSSDCacheManager | Callable[[Any], PagedSSDCacheManager], *,
                 load_first: bool = False,
                 on_cache: Callable[[PagedPromptCache], None] | None = None) -> None:
    """THE patch point: replace two names in ``mlx_lm.server``, both looked up by
    ``mlx_lm.server.run`` when it starts, so this must run before ``mlx_lm.server.main()``.

    - ``ResponseGenerator``: a subclass that puts a ``PagedPromptCache`` in place of the prompt
      cache handed to it: a ``PagedPromptCache`` is kept and bound to the model provider, any
      other (``run``'s empty ``LRUPromptCache``) is replaced by one over ``manager`` (kept as
      ``paged_cache``). ``manager`` may be a callable opening it, called once with the model
      provider when the first generator is built. ``load_first``: load the default model on
      the calling thread before that, so a model that cannot be loaded raises ``ServeError``
      and nothing is opened. ``on_cache``: called with each generator's ``PagedPromptCache``.
    - ``_run_http_server``: the same function called with ``handler_class`` set to an
      ``APIHandler`` subclass that also answers ``GET /paged-cache/stats`` and ``GET /metrics``
      (``run`` passes none); a failure to listen stops the generation thread and raises
      ``ServeError`` instead of leaving the process hanging.

    Nothing else of mlx-lm is changed; patching again replaces the previous patch.
    """
    from mlx_lm import server

    from paged_cache.integrations.shared import stats_http

    generator, run_http = compat.server_hooks()
    base = getattr(generator, "paged_base", generator)
    run_http_server = getattr(run_http, "paged_base", run_http)
    opened: list[PagedSSDCacheManager] = [manager] if not callable(manager) else []

    class PagedResponseGenerator(base):
        """mlx_lm.server's ResponseGenerator with the tiered prompt cache."""

        paged_base = base

        def __init__(self, model_provider: Any, prompt_cache: Any) -> None:
            if load_first:
                _load_default(model_provider)
            resolve = provider_resolver(model_provider)
            if isinstance(prompt_cache, PagedPromptCache):
                prompt_cache.bind(resolve)
                self.paged_cache = prompt_cache
            else:
                if not opened:
                    opened.append(manager(model_provider))  # type: ignore[operator]
                args = getattr(model_provider, "cli_args", None)
                # Kept under its own name: the generation thread deletes `prompt_cache` on exit.
                self.paged_cache = PagedPromptCache(
                    opened[0], resolve, max_size=getattr(args, "prompt_cache_size", None),
                    max_bytes=getattr(args, "prompt_cache_bytes", None), defer_stores=True)
            cache = self.paged_cache
            if on_cache is not None:
                on_cache(cache)
            config = cache.manager.config
            # the ranks of a group poll their queue in lock step: none may hold a request back
            self.paged_sharing = SharedPrefills(
                self._segments,
                lambda tokens, salt: cache.reach(model_provider.model_key, tokens, salt),
                cache.counters, min_tokens=config.block_size,
                enabled=config.shared_prefill and cache.group is None)
            cache.on_insert = self.paged_sharing.inserted
            self._tokenized: dict[int, tuple[Any, Any, Any]] = {}  # see _segments
            super().__init__(model_provider, cache)

        def _segments(self, request: Any, args: Any) -> Tokenized | None:
            """A queued request's prompt and the segment ends where the server will insert its
            cache before the prompt's end (shared_prefill.py), tokenized as the server does (kept
            for its own ``_tokenize`` of the request); None for a request it serves alone, one
            with images, or before a model is loaded."""
            tokenizer = self.model_provider.tokenizer
            if tokenizer is None or not self._is_batchable(args):
                return None
            result = base._tokenize(self, tokenizer, request, args)
            while len(self._tokenized) >= MAX_TOKENIZED:  # requests the server never tokenized
                self._tokenized.pop(next(iter(self._tokenized)))
            self._tokenized[id(request)] = (request, tokenizer, result)
            prompt, segments = result[0], result[1]
            if compat.tokenized_images(result):
                return None
            return list(prompt), list(itertools.accumulate(len(s) for s in segments))[:-1]

        def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
            """The server's tokenization of a request, done once: ``_segments`` may have."""
            kept = self._tokenized.pop(id(request), None)
            if kept is not None and kept[0] is request and kept[1] is tokenizer:
                return kept[2]
            return super()._tokenize(tokenizer, request, args)

        def _log_cache_stats(self) -> None:
            """Nothing: mlx_lm.server's "Prompt Cache: N sequences, X GB" lines, before every
            fetch, described the cache this class replaced; each request's own line says what
            the tiers hold."""

        def _next_request(self, timeout: float | None = None) -> Any:
            """The generation thread's poll of the request queue, through ``SharedPrefills``
            (requests sharing a prefix another is prefilling wait for it). When it would wait
            (no batch running: mlx_lm.server passes a timeout), no request is queued and none
            is held back, the deferred inserts are cut into blocks first, one at a time, while
            that lasts."""
            cache, sharing = self.paged_cache, self.paged_sharing
            while (timeout is not None and cache.deferred and self.requests.empty()
                   and not sharing.parked):
                cache.store_deferred(1, idle=True)
            return sharing.next(super()._next_request, timeout)

        def _generate(self) -> None:
            """The generation loop; the inserts still deferred when it ends are stored on its
            thread (the manager is flushed and closed after it), and requests still held back
            go back to the queue."""
            try:
                super()._generate()
            finally:
                self.paged_sharing.requeue(self.requests.put)
                self.paged_cache.store_deferred()

        def generate(self, request: Any, generation_args: Any, *args: Any,
                     **kwargs: Any) -> tuple[Any, Iterator[Any]]:
            """The server's generate (on the HTTP handler thread), with the request's time to
            first token counted, the salt its request carries attached to it, and its prompt's
            end told to the requests waiting for its prefill."""
            salt = getattr(_handling, "salt", None)
            if salt is not None:
                attach_salt(generation_args, salt)
            submitted = time.perf_counter()
            sharing = self.paged_sharing
            try:
                ctx, responses = super().generate(request, generation_args, *args, **kwargs)
            except BaseException:
                sharing.prompt_done(request)
                raise
            return ctx, self.paged_cache.time_first_token(
                ctx.prompt, lambda: ctx.prompt_cache_count, sharing.watch(request, responses),
                submitted, sharing.waited(request))

    def before_fetch(generator: Any, args: Any) -> None:  # the generation thread
        generator.paged_cache.next_salt(salt_of_args(args))

    class PagedAPIHandler(server.APIHandler):
        """mlx_lm.server's request handler plus the `paged-cache stats` routes and tenants'
        cache salts (a request's blocks are its salt's own)."""

        def do_GET(self) -> None:
            if not stats_http.answer(self, self.response_generator.paged_cache.stats,
                                     PagedPromptCache.STAT_GAUGES):
                super().do_GET()

        def do_POST(self) -> None:
            stream, body = self.rfile, _request_body(self)
            try:
                config = self.response_generator.paged_cache.manager.config
                _handling.salt = request_salt(body, self.headers,
                                              from_user=config.cache_salt_from_user)
            except SaltError as error:
                answer = error_body(error)
                self.send_response(400)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                return
            if body is not None:
                self.rfile = io.BytesIO(body)  # mlx_lm.server reads the body again
            try:
                super().do_POST()
            finally:
                self.rfile, _handling.salt = stream, None

    def paged_run_http_server(host: str, port: int, response_generator: Any,
                              server_class: Any = server.ThreadingHTTPServer,
                              handler_class: Any = PagedAPIHandler) -> None:
        try:
            run_http_server(host, port, response_generator, server_class=server_class,
                            handler_class=handler_class)
        except OSError as error:
            response_generator.stop_and_join()
            raise ServeError(f"HTTP server on {host}:{port} failed: {error}") from error

    paged_run_http_server.paged_base = run_http_server  # type: ignore[attr-defined]
    compat.set_server_hooks(compat.before_each_fetch(PagedResponseGenerator, before_fetch),
                            paged_run_http_server)


_handling = threading.local()  # the cache salt of the request an HTTP handler thread serves


def _request_body(handler: Any) -> bytes | None:
    """The body of the request ``handler`` serves (read: its stream is past it), or None when
    its Content-Length is missing or not a number (mlx_lm.server then answers the error)."""
    try:
        length = int(handler.headers.get("Content-Length", ""))
    except ValueError:
        return None
    return handler.rfile.read(length) if length >= 0 else None


def _load_default(provider: Any) -> None:
    """Load the server's default model now, on this thread; ServeError naming it if it fails."""
    try:
        provider.load_default()
    except Exception as error:  # noqa: BLE001 - any loader failure means: cannot serve
        model = getattr(getattr(provider, "cli_args", None), "model", None)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        why = _hub_miss(error) or first
        raise ServeError(f"--model {model!r} could not be loaded: {why}") from error


def _hub_miss(error: BaseException) -> str | None:
    """What to do when ``error`` says a Hugging Face id is neither reachable on the hub nor in
    its cache (no network, or HF_HUB_OFFLINE set); None for any other failure."""
    from huggingface_hub import constants
    from huggingface_hub.utils import LocalEntryNotFoundError

    chain, seen = [], error
    while seen is not None and len(chain) < 16:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if not any(isinstance(e, LocalEntryNotFoundError) for e in chain):
        return None
    cache = f"it is not in the hub's cache ({constants.HF_HUB_CACHE})"
    local = ("give a local mlx-lm model directory instead (`paged-cache make-model DIR --real "
             "smollm2` writes a small real one, `--arch llama` a tiny random one)")
    if constants.HF_HUB_OFFLINE:
        return f"HF_HUB_OFFLINE is set and {cache}; unset it to download the model, or {local}"
    cause = next((e for e in chain if not type(e).__module__.startswith("huggingface_hub")), None)
    reason = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    return (f"the Hugging Face hub at {constants.ENDPOINT} could not be reached{reason} and "
            f"{cache}; {local}, or download the model once where the hub is reachable "
            f"(HF_HUB_OFFLINE=1 then loads it from that cache with no network)")


def check_address(host: str, port: int) -> None:
    """Raise ServeError when ``host:port`` cannot be bound (in use, or ``host`` unresolvable),
    as mlx_lm.server would find out only after loading the model."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
            probe.bind(address)
    except OSError as error:
        raise ServeError(f"HTTP server on {host}:{port} failed: {error}") from error


def _server_address(server_argv: Sequence[str]) -> tuple[str, int]:
    """The --host / --port mlx_lm.server will use, read with its own parser (its defaults
    unless passed; a bad value exits as mlx_lm.server would)."""
    known, _ = compat.server_parser().parse_known_args(list(server_argv))
    return known.host, known.port


def serve_main(config: CacheConfig, server_argv: Sequence[str],
               metrics_port: int | None = None) -> int:
    """Run ``mlx_lm.server`` with ``server_argv`` and the tiered cache; returns the exit status.

    Fails fast, before anything is created on disk: the address is bound once to check it, the
    model is loaded, and only then is the manager (and its SSD directory) opened; each failure
    raises ServeError. Under ``mlx.launch`` (a model sharded over several ranks) every rank runs
    this: rank 0 checks the address and serves HTTP, the others log warnings and errors only.
    SIGTERM stops the server like Ctrl-C: the manager is flushed and closed on the way out, and
    the flush logged (INFO: blocks and bytes written per tier, see integrations.shutdown).
    mlx_lm.server's own argument errors exit (SystemExit 2) with its usage under the name
    ``paged-cache serve``. ``metrics_port``: every rank also answers the stats routes on
    ``--host`` at ``metrics_port + rank`` (ServeError at start when it cannot listen there).
    """
    from mlx_lm import server

    stopped: dict[str, str] = {}   # what stopped the server, for the line its flush logs

    def stop(_signum: int, _frame: Any) -> None:
        stopped["by"] = "SIGTERM"
        raise KeyboardInterrupt

    group = resolve_group(WORLD)  # under mlx.launch: every rank runs this, rank 0 serves HTTP
    histograms.set_process_labels(rank=group.rank() if group is not None else 0)
    if group is not None and group.rank() != 0:
        logging.getLogger("paged_cache").setLevel(logging.WARNING)  # rank 0 tells the story
    else:
        check_address(*_server_address(server_argv))
    previous = signal.signal(signal.SIGTERM, stop)
    argv = sys.argv
    serving: list[PagedPromptCache] = []  # this process's, once its generator is built
    try:
        with ExitStack() as stack:
            if metrics_port is not None:
                _metrics_endpoint(stack, group, _server_address(server_argv)[0], metrics_port,
                                  serving)
            def open_manager(provider: Any) -> PagedSSDCacheManager:
                try:
                    fitted = config.beside_model(model_bytes(provider))
                except ValueError as error:  # an explicit hot budget that cannot fit
                    raise ServeError(str(error)) from error
                try:
                    manager = PagedSSDCacheManager(fitted)
                except (OSError, ValueError) as error:  # ValueError: a bad ssd_dir, named
                    raise ServeError(f"cannot open the SSD tier at {config.ssd_dir}: {error}") \
                        from error
                stack.callback(lambda: close_logged(manager, stopped.get("by", "server stopped"),
                                                    logger))
                logger.info("serving with paged-cache: %s", _describe(fitted))
                histograms.set_process_labels(engine="mlx_lm", model=provider.cli_args.model)
                if config.remote_url and not config.remote_secret and not config.remote_insecure:
                    # loopback (another host is refused without a secret); the opt-out warns
                    # at each manager start itself
                    logger.warning("remote tier %s has no remote_secret: anyone who can write to "
                                   "that server can change what this server answers (set one on "
                                   "every host: docs/scaling.md)", config.remote_url.redacted())
                return manager

            patch_server(open_manager, load_first=True, on_cache=serving.append)
            sys.argv = ["paged-cache serve", *server_argv]
            try:
                server.main()
            except KeyboardInterrupt:
                stopped.setdefault("by", "Ctrl-C")
    finally:
        sys.argv = argv
        signal.signal(signal.SIGTERM, previous)
    return 0


def _metrics_endpoint(stack: ExitStack, group: Any, host: str, base: int,
                      serving: list[PagedPromptCache]) -> None:
    """This rank's own stats routes at ``base + rank`` on ``host`` (stopped with ``stack``),
    its metrics labelled with its rank; rank 0 logs every rank's address."""
    from paged_cache.integrations.shared import stats_http

    rank, size = (group.rank(), group.size()) if group is not None else (0, 1)
    try:
        endpoint = stats_http.start_rank_endpoint(
            host, base, rank, size, lambda: serving[0].stats() if serving else {},
            PagedPromptCache.STAT_GAUGES)
    except ValueError as error:
        raise ServeError(f"--metrics-port {base} (rank {rank}): {error}") from error
    stack.callback(endpoint.server_close)
    stack.callback(endpoint.shutdown)


def model_bytes(provider: Any) -> int:
    """Bytes of the weights the server's model provider holds (the model and a draft model)."""
    models = [getattr(provider, name, None) for name in ("model", "draft_model")]
    return sum(array.nbytes for model in models if model is not None
               for _, array in tree_flatten(model.parameters()))


def _describe(config: CacheConfig) -> str:
    where = "hot tier only" if config.hot_cache_only else f"SSD tier at {os.fspath(config.ssd_dir)}"
    return (f"block size {config.block_size}, hot tier {format_size(config.hot_cache_max_bytes)}, "
            f"{where}")
