"""Every private name of vllm-mlx that paged-cache relies on, checked once at import.

vllm-mlx's continuous-batching ``Scheduler`` builds its prefix cache itself
(``MemoryAwarePrefixCache(model=..., config=...)``, a name it looks up in its own module) and has
no option to pick another class, so paged-cache's adapter goes in by replacing names of
``vllm_mlx.scheduler`` at run time (``install``). Tenants' cache salts reach the cache through
three more (``carry_salts``): a middleware on ``vllm_mlx.server.app``, the ``Request`` class
``EngineCore.add_request`` builds (made in the HTTP request's task, so it can take the salt
along) and ``Scheduler.add_request`` (which fetches the cache on the engine's worker thread);
``api.utils.resolve_mllm_route``, by which ``vllm-mlx serve`` picks the vision path, is watched.
The Scheduler prefills in the BatchGenerator ``Scheduler._create_batch_generator`` builds, which
is handed over with the Scheduler's ``memory_aware_cache`` to be measured and to have its prompts
split at their chat prefix (``on_batch_generator``). Requests sharing a prefix another is
prefilling are kept out of ``Scheduler._schedule_waiting`` (its ``waiting`` queue, by identity)
and admitted again later, out of its ``waiting`` and ``requests`` (``hold_back``, ``readmit``);
a request's ``prefix_boundary`` (the prompt before its last user message), ``request_id`` and
``output_token_ids`` are read, and its ``arrival_time`` and ``first_token_time`` (which
``Scheduler._process_batch_responses`` sets) after each step, for the time to first token
(``after_responses``).
This module is the only one that touches them: at import it checks that the installed vllm-mlx
is in the supported range and still has each name (and that the code still reaches them:
``Scheduler.__init__`` constructs the cache through the first, ``EngineCore.add_request``
builds a ``Request(...)``, ``Scheduler.add_request`` fetches the cache), and raises
``paged_cache.compat.IncompatibleVersion`` naming the range and what is missing otherwise.
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from contextvars import ContextVar
from importlib import metadata
from typing import Any, Callable

from paged_cache.compat import IncompatibleVersion
from paged_cache.install import install_command
from paged_cache.integrations.shared.tenants import CURRENT_SALT, attach_salt, salt_of_args

logger = logging.getLogger("paged_cache.integrations.vllm_mlx")

DIST = "vllm-mlx"
RANGE = (">=0.6.0", "<0.7")   # kept equal to the vllm-mlx extra in pyproject.toml
EXTRA = "vllm-mlx"   # paged-cache's extra that installs it

# vllm_mlx.scheduler names the adapter replaces (see install) or reads.
CACHE_NAME = "MemoryAwarePrefixCache"     # the class Scheduler.__init__ builds its cache from
REFRESH_NAME = "SNAPSHOT_REFRESH_TOKENS"  # Scheduler: prompt growth before a snapshot is re-taken
BOUND_NAME = "_bound_cache_layers"        # Scheduler: its --max-kv-size rule for a cache list
ADD_NAME = "add_request"                  # Scheduler: admits a request, fetching its cache
FETCH_CALL = "memory_aware_cache.fetch("  # ... as it does in add_request
REQUEST_NAME = "Request"                  # vllm_mlx.engine_core: what EngineCore builds
ROUTE_NAME = "resolve_mllm_route"         # vllm_mlx.api.utils: text or vision path, at serve
CREATE_NAME = "_create_batch_generator"   # Scheduler: builds the BatchGenerator that prefills
CACHE_ATTR = "memory_aware_cache"         # Scheduler: the prefix cache it built (CACHE_NAME)
SCHEDULE_NAME = "_schedule_waiting"       # Scheduler: moves its waiting requests into the batch
WAITING_ATTR = "waiting"                  # Scheduler: its queue of waiting requests (a deque)
REQUESTS_ATTR = "requests"                # Scheduler: request id -> request, until it ends
RESPONSES_NAME = "_process_batch_responses"  # Scheduler: a step's outputs, first tokens timed
# Request fields read (vllm_mlx.request.Request, a dataclass)
REQUEST_FIELDS = ("request_id", "prefix_boundary", "output_token_ids", "arrival_time",
                  "first_token_time")


def _version() -> tuple[int, ...]:
    return tuple(int(p) for p in metadata.version(DIST).split(".")[:3] if p.isdigit())


def _bound(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.lstrip("<>=").split("."))


def _fail(missing: list[str]) -> IncompatibleVersion:
    what = f"lacks {', '.join(missing)}" if missing else "is outside it"
    return IncompatibleVersion(
        f"paged-cache's vllm-mlx adapter supports {DIST}{','.join(RANGE)}; the installed {DIST} "
        f"{metadata.version(DIST)} {what}. Install a supported one: {install_command(EXTRA)}")


def _check() -> tuple[Any, Any, Any, Any]:
    """The vllm_mlx.scheduler, engine_core, server and api.utils modules, after checking version
    and names."""
    try:
        metadata.version(DIST)
    except metadata.PackageNotFoundError:
        raise IncompatibleVersion(f"{DIST} is not installed: {install_command(EXTRA)}") from None
    from vllm_mlx import cli, engine_core, scheduler, server
    from vllm_mlx.api import utils

    missing = []
    original = getattr(scheduler, CACHE_NAME, None)
    if original is None:
        missing.append(f"vllm_mlx.scheduler.{CACHE_NAME}")
    elif list(inspect.signature(original).parameters)[:2] != ["model", "config"]:
        missing.append(f"{CACHE_NAME}(model, config)")
    sched = getattr(scheduler, "Scheduler", None)
    if sched is None:
        missing.append("vllm_mlx.scheduler.Scheduler")
    else:
        if not isinstance(getattr(sched, REFRESH_NAME, None), int):
            missing.append(f"Scheduler.{REFRESH_NAME}")
        if not callable(getattr(sched, BOUND_NAME, None)):
            missing.append(f"Scheduler.{BOUND_NAME}")
        if f"{CACHE_NAME}(" not in inspect.getsource(sched.__init__):
            missing.append(f"Scheduler.__init__ building its cache with {CACHE_NAME}(...)")
        if f"self.{CACHE_ATTR} = {CACHE_NAME}(" not in inspect.getsource(sched.__init__):
            missing.append(f"Scheduler.__init__ keeping its cache as self.{CACHE_ATTR}")
        create = getattr(sched, CREATE_NAME, None)
        if create is None or "BatchGenerator(" not in inspect.getsource(create) \
                or f"self.batch_generator = self.{CREATE_NAME}(" not in inspect.getsource(
                    getattr(sched, "_ensure_batch_generator", create)):
            missing.append(f"Scheduler.{CREATE_NAME} building its BatchGenerator")
        add = getattr(sched, ADD_NAME, None)
        if add is None or FETCH_CALL not in inspect.getsource(add):
            missing.append(f"Scheduler.{ADD_NAME} fetching the cache ({FETCH_CALL}...)")
        elif f"self.{REQUESTS_ATTR}[request.request_id] = request" not in inspect.getsource(add) \
                or f"self.{WAITING_ATTR}.append(request)" not in inspect.getsource(add):
            missing.append(f"Scheduler.{ADD_NAME} queueing the request in self.{REQUESTS_ATTR} "
                           f"and self.{WAITING_ATTR}")
        schedule = getattr(sched, SCHEDULE_NAME, None)
        if schedule is None or f"self.{WAITING_ATTR}.popleft()" not in inspect.getsource(schedule):
            missing.append(f"Scheduler.{SCHEDULE_NAME} taking requests from self.{WAITING_ATTR}")
        responses = getattr(sched, RESPONSES_NAME, None)
        if responses is None or "first_token_time =" not in inspect.getsource(responses):
            missing.append(f"Scheduler.{RESPONSES_NAME} setting a request's first_token_time")
    core = getattr(engine_core, "EngineCore", None)
    if not isinstance(getattr(engine_core, REQUEST_NAME, None), type) or core is None \
            or f"{REQUEST_NAME}(" not in inspect.getsource(core.add_request):
        missing.append(f"vllm_mlx.engine_core.EngineCore.add_request building "
                       f"{REQUEST_NAME}(...)")
    fields = getattr(getattr(engine_core, REQUEST_NAME, None), "__dataclass_fields__", {})
    missing += [f"Request.{name}" for name in REQUEST_FIELDS if name not in fields]
    if not callable(getattr(getattr(server, "app", None), "add_middleware", None)):
        missing.append("vllm_mlx.server.app (a FastAPI application)")
    if not callable(getattr(cli, "main", None)):
        missing.append("vllm_mlx.cli.main")
    if not callable(getattr(utils, ROUTE_NAME, None)) \
            or f"{ROUTE_NAME}(" not in inspect.getsource(cli):
        missing.append(f"vllm_mlx.cli choosing its path with api.utils.{ROUTE_NAME}(...)")
    low, high = (_bound(b) for b in RANGE)
    if missing or not low <= _version() < high:
        raise _fail(missing)
    return scheduler, engine_core, server, utils


_scheduler, _engine_core, _server, _utils = _check()
ORIGINAL_CACHE = getattr(_scheduler, CACHE_NAME)
ORIGINAL_REFRESH = getattr(_scheduler.Scheduler, REFRESH_NAME)
ORIGINAL_ADD = getattr(_scheduler.Scheduler, ADD_NAME)
ORIGINAL_CREATE = getattr(_scheduler.Scheduler, CREATE_NAME)
ORIGINAL_SCHEDULE = getattr(_scheduler.Scheduler, SCHEDULE_NAME)
ORIGINAL_RESPONSES = getattr(_scheduler.Scheduler, RESPONSES_NAME)
# The request Scheduler.add_request is admitting (its cache fetch sees it), else None.
ADMITTING: ContextVar[Any] = ContextVar("paged_cache_vllm_mlx_admitting", default=None)
ORIGINAL_REQUEST: type = getattr(_engine_core, REQUEST_NAME)
ORIGINAL_ROUTE: Callable[..., Any] = getattr(_utils, ROUTE_NAME)


class SaltedRequest(ORIGINAL_REQUEST):  # type: ignore[misc, valid-type]
    """vllm-mlx's ``Request``, carrying the cache salt of the HTTP request it is made for
    (``CURRENT_SALT`` where ``EngineCore.add_request`` builds it, in that request's task)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        attach_salt(self, CURRENT_SALT.get())


def _add_request(scheduler: Any, request: Any) -> Any:
    """``Scheduler.add_request`` with the request's salt current while it fetches the request's
    cache (on the engine's worker thread, which the HTTP request's context does not reach), and
    the request itself (``ADMITTING``)."""
    token = CURRENT_SALT.set(salt_of_args(request))
    admitting = ADMITTING.set(request)
    try:
        return ORIGINAL_ADD(scheduler, request)
    finally:
        ADMITTING.reset(admitting)
        CURRENT_SALT.reset(token)


def install(cache_class: type, refresh_tokens: int) -> None:
    """Make every Scheduler built from now on use ``cache_class`` for its prefix cache and re-take
    its prompt snapshot once a prompt grew by ``refresh_tokens`` past what the cache served."""
    setattr(_scheduler, CACHE_NAME, cache_class)
    setattr(_scheduler.Scheduler, REFRESH_NAME, refresh_tokens)


def on_batch_generator(on_generator: Callable[[Any, Any], None]) -> None:
    """Hand every BatchGenerator a Scheduler builds from now on, with that Scheduler's prefix
    cache, to ``on_generator(generator, cache)`` (which may wrap its methods) before it runs."""

    def create(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        generator = ORIGINAL_CREATE(scheduler, *args, **kwargs)
        on_generator(generator, getattr(scheduler, CACHE_ATTR, None))
        return generator

    setattr(_scheduler.Scheduler, CREATE_NAME, create)


def hold_back(held: Callable[[Any, Any], list]) -> None:
    """Make every Scheduler's rounds of admission (``_schedule_waiting``) leave out the waiting
    requests ``held(scheduler, its prefix cache)`` names (asked first, on the engine's worker
    thread; it may ``readmit`` requests): they stay at the head of the queue, in their order.
    An error in ``held`` is logged, and the round holds nothing back."""

    def schedule(scheduler: Any) -> Any:
        try:
            ids = {id(r) for r in held(scheduler, getattr(scheduler, CACHE_ATTR, None))}
        except Exception:  # noqa: BLE001 - never into the engine's loop
            logger.exception("shared prefills: the round goes on without holding requests back")
            ids = set()
        waiting = getattr(scheduler, WAITING_ATTR)
        kept = [r for r in waiting if id(r) in ids]
        if kept:
            _keep_only(waiting, lambda r: id(r) not in ids)
        try:
            return ORIGINAL_SCHEDULE(scheduler)
        finally:
            waiting.extendleft(reversed(kept))

    setattr(_scheduler.Scheduler, SCHEDULE_NAME, schedule)


def after_responses(observe: Callable[[Any, Any], None]) -> None:
    """Call ``observe(scheduler, its prefix cache)`` after every Scheduler has turned a step's
    responses into outputs (on the engine's worker thread), when the requests that got their
    first token have its time set. An error in ``observe`` is logged, never raised."""

    def responses(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        out = ORIGINAL_RESPONSES(scheduler, *args, **kwargs)
        try:
            observe(scheduler, getattr(scheduler, CACHE_ATTR, None))
        except Exception:  # noqa: BLE001 - never into the engine's loop
            logger.exception("time to first token not observed")
        return out

    setattr(_scheduler.Scheduler, RESPONSES_NAME, responses)


def first_token_seconds(request: Any) -> float | None:
    """The seconds from ``request``'s arrival to its first token, as vllm-mlx timed them (None
    before its first token)."""
    if request.first_token_time is None:
        return None
    return max(0.0, request.first_token_time - request.arrival_time)


def _keep_only(queue: deque, keep: Callable[[Any], bool]) -> None:
    """Drop from ``queue`` (in place, its order kept) what ``keep`` refuses; compared by
    identity (a Request's ``==`` compares every field)."""
    kept = [r for r in queue if keep(r)]
    queue.clear()
    queue.extend(kept)


def readmit(scheduler: Any, request: Any) -> bool:
    """Admit a waiting ``request`` to ``scheduler`` again (``Scheduler.add_request``, so its
    cache is fetched again), at the back of its queue; False when it no longer waits (aborted).
    If the admission raises, the request waits again as it was (logged)."""
    waiting, requests = getattr(scheduler, WAITING_ATTR), getattr(scheduler, REQUESTS_ATTR)
    if requests.get(request.request_id) is not request or not any(r is request for r in waiting):
        return False
    _keep_only(waiting, lambda r: r is not request)
    del requests[request.request_id]
    try:
        _add_request(scheduler, request)
    except Exception:  # noqa: BLE001 - never into the engine's loop
        logger.exception("request %s: admitted again failed; it goes on as first admitted",
                         request.request_id)
        requests[request.request_id] = request
        if not any(r is request for r in waiting):
            waiting.append(request)
    return True


def prompt_done(scheduler: Any, request: Any) -> bool:
    """Whether ``request``'s prompt is processed (it has a token out) or never will be (it
    left ``scheduler``: finished or aborted)."""
    return (getattr(scheduler, REQUESTS_ATTR).get(request.request_id) is not request
            or bool(request.output_token_ids))


def prefix_boundary(request: Any) -> int:
    """The tokens of ``request``'s prompt before its last user message (vllm-mlx computes it
    for chats; 0: none)."""
    return request.prefix_boundary or 0


def splits_prompts(generator: Any) -> bool:
    """Whether ``generator`` (the Scheduler's BatchGenerator) takes prompts in segments and stops
    at their ends: mlx-lm's ``insert_segments``. On such a generator vllm-mlx's chunked prefill
    (``--chunked-prefill-tokens``) only sets its ``prefill_step_size``, which keeps that."""
    return callable(getattr(generator, "insert_segments", None))


def carry_salts(middleware: type, on_vision: Callable[[], None], **options: Any) -> None:
    """Make each HTTP request's cache salt reach the cache fetch it causes: ``middleware`` (with
    ``options``; it sets ``CURRENT_SALT``) wraps vllm-mlx's application, requests built from now
    on carry the salt (``SaltedRequest``) and the Scheduler fetches under it. ``on_vision()`` is
    called when ``vllm-mlx serve`` routes its model to the vision path (whose own scheduler and
    cache this does not reach), before the model loads; it may raise to stop the start."""
    _drop_middleware()
    _server.app.add_middleware(middleware, **options)
    _added.append(middleware)
    setattr(_engine_core, REQUEST_NAME, SaltedRequest)
    setattr(_scheduler.Scheduler, ADD_NAME, _add_request)

    def route(*args: Any, **kwargs: Any) -> Any:
        chosen = ORIGINAL_ROUTE(*args, **kwargs)
        if chosen.is_mllm:
            on_vision()
        return chosen

    setattr(_utils, ROUTE_NAME, route)


_added: list[type] = []   # the middleware carry_salts put on vllm-mlx's application


def _drop_middleware() -> None:
    """Take the middleware carry_salts added off vllm-mlx's application (before it serves)."""
    app = _server.app
    app.user_middleware[:] = [m for m in app.user_middleware if m.cls not in _added]
    _added.clear()


def uninstall() -> None:
    """Put vllm-mlx's own cache class, snapshot interval, Request class, admission, rounds of
    admission, response processing and BatchGenerator back, and its application without the
    salt middleware."""
    install(ORIGINAL_CACHE, ORIGINAL_REFRESH)
    setattr(_scheduler.Scheduler, CREATE_NAME, ORIGINAL_CREATE)
    setattr(_engine_core, REQUEST_NAME, ORIGINAL_REQUEST)
    setattr(_scheduler.Scheduler, ADD_NAME, ORIGINAL_ADD)
    setattr(_scheduler.Scheduler, SCHEDULE_NAME, ORIGINAL_SCHEDULE)
    setattr(_scheduler.Scheduler, RESPONSES_NAME, ORIGINAL_RESPONSES)
    setattr(_utils, ROUTE_NAME, ORIGINAL_ROUTE)
    _drop_middleware()


def layout(model: Any, max_kv_size: int | None) -> list:
    """The cache list the Scheduler builds for a request on ``model``: mlx-lm's
    ``make_prompt_cache``, bounded by the Scheduler's own rule when ``--max-kv-size`` is set."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    return getattr(_scheduler.Scheduler, BOUND_NAME)(cache, max_kv_size) if max_kv_size else cache


def memory_limit_bytes(config: Any) -> int | None:
    """The byte budget a vllm-mlx ``MemoryCacheConfig`` asks for (``--cache-memory-mb`` /
    ``--cache-memory-percent``), None without a config."""
    return None if config is None else int(config.compute_memory_limit())


def run_cli(argv: list[str]) -> None:
    """Run vllm-mlx's command line (``vllm-mlx serve ...``) with ``argv`` (without the program)."""
    import sys

    from vllm_mlx import cli

    saved = sys.argv
    sys.argv = ["vllm-mlx", *argv]
    try:
        cli.main()
    finally:
        sys.argv = saved
