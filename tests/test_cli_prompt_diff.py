"""`paged-cache prompt-diff`: where two requests' prompts part once the model's chat template
rendered them, on a real model directory's byte tokenizer (one token per byte, one per special
token, so the expected counts are computed here without it)."""

from __future__ import annotations

import json
import re

import pytest

from paged_cache.cli.main import main
from paged_cache.testing import write_model_dir
from paged_cache.testing.model_dir import SPECIAL_TOKENS

pytestmark = pytest.mark.unit

# A template that rewrites history as Qwen3's does: an earlier reply loses its thinking (unless
# the template argument keep_thinking is set).
DROPS_THINKING = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not keep_thinking %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Capital of France?"}
REPLY = {"role": "assistant", "content": "<think>\neasy\n</think>\nParis."}
NEXT = {"role": "user", "content": "And of Spain?"}


def tokens(text: str) -> int:
    """Tokens of ``text`` under the byte tokenizer."""
    specials = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))
    return len(specials.findall(text)) + len(specials.sub("", text).encode())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model"), "llama")


def diff(model, tmp_path, capsys, first, second, *extra: str) -> tuple[int, str, str]:
    paths = []
    for name, body in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(body if isinstance(body, str) else json.dumps(body))
        paths.append(str(tmp_path / name))
    status = main(["prompt-diff", "--model", str(model), *paths, *extra])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture
def drops_thinking(model):
    """``model`` with DROPS_THINKING as its chat template for one test."""
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"], template = DROPS_THINKING, config.get("chat_template")
    path.write_text(json.dumps(config))
    yield model
    config["chat_template"] = template
    path.write_text(json.dumps(config))


def test_a_template_that_drops_thinking_parts_where_the_reply_began(drops_thinking, tmp_path,
                                                                    capsys):
    turns = ({"messages": [SYSTEM, USER, REPLY]}, {"messages": [SYSTEM, USER, REPLY, NEXT]})
    status, out, err = diff(drops_thinking, tmp_path, capsys, *turns, "--block-size", "16")
    assert status == 0, err
    shared = tokens("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nCapital of "
                    "France?<|im_end|>\n<|im_start|>assistant\n")
    assert f"shared prefix: {shared} tokens ({shared // 16} whole block(s) of 16)" in out
    assert f"first difference at token {shared} (in block {shared // 16}," in out
    assert out.split("then A:\n")[1].split("\n")[0].strip().startswith('"<think>\\neasy')
    assert out.split("then B:\n")[1].split("\n")[0].strip().startswith('"Paris.<|im_end|>')
    # The template's switch, given as the server's --chat-template-args, keeps the history.
    status, out, err = diff(drops_thinking, tmp_path, capsys, *turns,
                            "--chat-template-args", '{"keep_thinking": true}')
    assert status == 0 and "B starts with all of A" in out, err


def test_a_later_turn_that_keeps_history_starts_with_all_of_the_earlier(model, tmp_path, capsys):
    reply = dict(REPLY, content="Paris.")
    status, out, err = diff(model, tmp_path, capsys, [SYSTEM, USER, reply],
                            {"messages": [SYSTEM, USER, reply, NEXT]})
    assert status == 0, err
    assert "B starts with all of A: a fetch of B can restore everything A stored" in out


def test_a_file_that_is_no_request_is_named(model, tmp_path, capsys):
    status, out, err = diff(model, tmp_path, capsys, {"model": "x"}, [USER])
    assert status == 2 and out == ""
    assert f"paged-cache prompt-diff: error: {tmp_path / 'a.json'}: expected a chat request" in err
    status, out, err = diff(model, tmp_path, capsys, "{not json", [USER])
    assert status == 2 and f"{tmp_path / 'a.json'}: not a readable JSON file" in err
