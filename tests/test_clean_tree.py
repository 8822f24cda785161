"""The tracked tree holds sources and docs only: no build artifact or binary outside
benchmarks/results/ (the benchmark runs' JSON and plots) is ever committed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results/"
# What a build, an install or an interpreter leaves behind, and archives of any kind.
ARTIFACT_SUFFIXES = (".whl", ".egg", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip",
                     ".gz", ".bz2", ".xz", ".zst", ".7z", ".rar", ".so", ".dylib", ".dll", ".pyd",
                     ".pyc", ".pyo", ".o", ".a", ".exe", ".jar", ".npy", ".npz", ".safetensors")
ARTIFACT_DIRS = ("__pycache__", "build", "dist", ".eggs", ".venv")
SNIFF_BYTES = 8192  # a NUL byte in a file's first bytes: binary


def artifact_reason(path: str, head: bytes) -> str | None:
    """Why the tracked ``path`` (whose first bytes are ``head``) does not belong in the tree, or
    None when it does."""
    if path.startswith(RESULTS):
        return None
    parts = path.split("/")
    name = parts[-1].lower()
    for suffix in ARTIFACT_SUFFIXES:
        if name.endswith(suffix):
            return f"a {suffix} file (build artifact or archive)"
    for part in parts[:-1]:
        if part in ARTIFACT_DIRS or part.endswith(".egg-info"):
            return f"inside {part}/ (build output)"
    if b"\0" in head:
        return "a binary file (NUL bytes)"
    return None


def tracked_files() -> list[str]:
    """``git ls-files`` of the repository this test lives in."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        if not (ROOT / ".git").exists():
            pytest.skip(f"{ROOT} is not a git checkout (an unpacked sdist): no tracked files")
        raise AssertionError(f"git ls-files failed in {ROOT}: {exc}") from exc
    return [p for p in out.decode().split("\0") if p]


def test_no_tracked_file_is_a_build_artifact_or_binary() -> None:
    files = tracked_files()
    assert "paged_cache/manager.py" in files  # the listing is this repository's
    found = {}
    for path in files:
        full = ROOT / path
        head = full.open("rb").read(SNIFF_BYTES) if full.is_file() else b""
        reason = artifact_reason(path, head)
        if reason is not None:
            found[path] = reason
    assert not found, "tracked files that do not belong in the tree (git rm them; keep build " \
        f"outputs in .gitignore): {found}"


@pytest.mark.parametrize("path, head", [
    ("pyflakes-4.1.0-py2.py3-none-any.whl", b"PK\x03\x04"),
    ("dist/paged_cache-0.1.tar.gz", b"\x1f\x8b"),
    ("paged_cache/_ext.cpython-312-darwin.so", b"\xcf\xfa\xed\xfe"),
    ("paged_cache/__pycache__/config.cpython-312.pyc", b"\xcb\r\r\n"),
    ("paged_cache.egg-info/PKG-INFO", b"Metadata-Version: 2.1\n"),
    ("docs/diagram.bin", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"),
])
def test_artifacts_and_binaries_are_recognised(path: str, head: bytes) -> None:
    assert artifact_reason(path, head) is not None


@pytest.mark.parametrize("path, head", [
    ("paged_cache/config.py", b'"""CacheConfig"""\n'),
    ("docs/configuration.md", b"# Configuration\n"),
    ("benchmarks/results/memory.png", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"),
    ("benchmarks/results/lookup.json", b"{}"),
])
def test_sources_docs_and_benchmark_results_pass(path: str, head: bytes) -> None:
    assert artifact_reason(path, head) is None
