"""The benchmark families stay runnable: every module imports, and the startup family builds and
opens a small SSD tier through the manifest's own row constructor (a schema change broke it once
without any test noticing). The figures themselves are measured by ``make bench``, not here."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from benchmarks.run import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_family_imports_and_has_run(family: str) -> None:
    module = importlib.import_module(f"benchmarks.{family}")
    assert callable(module.run)


def test_startup_builds_and_opens_a_tier(tmp_path: Path) -> None:
    from benchmarks.startup import build, open_seconds

    build(tmp_path / "c", 50)
    seconds, stats = open_seconds(tmp_path / "c")
    assert seconds > 0 and stats["blocks"] == 50, stats
