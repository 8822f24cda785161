"""The conventions of the `paged-cache` command itself, run as a real process: --version from the
package metadata, one --log-level flag (on each subcommand), install hints that work today."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib import metadata

import pytest


def cli(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paged_cache.cli.main", *argv],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))


def test_version_comes_from_the_package_metadata():
    run = cli("--version")
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"paged-cache {metadata.version('paged-cache')}\n"


def test_one_log_level_flag_on_each_subcommand(tmp_path):
    """--log-level follows the command name; before it there is none. The level applies: a
    warning of the configuration (an SSD budget above the filesystem's size) shows at the default
    WARNING and not at ERROR."""
    run = cli("--log-level", "DEBUG", "config")
    assert run.returncode == 2 and "usage: paged-cache" in run.stderr
    assert "(default WARNING)" in cli("config", "--help").stdout
    assert "(default INFO)" in cli("serve", "--help").stdout   # mlx_lm.server's default
    argv = ("config", "--ssd-dir", str(tmp_path), "--ssd-max-bytes", "1000000TiB")
    warned = cli(*argv)
    assert warned.returncode == 0 and "exceeds the filesystem size" in warned.stderr
    quiet = cli(*argv, "--log-level", "error")
    assert quiet.returncode == 0 and "exceeds the filesystem size" not in quiet.stderr
    assert quiet.stdout == warned.stdout
    bad = cli("config", "--log-level", "LOUD")
    assert bad.returncode == 2 and "--log-level: invalid choice: 'LOUD'" in bad.stderr


@pytest.mark.parametrize("command, dist, extra", [("vllm-mlx", "vllm_mlx", "vllm-mlx"),
                                                  ("openai-server", "app", "openai-server")])
def test_a_missing_engine_names_an_install_command_that_works(command, dist, extra):
    """paged-cache is not on the package index: the hint installs the extra from a clone."""
    if importlib.util.find_spec(dist) is not None:
        pytest.skip(f"{command}'s engine is installed here")
    run = cli(command)
    assert run.returncode == 1
    assert f"pip install -e '.[{extra}]' (in a clone of paged-cache)" in run.stderr
    assert "pip install 'paged-cache" not in run.stderr
