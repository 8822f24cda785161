"""`paged-cache exo` names what is missing from exo's environment (exo itself, exo's mlx-lm fork,
its Rust bindings, another dependency) and how an exo user gets it. Without exo (CI): real
import failures in subprocesses, on a sys.path without exo or with the module refused by the
import system (``sys.modules[name] = None``). With exo: tests/engines/test_exo.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version

from paged_cache.integrations.exo import needs

NO_EXO = """
import importlib.util, os, sys
sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "exo"))]
assert importlib.util.find_spec("exo") is None, "exo is still importable"
from paged_cache.cli.main import main
sys.exit(main(["exo", "--hot-cache-only"]))
"""
REFUSED = """
import json, sys
from paged_cache.integrations.exo.needs import missing
out = {}
for name in sys.argv[1:]:
    sys.modules[name] = None
    try:
        __import__(name)
    except ImportError as error:
        out[name] = missing(error, "exo.worker.engines.mlx.cache")
print(json.dumps(out))
"""


def python(script: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))


def test_without_exo_the_launcher_says_exo_is_not_installed_and_how_to_get_it() -> None:
    run = python(NO_EXO)
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("paged-cache exo: error: exo: cannot import exo.worker.engines.mlx."
                           "cache (No module named 'exo')"), line
    assert "exo is not installed in this environment" in line
    assert needs.EXO_REPO in line and "uv sync" in line and "unrelated project" in line


def test_each_missing_part_of_exos_environment_is_named_with_its_remedy() -> None:
    run = python(REFUSED, needs.FORK_MODULE, needs.RUST_MODULE, "daemon")
    assert run.returncode == 0, run.stderr
    said = json.loads(run.stdout)
    fork = said[needs.FORK_MODULE]
    assert "exo needs its own mlx-lm, a fork that has mlx_lm.models.deepseek_v4" in fork
    assert f"git {needs.FORK_REPO}, branch {needs.FORK_BRANCH}" in fork
    assert f"the mlx-lm installed here ({version('mlx-lm')}) is not it" in fork
    assert f"mlx-lm @ git+{needs.FORK_REPO}@{needs.FORK_BRANCH}" in fork
    rust = said[needs.RUST_MODULE]
    assert "exo's Rust bindings (exo_rs, built from rust/exo_rs" in rust and "nightly" in rust
    assert "exo's dependency `daemon` is missing" in said["daemon"]
    for line in said.values():   # none of them blames the package index's exo
        assert "unrelated" not in line and "uv sync" in line
