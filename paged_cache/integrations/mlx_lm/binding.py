"""How a server model key becomes the live model the prefix cache works on: ``ModelBinding``
(model, layout, namespace, identity, KV quantization), the binding of mlx_lm.server's model
provider (with its draft model: ``ModelWithDraft``) and the resolver built on it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable

from paged_cache.hashing import model_identity


@dataclass(frozen=True)
class ModelBinding:
    """The live model behind a server model key, and how its cache list is laid out / namespaced.

    ``kv_quantization``: ``(bits, group_size)`` when the server turns KV layers into
    QuantizedKVCache during generation (``--kv-bits``); such caches are stored and fetched as
    quantized layers, under their own layout fingerprint.
    """

    model: Any
    make_cache: Callable[[], list] | None = None
    namespace: str | None = None
    model_id: str | None = None
    kv_quantization: tuple[int, int] | None = None
    name: str | None = None  # the model as the user gave it (stored with the blocks, for people)

    def same_as(self, other: "ModelBinding") -> bool:
        """The same live model (by identity: an mlx Module compares as a dict) and settings."""
        return self.model is other.model and (
            (self.make_cache, self.namespace, self.model_id, self.kv_quantization)
            == (other.make_cache, other.namespace, other.model_id, other.kv_quantization))


Resolver = Callable[[Hashable], "ModelBinding | None"]


def model_id_for(model_path: str) -> str | None:
    """A model id that changes when the weights do: for a local directory the resolved path plus
    the weight files' names, sizes and modification times. None for a Hugging Face repo id (its
    revision can change under the same name), so the prefix cache falls back to its default
    identity: model config + weights digest (hashing.model_identity)."""
    path = Path(model_path)
    if not path.exists():
        return None
    weights = sorted(path.resolve().glob("*.safetensors"))
    stamp = ";".join(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights)
    return f"path:{path.resolve()}|{stamp}"


def plain_layout(model: Any) -> Callable[[], list]:
    """The cache list mlx-lm builds for ``model`` (``make_prompt_cache``)."""
    from mlx_lm.models.cache import make_prompt_cache
    return lambda: make_prompt_cache(model)


def quantized_layout(cache: list, bits: int, group_size: int) -> list:
    """``cache`` with every layer that can be quantized turned into a QuantizedKVCache, as
    mlx-lm's generation does once a cache reaches ``quantized_kv_start`` tokens (a layer whose
    ``to_quantized`` is not implemented, e.g. RotatingKVCache, stays as it is)."""
    out = []
    for layer in cache:
        try:
            out.append(layer.to_quantized(group_size=group_size, bits=bits)
                       if hasattr(layer, "to_quantized") else layer)
        except NotImplementedError:
            out.append(layer)
    return out


class ModelWithDraft:
    """A model and its draft model over one cache list, the model's layers then the draft's (the
    layout mlx_lm.server builds for speculative decoding): calling it runs both on their own
    layers, so the prefix cache's 1-token layout probe fills every layer."""

    def __init__(self, model: Any, draft: Any) -> None:
        self.model = model
        self.draft = draft
        self.split = len(plain_layout(model)())

    def make_cache(self) -> list:
        """A fresh cache list: the model's layers followed by the draft model's."""
        return plain_layout(self.model)() + plain_layout(self.draft)()

    def __call__(self, inputs: Any, cache: list) -> Any:
        out = self.model(inputs, cache=cache[:self.split])
        self.draft(inputs, cache=cache[self.split:])
        return out


def provider_binding(provider: Any, model_key: Hashable) -> ModelBinding:
    """How the model ``provider`` holds now is cached under ``model_key``: the draft model's
    layers are part of the layout and of the identity; any part of the key after the model path
    (mlx_lm.server's adapter and draft paths) names the namespace; ``--kv-bits`` adds the
    quantized layout. Any key shape works (a tuple's first string is the model path)."""
    parts = model_key if isinstance(model_key, tuple) else (model_key,)
    path = parts[0] if parts and isinstance(parts[0], str) else None
    model_id = model_id_for(path) if path is not None else None
    extra = [None if p is None else str(p) for p in parts[1:]]
    namespace = f"key={json.dumps(extra)}" if any(p is not None for p in extra) else None
    model, make_cache = provider.model, None
    draft = getattr(provider, "draft_model", None)
    args = getattr(provider, "cli_args", None)
    if draft is not None:
        draft_path = parts[2] if len(parts) > 2 else getattr(args, "draft_model", None)
        draft_id = model_id_for(draft_path) if isinstance(draft_path, str) else None
        model_id = (f"{model_identity(model, model_id)}+draft:"
                    f"{model_identity(draft, draft_id)}")
        model = ModelWithDraft(model, draft)
        make_cache = model.make_cache
    bits = getattr(args, "kv_bits", None)
    quantization = None if bits is None else (bits, getattr(args, "kv_group_size", 64))
    return ModelBinding(model, make_cache, namespace, model_id, quantization, path)


def provider_resolver(provider: Any) -> Resolver:
    """Resolve mlx_lm.server model keys to the model its ``ModelProvider`` holds now (None for
    any other key, or while no model is loaded)."""
    last: list = []   # [(model_key, model, draft), binding]: one binding per loaded model

    def resolve(model_key: Hashable) -> ModelBinding | None:
        model = getattr(provider, "model", None)
        if model is None or model_key != getattr(provider, "model_key", None):
            return None
        loaded = (model_key, model, getattr(provider, "draft_model", None))
        if not last or last[0][0] != loaded[0] or any(a is not b for a, b in
                                                      zip(last[0][1:], loaded[1:])):
            last[:] = [loaded, provider_binding(provider, model_key)]
        return last[1]

    return resolve
