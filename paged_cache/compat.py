"""Every private name of mlx-lm / mlx-vlm that paged-cache relies on, checked once at import.

It also holds every difference between the supported mlx-lm releases, as one small function per
difference chosen once at import, so no other module asks which version is installed.

mlx-lm's cache classes and server have no public hooks for what paged-cache does (reading a
rotating window in temporal order, restoring its write slot, allocating its buffer once, swapping
the server's prompt cache and HTTP handler). This module is the only one that touches those
private names: it checks that each exists in the installed version and raises
``IncompatibleVersion`` naming the supported range otherwise, so an unsupported mlx-lm fails at
import instead of at store or fetch time (or, for an override, by silently not running). mlx-vlm
is optional: an unsupported one turns only the TurboQuant handler off (handlers/__init__.py).
"""

from __future__ import annotations

import argparse
import types
from importlib import metadata
from typing import Any, Callable, Iterable

import mlx.core as mx
from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache
from mlx_lm.sample_utils import make_sampler

MLX_LM_RANGE = (">=0.31.3", "<0.33")      # kept equal to the mlx-lm requirement in pyproject.toml
MLX_VLM_RANGE = (">=0.7.9", "<0.8")      # the turboquant extra's requirement

# RotatingKVCache: _idx (write slot), _temporal_order (buffer in position order), and the two
# update paths its update_and_fetch dispatches to (multi-token chunks / single tokens).
_ROTATING_METHODS = ("_temporal_order", "_update_concat", "_update_in_place")
# mlx_lm.server: the generation object and the function that starts the HTTP server.
_SERVER_NAMES = ("ResponseGenerator", "_run_http_server", "APIHandler", "ThreadingHTTPServer")
# ResponseGenerator: the step of the generation thread right before a request's cache fetch (its
# tokenization into segments), its poll of the request queue (where it would wait idle), its loop
# (whose end runs on that thread) and whether it batches a request.
_GENERATOR_METHODS = ("_tokenize", "_next_request", "_generate", "_is_batchable")


class IncompatibleVersion(ImportError):
    """The installed mlx-lm / mlx-vlm is outside the supported range or lacks a private name
    paged-cache needs."""


def _version(dist: str) -> tuple[int, ...]:
    return tuple(int(p) for p in metadata.version(dist).split(".")[:3] if p.isdigit())


def _parse(bound: str) -> tuple[int, ...]:
    return tuple(int(p) for p in bound.lstrip("<>=").split("."))


def _in_range(version: tuple[int, ...], bounds: tuple[str, str]) -> bool:
    low, high = (_parse(b) for b in bounds)
    return low <= version < high


def _fail(dist: str, bounds: tuple[str, str], missing: list[str]) -> IncompatibleVersion:
    """The one message: the supported range, the installed version and what it lacks."""
    what = f"lacks {', '.join(missing)}" if missing else "is outside it"
    return IncompatibleVersion(
        f"paged-cache supports {dist}{','.join(bounds)}; the installed {dist} "
        f"{metadata.version(dist)} {what}. Install a supported one: "
        f"pip install '{dist}{','.join(bounds)}'")


def _check_rotating() -> list[str]:
    """Missing RotatingKVCache internals, including update_and_fetch still dispatching to the
    two update methods (a subclass overriding them must see both called)."""
    missing = [f"RotatingKVCache.{m}" for m in _ROTATING_METHODS if not hasattr(RotatingKVCache, m)]
    if missing:
        return missing
    called = []

    class Probe(RotatingKVCache):
        def _update_concat(self, keys: mx.array, values: mx.array) -> Any:
            called.append("_update_concat")
            return super()._update_concat(keys, values)

        def _update_in_place(self, keys: mx.array, values: mx.array) -> Any:
            called.append("_update_in_place")
            return super()._update_in_place(keys, values)

    probe = Probe(max_size=4, keep=0)
    probe.update_and_fetch(mx.zeros((1, 1, 2, 1)), mx.zeros((1, 1, 2, 1)))
    probe.update_and_fetch(mx.zeros((1, 1, 1, 1)), mx.zeros((1, 1, 1, 1)))
    if not hasattr(probe, "_idx"):
        missing.append("RotatingKVCache._idx")
    for name in ("_update_concat", "_update_in_place"):
        if name not in called:
            missing.append(f"RotatingKVCache.update_and_fetch calling {name}")
    return missing


# mlx_lm.models.pipeline.PipelineMixin: the attributes its pipeline() sets on the layer stack
_PIPELINE_NAMES = ("pipeline_size", "start_idx", "end_idx")


def _check_pipeline() -> list[str]:
    from mlx_lm.models.pipeline import PipelineMixin

    stack = PipelineMixin()
    return [f"PipelineMixin.{n}" for n in _PIPELINE_NAMES if not hasattr(stack, n)]


# BatchGenerator: the prompt tokens it processed and the seconds it took, counted in _next
# (0.31.x: two attributes; 0.32: a counters object)
_BATCH_COUNTERS = {True: ("self._prompt_tokens_counter", "self._prompt_time_counter"),
                   False: ("self._counters.prompt_tokens", "self._counters.prompt_time")}


def _check_batch_counters(before_0_32: bool) -> list[str]:
    import inspect

    from mlx_lm.generate import BatchGenerator

    source = inspect.getsource(BatchGenerator._next)
    return [f"BatchGenerator._next counting {name}" for name in _BATCH_COUNTERS[before_0_32]
            if f"{name} +=" not in source]


def _check_mlx_lm() -> None:
    from mlx_lm import server

    missing = _check_rotating() + _check_pipeline()
    missing += _check_batch_counters(_version("mlx-lm") < (0, 32))
    missing += [f"mlx_lm.server.{n}" for n in _SERVER_NAMES if not hasattr(server, n)]
    missing += [f"mlx_lm.server.ResponseGenerator.{n}" for n in _GENERATOR_METHODS
                if not hasattr(getattr(server, "ResponseGenerator", None), n)]
    if missing or not _in_range(_version("mlx-lm"), MLX_LM_RANGE):
        raise _fail("mlx-lm", MLX_LM_RANGE, missing)


_check_mlx_lm()

# mlx-lm 0.31.x: BatchGenerator stops on SequenceStateMachine transitions (0.32: StopSequences)
# and loses track of per-sequence samplers (see batch_options), ChunkedKVCache trims its front by
# buffer capacity (see _trim_front).
_BEFORE_0_32 = _version("mlx-lm") < (0, 32)


# ----------------------------------------------------------------------------- BatchGenerator

GREEDY = make_sampler(temp=0.0)  # argmax, mlx-lm's fallback sampler (0.31.x has no greedy_sampler)

if _BEFORE_0_32:
    def batch_options(sampler: Callable[[mx.array], mx.array] | None,
                      stop_tokens: Iterable[int]) -> dict[str, list[Any]]:
        """``BatchGenerator.insert`` keyword arguments for one sequence: its sampler, and an end
        at any of ``stop_tokens``.

        0.31.x keeps its per-sequence sampler list aligned only while some sequence has a
        sampler (a batch of ``None`` is not filtered when sequences finish), so ``None`` is
        given as the greedy sampler the generator would fall back to.
        """
        from mlx_lm.generate import SequenceStateMachine

        edges = [([t], None) for t in sorted(stop_tokens)]
        return {"samplers": [sampler or GREEDY],
                "state_machines": [SequenceStateMachine({"normal": edges} if edges else {})]}
else:
    def batch_options(sampler: Callable[[mx.array], mx.array] | None,
                      stop_tokens: Iterable[int]) -> dict[str, list[Any]]:
        """``BatchGenerator.insert`` keyword arguments for one sequence: its sampler, and an end
        at any of ``stop_tokens``."""
        from mlx_lm.generate import StopSequences

        return {"samplers": [sampler],
                "stop_sequences": [StopSequences([[t] for t in sorted(stop_tokens)] or None)]}


if _BEFORE_0_32:
    def prompt_work(generator: Any) -> tuple[int, float]:
        """The prompt tokens a BatchGenerator has prefilled so far and the seconds it took (its
        model calls and their evaluation)."""
        return generator._prompt_tokens_counter, generator._prompt_time_counter
else:
    def prompt_work(generator: Any) -> tuple[int, float]:
        """The prompt tokens a BatchGenerator has prefilled so far and the seconds it took (its
        model calls and their evaluation)."""
        counters = generator._counters
        return counters.prompt_tokens, counters.prompt_time


# ----------------------------------------------------------------------------- ChunkedKVCache

if _BEFORE_0_32:
    def _trim_front(self: ChunkedKVCache) -> None:
        """Keep the last ``chunk_size`` written rows (the front trim mlx-lm 0.32 ships).

        mlx-lm 0.31.x trims by buffer capacity, which counts the unwritten rows of its 256-row
        allocation step as written: any ``chunk_size`` that is not a multiple of 256 then moves
        ``start_position`` past ``offset`` and the next update fails to broadcast.
        """
        if self.keys is None:
            return
        valid = self.offset - self.start_position
        if valid > self.chunk_size:
            trim = valid - self.chunk_size
            self.start_position += trim
            self.keys = self.keys[..., trim:valid, :]
            self.values = self.values[..., trim:valid, :]

    ChunkedKVCache.maybe_trim_front = _trim_front


# ----------------------------------------------------------------------------- RotatingKVCache

def temporal_order(layer: RotatingKVCache, buffer: mx.array) -> mx.array:
    """A rotating layer's buffer (keys or values) with its rows in position order."""
    return layer._temporal_order(buffer)


def ring_slot(layer: RotatingKVCache) -> int:
    """The row a rotating layer writes its next single token to."""
    return layer._idx


def set_ring_slot(layer: RotatingKVCache, slot: int) -> None:
    """Set the row a rotating layer writes its next single token to."""
    layer._idx = slot


def live_rows(layer: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """The keys and values a rotating layer attends to after an update (all rows once full)."""
    if layer.offset < layer.keys.shape[2]:
        return layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
    return layer.keys, layer.values


def rotating_updates(cls: type) -> type:
    """Class decorator: route ``update_and_fetch`` of a RotatingKVCache subclass to its
    ``update_chunk`` (multi-token) and ``update_token`` (single token) methods."""
    cls._update_concat = cls.update_chunk
    cls._update_in_place = cls.update_token
    return cls


# ----------------------------------------------------------------------------- deepseek_v41

# LayerCache (deepseek_v41, mlx-lm 0.32+): the sliding window, the closed compressed groups and
# their index keys, and the float32 projections of the open group. It has no state setter, trim
# or from_state: a rebuild assigns these attributes (and ``offset``) itself.
LAYER_CACHE_FIELDS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate")
_V41_ARGS = ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "sliding_window",
             "head_dim", "index_head_dim")


def _check_deepseek_v41() -> type | None:
    """deepseek_v41's LayerCache class, None when the installed mlx-lm has no deepseek_v41."""
    try:
        from mlx_lm.models import deepseek_v41
    except ImportError:
        return None
    missing = [f"deepseek_v41.{n}" for n in ("LayerCache", "ModelArgs")
               if not hasattr(deepseek_v41, n)]
    if not missing:
        probe = deepseek_v41.LayerCache(4)
        missing += [f"deepseek_v41.LayerCache.{n}"
                    for n in ("window_size", "offset", *LAYER_CACHE_FIELDS) if not hasattr(probe, n)]
        fields = getattr(deepseek_v41.ModelArgs, "__dataclass_fields__", {})
        missing += [f"deepseek_v41.ModelArgs.{n}" for n in _V41_ARGS if n not in fields]
    if missing:
        raise _fail("mlx-lm", MLX_LM_RANGE, missing)
    return deepseek_v41.LayerCache


LayerCache = _check_deepseek_v41()


def layer_cache_get(layer: Any, name: str) -> mx.array | None:
    """One of a LayerCache's arrays (``LAYER_CACHE_FIELDS``), None while it has none."""
    return getattr(layer, name)


def layer_cache_set(layer: Any, offset: int, arrays: dict[str, mx.array | None]) -> None:
    """Set a LayerCache's offset and arrays (every name of ``LAYER_CACHE_FIELDS``)."""
    layer.offset = offset
    for name in LAYER_CACHE_FIELDS:
        setattr(layer, name, arrays[name])


def deepseek_v41_layer(model: Any, index: int) -> tuple[int, bool]:
    """For entry ``index`` of a deepseek_v41 model's cache list: the ratio of the compressed
    groups its LayerCache holds (0: none; a layer that is no KV source reads another layer's)
    and whether it holds their index keys too. ValueError for a model split in pipeline stages
    (a stage's first LayerCache then also holds entries the stage before computed)."""
    inner = getattr(model, "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:
        raise ValueError("deepseek_v41 split in pipeline stages: its first LayerCache holds "
                         "another stage's compressed entries")
    args = model.args
    layer = model.layers[index].layer_idx
    ratios = args.compress_ratios
    ratio = int(ratios[layer]) if layer < len(ratios) and layer in args.kv_source_layer_ids else 0
    return ratio, bool(ratio) and layer in args.index_source_layer_ids


def deepseek_v41_widths(model: Any) -> dict[str, int]:
    """The last axis of each LayerCache array (``LAYER_CACHE_FIELDS``) of a deepseek_v41 model:
    the compressor and the window project to ``head_dim``, the index keys to ``index_head_dim``."""
    args = model.args
    return {**dict.fromkeys(LAYER_CACHE_FIELDS, int(args.head_dim)),
            "index_k": int(args.index_head_dim)}


# ----------------------------------------------------------------------------- mlx_lm.server

def server_hooks() -> tuple[type, Callable[..., None]]:
    """mlx_lm.server's ResponseGenerator class and its HTTP server start function."""
    from mlx_lm import server

    return server.ResponseGenerator, server._run_http_server


def set_server_hooks(generator: type, run_http_server: Callable[..., None]) -> None:
    """Make ``mlx_lm.server.run`` use ``generator`` and ``run_http_server``."""
    from mlx_lm import server

    server.ResponseGenerator = generator
    server._run_http_server = run_http_server


def before_each_fetch(generator: type, hook: Callable[[Any, Any], None]) -> type:
    """A subclass of the ResponseGenerator class ``generator`` that calls ``hook(self, args)``
    (``args``: the request's GenerationArguments) on the generation thread right before each
    request's prompt is tokenized, which both of mlx_lm.server's paths do right before they fetch
    the request's cache (``_tokenize``, checked at import)."""

    class Hooked(generator):  # type: ignore[misc, valid-type]
        def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
            hook(self, args)
            return super()._tokenize(tokenizer, request, args)

    Hooked.__name__ = Hooked.__qualname__ = generator.__name__
    return Hooked


def tokenized_images(tokenized: tuple) -> bool:
    """Whether ResponseGenerator._tokenize's result carries images (0.32: a fifth item, None
    without; 0.31 has four items and serves no images)."""
    return len(tokenized) > 4 and tokenized[4] is not None


class _ParserBuilt(Exception):
    """Raised from inside mlx_lm.server.main to hand over the parser it just built."""


def server_parser() -> argparse.ArgumentParser:
    """mlx_lm.server's own option parser. No function returns it: ``server.main`` builds it and
    parses the command line at once, so main is run with ``parse_args`` raising, and stopped
    there (nothing before it has effects)."""
    from mlx_lm import server

    def stop(parser: argparse.ArgumentParser, *_: Any, **__: Any) -> None:
        raise _ParserBuilt(parser)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = stop  # type: ignore[method-assign]
    try:
        server.main()
    except _ParserBuilt as built:
        return built.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise _fail("mlx-lm", MLX_LM_RANGE, ["mlx_lm.server.main parsing its options"])


# ----------------------------------------------------------------------------- pipeline

def pipeline_layers(model: Any) -> tuple[int, int] | None:
    """[start, end) of the layer numbers this pipeline rank runs; None when ``model`` is not
    split into pipeline stages (mlx-lm's pipeline() keeps layer numbers: the first ones are
    None on every rank but the last)."""
    for _, module in model.named_modules():
        if getattr(module, "pipeline_size", 1) > 1:
            return int(module.start_idx), int(module.end_idx)
    return None


# ----------------------------------------------------------------------------- mlx-vlm

def turboquant() -> types.ModuleType:
    """mlx-vlm's turboquant module, checked for the private codec snapshot it is used with.

    ModuleNotFoundError when mlx-vlm is not installed (the turboquant extra is optional).
    IncompatibleVersion naming the supported range when the installed one is outside it (then
    never imported), lacks a name, or fails to import: the caller turns the TurboQuant handler
    off, never the library.
    """
    try:
        version = _version("mlx-vlm")
    except metadata.PackageNotFoundError:
        raise ModuleNotFoundError("mlx-vlm is not installed (the turboquant extra)") from None
    if not _in_range(version, MLX_VLM_RANGE):
        raise _fail("mlx-vlm", MLX_VLM_RANGE, [])
    try:
        from mlx_vlm import turboquant as tq
    except Exception as exc:  # noqa: BLE001 - any failure of a broken install is this one
        raise _fail("mlx-vlm", MLX_VLM_RANGE, [f"an importable mlx_vlm.turboquant ({exc!r:.200})"])
    missing = [f"mlx_vlm.turboquant.{n}" for n in ("TurboQuantKVCache", "_snapshot_kv_codec")
               if not hasattr(tq, n)]
    if not missing and not hasattr(tq.TurboQuantKVCache, "prefix_cache_restore"):
        missing = ["TurboQuantKVCache.prefix_cache_restore"]
    if missing:
        raise _fail("mlx-vlm", MLX_VLM_RANGE, missing)
    return tq


def snapshot_kv_codec(codec: Any) -> tuple[Any, Any, Any]:
    """(dim, low, high) of a TurboQuant codec, as mlx-vlm snapshots it (low/high None unless split)."""
    from mlx_vlm import turboquant as tq

    return tq._snapshot_kv_codec(codec)
