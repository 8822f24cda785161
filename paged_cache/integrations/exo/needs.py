"""What an exo environment needs for ``paged-cache exo``, and the line that names what is missing
when an import of exo fails (no exo import here: it runs when exo cannot be imported).

exo is on no package index (the index's ``exo`` is an unrelated project): it is installed from
its repository, whose ``uv sync`` installs what its pyproject pins, among them its own mlx-lm (a
fork with ``mlx_lm.models.deepseek_v4``, which exo's cache module imports, in place of the
index's mlx-lm) and builds its Rust bindings (``exo_rs``, which exo's node imports).
"""

from __future__ import annotations

import importlib.metadata

EXO_REPO = "https://github.com/exo-explore/exo"
INSTALL_EXO = (f"clone exo's repository ({EXO_REPO}), run `uv sync` in it, install paged-cache "
               "into that environment (there: `uv pip install -e PATH-TO-paged-cache`) and run "
               "`uv run paged-cache exo` there")
FORK_REPO = "https://github.com/rltakashige/mlx-lm"   # exo's pyproject: [tool.uv.sources] mlx-lm
FORK_BRANCH = "leo/deepseek-v4"
FORK_MODULE = "mlx_lm.models.deepseek_v4"
RUST_MODULE = "exo_rs"


def missing(error: ImportError, wanted: str) -> str:
    """What ``paged-cache exo`` prints when importing ``wanted`` (an exo module) raised ``error``:
    the part of exo's environment that is missing, judged by the module that failed to import,
    and how an exo user gets it."""
    name = error.name or ""
    root = name.split(".")[0]
    head = f"exo: cannot import {wanted} ({error})"
    if name == "exo":
        return (f"{head}: exo is not installed in this environment. paged-cache's exo adapter "
                f"runs inside exo's own environment: {INSTALL_EXO}. The package index's `exo` "
                "is an unrelated project")
    if root == "exo":
        return (f"{head}: the installed `exo` is not exo's from its repository, or not all of it "
                f"(the package index's `exo` is an unrelated project): {INSTALL_EXO}")
    if root == "mlx_lm":
        return (f"{head}: exo needs its own mlx-lm, a fork that has {FORK_MODULE} (git "
                f"{FORK_REPO}, branch {FORK_BRANCH}); the mlx-lm installed here "
                f"({_version('mlx-lm')}) is not it. `uv sync` in exo's checkout installs it, or "
                f"`pip install --no-deps 'mlx-lm @ git+{FORK_REPO}@{FORK_BRANCH}'`")
    if root == RUST_MODULE:
        return (f"{head}: exo's Rust bindings ({RUST_MODULE}, built from rust/{RUST_MODULE} in "
                "exo's checkout) are not installed. `uv sync` in exo's checkout builds them; "
                "it needs Rust's nightly toolchain (`rustup toolchain install nightly`)")
    return (f"{head}: exo's dependency `{root or name}` is missing. Install exo with its "
            "dependencies: `uv sync` in exo's checkout")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"
