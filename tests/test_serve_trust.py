"""`paged-cache serve` across trust boundaries: a request's cache salt (body field `cache_salt`,
header `X-Cache-Salt`, or with --cache-salt-from-user its `user` field) makes its blocks its
own; a remote tier without a secret is announced once. Real server subprocesses, the official
openai client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from paged_cache.testing import write_model_dir
from paged_cache.testing.server import ValkeyServer
from test_serve_e2e import paged_argv, server

# One long private text: the blocks a second tenant must never get (about 1,000 tokens).
PRIVATE = " ".join(f"Clause {i}: the tenant's private figure is {i * 7919 % 1000}." for i in range(90))
MESSAGES = [{"role": "user", "content": PRIVATE + " Summarize."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama", "llama")


def cached(client: openai.OpenAI, *, salt: str | None = None, header: str | None = None,
           user: str | None = None, seed: int | None = None) -> tuple[int, int]:
    """(cached prompt tokens, prompt tokens) of one greedy chat completion of MESSAGES."""
    extra = {} if salt is None else {"cache_salt": salt}
    headers = {} if header is None else {"X-Cache-Salt": header}
    kw = {} if user is None else {"user": user}
    r = client.chat.completions.create(model="default_model", messages=MESSAGES, temperature=0.0,
                                       max_tokens=4, seed=seed, extra_body=extra,
                                       extra_headers=headers, **kw)
    return r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


@pytest.mark.parametrize("seed", [None, 7])   # BatchGenerator path, sequential path
def test_a_salted_tenant_reuses_only_its_own_blocks(model_dir: Path, tmp_path: Path,
                                                    seed: int | None) -> None:
    argv = paged_argv(model_dir, "--ssd-dir", str(tmp_path / "ssd"))
    with server(argv, tmp_path / "serve.log") as (c, proc, _):
        first, prompt_tokens = cached(c, salt="tenant-a", seed=seed)
        assert first == 0 and prompt_tokens > 900
        assert cached(c, salt="tenant-b", seed=seed)[0] == 0         # another salt: nothing
        assert cached(c, seed=seed)[0] == 0                          # no salt: nothing either
        everything = cached(c, seed=seed)[0]                         # the unsalted repeat
        assert everything >= prompt_tokens - 16
        assert cached(c, salt="tenant-a", seed=seed)[0] == everything   # a's own, all of it
        assert cached(c, header="tenant-b", seed=seed)[0] == everything  # header = body field
        assert cached(c, salt="tenant-c", header="tenant-c", seed=seed)[0] == 0
        for bad in ({"salt": ""}, {"salt": 5}, {"salt": "x", "header": "y"}):
            with pytest.raises(openai.BadRequestError, match="cache_salt"):
                cached(c, seed=seed, **bad)
    assert proc.returncode == 0


def test_the_user_field_is_the_salt_when_asked(model_dir: Path, tmp_path: Path) -> None:
    argv = paged_argv(model_dir, "--ssd-dir", str(tmp_path / "ssd"), "--cache-salt-from-user")
    with server(argv, tmp_path / "serve.log") as (c, proc, _):
        assert cached(c, user="alice")[0] == 0
        assert cached(c, user="bob")[0] == 0
        alice = cached(c, user="alice")[0]
        assert alice > 900
        assert cached(c)[0] == 0                                     # no user: the shared space
        assert cached(c, user="bob", salt="alice")[0] == alice       # an explicit salt wins
    assert proc.returncode == 0


def test_a_remote_tier_without_a_secret_is_announced_once(model_dir: Path, tmp_path: Path) -> None:
    with ValkeyServer() as valkey:
        for name, env in (("open", {}), ("sealed", {"PAGED_CACHE_REMOTE_SECRET": "s" * 24})):
            log = tmp_path / f"{name}.log"
            argv = paged_argv(model_dir, "--ssd-dir", str(tmp_path / name), "--remote-url",
                              valkey.url)
            with server(argv, log, env_extra=env) as (c, proc, _):
                cached(c)
                cached(c)
            text = log.read_text()
            warned = text.count("anyone who can write to")
            assert warned == (1 if name == "open" else 0), text[-3000:]
            assert "s" * 24 not in text
