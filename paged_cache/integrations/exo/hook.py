"""The startup hook that puts paged-cache into exo's runner process.

exo's runner is a multiprocessing spawn child: a new interpreter, which runs ``sitecustomize``
at start. The launcher writes ``SITECUSTOMIZE`` into a directory of its own, put first on the
``PYTHONPATH`` the children inherit (nothing in site-packages changes; without the launcher
nothing runs). It calls ``activate``: when ``settings.ENV`` is set, the import of exo's builder
module is followed by ``compat.patch_builder`` (exo modules are not imported any earlier, so
other interpreters exo starts pay nothing); a ``sitecustomize`` it shadows still runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

from paged_cache.integrations.exo.settings import ENV

logger = logging.getLogger("paged_cache.integrations.exo")

BUILDER_MODULE = "exo.worker.engines.mlx.builder"   # compat.BUILDER_MODULE (compat imports exo)
SITECUSTOMIZE = '''"""paged-cache's startup hook for exo (paged_cache.integrations.exo.hook)."""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if os.environ.get({env!r}):
    from paged_cache.integrations.exo.hook import activate
    activate()
from paged_cache.integrations.exo.hook import run_shadowed
run_shadowed(_here)
'''


def write_hook(directory: Path) -> Path:
    """Write the ``sitecustomize.py`` that calls ``activate`` into ``directory``; return it."""
    path = Path(directory) / "sitecustomize.py"
    path.write_text(SITECUSTOMIZE.format(env=ENV))
    return path


def run_shadowed(hook_dir: str) -> None:
    """Run the ``sitecustomize`` the hook directory hides (the next one on ``sys.path``)."""
    rest = [p for p in sys.path if os.path.abspath(p or ".") != hook_dir]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def activate(environ: Mapping[str, str] | None = None) -> bool:
    """Patch exo's builder now if it is imported, else right after its import; False (nothing
    done) when ``ENV`` is not set."""
    if not (os.environ if environ is None else environ).get(ENV):
        return False
    module = sys.modules.get(BUILDER_MODULE)
    if module is not None:
        _patch(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
    return True


def _patch(builder: ModuleType) -> None:
    from paged_cache.integrations.exo import adapter, compat   # imports exo: only now

    compat.patch_builder(builder, adapter.PagedKVPrefixCache)
    logger.info("exo's runner builds paged-cache's prefix cache (pid %d)", os.getpid())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds exo's builder module as the other finders do, and patches it once executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != BUILDER_MODULE:
            return None
        sys.meta_path.remove(self)   # once: the patch is in place for the process
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Patching(spec.loader)
        return spec


class _Patching(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _patch(module)
