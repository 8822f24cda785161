"""`paged-cache serve` across trust boundaries: a request's cache salt (body field `cache_salt`,
header `X-Cache-Salt`, or with --cache-salt-from-user its `user` field) makes its blocks its
own; a remote tier without a secret is announced once. Real server subprocesses, the official
openai client."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_cache.testing import write_model_dir
from paged_cache.testing.server import ValkeyServer
from helpers.tenants import chat_ask, check_salts, check_user_salts
from test_serve_e2e import paged_argv, server

MODEL = "default_model"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama", "llama")


@pytest.mark.parametrize("seed", [None, 7])   # BatchGenerator path, sequential path
def test_a_salted_tenant_reuses_only_its_own_blocks(model_dir: Path, tmp_path: Path,
                                                    seed: int | None) -> None:
    argv = paged_argv(model_dir, "--ssd-dir", str(tmp_path / "ssd"))
    with server(argv, tmp_path / "serve.log") as (c, proc, _):
        check_salts(chat_ask(c, MODEL, seed=seed))
    assert proc.returncode == 0


def test_the_user_field_is_the_salt_when_asked(model_dir: Path, tmp_path: Path) -> None:
    argv = paged_argv(model_dir, "--ssd-dir", str(tmp_path / "ssd"), "--cache-salt-from-user")
    with server(argv, tmp_path / "serve.log") as (c, proc, _):
        check_user_salts(chat_ask(c, MODEL))
    assert proc.returncode == 0


def test_a_remote_tier_without_a_secret_is_announced_once(model_dir: Path, tmp_path: Path) -> None:
    with ValkeyServer() as valkey:
        for name, env in (("open", {}), ("sealed", {"PAGED_CACHE_REMOTE_SECRET": "s" * 24})):
            log = tmp_path / f"{name}.log"
            argv = paged_argv(model_dir, "--ssd-dir", str(tmp_path / name), "--remote-url",
                              valkey.url)
            with server(argv, log, env_extra=env) as (c, proc, _):
                ask = chat_ask(c, MODEL)
                ask()
                ask()
            text = log.read_text()
            warned = text.count("anyone who can write to")
            assert warned == (1 if name == "open" else 0), text[-3000:]
            assert "s" * 24 not in text
