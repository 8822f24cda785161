"""Several MLX distributed ranks on this machine, for tests and benchmarks of sharded models.

``launch`` runs a program on ``ranks`` processes with ``mlx.launch --backend ring`` on 127.0.0.1
(it ships with mlx; nothing else is needed), on ports nobody listens on, and turns a hang (a
rank that skipped a collective stalls the others) into ``LaunchTimeout`` after killing every
rank.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence


class LaunchTimeout(RuntimeError):
    """The ranks did not finish in time (killed): a hang, with what they printed."""


def launcher() -> list[str]:
    """The ``mlx.launch`` command of this interpreter's environment."""
    beside = Path(sys.executable).parent / "mlx.launch"
    found = str(beside) if beside.exists() else shutil.which("mlx.launch")
    if found is None:
        raise RuntimeError("mlx.launch not found beside the interpreter or on PATH: install mlx")
    return [found]


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive TCP ports on 127.0.0.1 nobody listens on now."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            held = []
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
        return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def launch_command(argv: Sequence[str], *, ranks: int = 2, module: bool = False) -> list[str]:
    """The mlx.launch command line that runs ``argv`` (a script and its arguments, or with
    ``module`` a module name and its arguments) on ``ranks`` local ranks with this interpreter."""
    # The program is given whole, behind "env": mlx.launch of mlx 0.31.2 runs a command it
    # finds on PATH as it is (a file it would hand to its --python, resolved out of the
    # virtual environment), that of 0.32.0 runs what follows its options as it is, that of
    # 0.32.4 puts its --python ("env" here too) before it. "--": the program's own options
    # (--host, --port, ...) are not mlx.launch's abbreviations.
    return [*launcher(), "--backend", "ring", "-n", str(ranks),
            "--starting-port", str(free_ports(ranks)), "--python", "env", "--",
            "env", sys.executable, *(["-m"] if module else []), *argv]


def start(argv: Sequence[str], *, ranks: int = 2, module: bool = False,
          env: dict[str, str] | None = None, **popen: object) -> subprocess.Popen:
    """Start the ranks in their own process group (``stop`` ends them all)."""
    return subprocess.Popen(launch_command(argv, ranks=ranks, module=module),
                            env={**os.environ, **(env or {})}, start_new_session=True,
                            **popen)  # type: ignore[call-overload]


def stop(process: subprocess.Popen, grace: float = 5.0) -> None:
    """End the launcher and every rank: SIGTERM to the group, then, once the launcher ended or
    after ``grace`` seconds, SIGKILL to whatever of the group is left (a rank whose peer failed
    to start can outlive the launcher, waiting on the ring for good)."""
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(process, signal.SIGKILL)
    process.wait()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):  # nobody (but zombies, on macOS) left
        pass


def launch(argv: Sequence[str], *, ranks: int = 2, timeout: float = 180.0, module: bool = False,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` on ``ranks`` local ranks to the end (a rank left behind by the launcher is
    killed); ``LaunchTimeout`` (every rank killed) when it takes longer than ``timeout`` seconds."""
    process = start(argv, ranks=ranks, module=module, env=env, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(process)
        out, _ = process.communicate()
        raise LaunchTimeout(f"{ranks} ranks of {' '.join(argv)} still running after {timeout} s "
                            f"(killed); output:\n{(out or '')[-4000:]}") from None
    stop(process)
    return subprocess.CompletedProcess(process.args, process.returncode, out, "")


def can_split(arch: str, mode: str) -> bool:
    """True when the installed mlx-lm can split the tiny ``arch`` model that way: "tensor" needs
    the model's ``shard``, "pipeline" its layer stack's ``pipeline`` (mlx-lm 0.31 has pipeline
    stages for a few architectures only, qwen3_next not among them)."""
    from paged_cache.testing.models import tiny_model

    model = tiny_model(arch)
    if mode == "tensor":
        return hasattr(model, "shard")
    return hasattr(getattr(model, "model", None), "pipeline")
