"""`paged-cache serve` on a real instruct model (SmolLM2-135M-Instruct, float32 for MLX's CPU
backend) against plain `mlx_lm.server` on the same chat: the replies are equal, paged-cache's
cached tokens are at least plain's, and after a restart the chat is restored from SSD. The chat
sends no system message, so the model's template writes its default one into every prompt."""

from __future__ import annotations

from helpers.serve import REQUEST_LINE, ask, paged_argv, server
from paged_cache.testing.real_model import SMOLLM2

QUESTION, REPLY = SMOLLM2.probe
CHAT = [QUESTION, "And of Germany?"]


def two_turns(client) -> list[tuple[str, int, int]]:
    """The chat, each turn's history holding the server's own reply; (text, cached, prompt)."""
    messages, results = [], []
    for turn, question in enumerate(CHAT):
        messages.append({"role": "user", "content": question})
        results.append(ask(client, messages, stream=bool(turn), seed=None))
        messages.append({"role": "assistant", "content": results[-1][0]})
    return results


def test_serve_against_plain_server_then_restart(smollm2, tmp_path):
    model = smollm2["float32"]
    plain_argv = ["-m", "mlx_lm.server", "--model", str(model)]
    with server(plain_argv, tmp_path / "plain.log") as (c, _, _):
        plain = two_turns(c)
    ssd = tmp_path / "ssd"
    with server(paged_argv(model, "--ssd-dir", str(ssd)), tmp_path / "paged.log") as (c, _, _):
        paged = two_turns(c)
    assert plain[0][0] == REPLY
    assert [text for text, _, _ in paged] == [text for text, _, _ in plain]
    assert [p for _, _, p in paged] == [p for _, _, p in plain]
    assert paged[1][1] >= plain[1][1] and paged[1][1] > 0
    # a restart: RAM is empty, the blocks on SSD serve the second turn again
    messages = [{"role": "user", "content": CHAT[0]}, {"role": "assistant", "content": plain[0][0]},
                {"role": "user", "content": CHAT[1]}]
    log = tmp_path / "restarted.log"
    with server(paged_argv(model, "--ssd-dir", str(ssd)), log) as (c, _, _):
        text, cached, prompt = ask(c, messages, stream=False, seed=None)
    assert (text, prompt) == paged[1][::2] and cached >= paged[1][1]
    tiers = [m.group(3) for m in map(REQUEST_LINE.search, log.read_text().splitlines()) if m]
    assert tiers == ["ssd"]
