"""compat: the installed mlx-lm is in the supported range, and a missing private name fails at
import with one message naming the range (checked in a subprocess that removes the name first)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from mlx_lm.models.cache import RotatingKVCache

from paged_cache import compat

ROOT = Path(__file__).resolve().parents[1]


def _import_after(breakage: str) -> subprocess.CompletedProcess:
    code = ("import mlx_lm.models.cache as c\n" + breakage + "\nimport paged_cache.caches\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_declared_ranges_match_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["turboquant"]
    assert "mlx-lm" + ",".join(compat.MLX_LM_RANGE) in [d.split(";")[0].split("#")[0].strip()
                                                        for d in deps]
    assert "mlx-vlm" + ",".join(compat.MLX_VLM_RANGE) in deps


def _pins(name: str) -> dict[str, str]:
    lines = (ROOT / ".ci" / name).read_text().splitlines()
    return dict(line.split("#")[0].strip().split("==") for line in lines if "==" in line)


def test_the_lowest_lane_pins_the_declared_floors() -> None:
    """`make test-lowest` installs each floor pyproject.toml and compat.py declare
    (.ci/lowest.txt; mlx-vlm's in .ci/lowest-turboquant.txt); the optional-versions test's
    mlx-vlm is below the extra's range."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {d.split(";")[0].split("#")[0].strip() for d in project["dependencies"]}
    lowest, turboquant = _pins("lowest.txt"), _pins("lowest-turboquant.txt")
    assert f"mlx>={lowest['mlx']}" in floors and lowest["mlx-cpu"] == lowest["mlx"]
    assert lowest["mlx-lm"] == turboquant["mlx-lm"] == compat.MLX_LM_RANGE[0].lstrip(">=")
    assert "mlx-vlm" not in lowest  # its floor needs a higher mlx: the turboquant tests run apart
    assert turboquant["mlx-vlm"] == compat.MLX_VLM_RANGE[0].lstrip(">=")
    assert turboquant["mlx-cpu"] == turboquant["mlx"]
    assert not compat._in_range(compat._parse(_pins("old-mlx-vlm.txt")["mlx-vlm"]),
                                compat.MLX_VLM_RANGE)


def test_installed_versions_are_in_range() -> None:
    assert compat._in_range(compat._version("mlx-lm"), compat.MLX_LM_RANGE)
    assert not compat._in_range((0, 31, 2), compat.MLX_LM_RANGE)
    assert not compat._in_range((0, 33, 0), compat.MLX_LM_RANGE)


@pytest.mark.parametrize("breakage, missing", [
    ("del c.RotatingKVCache._temporal_order", "RotatingKVCache._temporal_order"),
    ("c.RotatingKVCache._update_in_place_renamed = c.RotatingKVCache._update_in_place\n"
     "c.RotatingKVCache.update_and_fetch = lambda self, k, v: self._update_concat(k, v)",
     "update_and_fetch calling _update_in_place"),
    ("import mlx_lm.server as s\ndel s._run_http_server", "mlx_lm.server._run_http_server"),
    pytest.param("import mlx_lm.models.deepseek_v41 as d\ninit = d.LayerCache.__init__\n"
                 "d.LayerCache.__init__ = lambda self, w: (init(self, w), delattr(self, 'pending_gate'))[0]",
                 "deepseek_v41.LayerCache.pending_gate",
                 marks=pytest.mark.skipif(compat.LayerCache is None,
                                          reason="the installed mlx-lm has no deepseek_v41")),
])
def test_missing_private_name_fails_at_import_naming_the_range(breakage: str, missing: str) -> None:
    run = _import_after(breakage)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("paged_cache.compat.IncompatibleVersion: paged-cache supports "
                           "mlx-lm" + ",".join(compat.MLX_LM_RANGE)), last
    assert missing in last


def test_ring_slot_helpers_follow_mlx_lm() -> None:
    import mlx.core as mx
    layer = RotatingKVCache(max_size=4, keep=1)
    layer.update_and_fetch(mx.zeros((1, 1, 3, 2)), mx.zeros((1, 1, 3, 2)))
    layer.update_and_fetch(mx.ones((1, 1, 1, 2)), mx.ones((1, 1, 1, 2)))
    assert compat.ring_slot(layer) == 4
    compat.set_ring_slot(layer, 2)
    assert compat.ring_slot(layer) == 2
    assert compat.temporal_order(layer, layer.keys).shape[2] == 4


def test_batch_options_give_each_sequence_its_sampler_and_stop_tokens() -> None:
    """A sequence without a sampler finishes first; the next ones must still get their own
    sampler and stop tokens (0.31.x misaligns a sampler list that held only None)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from paged_cache.testing import tiny_model

    gen = BatchGenerator(tiny_model("llama"), completion_batch_size=4, prefill_batch_size=4)

    def run(*requests: tuple) -> dict[int, tuple[list[int], str]]:
        uids = [gen.insert([[1, 2, 3]], max_tokens=[n], **compat.batch_options(sampler, stop))[0]
                for sampler, stop, n in requests]
        out: dict[int, tuple[list[int], str]] = {uid: ([], None) for uid in uids}
        while any(reason is None for _, reason in out.values()):
            for r in gen.next_generated():
                out[r.uid] = (out[r.uid][0] + [r.token], r.finish_reason)
        return {i: out[uid] for i, uid in enumerate(uids)}

    assert run((None, [], 2))[0][1] == "length"
    always_7 = lambda logprobs: mx.full(logprobs.shape[:-1], 7, dtype=mx.uint32)  # noqa: E731
    got = run((None, [], 3), (always_7, [], 3), (None, [7], 4), (always_7, [7], 5))
    assert got[0][1] == "length" and len(got[0][0]) == 3 and 7 not in got[0][0]
    assert got[1] == ([7, 7, 7], "length") and got[3] == ([7], "stop")
    assert got[2][1] == "length" and len(got[2][0]) == 4 and 7 not in got[2][0]
    gen.close()


@pytest.mark.turboquant
def test_a_broken_mlx_vlm_turns_off_only_the_turboquant_handler() -> None:
    """An in-range mlx-vlm lacking a private name: paged-cache imports, the TurboQuant handler is
    off, and a TurboQuantKVCache is refused naming the range and what is missing."""
    run = subprocess.run([sys.executable, "-c", "import mlx_vlm.turboquant as t\n"
                          "del t._snapshot_kv_codec\nfrom paged_cache import handlers\n"
                          "handlers.require_handler(t.TurboQuantKVCache(bits=4))\n"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("paged_cache.handlers.registry.UnsupportedCacheError: no paged-cache "
                           "handler for cache type TurboQuantKVCache (the TurboQuant handler is "
                           "off: paged-cache supports mlx-vlm" + ",".join(compat.MLX_VLM_RANGE)), last
    assert "mlx_vlm.turboquant._snapshot_kv_codec" in last
