"""Fixtures of the engine tests (collected only with `--engine NAME`, inside that engine's
environment): tiny model directories whose greedy replies are printable text."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_cache.testing import write_model_dir
from reuse import ARCHS


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: write_model_dir(root / arch, arch, printable_replies=True) for arch in ARCHS}
