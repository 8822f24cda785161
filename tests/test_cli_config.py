"""`paged-cache config` in a real process: the environment and a TOML file as sources, the
master switch, a hot budget above RAM refused with exit 2 (the unit lane, tests/test_config.py,
runs no subprocess)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from helpers.cli import parse_cli

from paged_cache.config import CacheConfig, format_size, physical_memory_bytes


def test_env_hot_cache_only_over_a_toml_ssd_dir(tmp_path, caplog):
    """The master switch from the environment: no error, no directory, the manager logs the
    inert fields once, and `paged-cache config` shows them inactive with their sources."""
    from paged_cache.manager import PagedSSDCacheManager

    ssd = tmp_path / "ssd"
    toml = tmp_path / "c.toml"
    toml.write_text(f"[paged_cache]\nssd_dir = '{ssd}'\nssd_max_bytes = '1GB'\n")
    env = dict(os.environ, PAGED_CACHE_HOT_CACHE_ONLY="1")
    config = parse_cli(["--config", str(toml)], env)
    with caplog.at_level(logging.WARNING, logger="paged_cache.config"):
        for _ in range(2):
            with PagedSSDCacheManager(config) as manager:
                assert manager.stats()["hot_cache_only"] is True
    assert not ssd.exists()
    logged = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert logged == [f"hot_cache_only=True (from env:PAGED_CACHE_HOT_CACHE_ONLY): ignoring "
                      f"ssd_dir (from toml:{toml}), ssd_max_bytes (from toml:{toml})"]
    run = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "config", "--config",
                          str(toml)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    lines = {line.split()[0]: line for line in run.stdout.splitlines()}
    assert f"[toml:{toml}]" in lines["ssd_dir"] and "inactive: hot_cache_only" in lines["ssd_dir"]
    assert "[default]" in lines["compression"] and "inactive" in lines["compression"]
    assert "[env:PAGED_CACHE_HOT_CACHE_ONLY]" in lines["hot_cache_only"]
    assert "inactive" not in lines["block_size"] + lines["hot_cache_only"]
    shown = json.loads(subprocess.run(
        [sys.executable, "-m", "paged_cache.cli.main", "config", "--json", "--config", str(toml)],
        env=env, capture_output=True, text=True, check=True).stdout)
    assert shown["ssd_dir"] == {"value": str(ssd), "source": f"toml:{toml}", "active": False}
    assert not ssd.exists()


def test_a_hot_budget_above_ram_is_refused_naming_ram_and_the_source(tmp_path):
    ram = physical_memory_bytes()
    assert ram, "physical RAM must be readable here"
    with pytest.raises(ValueError, match=r"^hot_cache_max_bytes: .* \(from constructor\) exceeds "
                                         r"this machine's RAM \(.+\)"):
        CacheConfig(hot_cache_max_bytes=ram + 1)
    assert CacheConfig(hot_cache_max_bytes=ram).hot_cache_max_bytes == ram
    # the typo of the report: a 100x size on the command line, and the same from the environment;
    # the message repeats the size as it was typed, then in binary units
    typed = f"{ram * 100 // 10**9}GB"
    env = dict(os.environ, PAGED_CACHE_HOT_CACHE_MAX_BYTES=str(ram * 2))
    for argv, environ, source, shown in (
            (["--hot-cache-max-bytes", typed], os.environ, "flag:--hot-cache-max-bytes",
             f"{typed} = {format_size(ram * 100 // 10**9 * 10**9)}"),
            ([], env, "env:PAGED_CACHE_HOT_CACHE_MAX_BYTES", f"{ram * 2} = {format_size(ram * 2)}")):
        run = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "config", *argv],
                             env=environ, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and run.stdout == ""
        assert run.stderr.startswith(f"paged-cache config: error: hot_cache_max_bytes: {shown} "
                                     f"(from {source}) exceeds this machine's RAM "
                                     f"({format_size(ram)})"), run.stderr


def test_config_subcommand_reads_the_environment(tmp_path):
    env = dict(os.environ, PAGED_CACHE_COMPRESSION="lz4", XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "config", "--json"],
                         env=env, capture_output=True, text=True, check=True).stdout
    shown = json.loads(out)
    assert shown["compression"] == {"value": "lz4", "source": "env:PAGED_CACHE_COMPRESSION",
                                    "active": True}
    assert shown["ssd_dir"] == {"value": str(tmp_path / "paged-cache"), "source": "default",
                                "active": True}


def test_the_remote_secret_is_no_flag(tmp_path):
    """Other users can read a command line: --remote-secret is refused, naming the environment
    variable and the TOML setting that take it; the environment gives it."""
    secret = "sixteen chars ok, and more"
    run = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "config",
                          "--remote-secret", secret], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "" and secret not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "paged-cache config: error: --remote-secret: not taken on the command line, where other "
        "users can read it (ps); set PAGED_CACHE_REMOTE_SECRET or remote_secret in a private "
        "--config TOML file")
    assert "--remote-secret" not in subprocess.run(
        [sys.executable, "-m", "paged_cache.cli.main", "serve", "--help"], capture_output=True,
        text=True, timeout=120).stdout
    env = dict(os.environ, PAGED_CACHE_REMOTE_SECRET=secret)
    shown = json.loads(subprocess.run(
        [sys.executable, "-m", "paged_cache.cli.main", "config", "--json"], env=env,
        capture_output=True, text=True, check=True, timeout=120).stdout)
    assert shown["remote_secret"] == {"value": "***", "source": "env:PAGED_CACHE_REMOTE_SECRET",
                                      "active": True}
