"""Under concurrent chats `paged-cache serve` reuses at least as many prompt tokens as plain
mlx_lm.server: both servers on 127.0.0.1, one after the other, each sent the same conversations
by several official openai clients at once (streamed, greedy; paged_cache.testing.load).

The servers keep as many sequences in RAM as there are conversations (``--prompt-cache-size``):
mlx_lm.server's cache then holds each conversation's latest turn, so a paged-cache that counted
more sequences than that (every prompt insert as well as the final one) pushed whole
conversations out of RAM, and their partial tails (never written to SSD) with them: fewer tokens
reused. A conversation's first turn finds the system prompt on plain mlx_lm.server only when
another one stored it before it came (a race; paged-cache holds chats opening together back
until one has: tests/test_shared_prefill.py), so the tokens compared are those of the later
turns, each sent once its conversation's previous reply is in.
Time is measured by the ``load`` benchmark family, not here.

The models' greedy replies are printable ASCII (``printable_replies``; mamba's encode back as
they are), so a reply sent back as history is the tokens the server generated: each later turn's
prompt extends its conversation's previous final insert (prompt + reply), and paged-cache must
restore all of it on every family, hybrid and recurrent ones too. (A reply that does not encode
back, such as invalid UTF-8 the client receives as U+FFFD, makes the next prompt leave the
previous one's tokens right after its prompt: models whose layers cannot be trimmed, on either
server, then restore only the prompt's own insert, which mlx_lm.server makes one token short of the
prompt: it holds the last token back for the first decode step.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_cache.testing.load import SIDES, concurrent_chats, load_model, load_server

CLIENTS, TURNS = 4, 2
# ~600 tokens with the byte tokenizer: two full blocks of 256 and a partial tail
SYSTEM = ("You are the assistant of a concurrent cache test. Answer in one short line. " * 8)
REQUEST_SECONDS = 90.0  # one request slower than this fails the test (openai's timeout)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "gemma3_text", "mamba"])
def test_concurrent_chats_reuse_at_least_as_much_as_plain(tmp_path: Path, arch: str) -> None:
    model = load_model(tmp_path / "model", arch)
    runs = {}
    for side in SIDES:
        with load_server(side, model, tmp_path / side, "--prompt-cache-size",
                         str(CLIENTS)) as server:
            runs[side] = concurrent_chats(server.url, clients=CLIENTS, turns=TURNS,
                                          system=SYSTEM, timeout=REQUEST_SECONDS)
    plain, paged = runs["plain"], runs["paged-cache"]
    assert len(paged.turns) == len(plain.turns) == CLIENTS * TURNS
    assert paged.replies() == plain.replies()  # greedy: the same text, cached or not
    assert plain.later_cached > 0, "plain mlx_lm.server reused nothing: no history?"
    per_request = {side: {(t.conversation, t.turn): t.cached_tokens for t in run.turns if t.turn}
                   for side, run in runs.items()}
    assert paged.later_cached >= plain.later_cached, per_request
    # every later turn restores its conversation's previous final insert: the previous prompt
    # and reply (one token per byte with the byte tokenizer)
    previous = {(t.conversation, t.turn + 1): t for t in paged.turns}
    reused = per_request["paged-cache"]
    reach = {key: previous[key].prompt_tokens + len(previous[key].reply.encode()) for key in reused}
    assert all(reused[key] >= reach[key] for key in reused), (reused, reach)
