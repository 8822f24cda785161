"""SSD wear: a 20-turn agentic conversation (~20k tokens) through `paged-cache serve` writes at most
1.2x one copy of the conversation's KV, counted by ``bytes_written`` (block files and the
manifest's own writes) and checked against what the kernel saw the server process write."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from paged_cache.testing import write_model_dir
from paged_cache.testing.engines import EngineServer, agentic

GOAL = 1.2  # bytes written / one copy of the conversation's KV
PROBE = 64  # tokens per probe prefill (one_copy)


def process_io(pid: int) -> dict[str, int]:
    """The kernel's I/O counters of a process (``/proc/PID/io``)."""
    lines = Path(f"/proc/{pid}/io").read_text().splitlines()
    return {name: int(value) for name, value in (line.split(": ") for line in lines)}


def one_copy(model_dir: Path, messages: list[dict]) -> tuple[int, int]:
    """(tokens, bytes) of the conversation's cache: one copy of its KV (and of its recurrent
    state, for a hybrid model). Cache bytes are a fixed part (states) plus a part per token (KV
    rows), told from the cache after two short prefills of the same conversation."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(str(model_dir))
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    cache = make_prompt_cache(model)
    sizes = []
    for start in (0, PROBE):
        model(mx.array(ids[start:start + PROBE])[None], cache=cache)
        sizes.append(sum(_held_bytes(layer) for layer in cache))
    per_token = (sizes[1] - sizes[0]) // PROBE
    return len(ids), sizes[0] + per_token * (len(ids) - PROBE)


def _held_bytes(layer) -> int:
    """Bytes a layer holds for its tokens: the valid KV rows (not the preallocated buffer), or
    its state arrays."""
    keys = getattr(layer, "keys", None)
    if keys is not None:
        return (keys.nbytes + layer.values.nbytes) * layer.offset // keys.shape[2]
    arrays = [a for _, a in tree_flatten(layer.state) if isinstance(a, mx.array)]
    mx.eval(arrays)
    return sum(a.nbytes for a in arrays)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_twenty_turn_conversation_writes_one_copy(tmp_path: Path, arch: str) -> None:
    model_dir = write_model_dir(tmp_path / "model", arch, printable_replies=True)
    ssd = tmp_path / "ssd"
    server = EngineServer(sys.executable, ["-m", "paged_cache.cli.main", "serve", "--model",
                                           str(model_dir), "--ssd-dir", str(ssd)],
                          tmp_path, ready="/health", name="serve")
    with server:
        before = process_io(server.process.pid)
        messages = agentic(server.url)
        stats = server.get("/paged-cache/stats")
        after = process_io(server.process.pid)
        with urllib.request.urlopen(server.url + "/metrics") as reply:
            metrics = reply.read().decode()
    # stopped by SIGTERM, it closed its cache and exited normally (the tally below needs it)
    assert server.process.returncode == 0, server.tail()
    ssd_stats = stats["manager"]["ssd"]
    counted = ssd_stats["bytes_written"]
    assert counted == ssd_stats["write_bytes"] + ssd_stats["manifest_write_bytes"]
    exported = [line.split() for line in metrics.splitlines()
                if line.startswith("paged_cache_tier_bytes_written_total{")
                and 'tier="ssd"' in line]
    assert len(exported) == 1 and float(exported[0][1]) >= counted   # read later: the writer runs on
    assert stats["requests"]["requests_hot"] == 19, stats["requests"]   # every turn reused
    # The counter is what the process wrote (wchar: every write call's bytes, sockets and the
    # log included, which are small here).
    seen = after["wchar"] - before["wchar"]
    assert 0.85 * seen <= counted <= seen, (counted, seen)
    tokens, kv = one_copy(model_dir, messages)
    assert 18_000 <= tokens <= 22_000
    inspect = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "inspect", str(ssd),
                              "--json"], capture_output=True, text=True, timeout=120, check=True)
    totals = json.loads(inspect.stdout)["totals"]
    written = totals["written_bytes"]   # recorded by the server, its close included
    assert written >= counted
    # The whole conversation is on disk (its last partial block written at close), once.
    assert totals["file_bytes"] >= 0.95 * kv
    assert written <= GOAL * kv, f"{arch}: wrote {written / kv:.2f}x one copy ({kv} bytes)"
