"""mlx-openai-server (installed from the package registry) serving over HTTP with paged-cache as
its prompt cache, against the same server with its own LRUPromptCache and with none (the cold
run).

Run inside the engine's environment: `make test-engines` (pytest --engine openai-server).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from paged_cache import rates_file
from paged_cache.testing.engines import ENGINES, EngineServer, chat, openai_client
from paged_cache.testing.load import LOAD_SYSTEM, concurrent_chats
from helpers.tenants import PRIVATE, chat_ask, check_salts, check_user_salts
from reuse import ARCHS, RESTORE, Reference, check_reuse, references, drop_a_stream, first_turns_together

pytestmark = pytest.mark.timeout(900)

ENGINE = ENGINES["openai-server"]
# mlx-openai-server serves a model through its batch scheduler unless told otherwise; the
# sliding-window model runs on its single-request path (--disable-batching), so both paths of the
# handler are covered.
MODES = {"llama": (), "qwen3_next": (), "gemma3_text": ("--disable-batching",)}


def server(model: Path, arch: str, workdir: Path, *extra: str, name: str) -> EngineServer:
    """Plain `mlx-openai-server launch ...` (its own prompt cache unless told otherwise)."""
    return ENGINE.own(sys.executable, model, workdir, *MODES[arch], *extra, name=name)


def paged(model: Path, arch: str, workdir: Path, *cache_flags: str,
          name: str = "paged") -> EngineServer:
    """`paged-cache openai-server --block-size 16 [cache flags] launch ...`."""
    return ENGINE.paged(sys.executable, model, workdir, "--block-size", "16", *cache_flags,
                        extra=MODES[arch], name=name)


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory) -> Reference:
    """(cold run, own-cache run) per arch; the cold server keeps no prompt cache
    (--prompt-cache-size 0)."""
    return references(tmp_path_factory,
                      lambda arch, work, name, extra: server(models[arch], arch, work, *extra,
                                                             name=name),
                      lambda s, arch: chat(s.url, str(models[arch])), ENGINE.cold)


@pytest.mark.parametrize("arch", ARCHS)
def test_reuse_at_least_own_cache_and_replies_equal_cold(arch, models, reference, tmp_path):
    """Two conversations of three turns sharing a system prompt: every reply equals the cold
    run's and every request reuses at least what mlx-openai-server's own cache reuses (as its
    usage reports cached tokens); blocks reach the SSD tier. The handler's prefills (the batch
    scheduler's, or the single-request path's) are samples of the model's prefill rate, saved in
    the SSD directory when it stops. Each request's time to first token is observed under the
    outcome its fetch had (the handler logs them by outcome as it stops)."""
    cold, own = reference(arch)
    with paged(models[arch], arch, tmp_path, "--ssd-dir", str(tmp_path / "ssd"), *RESTORE) as ours:
        turns = chat(ours.url, str(models[arch]))
        assert ours.stop() == 0, ours.tail()
    saved = rates_file.load(tmp_path / "ssd")
    assert saved is not None and len(saved.prefill_tokens_per_s) == 1, ours.tail()
    assert list(saved.prefill_tokens_per_s.values())[0] > 0
    total, _ = check_reuse(turns, own, cold)
    assert total > 0
    assert list((tmp_path / "ssd").rglob("*.safetensors")), "no block reached the SSD tier"
    assert "prompt cache is paged-cache" in ours.tail(200_000)
    timed = first_tokens_logged(ours.tail(200_000))
    assert sum(timed.values()) == len(turns), timed
    assert timed.get(("miss", "none"), 0) == sum(t.cached_tokens == 0 for t in turns) > 0
    assert sum(n for (outcome, _), n in timed.items() if outcome == "hit") > 0


def first_tokens_logged(log: str) -> dict[tuple[str, str], int]:
    """The handler's last line of times to first token: requests by (outcome, tier), each with
    a mean above zero."""
    line = [row for row in log.splitlines() if "time to first token: " in row][-1]
    timed = {}
    for part in line.split("time to first token: ", 1)[1].split("; "):
        outcome, tier, count, _, _, mean, _ = part.split()
        assert float(mean) > 0, line
        timed[(outcome, tier)] = int(count)
    return timed


def test_batching_cancel_and_restart_from_ssd(models, reference, tmp_path):
    """Concurrent first turns (one batch) get the cold run's replies; a stream the client drops
    is cancelled and the server goes on serving, the next turn from the cache; after a restart
    the turn after that is rebuilt from the SSD tier."""
    arch = "qwen3_next"
    model, ssd = models[arch], tmp_path / "ssd"
    cold, _ = reference(arch)      # conversation 0: turns 0-2, then conversation 1
    histories: dict[int, list[dict]] = {}
    with paged(model, arch, tmp_path, "--ssd-dir", str(ssd), name="first") as first:
        firsts = first_turns_together(first.url, str(model), histories)
        assert [t.reply for t in firsts] == [cold[0].reply, cold[3].reply]
        drop_a_stream(first.url, str(model))   # mlx-openai-server cancels it
        second = chat(first.url, str(model), conversations=1, turns=1, history=histories,
                      first_turn=1)
        assert first.stop() == 0, first.tail()
    assert second[0].reply == cold[1].reply
    assert second[0].cached_tokens > cold[0].prompt_tokens
    with paged(model, arch, tmp_path, "--ssd-dir", str(ssd), name="second") as again:
        third = chat(again.url, str(model), conversations=1, turns=1, history=histories,
                     first_turn=2)
        log = again.tail(200_000)
    assert third[0].reply == cold[2].reply
    assert third[0].cached_tokens > cold[1].prompt_tokens
    assert f"{third[0].cached_tokens}/{third[0].prompt_tokens} prompt tokens cached (ssd)" in log \
        or f"{third[0].cached_tokens}/{third[0].prompt_tokens} prompt tokens cached (mixed)" in log


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_chats_opening_together_share_one_prefill(arch, models, tmp_path):
    """Four chats opening at once over a ~2.4k-token system prompt (the load benchmark's): with
    shared prefills (the default) every first turn but one restores the system prompt, which
    one of them prefilled; each reply equals the one with shared prefills off
    (--no-shared-prefill). On a KV model paged-cache splits the prompts at the system prompt's
    end itself; the hybrid's the handler splits."""
    model, clients = models[arch], 4
    runs = {}
    for flags in ((), ("--no-shared-prefill",)):
        name = "shared" if not flags else "alone"
        with paged(model, arch, tmp_path / name, "--ssd-dir", str(tmp_path / name / "ssd"),
                   *flags, name=name) as ours:
            runs[name] = concurrent_chats(ours.url, str(model), clients=clients, turns=1)
            assert ours.stop() == 0, ours.tail()
    shared, alone = runs["shared"], runs["alone"]
    assert shared.replies() == alone.replies()
    restored = sorted(t.cached_tokens or 0 for t in shared.turns)
    assert restored[0] == 0 and all(n >= len(LOAD_SYSTEM) - 16 for n in restored[1:]), restored
    assert shared.prompt == alone.prompt


@pytest.mark.parametrize("mode, flags, check", [
    ((), (), check_salts),
    (("--disable-batching",), (), check_salts),
    ((), ("--cache-salt-from-user",), check_user_salts),
], ids=["salts-batched", "salts-single", "users-batched"])
def test_tenants_reuse_only_their_own_prefixes(models, tmp_path, mode, flags, check):
    """As with `paged-cache serve` (tests/helpers/tenants.py), on the batch scheduler and the
    single-request path (the salt reaches the fetch on either): a second tenant (another salt,
    no salt; with --cache-salt-from-user another user) reuses 0 tokens of the first's private
    text, the same tenant all of it; bad salts get HTTP 400."""
    model = models["llama"]
    with ENGINE.paged(sys.executable, model, tmp_path, "--block-size", "16", "--ssd-dir",
                      str(tmp_path / "ssd"), *flags, extra=mode) as ours:
        check(chat_ask(openai_client(ours.url), str(model)))
    assert "prompt cache is paged-cache" in ours.tail(200_000)


def test_the_responses_route_carries_the_salt_too(models, tmp_path):
    """/v1/responses hands the handler a request of its own making: the salt still reaches the
    fetch. The private text sent there with salt a is reused by a chat completion with salt a
    (the same prompt), by none with salt b or without a salt."""
    model = models["llama"]
    with ENGINE.paged(sys.executable, model, tmp_path, "--block-size", "16", "--ssd-dir",
                      str(tmp_path / "ssd")) as ours:
        client = openai_client(ours.url)
        client.responses.create(model=str(model), input=PRIVATE + " Summarize.",
                                max_output_tokens=4, temperature=0.0,
                                extra_body={"cache_salt": "tenant-a"})
        ask = chat_ask(client, str(model))
        assert ask(salt="tenant-b")[0] == 0
        assert ask()[0] == 0
        reused, prompt_tokens = ask(salt="tenant-a")
        assert reused >= prompt_tokens - 16


def test_command_line_paged_cache_cannot_serve_fails_clearly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "openai-server",
                           "serve", "M"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("paged-cache openai-server: error: expected `paged-cache "
                                  "openai-server launch")


LONG_TURN = "And what then, step by step? " * 150


def _second_turn(model: Path, workdir: Path, drop: bool) -> int:
    """Cached tokens (as the usage reports them) of a conversation's second turn, a long message,
    on a fresh server; after (``drop``) the same turn sent as a stream the client drops after
    its first chunk (mlx-openai-server cancels it while it generates, before its insert)."""
    histories: dict[int, list[dict]] = {}
    with paged(model, "llama", workdir, "--ssd-dir", str(workdir / "ssd"),
               name=workdir.name) as ours:
        chat(ours.url, str(model), conversations=1, turns=1, history=histories)
        messages = histories[0] + [{"role": "user", "content": LONG_TURN}]
        client = openai_client(ours.url)
        if drop:
            stream = client.chat.completions.create(model=str(model), messages=messages,
                                                    max_tokens=4000, temperature=0.0, stream=True)
            next(iter(stream))  # its prefill is done, its generation runs: no insert yet
            stream.close()
        reply = client.chat.completions.create(model=str(model), messages=messages, max_tokens=12,
                                               temperature=0.0)
        assert ours.stop() == 0, ours.tail()
    return reply.usage.prompt_tokens_details.cached_tokens


def test_a_dropped_turn_costs_the_same_turn_asked_again_nothing(models, tmp_path):
    """A client that goes away while its turn is served (the request may never store): the
    same turn asked again reuses at least what it reuses when nobody dropped it (the
    conversation's partial tail was read by the dropped request's fetch, not taken)."""
    plain = _second_turn(models["llama"], tmp_path / "plain", drop=False)
    assert _second_turn(models["llama"], tmp_path / "dropped", drop=True) >= plain > 0
