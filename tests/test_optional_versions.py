"""An optional package's version never makes paged-cache fail to import: with a real mlx-vlm below
the turboquant extra's range (.ci/old-mlx-vlm.txt: the one exo locks; `make install` puts it alone in
.venv-old-mlx-vlm) first on sys.path, every public name and module imports (the TurboQuant
handler's aside), a KV model is stored and fetched exactly through the SSD tier, and a
TurboQuantKVCache layout is refused: counted, and logged with the supported range. Run in a
subprocess: the suite's own mlx-vlm is the one it imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from paged_cache import compat

ROOT = Path(__file__).resolve().parents[1]
OLD_VLM = ROOT / ".venv-old-mlx-vlm"

SCRIPT = """
import importlib, json, logging, pkgutil, sys, tempfile
from importlib import metadata
from pathlib import Path

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
import paged_cache
publics = {name: type(getattr(paged_cache, name)).__name__ for name in paged_cache.__all__}
failed = {}
for module in pkgutil.walk_packages(paged_cache.__path__, "paged_cache."):
    try:
        importlib.import_module(module.name)
    except Exception as exc:
        failed[module.name] = f"{type(exc).__name__}: {exc}"
import mlx_vlm.turboquant as tq
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from helpers.managers import new_manager
from helpers.prefix import assert_exact, prompt, store_prompt

model = tiny_model("llama")
with tempfile.TemporaryDirectory() as ssd:
    kv = BlockAwarePrefixCache(new_manager(Path(ssd), block_size=16), model)
    stored = store_prompt(model, kv, prompt(40))
    kv.manager.flush()
    kv.manager.trim_hot(0)  # on the SSD only: the fetch reads the block files
    n_kv = assert_exact(model, kv, stored[:37] + [3, 4])
    tier = kv.last_fetch.tier
    kv.manager.close()
packed = BlockAwarePrefixCache(new_manager(block_size=16), model,
                               make_cache=lambda: [tq.TurboQuantKVCache(bits=4) for _ in model.layers])
print(json.dumps({
    "mlx_vlm": metadata.version("mlx-vlm"), "mlx_vlm_file": tq.__file__, "publics": publics,
    "failed": failed,
    "kv_fetched": n_kv, "kv_tier": tier,
    "packed_stored": packed.store(prompt(40), packed.make_cache()),
    "packed_fetched": packed.fetch(prompt(40))[1],
    "refused": packed.stats()["refused_unsupported"], "unsupported": packed.unsupported,
}))
"""


def test_an_out_of_range_mlx_vlm_turns_off_only_the_turboquant_handler() -> None:
    assert (OLD_VLM / "mlx_vlm").is_dir(), f"{OLD_VLM} is missing: `make install` puts it there"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(OLD_VLM), str(ROOT / "tests")])}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    pinned = next(line.split("==")[1].strip() for line in (ROOT / ".ci/old-mlx-vlm.txt").read_text()
                  .splitlines() if line.startswith("mlx-vlm=="))
    assert got["mlx_vlm"] == pinned and got["mlx_vlm_file"].startswith(str(OLD_VLM))
    assert not compat._in_range(tuple(map(int, pinned.split("."))), compat.MLX_VLM_RANGE)
    assert sorted(got["publics"]) == sorted(__import__("paged_cache").__all__)
    # every module imports but the handler module turned off and the adapters of serving engines
    # this environment lacks (each refuses loudly, as when its engine is out of range)
    engines = {name for name in got["failed"] if name.startswith("paged_cache.integrations.")
               and name.split(".")[2] not in ("mlx_lm", "shared")}
    assert set(got["failed"]) - engines == {"paged_cache.handlers.turboquant"}, got["failed"]
    assert got["failed"]["paged_cache.handlers.turboquant"].startswith("IncompatibleVersion")
    assert got["kv_fetched"] == 37 and got["kv_tier"] == "ssd"
    assert got["packed_stored"] == 0 and got["packed_fetched"] == 0 and got["refused"] == 2
    supported = "mlx-vlm" + ",".join(compat.MLX_VLM_RANGE)
    assert supported in got["unsupported"] and f"mlx-vlm {pinned}" in got["unsupported"]
    assert "TurboQuantKVCache" in got["unsupported"]
    warnings = [line for line in run.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and got["unsupported"] in warnings[0], run.stderr[-3000:]
