"""NodeBounds accepts every node a store writes, for every supported cache layout, and refuses
nodes whose arrays or descriptors another store could not have written (paged_cache/bounds.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest

from paged_cache.caches import make_bounded_cache
from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import ARCHS, tiny_model
from paged_cache.tiers import format as fmt
from helpers.prefix import prompt, store_prompt

BLOCK = 16


def _layouts() -> dict[str, tuple[Any, Callable[[], list] | None]]:
    out: dict[str, tuple[Any, Callable[[], list] | None]] = {a: (a, None) for a in ARCHS}
    for name, pre in (("window-keep4-prealloc", True), ("window-keep4", False)):
        out[name] = ("llama", lambda m, pre=pre: make_bounded_cache(m, 40, keep=4, preallocate=pre))
    out["quantized"] = ("llama-32", lambda m: [layer.to_quantized(group_size=32, bits=8)
                                            for layer in make_bounded_cache(m)])
    return out


LAYOUTS = _layouts()


def stored_headers(tmp_path: Path, name: str) -> tuple[BlockAwarePrefixCache, list[fmt.Header]]:
    """The headers of the nodes of layout ``name`` (``stored_nodes``)."""
    arch, factory = LAYOUTS[name]
    # quantization groups of 32 need a head dimension of 32: two heads of the 64-wide model
    model = (tiny_model("llama", num_attention_heads=2, num_key_value_heads=2)
             if arch == "llama-32" else tiny_model(arch))
    return stored_nodes(tmp_path, model, factory)


def stored_nodes(tmp_path: Path, model: Any, factory: Callable[[Any], list] | None
                 ) -> tuple[BlockAwarePrefixCache, list[fmt.Header]]:
    """Store conversations (a branch, partial tails, decoded tokens, a prefix of a stored one:
    checkpoints for layouts that need them) on SSD; their prefix cache and every file's header."""
    manager = PagedSSDCacheManager(CacheConfig(block_size=BLOCK, ssd_dir=tmp_path / "c",
                                               hot_cache_max_bytes=0))
    prefix = BlockAwarePrefixCache(manager, model,
                                   make_cache=None if factory is None else lambda: factory(model))
    base = prompt(5 * BLOCK + 3)
    store_prompt(model, prefix, base, decode=6)
    store_prompt(model, prefix, base[:2 * BLOCK] + prompt(BLOCK + 9, seed=4), decode=3)
    store_prompt(model, prefix, base[:3 * BLOCK + 5])
    manager.flush()
    headers = []
    for path in sorted((tmp_path / "c" / "blocks").rglob("*.safetensors*")):
        data = path.read_bytes()
        headers.append(fmt.read_header_only(lambda off, n: data[off:off + n], len(data), 1 << 30))
    manager.close()
    return prefix, headers


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_stored_node_fits_its_layout_and_altered_ones_do_not(tmp_path: Path,
                                                                   name: str) -> None:
    check_nodes(*stored_headers(tmp_path, name), name)


@pytest.mark.turboquant
@pytest.mark.parametrize("bits", [dict(bits=4), dict(bits=3, key_bits=2.5)])  # 2.5: split codec
def test_turboquant_nodes_fit_their_layout(tmp_path: Path, bits: dict) -> None:
    import mlx_vlm.turboquant as tq
    from helpers.turboquant import tiny_vlm_llama

    model = tiny_vlm_llama()
    check_nodes(*stored_nodes(tmp_path, model,
                              lambda m: [tq.TurboQuantKVCache(**bits) for _ in m.layers]), "tq")


def check_nodes(prefix: BlockAwarePrefixCache, headers: list[fmt.Header], name: str) -> None:
    """Every header fits ``prefix.bounds``; every alteration of one does not."""
    bounds = prefix.bounds
    assert len(headers) >= 8
    for h in headers:
        bounds.check(h)  # raises on a node a store wrote: the bound would be too strict
        assert h.header_len <= bounds.header_bytes and h.data_bytes <= bounds.data_bytes
        tensors = {n: (d.name, s) for n, d, s, _, _ in h.tensors}
        for label, meta, changed in _alterations(h.meta, tensors):
            assert bounds.mismatch(meta, changed) is not None, (name, label, h.meta["layers"])


def _alterations(meta: dict[str, str], tensors: dict[str, tuple[str, tuple[int, ...]]]):
    """(label, meta, tensors) variants no store writes."""
    first = sorted(tensors)[0] if tensors else None
    if first is not None:
        dtype, shape = tensors[first]
        yield "missing array", meta, {k: v for k, v in tensors.items() if k != first}
        yield "another dtype", meta, {**tensors, first: ("float64" if dtype != "float64" else
                                                          "float32", shape)}
        yield "grown", meta, {**tensors, first: (dtype, tuple(d + 1 + 2 * BLOCK for d in shape))}
    yield "stray array", meta, {**tensors, "l999.keys": ("float32", (1,))}
    layers = json.loads(meta["layers"])
    yield "a layer short", {**meta, "layers": json.dumps(layers[:-1])}, tensors
    yield "another type", {**meta, "layers": json.dumps([{**layers[0], "type": "Nope"}]
                                                        + layers[1:])}, tensors
    yield "off the grid", {**meta, "start": str(int(meta["start"]) + 1)}, tensors
    yield "more tokens than a block", {**meta, "tokens": str(BLOCK + 1)}, tensors
    yield "another model", {**meta, "fingerprint": "0" * 64}, tensors


@pytest.mark.parametrize("name", ["window-keep4", "gemma3_text"])
def test_a_ring_no_store_writes_is_refused(tmp_path: Path, name: str) -> None:
    """A sliding window's ``ring`` (source position, phase) is checked before a rebuild orders
    rows by it: a position before the node's end, a phase outside the ring, a phase or position
    of another type (min() over them raised TypeError) are mismatches."""
    prefix, headers = stored_headers(tmp_path, name)
    ringed = [(h, i) for h in headers for i, d in enumerate(json.loads(h.meta["layers"]))
              if "ring" in d]
    assert ringed
    for h, i in ringed:
        layers = json.loads(h.meta["layers"])
        layer = prefix.layout.template[i]
        tensors = {n: (d.name, s) for n, d, s, _, _ in h.tensors}
        pos, phase = layers[i]["ring"]
        assert prefix.bounds.mismatch(h.meta, tensors) is None
        for bad in (["x", phase], [pos], [int(h.meta["start"]), phase], [pos, "0"], [pos, -1],
                    [pos, layer.max_size - layer.keep], [float(pos), phase], "ring"):
            meta = {**h.meta, "layers": json.dumps(layers[:i] + [{**layers[i], "ring": bad}]
                                                    + layers[i + 1:])}
            assert prefix.bounds.mismatch(meta, tensors) is not None, bad


def test_a_read_before_any_fetch_or_store_learns_the_layout_and_removes_nothing(
        tmp_path: Path) -> None:
    """A prefix cache whose first call is a read of a stored node (its layout not learned by a
    fetch or store yet) gets the node whole: bounds made without the layout called every stored
    block too large, and the read removed each as damaged."""
    model = tiny_model("llama")
    config = CacheConfig(block_size=BLOCK, ssd_dir=tmp_path / "c", hot_cache_max_bytes=0)
    with PagedSSDCacheManager(config) as manager:
        store_prompt(model, BlockAwarePrefixCache(manager, model), prompt(3 * BLOCK))
        manager.flush()
    files = sorted((tmp_path / "c" / "blocks").rglob("*.safetensors*"))
    assert len(files) == 3
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        for path in files:
            got = prefix.read(path.name.split(".")[0])
            assert got is not None and got.meta[fmt.META_FINGERPRINT] == prefix.layout.fingerprint
        assert manager.stats()["ssd"]["damaged"] == 0
    assert sorted((tmp_path / "c" / "blocks").rglob("*.safetensors*")) == files


def test_alike_layers_are_checked_once_and_alterations_judged_as_with_every_layer(
        tmp_path: Path) -> None:
    """A node's layers that one handler checks alike (a model's KV layers) get the first one's
    verdict when their descriptor and arrays are its own (a node whose descriptors are all the
    same text: by their arrays alone); an alteration of the last layer alone (its array's dtype,
    shape or absence; 1 or "true" for true; an extra field, which a KV layer ignores), or of
    every layer's descriptor alike, gets the verdict it gets with every layer checked, the
    others than the extra field refused; a
    sliding window's layers (their handler's own positions) are never assumed alike."""
    prefix, headers = stored_headers(tmp_path, "llama")
    bounds = prefix.bounds
    last = len(bounds.layers) - 1
    assert last >= 1 and bounds.alike == [None] + [0] * last
    every = copy.copy(bounds)
    every.alike = [None] * len(bounds.layers)
    every._as_first = [False] * len(bounds.layers)  # no layer passed by the first one's text
    calls = []
    handler = bounds.handlers[0]
    original = handler.accepts
    handler.accepts = lambda *a: calls.append(a) or original(*a)  # counted, the same verdicts
    try:
        checks = 0
        for h in headers:
            before = len(calls)
            bounds.check(h)
            checks += len(calls) - before
            tensors = {n: (d.name, s) for n, d, s, _, _ in h.tensors}
            layers = json.loads(h.meta["layers"])
            mine = {n: v for n, v in tensors.items() if n.startswith(f"l{last}.")}
            name, (dtype, shape) = sorted(mine.items())[0]
            altered = [("dtype", h.meta, {**tensors, name: ("float64", shape)}),
                       ("shape", h.meta, {**tensors, name: (dtype, (*shape[:-1], shape[-1] + 1))}),
                       ("missing", h.meta, {k: v for k, v in tensors.items() if k != name})]
            for field, value in (("has_rows", 1), ("has_rows", "true"), ("extra", [])):
                desc = {**layers[last], field: value}
                altered.append((f"{field}={value!r}",
                                {**h.meta, "layers": json.dumps(layers[:-1] + [desc])}, tensors))
                every_layer = json.dumps([{**d, field: value} for d in layers])  # the same text
                altered.append((f"{field}={value!r} everywhere", {**h.meta, "layers": every_layer},
                                tensors))
            for label, meta, changed in altered:
                verdict = bounds.mismatch(meta, changed)
                assert verdict == every.mismatch(meta, changed), label
                assert (verdict is None) == label.startswith("extra"), (label, verdict)
        assert checks == len(headers)  # one ``accepts`` a node, not one a layer
    finally:
        del handler.accepts
    windowed, _ = stored_headers(tmp_path / "w", "window-keep4")
    assert windowed.bounds.alike == [None] * len(windowed.bounds.layers)


def test_array_names_are_remembered_up_to_a_bound(tmp_path: Path) -> None:
    """The array names a layout's nodes use are split into (layer, name) once, not once a node
    (``NodeBounds._where``), and a stream of names no store writes neither passes nor grows that
    memory past its bound."""
    prefix, headers = stored_headers(tmp_path, "llama")
    bounds = prefix.bounds
    h = headers[0]
    tensors = {n: (d.name, s) for n, d, s, _, _ in h.tensors}
    for _ in range(2):
        assert bounds.mismatch(h.meta, tensors) is None
    assert set(tensors) <= set(bounds._where)
    for i in range(2_000):
        assert bounds.mismatch(h.meta, {**tensors, f"l0.stray{i}": ("float32", (1,))}) is not None
    assert len(bounds._where) <= bounds._where_cap < 2_000
