"""The supported range of each engine is one fact kept in three places: its adapter's compat
module (checked at import), the pyproject extra users install, and the .ci/engines file
`make test-engines` installs. They must agree (read without importing the engines)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# extra name -> compat module of its adapter
EXTRAS = {"vllm-mlx": "vllm_mlx/compat", "openai-server": "openai_server/compat"}


def constants(module: str) -> dict[str, object]:
    tree = ast.parse((ROOT / "paged_cache" / "integrations" / f"{module}.py").read_text())
    return {t.id: ast.literal_eval(node.value) for node in tree.body
            if isinstance(node, ast.Assign) for t in node.targets
            if isinstance(t, ast.Name) and t.id in ("DIST", "RANGE", "EXTRA")}


@pytest.mark.parametrize("extra", EXTRAS)
def test_compat_range_equals_the_extra_and_the_ci_install(extra):
    c = constants(EXTRAS[extra])
    requirement = f"{c['DIST']}{','.join(c['RANGE'])}"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"][extra] == [requirement]
    assert (ROOT / ".ci" / "engines" / f"{extra}.engine").read_text().split() == [requirement]
    assert c["EXTRA"] == extra


@pytest.mark.parametrize("extra", EXTRAS)
def test_ci_install_keeps_mlx_lm_in_paged_caches_range(extra):
    """The engine's mlx-lm range (in its .txt) lies inside paged-cache's supported range."""
    from paged_cache.compat import MLX_LM_RANGE

    lines = [line.split("#")[0].strip() for line in
             (ROOT / ".ci" / "engines" / f"{extra}.txt").read_text().splitlines()]
    (pin,) = [line for line in lines if line.startswith("mlx-lm")]
    low, high = pin[len("mlx-lm"):].split(",")
    as_tuple = lambda bound: tuple(int(p) for p in bound.lstrip("<>=").split("."))  # noqa: E731
    assert as_tuple(MLX_LM_RANGE[0]) <= as_tuple(low) and as_tuple(high) <= as_tuple(MLX_LM_RANGE[1])
