"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

``mx.load`` reads GGUF directly: Q4_1 / Q8_0 tensors come back MLX-quantized (``weight``,
``scales``, ``biases``, affine, group size 32), the rest as arrays, and the metadata holds the
hyper-parameters, the BPE tokenizer and the chat template. What mlx-lm needs on top:
- its parameter names (``blk.N.attn_q`` -> ``model.layers.N.self_attn.q_proj`` ...);
- each quantized tensor's bits (the 8-bit embedding next to 4-bit layers), in config.json;
- traditional RoPE: llama.cpp stores Q and K with each head's rotary halves interleaved, the
  layout MLX's ``traditional=True`` rotation expects;
- a ``tokenizer.json`` (byte-level BPE with the vocabulary, merges and special tokens) and a
  ``tokenizer_config.json`` with the chat template and the EOS token.
Two forms: ``quantized`` keeps the file's bits (as users run 4-bit models); ``float32``
dequantizes every tensor (MLX's CPU backend runs quantized matmuls slowly).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx

FORMS = ("quantized", "float32")
GROUP_SIZE = 32          # the block size of GGUF's Q4_0/Q4_1/Q8_0 types

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases)$")
_TOP = re.compile(r"(\w+)\.(weight|scales|biases)$")

# tokenizer.ggml.token_type: 3 is a control token (special: never split, skipped when decoding)
_CONTROL = 3
# tokenizer.ggml.pre -> whether digits are split one by one before GPT-2's regex (SmolLM's are)
_DIGITS_APART = {"gpt2": False, "default": False, "smollm": True}


class GGUFError(ValueError):
    """The GGUF file is not one this converter handles (names the file and what is wrong)."""


def mlx_name(name: str, source: str) -> str:
    """mlx-lm's parameter name for the GGUF tensor ``name`` (``source``: the file, for errors)."""
    if (m := _LAYER.match(name)) and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    if (m := _TOP.match(name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise GGUFError(f"{source}: tensor {name!r} has no llama counterpart in mlx-lm")


def _scalar(meta: dict[str, Any], key: str, source: str) -> Any:
    if key not in meta:
        raise GGUFError(f"{source}: metadata has no {key!r}")
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def model_config(meta: dict[str, Any], source: str) -> dict[str, Any]:
    """mlx-lm's config.json fields of a llama GGUF (without quantization)."""
    arch = _scalar(meta, "general.architecture", source)
    if arch != "llama":
        raise GGUFError(f"{source}: architecture {arch!r}; only 'llama' is converted")
    get = lambda key: _scalar(meta, f"llama.{key}", source)  # noqa: E731
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": int(get("rope.dimension_count")),
        # a float32 in the file: printed at its own precision (1e-05, not 9.99999974e-06)
        "rms_norm_eps": float(f'{get("attention.layer_norm_rms_epsilon"):.7g}'),
        "rope_theta": float(get("rope.freq_base")),
        "rope_traditional": True,
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id", source)),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id", source)),
    }


def _bits(weight: mx.array, scales: mx.array) -> int:
    """The bits per value of an MLX-quantized ``weight`` (uint32 words) with ``scales``."""
    values = scales.shape[-1] * GROUP_SIZE
    return weight.shape[-1] * 32 // values


def convert_weights(tensors: dict[str, mx.array], form: str,
                    source: str) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """(mlx-lm weights, the config's ``quantization`` entry or {}) of ``tensors`` in ``form``."""
    weights = {mlx_name(name, source): array for name, array in tensors.items()}
    quantized = sorted(n[: -len(".scales")] for n in weights if n.endswith(".scales"))
    bits = {n: _bits(weights[f"{n}.weight"], weights[f"{n}.scales"]) for n in quantized}
    if form == "quantized":
        if not bits:
            return weights, {}
        common = max(set(bits.values()), key=list(bits.values()).count)
        quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common}
        quantization.update({n: {"group_size": GROUP_SIZE, "bits": b}
                             for n, b in bits.items() if b != common})
        return weights, quantization
    for n, b in bits.items():
        # in float32 throughout: the values are exactly q * scale + bias
        weights[f"{n}.weight"] = mx.dequantize(
            weights[f"{n}.weight"], weights.pop(f"{n}.scales").astype(mx.float32),
            weights.pop(f"{n}.biases").astype(mx.float32), group_size=GROUP_SIZE, bits=b)
    return {n: a.astype(mx.float32) for n, a in weights.items()}, {}


def write_tokenizer(meta: dict[str, Any], out: Path, source: str) -> None:
    """tokenizer.json (byte-level BPE from the metadata) and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    kind = _scalar(meta, "tokenizer.ggml.model", source)
    if kind != "gpt2":
        raise GGUFError(f"{source}: tokenizer {kind!r}; only GPT-2-style BPE ('gpt2') is converted")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in _DIGITS_APART:
        raise GGUFError(f"{source}: pre-tokenizer {pre!r}; converted: {', '.join(_DIGITS_APART)}")
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if _DIGITS_APART[pre] else []
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        steps + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([t for t, kind in zip(tokens, types) if kind == _CONTROL])
    tokenizer.save(str(out / "tokenizer.json"))

    def token(key: str) -> str:
        return tokens[int(_scalar(meta, f"tokenizer.ggml.{key}_token_id", source))]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": _scalar(meta, "tokenizer.chat_template", source),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding") if "tokenizer.ggml.padding_token_id" in meta else None,
        "unk_token": token("unknown") if "tokenizer.ggml.unknown_token_id" in meta else None,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(_scalar(meta, "llama.context_length", source)),
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def convert_gguf(gguf: str | Path, out: str | Path, form: str = "quantized") -> Path:
    """Write the mlx-lm model directory of the llama GGUF file ``gguf`` in ``form`` at ``out``."""
    if form not in FORMS:
        raise ValueError(f"form: expected one of {', '.join(FORMS)}, got {form!r}")
    source = str(gguf)
    tensors, meta = mx.load(source, return_metadata=True)
    config = model_config(meta, source)
    weights, quantization = convert_weights(tensors, form, source)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    if quantization:
        config["quantization"] = quantization
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(meta, out, source)
    return out
