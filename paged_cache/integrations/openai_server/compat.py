"""Every private name of mlx-openai-server that paged-cache relies on, checked once at import.

mlx-openai-server builds each language model's prompt cache inside ``MLXLMHandler.__init__``
(an ``LRUPromptCache`` of its own) and runs every handler in a process it spawns, whose entry
point is ``app.core.handler_process._handler_worker``; neither can be chosen by an option, so
paged-cache replaces those two names at run time (see ``paged_cache.integrations.openai_server.adapter``).
This module is the only one that touches them: at import it checks that the installed
mlx-openai-server is in the supported range, that each name exists and that the code still
reaches them (the proxy starts its process with ``target=_handler_worker``; handlers are made by
``create_handler_from_config`` through ``MLXLMHandler(...)``), and raises
``paged_cache.compat.IncompatibleVersion`` naming the range and what is missing otherwise.

Tenants' cache salts cross the same boundaries: in the server process a middleware goes on the
application ``app.main.setup_server`` builds, and ``HandlerProcessProxy.generate_text_stream`` /
``generate_text_response`` put the request's salt on the request object they send to the
handler process (``carry_salts``); there, each request runs in a task of its own
(``_handler_worker`` starts one per request), and the ``BatchScheduler`` the handler builds
takes the salt from submission to the fetch on its own thread (``paged_batches``: its admission
queue is ``_admission_queue``, filled by ``submit_stream`` and drained by ``_admit_pending``
right before it fetches).

The handler process prefills what a fetch did not cover in two places, each timed for the fetch
plan's prefill rate: the ``BatchGenerator`` the batch scheduler builds in ``_run`` (stored as
``_batch_generator``; ``paged_batches`` hands it, with the scheduler's ``_prompt_cache``, to be
measured) and, on the single-request path, mlx-lm's ``stream_generate`` called by the handler's
``_stream_with_lock_and_cache_persist`` / ``_generate_with_lock_and_cache_persist``
(``observe_single_requests`` passes what they return through an observer).

Shared prefills (``paged_batches`` with a gate, ``segment_batched_prompts``): the admission
queue's ``get`` is where a request is held back. A queued request is a ``_PendingRequest``
(``input_ids``, ``prompt_cache``, ``segments``, ``out_queue``); while it prefills, the scheduler
inserts its cache at the end of each segment (``_handle_prompt_responses``; the last one a
token short: ``insert_segments`` keeps one token to start generating), and every output for it
goes through ``BatchScheduler._send`` (its first token, an error, a cancellation), which tells
the gate its prompt is done. Requests still held when the scheduler stops are failed as its
``_drain_admission_queue`` fails the queued ones. The handler gives a batched request segments
only for models whose cache cannot be trimmed: ``MLXLMHandler._build_inference_context`` (which
calls the model's ``create_input_prompt(messages, chat_template_kwargs)``) splits it at
``_compute_checkpoint_boundary``, where the last user message begins; ``segment_batched_prompts``
does the same for every model.

Time to first token: the handler's entry (``generate_text_stream`` / ``generate_text_response``,
in the request's task) marks when a request arrived (``ARRIVED``), which the admission queue
carries to the batch scheduler's thread as it carries the salt; its first output through
``BatchScheduler._send`` (a chunk: it has a ``token``) and the single-request path's first
streamed response end it (``paged_batches``' ``first_output``, ``observe_single_requests``).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import queue
import threading
from contextvars import ContextVar
from dataclasses import fields
from importlib import metadata
from typing import Any, Callable, Protocol

from paged_cache.compat import IncompatibleVersion
from paged_cache.install import install_command
from paged_cache.integrations.shared.tenants import CURRENT_SALT, attach_salt, salt_of_args

logger = logging.getLogger("paged_cache.integrations.openai_server")

# When the request being served arrived in the handler process (time.perf_counter()): set in its
# task, made current on the batch scheduler's thread while it admits the request.
ARRIVED: ContextVar[float | None] = ContextVar("paged_cache_arrived", default=None)
ARRIVED_ATTR = "paged_cache_arrived"  # a queued request's ARRIVED, taken along like its salt
CHUNK_FIELD = "token"   # BatchChunk: what the scheduler sends a stream for each generated token

DIST = "mlx-openai-server"
RANGE = (">=1.8.0", "<1.9")   # kept equal to the openai-server extra in pyproject.toml
EXTRA = "openai-server"   # paged-cache's extra that installs it
TEXT_METHODS = ("generate_text_stream", "generate_text_response")  # a language model's requests
QUEUE_NAME = "_admission_queue"   # BatchScheduler: requests submitted, not yet admitted
GENERATOR_NAME = "_batch_generator"  # BatchScheduler: its BatchGenerator, built in _run
CACHE_ATTR = "_prompt_cache"         # BatchScheduler: the prompt cache it fetches from
# MLXLMHandler: its single-request path's generation (a stream, a whole response), self.model(...)
SINGLE_METHODS = ("_stream_with_lock_and_cache_persist", "_generate_with_lock_and_cache_persist")
SEND_NAME = "_send"                        # BatchScheduler: every output to a request's stream
DRAIN_NAME = "_drain_admission_queue"      # BatchScheduler: fails what is queued when it stops
PENDING_FIELDS = ("input_ids", "prompt_cache", "segments", "out_queue")  # _PendingRequest
BUILD_NAME = "_build_inference_context"    # MLXLMHandler: tokenizes a request, its segments
BOUNDARY_NAME = "_compute_checkpoint_boundary"  # MLXLMHandler: where the last user message begins
CONTEXT_FIELDS = ("cache_key", "batched_segments", "batched_segment_types")  # _InferenceContext


def _version() -> tuple[int, ...]:
    return tuple(int(p) for p in metadata.version(DIST).split(".")[:3] if p.isdigit())


def _bound(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.lstrip("<>=").split("."))


def _source(owner: Any, name: str) -> str:
    """The source of ``owner.name`` ('' when it is missing)."""
    member = getattr(owner, name, None)
    return inspect.getsource(member) if member is not None else ""


def _field_names(owner: Any) -> set[str]:
    try:
        return {f.name for f in fields(owner)}
    except TypeError:   # not a dataclass (or missing)
        return set()


def _sharing_missing(batching: Any, handlers: Any, batcher: Any, handler: Any) -> list[str]:
    """What shared prefills rely on that the installed mlx-openai-server lacks."""
    missing = []
    sends = [m for m in ("_admit_pending", "_handle_generation_response", "_fail_request",
                         "_process_cancellations") if f"self.{SEND_NAME}(" not in _source(batcher, m)]
    if not isinstance(inspect.getattr_static(batcher, SEND_NAME, None), staticmethod) or sends:
        missing.append(f"BatchScheduler sending every output through {SEND_NAME}")
    if f"self.{DRAIN_NAME}(" not in _source(batcher, "_run"):
        missing.append(f"BatchScheduler._run calling {DRAIN_NAME}")
    if "insert_cache(" not in _source(batcher, "_handle_prompt_responses") \
            or "insert_segments(" not in _source(batcher, "_admit_pending"):
        missing.append("BatchScheduler inserting the cache at each segment's end")
    if not set(PENDING_FIELDS) <= _field_names(getattr(batching, "_PendingRequest", None)):
        missing.append(f"_PendingRequest with {', '.join(PENDING_FIELDS)}")
    if not set(CONTEXT_FIELDS) <= _field_names(getattr(handlers, "_InferenceContext", None)):
        missing.append(f"_InferenceContext with {', '.join(CONTEXT_FIELDS)}")
    if "self.model.create_input_prompt(" not in _source(handler, BUILD_NAME) \
            or not callable(getattr(handler, BOUNDARY_NAME, None)) \
            or "_is_request_batchable" not in _source(handler, BUILD_NAME):
        missing.append(f"MLXLMHandler.{BUILD_NAME} with {BOUNDARY_NAME}")
    return missing


def _check() -> tuple[Any, Any, Any, Any, Any]:
    """The handler_process, handler.mlx_lm, batch_scheduler, main and cli modules, after checking
    version and names."""
    try:
        metadata.version(DIST)
    except metadata.PackageNotFoundError:
        raise IncompatibleVersion(f"{DIST} is not installed: {install_command(EXTRA)}") from None
    from app import cli, main, server
    from app.core import batch_scheduler, handler_process
    from app.handler import mlx_lm

    missing = []
    if not callable(getattr(handler_process, "_handler_worker", None)):
        missing.append("app.core.handler_process._handler_worker")
    elif "create_task(_handle_request(" not in _source(handler_process, "_handler_worker"):
        missing.append("_handler_worker running each request in a task of its own")
    proxy = getattr(handler_process, "HandlerProcessProxy", None)
    if proxy is None or "target=_handler_worker" not in inspect.getsource(proxy):
        missing.append("HandlerProcessProxy starting its process with target=_handler_worker")
    handler = getattr(mlx_lm, "MLXLMHandler", None)
    if handler is None or "prompt_cache" not in inspect.getsource(handler.__init__):
        missing.append("app.handler.mlx_lm.MLXLMHandler building self.prompt_cache")
    for owner in (proxy, handler):
        missing += [f"{getattr(owner, '__name__', owner)}.{m}" for m in TEXT_METHODS
                    if not callable(getattr(owner, m, None))]
    if "BatchScheduler(" not in _source(handler, "_get_or_start_scheduler"):
        missing.append("MLXLMHandler._get_or_start_scheduler making BatchScheduler(...)")
    batcher = getattr(batch_scheduler, "BatchScheduler", None)
    if getattr(mlx_lm, "BatchScheduler", None) is not batcher or batcher is None \
            or f"self.{QUEUE_NAME}" not in _source(batcher, "__init__") \
            or f"self.{QUEUE_NAME}.put" not in _source(batcher, "submit_stream") \
            or f"self.{QUEUE_NAME}.get(" not in _source(batcher, "_admit_pending") \
            or "fetch_nearest_cache(" not in _source(batcher, "_admit_pending"):
        missing.append(f"BatchScheduler submitting through {QUEUE_NAME} and fetching on admission")
    if f"self.{GENERATOR_NAME} = BatchGenerator(" not in _source(batcher, "_run") \
            or f"self.{GENERATOR_NAME}.next()" not in _source(batcher, "_run") \
            or f"self.{CACHE_ATTR} = " not in _source(batcher, "__init__"):
        missing.append(f"BatchScheduler._run building self.{GENERATOR_NAME} = BatchGenerator(...)")
    missing += [f"MLXLMHandler.{m}(cache_key, ...) calling self.model(...)"
                for m in SINGLE_METHODS if "self.model(" not in _source(handler, m)
                or list(inspect.signature(getattr(handler, m)).parameters)[1:2] != ["cache_key"]]
    missing += _sharing_missing(batch_scheduler, mlx_lm, batcher, handler)
    factory = getattr(server, "create_handler_from_config", None)
    if factory is None or "MLXLMHandler(" not in inspect.getsource(factory):
        missing.append("app.server.create_handler_from_config making MLXLMHandler(...)")
    if not callable(getattr(main, "setup_server", None)) \
            or "setup_server(" not in _source(main, "start_multi"):
        missing.append("app.main.start_multi calling setup_server(...)")
    if not callable(getattr(cli, "cli", None)):
        missing.append("app.cli.cli")
    low, high = (_bound(b) for b in RANGE)
    if missing or not low <= _version() < high:
        what = f"lacks {', '.join(missing)}" if missing else "is outside it"
        raise IncompatibleVersion(
            f"paged-cache's mlx-openai-server adapter supports {DIST}{','.join(RANGE)}; the "
            f"installed {DIST} {metadata.version(DIST)} {what}. Install a supported one: "
            f"{install_command(EXTRA)}")
    return handler_process, mlx_lm, batch_scheduler, main, cli


_process, _handlers, _batching, _main, _cli = _check()
ORIGINAL_WORKER: Callable[..., None] = _process._handler_worker
ORIGINAL_HANDLER: type = _handlers.MLXLMHandler
ORIGINAL_SETUP: Callable[[Any], Any] = _main.setup_server
ORIGINAL_PROXY_METHODS = {m: getattr(_process.HandlerProcessProxy, m) for m in TEXT_METHODS}
ORIGINAL_BATCHER: type = _batching.BatchScheduler


def set_worker(worker: Callable[..., None]) -> None:
    """Start every handler process from now on with ``worker`` (called with the arguments
    ``_handler_worker`` takes; it must be picklable: the processes are spawned)."""
    _process._handler_worker = worker


def set_handler_class(handler: type) -> None:
    """Make language-model handlers created from now on (in this process) ``handler``."""
    _handlers.MLXLMHandler = handler


def restore() -> None:
    """mlx-openai-server's own worker, handler class, server setup, proxy methods and batch
    scheduler again (in this process)."""
    set_worker(ORIGINAL_WORKER)
    set_handler_class(ORIGINAL_HANDLER)
    _main.setup_server = ORIGINAL_SETUP
    for name, method in ORIGINAL_PROXY_METHODS.items():
        setattr(_process.HandlerProcessProxy, name, method)
    _handlers.BatchScheduler = ORIGINAL_BATCHER


def carry_salts(middleware: type, **options: Any) -> None:
    """In the server process: the application gets ``middleware`` (with ``options``; it sets
    ``CURRENT_SALT`` for each HTTP request), and each language-model request sent to a handler
    process carries that salt (``attach_salt``; any value the client put there is replaced)."""

    @functools.wraps(ORIGINAL_SETUP)
    def setup_server(config: Any) -> Any:
        uvicorn_config = ORIGINAL_SETUP(config)
        uvicorn_config.app = middleware(uvicorn_config.app, **options)
        return uvicorn_config

    _main.setup_server = setup_server
    for name, method in ORIGINAL_PROXY_METHODS.items():
        setattr(_process.HandlerProcessProxy, name, _sending_salt(method))


def _sending_salt(method: Callable[..., Any]) -> Callable[..., Any]:
    """The proxy's ``method`` (returning a coroutine or an async generator), putting the current
    salt on the request before it is sent."""

    @functools.wraps(method)
    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        attach_salt(request, CURRENT_SALT.get())
        return method(self, request, *args, **kwargs)

    return send


class Gate(Protocol):
    """What holds requests back at a batch scheduler's admission (``SharedPrefills``): it sees
    each queued request as ``(request, its output stream, request)``."""

    def next(self, poll: Callable[[float | None], Any], timeout: float | None) -> Any: ...

    def prompt_done(self, request: Any) -> None: ...

    def requeue(self, put: Callable[[Any], None]) -> None: ...


class _AdmissionQueue(queue.Queue):
    """A BatchScheduler's admission queue that carries each request's salt (taken from the
    submitting task at ``put``, made current on the scheduler's thread at ``get``, right before
    the scheduler fetches that request's cache) and, with a ``gate``, lets it hold requests back:
    ``get`` hands over what the gate lets go (``queue.Empty`` when nothing)."""

    def __init__(self, maxsize: int, gate: Gate | None) -> None:
        super().__init__(maxsize)
        self.gate = gate
        self.prompts: dict[int, list[int]] = {}  # id of a stream -> its prompt, until it outputs

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        attach_salt(item, CURRENT_SALT.get())
        setattr(item, ARRIVED_ATTR, ARRIVED.get())
        self.prompts[id(item.out_queue)] = list(item.input_ids)
        super().put(item, block, timeout)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout) if self.gate is None else self._gated(block, timeout)
        CURRENT_SALT.set(salt_of_args(item))
        ARRIVED.set(getattr(item, ARRIVED_ATTR, None))
        return item

    def _gated(self, block: bool, timeout: float | None) -> Any:
        polled: list[Any] = []

        def poll(wait: float | None) -> Any:   # the gate's poll: None means do not wait
            try:
                item = queue.Queue.get(self, wait is not None, wait)
            except queue.Empty:
                return None
            polled.append(item)
            return item, item.out_queue, item

        wait = (threading.TIMEOUT_MAX if timeout is None else timeout) if block else None
        try:
            queued = self.gate.next(poll, wait)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - never into the scheduler's loop: admit it as it came
            logger.exception("shared prefills: admission failed; the request goes on unheld")
            queued = (polled[-1],) if polled else None
        if queued is None:
            raise queue.Empty
        return queued[0]


def queued_prompt(item: Any) -> tuple[list[int], list[int]] | None:
    """A request in a BatchScheduler's admission queue: its prompt and the ends before the
    prompt's end where the scheduler will insert its cache while prefilling it (each segment's
    end, the last one's a token short); None when it brings a cache of its own."""
    if item.prompt_cache is not None:
        return None
    tokens = list(item.input_ids)
    ends = list(itertools.accumulate(len(s) for s in item.segments or [tokens]))
    ends[-1] -= 1   # insert_segments keeps the prompt's last token to start generating
    return tokens, sorted({e for e in ends if 0 < e < len(tokens)})


def paged_batches(on_generator: Callable[[Any, Any], None],
                  gate_of: Callable[[Any], Gate | None] = lambda _cache: None,
                  first_output: Callable[[Any, list[int]], None] = lambda _c, _p: None) -> None:
    """Make batch schedulers built from now on (in this process) carry salts and arrival times
    in their admission queue, hold requests back with ``gate_of(prompt_cache)`` (None: none
    held; the gate is told when a request's prompt is done, at its first output), tell
    ``first_output(prompt_cache, prompt)`` when a request's first token goes out (an error, or
    a cancellation first: not told; an error in it is logged), and hand the BatchGenerator
    each builds, with its prompt cache, to ``on_generator(generator, prompt_cache)`` (which may
    wrap its methods) before it runs."""

    def get_generator(scheduler: Any) -> Any:
        return scheduler.__dict__.get(GENERATOR_NAME)

    def set_generator(scheduler: Any, generator: Any) -> None:
        if generator is not None:
            on_generator(generator, getattr(scheduler, CACHE_ATTR, None))
        scheduler.__dict__[GENERATOR_NAME] = generator

    send, drain = getattr(ORIGINAL_BATCHER, SEND_NAME), getattr(ORIGINAL_BATCHER, DRAIN_NAME)

    class PagedBatchScheduler(ORIGINAL_BATCHER):  # type: ignore[misc, valid-type]
        """mlx-openai-server's BatchScheduler whose admission queue carries salts and may hold
        requests back, and whose BatchGenerator is handed to ``on_generator`` as ``_run`` builds
        it."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.paged_gate = gate_of(getattr(self, CACHE_ATTR, None))
            setattr(self, QUEUE_NAME,
                    _AdmissionQueue(getattr(self, QUEUE_NAME).maxsize, self.paged_gate))

    def send_output(self: Any, loop: Any, stream: Any, item: Any) -> None:
        if self.paged_gate is not None:
            self.paged_gate.prompt_done(stream)
        prompt = getattr(self, QUEUE_NAME).prompts.pop(id(stream), None)
        if prompt is not None and hasattr(item, CHUNK_FIELD):
            try:
                first_output(getattr(self, CACHE_ATTR, None), prompt)
            except Exception:  # noqa: BLE001 - never into the scheduler's loop
                logger.exception("time to first token not observed")
        send(loop, stream, item)

    def fail_held(self: Any, error: BaseException) -> None:
        if self.paged_gate is not None:
            self.paged_gate.requeue(lambda queued: self._fail_request(queued[0], error))
        drain(self, error)

    setattr(PagedBatchScheduler, GENERATOR_NAME, property(get_generator, set_generator))
    setattr(PagedBatchScheduler, SEND_NAME, send_output)
    setattr(PagedBatchScheduler, DRAIN_NAME, fail_held)
    _handlers.BatchScheduler = PagedBatchScheduler


# (messages, chat template arguments) of the model's create_input_prompt calls in this task, while
# segment_batched_prompts watches them
_PROMPTS: ContextVar[list[tuple[Any, Any]] | None] = ContextVar("paged_cache_prompts",
                                                                default=None)


def segment_batched_prompts(handler: type, wanted: Callable[[Any], bool]) -> None:
    """Make ``handler`` (a subclass of MLXLMHandler) split a batched request's prompt where its
    last user message begins (e.g. at the end of a system prompt), as the handler does itself
    for models whose cache cannot be trimmed, when ``wanted(handler_instance)``: the batch
    scheduler then inserts the cache there while it prefills. Errors leave the request as the
    handler built it."""
    original = getattr(handler, BUILD_NAME)

    @functools.wraps(original)
    async def build(self: Any, request: Any) -> Any:
        if not wanted(self) or not self._is_request_batchable(request):
            return await original(self, request)
        seen: list[tuple[Any, Any]] = []
        token = _PROMPTS.set(seen)
        try:
            ctx = await original(self, request)
        finally:
            _PROMPTS.reset(token)
        if ctx.batched_segments is not None or not seen:
            return ctx
        try:
            tokens = list(ctx.cache_key)
            at = getattr(self, BOUNDARY_NAME)(seen[0][0], tokens, seen[0][1])
        except Exception:  # noqa: BLE001 - the request goes on unsplit
            logger.exception("shared prefills: cannot find where the last user message begins")
            return ctx
        if at is not None and 0 < at < len(tokens):
            ctx.batched_segments = [tokens[:at], tokens[at:]]
            ctx.batched_segment_types = ["system", "assistant"]
        return ctx

    setattr(handler, BUILD_NAME, build)


def watch_prompts(handler: Any) -> None:
    """Make the model of ``handler`` (an MLXLMHandler) report its ``create_input_prompt`` calls
    to ``segment_batched_prompts``."""
    lm = handler.model
    make = lm.create_input_prompt

    @functools.wraps(make)
    def create_input_prompt(messages: Any, chat_template_kwargs: Any) -> Any:
        seen = _PROMPTS.get()
        if seen is not None:
            seen.append((messages, chat_template_kwargs))
        return make(messages, chat_template_kwargs)

    lm.create_input_prompt = create_input_prompt


def observe_single_requests(handler: type, observe: Callable[[Any, list[int], Any], Any]) -> None:
    """Make ``handler`` (a subclass of MLXLMHandler) pass what its single-request path's
    generation returns (a stream of responses, or one response) through
    ``observe(handler_instance, prompt, returned)``, which returns what the handler gets
    instead; ``prompt``: the request's prompt tokens (its ``cache_key``, copied)."""
    for name in SINGLE_METHODS:
        original = getattr(handler, name)

        def observed(self: Any, cache_key: list[int], *args: Any,
                     _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            return observe(self, list(cache_key), _original(self, cache_key, *args, **kwargs))

        setattr(handler, name, functools.wraps(original)(observed))


def handler_model(handler: Any) -> tuple[Any, Any, Callable[[], list], str]:
    """What a language-model handler serves: (model, draft model or None, the function building
    its cache list, the model path)."""
    lm = handler.model
    return lm.model, getattr(lm, "draft_model", None), lm.create_prompt_cache, handler.model_path


def run_cli(argv: list[str]) -> int:
    """Run mlx-openai-server's command line (``launch ...``); its exit status."""
    try:
        _cli.cli.main(args=argv, prog_name="mlx-openai-server", standalone_mode=True)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0
