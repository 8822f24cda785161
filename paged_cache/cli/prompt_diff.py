"""`paged-cache prompt-diff --model MODEL A B`: where two requests' prompts part, in tokens.

A later turn reuses what an earlier one stored only up to the first token where the two differ.
A chat template that rewrites history (drops an earlier reply's thinking, injects today's date,
adds a default system prompt when none is given) moves that point back, sometimes to the start.
This renders both requests with the model's chat template as mlx_lm.server does for a text chat
(``add_generation_prompt``, the request's ``tools``, the server's ``--chat-template-args``
overlaid with the request's ``chat_template_kwargs``) and prints the tokens they share and the
text on each side of the first difference.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from paged_cache.cli.options import add_config_arguments
from paged_cache.cli.render import config_command, fail
from paged_cache.config import CacheConfig
from paged_cache.hashing import shared_prefix

CONTEXT_TOKENS = (16, 24)   # tokens shown before and after the first difference ...
CONTEXT_CHARS = 64          # ... as at most this many characters once escaped (80 columns)


class PromptError(ValueError):
    """A file that is no request this command can render (the message names it)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the prompt-diff subcommand."""
    parser = subparsers.add_parser(
        "prompt-diff", help="where two requests' prompts part (chat template applied)",
        description="Render two requests with MODEL's chat template as mlx_lm.server does and "
                    "print how many tokens they share (a fetch of B restores at most that many "
                    "of what A stored) and the text on each side of the first difference. A and "
                    "B are JSON files: an OpenAI chat request body ({\"messages\": [...], "
                    "\"tools\": ...}), a list of messages, or a completion body ({\"prompt\": "
                    "...}). A chat whose last message is the assistant's is the prompt before it "
                    "followed by that reply's tokens: what the cache holds after that turn.")
    parser.add_argument("--model", required=True,
                        help="mlx-lm model directory or Hugging Face repo (its tokenizer is read)")
    parser.add_argument("first", metavar="A", type=Path, help="the earlier request (JSON file)")
    parser.add_argument("second", metavar="B", type=Path, help="the later request (JSON file)")
    parser.add_argument("--chat-template-args", type=json.loads, default={}, metavar="JSON",
                        help="as mlx_lm.server's: arguments of the chat template, e.g. "
                             "'{\"enable_thinking\": false}' (a request's chat_template_kwargs "
                             "override them)")
    add_config_arguments(parser, fields=("block_size",))
    parser.set_defaults(func=config_command("prompt-diff", run))


def prompt_tokens(tokenizer: Any, request: Any, source: str,
                  template_args: dict[str, Any] | None = None) -> list[int]:
    """The token ids a request's prompt becomes (see the module docstring), ``template_args``
    being the server's --chat-template-args; PromptError naming ``source`` for anything else."""
    if isinstance(request, dict) and isinstance(request.get("prompt"), str):
        return list(tokenizer.encode(request["prompt"]))
    messages = request.get("messages") if isinstance(request, dict) else request
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise PromptError(f"{source}: expected a chat request ({{\"messages\": [...]}}), a list of "
                          "messages with a role each, or {\"prompt\": TEXT}")
    if not tokenizer.has_chat_template:
        raise PromptError(f"{source}: the model's tokenizer has no chat template")
    messages = [dict(m, content=_text(m.get("content"), source)) for m in messages]
    options = request if isinstance(request, dict) else {}
    overrides = options.get("chat_template_kwargs") or {}
    if not isinstance(overrides, dict):
        raise PromptError(f"{source}: chat_template_kwargs is not a JSON object")
    kwargs = {**(template_args or {}), **overrides, "tools": options.get("tools")}
    reply = messages.pop()["content"] if messages[-1]["role"] == "assistant" else None
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             **kwargs))
    if reply is not None:
        ids += tokenizer.encode(reply, add_special_tokens=False)
    return ids


def _text(content: Any, source: str) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise PromptError(f"{source}: a message's content is neither text nor a list of text parts")


def _shown(tokenizer: Any, ids: list[int], *, tail: bool = False) -> str:
    """Token ids as text, quoted, newlines and control characters escaped, cut to CONTEXT_CHARS
    (keeping its end when ``tail``)."""
    text = tokenizer.decode(ids)
    while len(json.dumps(text, ensure_ascii=False)) > CONTEXT_CHARS + 2:
        text = text[1:] if tail else text[:-1]
    return json.dumps(text, ensure_ascii=False)


def report(tokenizer: Any, a: list[int], b: list[int], block: int, names: tuple[str, str]
           ) -> list[str]:
    """The lines prompt-diff prints for prompts ``a`` and ``b``."""
    shared = shared_prefix(np.asarray(a), np.asarray(b))
    lines = [f"A: {names[0]}: {len(a):,} tokens", f"B: {names[1]}: {len(b):,} tokens",
             f"shared prefix: {shared:,} tokens ({shared // block} whole block(s) of {block})"]
    if shared == len(a):
        lines.append("B starts with all of A: a fetch of B can restore everything A stored")
        return lines
    if shared == len(b):
        lines.append("A starts with all of B: B is a prefix of A")
        return lines
    before, after = CONTEXT_TOKENS
    start = max(0, shared - before)
    lines += [f"first difference at token {shared:,} (in block {shared // block}, tokens "
              f"{shared // block * block:,}-{(shared // block + 1) * block - 1:,}); before it:",
              f"   {_shown(tokenizer, a[start:shared], tail=True)}",
              "then A:", f"   {_shown(tokenizer, a[shared:shared + after])}",
              "then B:", f"   {_shown(tokenizer, b[shared:shared + after])}"]
    return lines


def run(args: argparse.Namespace, config: CacheConfig) -> int:
    """Render both requests and print where they part."""
    requests = []
    for path in (args.first, args.second):
        try:
            requests.append(json.loads(path.read_text()))
        except (OSError, ValueError) as error:
            return fail("prompt-diff", f"{path}: not a readable JSON file ({error})")
    from mlx_lm.utils import load_tokenizer

    try:
        tokenizer = load_tokenizer(os.path.expanduser(args.model))
    except Exception as error:  # mlx_lm raises whatever loading the model's files raised
        return fail("prompt-diff", f"--model {args.model}: no tokenizer could be loaded ({error})",
                    1)
    try:
        a, b = (prompt_tokens(tokenizer, r, str(p), args.chat_template_args)
                for r, p in zip(requests, (args.first, args.second)))
    except PromptError as error:
        return fail("prompt-diff", str(error))
    print("\n".join(report(tokenizer, a, b, config.block_size,
                           (args.first.name, args.second.name))))
    return 0
