"""Write a tiny random-weight model directory that ``mlx_lm.load(DIR)`` loads with no network.

The directory holds ``config.json``, ``model.safetensors`` (the model's real parameter names) with
its ``model.safetensors.index.json`` (what a sharded load reads), and a real byte-level tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with a ChatML chat
template). Generated text is meaningless; the cache classes, shapes and serving paths are real.

Vocabulary: the 256 byte tokens (ids 0-255, GPT-2 byte-to-unicode alphabet, no merges, so every
byte of UTF-8 text is one token) followed by the special tokens in ``SPECIAL_TOKENS`` (ids 256+).
The model's ``vocab_size`` is set to ``TOKENIZER_VOCAB_SIZE`` so ids and embeddings match.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from paged_cache.testing.models import build_model, model_config

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB_SIZE = 256
TOKENIZER_VOCAB_SIZE = BYTE_VOCAB_SIZE + len(SPECIAL_TOKENS)  # 259
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# Command-line size options -> the config key they set (nested under text_config for llama4 and qwen3_5).
SIZE_KEYS = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
}


def byte_tokenizer() -> Any:
    """A byte-level ``tokenizers.Tokenizer``: 256 byte tokens, no merges, ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel's alphabet is the GPT-2 byte-to-unicode map; order it by byte value.
    byte_chars = _byte_to_unicode()
    if sorted(byte_chars.values()) != sorted(alphabet):
        raise RuntimeError("tokenizers' ByteLevel alphabet is not the GPT-2 byte map")
    vocab = {byte_chars[b]: b for b in range(BYTE_VOCAB_SIZE)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    if tokenizer.get_vocab_size() != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(f"byte tokenizer has {tokenizer.get_vocab_size()} tokens, "
                           f"expected {TOKENIZER_VOCAB_SIZE}")
    return tokenizer


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def dir_model_config(arch: str, **sizes: Any) -> dict[str, Any]:
    """The config.json dict for ``arch`` with the tokenizer's vocabulary and ``sizes`` applied.

    ``sizes`` keys are those of ``SIZE_KEYS`` (None values are ignored) or raw config keys.
    """
    base = model_config(arch)
    nested = "text_config" in base
    inner = dict(base["text_config"]) if nested else base
    # the text model's arguments: a module of their own (llama4_text) or the model's (qwen3_5)
    module = importlib.import_module(f"mlx_lm.models.{base['model_type']}")
    args_class = getattr(module, "TextModelArgs", None) or importlib.import_module(
        f"mlx_lm.models.{inner['model_type']}").ModelArgs
    fields = {f.name for f in dataclasses.fields(args_class)}
    for name, value in sizes.items():
        if value is None:
            continue
        key = SIZE_KEYS.get(name, name)
        if key not in fields:
            raise ValueError(f"{name}: architecture {arch!r} has no config field {key!r}")
        inner[key] = value
    inner["vocab_size"] = TOKENIZER_VOCAB_SIZE
    if "attn_temperature_tuning" in inner:  # transformers' strict llama4 config wants a bool
        inner["attn_temperature_tuning"] = bool(inner["attn_temperature_tuning"])
    if nested:
        base = dict(base, text_config=inner)
    return base


PRINTABLE = range(0x20, 0x7F)   # the token ids (bytes) of printable ASCII


def _printable_only(weights: dict[str, mx.array]) -> None:
    """Zero the output rows of every token but printable ASCII (the untied ``lm_head`` when the
    model has one, else the tied embedding): their logits are 0 while printable ones are random,
    so greedy replies are printable text that encodes back to the tokens generated."""
    heads = [n for n in weights if n.endswith("lm_head.weight")] or \
        [n for n in weights if n.endswith("embed_tokens.weight")]
    if len(heads) != 1:
        raise ValueError(f"printable_replies: cannot tell the output projection among {heads}")
    head = weights[heads[0]]
    keep = mx.zeros((head.shape[0], 1), dtype=head.dtype)
    keep[PRINTABLE.start:PRINTABLE.stop] = 1
    weights[heads[0]] = head * keep


def write_model_dir(path: str | Path, arch: str = "llama", *, seed: int = 0,
                    dtype: str = "float32", printable_replies: bool = False,
                    **sizes: Any) -> Path:
    """Write a loadable mlx-lm model directory for ``arch`` at ``path`` and return its Path.

    ``sizes``: see ``dir_model_config``. ``printable_replies``: greedy replies are printable
    ASCII (see ``_printable_only``), as engines' multi-turn tests need when a client sends a reply
    back as history. Existing files of the same names are overwritten.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    config = dir_model_config(arch, **sizes)
    model = build_model(config, seed=seed, dtype=DTYPES[dtype])
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_tokenizer()
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    config_out = dict(config, eos_token_id=eos_id, torch_dtype=dtype)
    weights = dict(tree_flatten(model.parameters()))
    if printable_replies:
        _printable_only(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    # the weight index of a split checkpoint: mlx-lm's sharded_load (a model split over several
    # ranks) reads it to pick each rank's files
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in sorted(weights)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(config_out, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out


def is_model_dir(path: str | Path) -> bool:
    """True when ``path`` holds the files ``write_model_dir`` writes."""
    p = Path(path)
    return all((p / name).is_file() for name in
               ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"))
