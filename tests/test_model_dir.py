"""make-model: a tiny model directory that mlx_lm.load reads offline, with a real chat tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
import pytest
from mlx_lm.generate import generate

from paged_cache.testing import (ARCHS, CHAT_TEMPLATE, TOKENIZER_VOCAB_SIZE, build_model,
                                 byte_tokenizer, dir_model_config, is_model_dir, write_model_dir)

MESSAGES = [{"role": "system", "content": "You are a tiny model. Ünïcode ok."},
            {"role": "user", "content": "Hello there"}]


@pytest.mark.parametrize("arch", ARCHS)
def test_load_matches_built_model_and_generates(tmp_path, arch):
    path = write_model_dir(tmp_path / arch, arch, seed=3)
    assert is_model_dir(path)
    model, tokenizer = mlx_lm.load(str(path))
    # Same weights under the real parameter names: identical logits to the in-memory build
    # (after the architecture's own load-time sanitize, e.g. baichuan_m1 normalises lm_head).
    reference = build_model(dir_model_config(arch), seed=3)
    reference.load_weights(list(reference.sanitize(dict(tree_flatten(reference.parameters())))
                                .items()))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    x = mx.array(prompt)[None]
    diff = mx.abs(model(x) - reference(x)).max().item()
    assert diff == 0.0
    text = generate(model, tokenizer, prompt, max_tokens=4, verbose=False)
    assert isinstance(text, str)


def test_tokenizer_bytes_specials_and_chat_template(tmp_path):
    path = write_model_dir(tmp_path / "m", "llama")
    _, tokenizer = mlx_lm.load(str(path))
    text = "héllo wörld \n\t 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # one token per UTF-8 byte
    assert tokenizer.decode(ids) == text
    assert tokenizer.has_chat_template
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    rendered = tokenizer.decode(prompt)
    assert rendered == ("<|im_start|>system\nYou are a tiny model. Ünïcode ok.<|im_end|>\n"
                        "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_ids == {im_end}
    assert max(prompt) < TOKENIZER_VOCAB_SIZE
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == TOKENIZER_VOCAB_SIZE == byte_tokenizer().get_vocab_size()
    assert json.loads((path / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


def test_sizes_and_dtype(tmp_path):
    path = write_model_dir(tmp_path / "m", "llama4", dtype="bfloat16", layers=2, hidden=32,
                           heads=2, kv_heads=1, head_dim=16)
    config = json.loads((path / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 2
    assert config["text_config"]["vocab_size"] == TOKENIZER_VOCAB_SIZE
    model, _ = mlx_lm.load(str(path))
    assert model.language_model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert len(model.make_cache()) == 2


def test_bad_arguments_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="heads: architecture 'mamba'"):
        write_model_dir(tmp_path / "a", "mamba", heads=4)
    with pytest.raises(ValueError, match="dtype"):
        write_model_dir(tmp_path / "b", "llama", dtype="int8")
    with pytest.raises(ValueError, match="arch"):
        write_model_dir(tmp_path / "c", "no_such_arch")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cli_make_model(tmp_path):
    out = tmp_path / "cli"
    run = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "make-model", str(out),
                          "--arch", "gemma3_text", "--layers", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert is_model_dir(out)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    bad = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "make-model",
                          str(tmp_path / "bad"), "--arch", "mamba", "--heads", "2"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "heads" in bad.stderr
    # Loads and chats with the Hugging Face hub switched off.
    load = subprocess.run(
        [sys.executable, "-c", "import sys, mlx_lm\n"
         "m, t = mlx_lm.load(sys.argv[1])\n"
         "p = t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True)\n"
         "print(len(mlx_lm.generate(m, t, p, max_tokens=3)) >= 0, t.decode(p)[:12])", str(out)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert load.returncode == 0, load.stderr[-2000:]
    assert load.stdout.strip() == "True <|im_start|>"


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "gemma3_text"])
def test_printable_replies_encode_back_to_the_tokens_generated(tmp_path, arch):
    """With printable_replies the greedy reply is printable ASCII, so a client sending it back as
    history sends exactly the tokens the model generated (the engines' multi-turn tests)."""
    path = write_model_dir(tmp_path / arch, arch, printable_replies=True)
    model, tokenizer = mlx_lm.load(str(path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                           add_generation_prompt=True)
    reply = generate(model, tokenizer, prompt, max_tokens=24)
    assert len(reply) == 24 and all(" " <= ch <= "~" for ch in reply), reply
    assert tokenizer.encode(reply, add_special_tokens=False) == list(reply.encode())
