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
"""

from __future__ import annotations

import inspect
from importlib import metadata
from typing import Any, Callable

from paged_cache.compat import IncompatibleVersion
from paged_cache.install import install_command

DIST = "mlx-openai-server"
RANGE = (">=1.8.0", "<1.9")   # kept equal to the openai-server extra in pyproject.toml
EXTRA = "openai-server"   # paged-cache's extra that installs it


def _version() -> tuple[int, ...]:
    return tuple(int(p) for p in metadata.version(DIST).split(".")[:3] if p.isdigit())


def _bound(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.lstrip("<>=").split("."))


def _check() -> tuple[Any, Any, Any]:
    """The handler_process, handler.mlx_lm and cli modules, after checking version and names."""
    try:
        metadata.version(DIST)
    except metadata.PackageNotFoundError:
        raise IncompatibleVersion(f"{DIST} is not installed: {install_command(EXTRA)}") from None
    from app import cli, server
    from app.core import handler_process
    from app.handler import mlx_lm

    missing = []
    if not callable(getattr(handler_process, "_handler_worker", None)):
        missing.append("app.core.handler_process._handler_worker")
    proxy = getattr(handler_process, "HandlerProcessProxy", None)
    if proxy is None or "target=_handler_worker" not in inspect.getsource(proxy):
        missing.append("HandlerProcessProxy starting its process with target=_handler_worker")
    handler = getattr(mlx_lm, "MLXLMHandler", None)
    if handler is None or "prompt_cache" not in inspect.getsource(handler.__init__):
        missing.append("app.handler.mlx_lm.MLXLMHandler building self.prompt_cache")
    factory = getattr(server, "create_handler_from_config", None)
    if factory is None or "MLXLMHandler(" not in inspect.getsource(factory):
        missing.append("app.server.create_handler_from_config making MLXLMHandler(...)")
    if not callable(getattr(cli, "cli", None)):
        missing.append("app.cli.cli")
    low, high = (_bound(b) for b in RANGE)
    if missing or not low <= _version() < high:
        what = f"lacks {', '.join(missing)}" if missing else "is outside it"
        raise IncompatibleVersion(
            f"paged-cache's mlx-openai-server adapter supports {DIST}{','.join(RANGE)}; the "
            f"installed {DIST} {metadata.version(DIST)} {what}. Install a supported one: "
            f"{install_command(EXTRA)}")
    return handler_process, mlx_lm, cli


_process, _handlers, _cli = _check()
ORIGINAL_WORKER: Callable[..., None] = _process._handler_worker
ORIGINAL_HANDLER: type = _handlers.MLXLMHandler


def set_worker(worker: Callable[..., None]) -> None:
    """Start every handler process from now on with ``worker`` (called with the arguments
    ``_handler_worker`` takes; it must be picklable: the processes are spawned)."""
    _process._handler_worker = worker


def set_handler_class(handler: type) -> None:
    """Make language-model handlers created from now on (in this process) ``handler``."""
    _handlers.MLXLMHandler = handler


def restore() -> None:
    """mlx-openai-server's own worker and handler class again (in this process)."""
    set_worker(ORIGINAL_WORKER)
    set_handler_class(ORIGINAL_HANDLER)


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
