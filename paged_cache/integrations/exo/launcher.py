"""``paged-cache exo [cache flags] <exo's arguments>``: exo, with paged-cache as the prefix cache
of every runner it starts; ``exo <exo's arguments>`` runs it without (nothing is installed).

The configuration (flags, ``--config`` TOML, ``PAGED_CACHE_*``) is resolved here, passed to the
runner processes in ``settings.ENV``, and a startup hook (``hook``) in a directory of this run's
own, first on ``PYTHONPATH``, patches exo's builder in each of them (and in this process).
With ``--metrics-port`` each runner answers ``/metrics`` and ``/paged-cache/stats`` at that port
+ its rank (``settings.serve_metrics``), on ``METRICS_HOST``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from paged_cache.compat import IncompatibleVersion
from paged_cache.config import CacheConfig
from paged_cache.integrations.exo import compat   # checks the installed exo on import
from paged_cache.integrations.exo.hook import activate, write_hook
from paged_cache.integrations.exo.settings import ENV, METRICS_ENV, config_to_environ
from paged_cache.integrations.shared import stats_http

METRICS_HOST = "127.0.0.1"   # where the runners' stats routes listen (a scraper on each host)


class ServeError(RuntimeError):
    """`paged-cache exo` cannot start as asked; the message says why."""


def runner_environ(config: CacheConfig, hook_dir: Path,
                   environ: dict[str, str] | None = None,
                   metrics_port: int | None = None) -> dict[str, str]:
    """The environment under which exo (and every process it spawns) runs with paged-cache:
    ``ENV`` holding ``config``, ``hook_dir`` (with the hook written in it) first on
    ``PYTHONPATH`` and, with ``metrics_port``, ``METRICS_ENV`` holding the runners' base
    address (ServeError now when that port cannot be bound)."""
    if config.cache_salt_from_user:
        raise ServeError(f"--cache-salt-from-user (from {config.sources['cache_salt_from_user']}): "
                         "exo's requests carry no user and no cache salt, so there are no tenants "
                         "to keep apart; remove it")
    env = dict(os.environ if environ is None else environ)
    write_hook(hook_dir)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(hook_dir) + (os.pathsep + path if path else "")
    env[ENV] = config_to_environ(config)
    env.pop(METRICS_ENV, None)
    if metrics_port is not None:
        try:   # bound once to check it: a port taken is an error now, not in a runner later
            probe = stats_http.start_endpoint(METRICS_HOST, metrics_port, dict)
        except ValueError as error:
            raise ServeError(f"--metrics-port {metrics_port}: {error}") from None
        probe.shutdown()
        probe.server_close()
        env[METRICS_ENV] = f"{METRICS_HOST}:{metrics_port}"
    return env


def serve_main(config: CacheConfig, argv: Sequence[str], metrics_port: int | None = None) -> int:
    """Run exo's own command with ``argv`` in this process, paged-cache in place; its status.
    ``metrics_port``: each runner's stats routes at that port + its rank."""
    hook_dir = Path(tempfile.mkdtemp(prefix="paged-cache-exo-"))
    try:
        os.environ.update(runner_environ(config, hook_dir, metrics_port=metrics_port))
        activate()
        sys.argv = ["exo", *argv]
        try:
            main = compat.exo_main()
        except IncompatibleVersion as error:   # exo's node: its Rust bindings, a dependency
            raise ServeError(str(error)) from None
        try:
            result = main()
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        return result if isinstance(result, int) else 0
    finally:
        shutil.rmtree(hook_dir, ignore_errors=True)
