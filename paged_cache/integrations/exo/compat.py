"""Every name of exo paged-cache uses, in one place, checked when this module is imported: the
installed exo must still have them with the signatures and call sites the adapter was written
against (read at exo commit b5375f8, version 0.3.70), or paged-cache refuses to start, saying
what changed (``IncompatibleVersion``), rather than serve exo's callers wrongly.

exo is on no package index (the index's ``exo`` is another project): it is installed from its
repository, with its own mlx-lm; ``needs`` names what is missing when an import fails. Its
runner builds its prefix cache in ``MlxBuilder.build`` as ``KVPrefixCache(self.group)``, a name
looked up in the builder module when ``build`` runs: the one patch point (``patch_builder``).
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any, Callable

from paged_cache.compat import IncompatibleVersion
from paged_cache.integrations.exo.needs import missing

CACHE_MODULE = "exo.worker.engines.mlx.cache"
BUILDER_MODULE = "exo.worker.engines.mlx.builder"
GENERATE_MODULE = "exo.worker.engines.mlx.generator.generate"
BATCH_MODULE = "exo.worker.engines.mlx.generator.batch_generate"
SERVE_MODULE = "exo.worker.engines.mlx.disaggregated.serve"
MAIN_MODULE = "exo.main"
BUILT_AS = "KVPrefixCache(self.group)"   # how MlxBuilder.build makes its cache

# KVPrefixCache's members the callers use, and the parameters (name, default) each must keep
SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {
    "__init__": (("self", inspect.Parameter.empty), ("group", inspect.Parameter.empty)),
    "get_kv_cache": (("self", inspect.Parameter.empty), ("model", inspect.Parameter.empty),
                     ("prompt_tokens", inspect.Parameter.empty), ("media_regions", None)),
    "add_kv_cache": (("self", inspect.Parameter.empty), ("prompt_tokens", inspect.Parameter.empty),
                     ("cache", inspect.Parameter.empty), ("ssm_snapshots", None),
                     ("media_regions", None), ("prefill_tps", 0.0)),
    "update_kv_cache": (("self", inspect.Parameter.empty), ("index", inspect.Parameter.empty),
                        ("prompt_tokens", inspect.Parameter.empty),
                        ("cache", inspect.Parameter.empty),
                        ("snapshots", inspect.Parameter.empty),
                        ("restore_pos", inspect.Parameter.empty), ("media_regions", None),
                        ("prefill_tps", 0.0)),
    "clear": (("self", inspect.Parameter.empty),),
}
# The callers, and what each must still do with the cache (source fragments)
CALLERS: dict[tuple[str, str], tuple[str, ...]] = {
    (GENERATE_MODULE, "mlx_generate"): (
        "kv_prefix_cache.get_kv_cache(", "kv_prefix_cache.prefill_tps[matched_index]",
        "kv_prefix_cache.update_kv_cache(", "kv_prefix_cache.add_kv_cache(", "prompt_tokens[:-1]",
        "prompt_tokens[-2:]"),
    (BATCH_MODULE, "ExoBatchGenerator.submit"): (
        "self.kv_prefix_cache.get_kv_cache(", "self.kv_prefix_cache.prefill_tps[matched_index]",
        "self._save_prefix_cache(", "prompt_tokens[:-1]", "prompt_tokens[-2:]"),
    (BATCH_MODULE, "ExoBatchGenerator._save_prefix_cache"): (
        "self.kv_prefix_cache.update_kv_cache(", "self.kv_prefix_cache.add_kv_cache("),
    (SERVE_MODULE, "run_prefill_for_request"): (
        "kv_prefix_cache.get_kv_cache(", "kv_prefix_cache.update_kv_cache(",
        "kv_prefix_cache.add_kv_cache(", "n_tokens - 2"),
    (BUILDER_MODULE, "MlxBuilder.build"): (BUILT_AS,),
}
# exo functions the adapter calls: name -> parameter names
FUNCTIONS: dict[str, tuple[str, ...]] = {"make_kv_cache": ("model", "max_kv_size", "keep"),
                                         "cache_length": ("cache",)}


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise IncompatibleVersion(missing(exc, name)) from exc


def _attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check() -> list[str]:
    """What differs from the exo the adapter was written against (empty: nothing)."""
    problems: list[str] = []
    cache = _import(CACHE_MODULE)
    kv = getattr(cache, "KVPrefixCache", None)
    if kv is None:
        return [f"{CACHE_MODULE}.KVPrefixCache is gone"]
    for method, want in SIGNATURES.items():
        fn = getattr(kv, method, None)
        got = (tuple((p.name, p.default) for p in inspect.signature(fn).parameters.values())
               if callable(fn) else None)
        if got != want:
            problems.append(f"KVPrefixCache.{method}{_shown(got)}, expected {method}{_shown(want)}")
    if not isinstance(getattr(kv(None), "prefill_tps", None), list):
        problems.append("KVPrefixCache().prefill_tps is no longer a list")
    for name, params in FUNCTIONS.items():
        fn = getattr(cache, name, None)
        got = tuple(inspect.signature(fn).parameters) if callable(fn) else None
        if got != params:
            problems.append(f"{CACHE_MODULE}.{name}{_shown(got)}, expected ({', '.join(params)})")
    for (module, name), fragments in CALLERS.items():
        try:
            source = inspect.getsource(_attr(_import(module), name))
        except (AttributeError, OSError, TypeError) as exc:
            problems.append(f"{module}.{name}: cannot read it ({exc})")
            continue
        problems += [f"{module}.{name} no longer has `{f}`" for f in fragments if f not in source]
    builder = _import(BUILDER_MODULE)
    if getattr(builder, "KVPrefixCache", None) is not kv:
        problems.append(f"{BUILDER_MODULE}.KVPrefixCache is not {CACHE_MODULE}.KVPrefixCache")
    return problems


def _shown(params: tuple | None) -> str:
    if params is None:
        return " (missing)"
    names = [p[0] if isinstance(p, tuple) else p for p in params]
    return "(" + ", ".join(names) + ")"


def _checked() -> ModuleType:
    problems = check()
    if problems:
        raise IncompatibleVersion(
            "exo: the installed exo's prefix cache is not the one paged-cache's adapter serves "
            "(written against exo 0.3.70, commit b5375f8): " + "; ".join(problems)
            + ". Run exo without paged-cache (`exo ...`), or a paged-cache that supports it")
    return _import(CACHE_MODULE)


_cache = _checked()
KVPrefixCache: type = _cache.KVPrefixCache
make_kv_cache: Callable[..., list] = _cache.make_kv_cache
cache_length: Callable[[Any], int] = _cache.cache_length


def patch_builder(builder: ModuleType, cache_class: type) -> None:
    """THE patch point: ``MlxBuilder.build`` (``BUILT_AS``) builds ``cache_class`` from now on."""
    builder.KVPrefixCache = cache_class


def exo_main() -> Callable[[], Any]:
    """exo's command (``exo.main:main``, its console script)."""
    return _import(MAIN_MODULE).main
