"""Every private name of vllm-mlx that paged-cache relies on, checked once at import.

vllm-mlx's continuous-batching ``Scheduler`` builds its prefix cache itself
(``MemoryAwarePrefixCache(model=..., config=...)``, a name it looks up in its own module) and has
no option to pick another class, so paged-cache's adapter goes in by replacing names of
``vllm_mlx.scheduler`` at run time (``install``). This module is the only one that touches them:
at import it checks that the installed vllm-mlx is in the supported range and still has each
name (and that ``Scheduler.__init__`` still constructs the cache through it), and raises
``paged_cache.compat.IncompatibleVersion`` naming the range and what is missing otherwise.
"""

from __future__ import annotations

import inspect
from importlib import metadata
from typing import Any

from paged_cache.compat import IncompatibleVersion
from paged_cache.install import install_command

DIST = "vllm-mlx"
RANGE = (">=0.6.0", "<0.7")   # kept equal to the vllm-mlx extra in pyproject.toml
EXTRA = "vllm-mlx"   # paged-cache's extra that installs it

# vllm_mlx.scheduler names the adapter replaces (see install) or reads.
CACHE_NAME = "MemoryAwarePrefixCache"     # the class Scheduler.__init__ builds its cache from
REFRESH_NAME = "SNAPSHOT_REFRESH_TOKENS"  # Scheduler: prompt growth before a snapshot is re-taken
BOUND_NAME = "_bound_cache_layers"        # Scheduler: its --max-kv-size rule for a cache list


def _version() -> tuple[int, ...]:
    return tuple(int(p) for p in metadata.version(DIST).split(".")[:3] if p.isdigit())


def _bound(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.lstrip("<>=").split("."))


def _fail(missing: list[str]) -> IncompatibleVersion:
    what = f"lacks {', '.join(missing)}" if missing else "is outside it"
    return IncompatibleVersion(
        f"paged-cache's vllm-mlx adapter supports {DIST}{','.join(RANGE)}; the installed {DIST} "
        f"{metadata.version(DIST)} {what}. Install a supported one: {install_command(EXTRA)}")


def _check() -> Any:
    """The vllm_mlx.scheduler module, after checking version and names."""
    try:
        metadata.version(DIST)
    except metadata.PackageNotFoundError:
        raise IncompatibleVersion(f"{DIST} is not installed: {install_command(EXTRA)}") from None
    from vllm_mlx import cli, scheduler

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
    if not callable(getattr(cli, "main", None)):
        missing.append("vllm_mlx.cli.main")
    low, high = (_bound(b) for b in RANGE)
    if missing or not low <= _version() < high:
        raise _fail(missing)
    return scheduler


_scheduler = _check()
ORIGINAL_CACHE = getattr(_scheduler, CACHE_NAME)
ORIGINAL_REFRESH = getattr(_scheduler.Scheduler, REFRESH_NAME)


def install(cache_class: type, refresh_tokens: int) -> None:
    """Make every Scheduler built from now on use ``cache_class`` for its prefix cache and re-take
    its prompt snapshot once a prompt grew by ``refresh_tokens`` past what the cache served."""
    setattr(_scheduler, CACHE_NAME, cache_class)
    setattr(_scheduler.Scheduler, REFRESH_NAME, refresh_tokens)


def uninstall() -> None:
    """Put vllm-mlx's own cache class and snapshot interval back."""
    install(ORIGINAL_CACHE, ORIGINAL_REFRESH)


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
