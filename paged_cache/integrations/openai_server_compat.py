"""Every private name of mlx-openai-server that paged-cache relies on, checked once at import.

mlx-openai-server builds each language model's prompt cache inside ``MLXLMHandler.__init__``
(an ``LRUPromptCache`` of its own) and runs every handler in a process it spawns, whose entry
point is ``app.core.handler_process._handler_worker``; neither can be chosen by an option, so
paged-cache replaces those two names at run time (see ``paged_cache.integrations.openai_server``).
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
"""

from __future__ import annotations

import functools
import inspect
import queue
from importlib import metadata
from typing import Any, Callable

from paged_cache.compat import IncompatibleVersion
from paged_cache.install import install_command
from paged_cache.integrations.tenants import CURRENT_SALT, attach_salt, salt_of_args

DIST = "mlx-openai-server"
RANGE = (">=1.8.0", "<1.9")   # kept equal to the openai-server extra in pyproject.toml
EXTRA = "openai-server"   # paged-cache's extra that installs it
TEXT_METHODS = ("generate_text_stream", "generate_text_response")  # a language model's requests
QUEUE_NAME = "_admission_queue"   # BatchScheduler: requests submitted, not yet admitted
GENERATOR_NAME = "_batch_generator"  # BatchScheduler: its BatchGenerator, built in _run
CACHE_ATTR = "_prompt_cache"         # BatchScheduler: the prompt cache it fetches from
# MLXLMHandler: its single-request path's generation (a stream, a whole response), self.model(...)
SINGLE_METHODS = ("_stream_with_lock_and_cache_persist", "_generate_with_lock_and_cache_persist")


def _version() -> tuple[int, ...]:
    return tuple(int(p) for p in metadata.version(DIST).split(".")[:3] if p.isdigit())


def _bound(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.lstrip("<>=").split("."))


def _source(owner: Any, name: str) -> str:
    """The source of ``owner.name`` ('' when it is missing)."""
    member = getattr(owner, name, None)
    return inspect.getsource(member) if member is not None else ""


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
    missing += [f"MLXLMHandler.{m} calling self.model(...)" for m in SINGLE_METHODS
                if "self.model(" not in _source(handler, m)]
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


class _SaltedQueue(queue.Queue):
    """A BatchScheduler's admission queue that carries each request's salt: taken from the
    submitting task at ``put``, made current on the scheduler's thread at ``get`` (right before
    the scheduler fetches that request's cache; the next ``get`` replaces it)."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        attach_salt(item, CURRENT_SALT.get())
        super().put(item, block, timeout)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        CURRENT_SALT.set(salt_of_args(item))
        return item


def paged_batches(on_generator: Callable[[Any, Any], None]) -> None:
    """Make batch schedulers built from now on (in this process) carry salts in their admission
    queue, and hand the BatchGenerator each builds, with its prompt cache, to
    ``on_generator(generator, prompt_cache)`` (which may wrap its methods) before it runs."""

    def get_generator(scheduler: Any) -> Any:
        return scheduler.__dict__.get(GENERATOR_NAME)

    def set_generator(scheduler: Any, generator: Any) -> None:
        if generator is not None:
            on_generator(generator, getattr(scheduler, CACHE_ATTR, None))
        scheduler.__dict__[GENERATOR_NAME] = generator

    class PagedBatchScheduler(ORIGINAL_BATCHER):  # type: ignore[misc, valid-type]
        """mlx-openai-server's BatchScheduler whose admission queue carries salts and whose
        BatchGenerator is handed to ``on_generator`` as ``_run`` builds it."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            setattr(self, QUEUE_NAME, _SaltedQueue(getattr(self, QUEUE_NAME).maxsize))

    setattr(PagedBatchScheduler, GENERATOR_NAME, property(get_generator, set_generator))
    _handlers.BatchScheduler = PagedBatchScheduler


def observe_single_requests(handler: type, observe: Callable[[Any, Any], Any]) -> None:
    """Make ``handler`` (a subclass of MLXLMHandler) pass what its single-request path's
    generation returns (a stream of responses, or one response) through
    ``observe(handler_instance, returned)``, which returns what the handler gets instead."""
    for name in SINGLE_METHODS:
        original = getattr(handler, name)

        def observed(self: Any, *args: Any, _original: Callable[..., Any] = original,
                     **kwargs: Any) -> Any:
            return observe(self, _original(self, *args, **kwargs))

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
