"""`paged-cache serve` stopped by SIGTERM (as a service manager stops it) logs what its flush
wrote; a real server process, a real model directory and a real SSD directory."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from paged_cache.config import format_size
from paged_cache.testing import write_model_dir
from helpers.serve import conversation, live_stats, paged_argv, server

FLUSH_LINE = re.compile(r"paged_cache\S* INFO stopped \(SIGTERM\): cache flushed in [\d.]+ s, "
                        r"written: SSD tier (\d+) blocks \(([^)]+)\)$", re.MULTILINE)


def test_sigterm_logs_the_blocks_and_bytes_its_flush_wrote(tmp_path):
    model = write_model_dir(tmp_path / "model", "llama")
    ssd, log = tmp_path / "ssd", tmp_path / "serve.log"
    # write-back: a block stays in RAM until it leaves the hot tier or the server stops, so the
    # flush has blocks to write; no tail's timer fires between the count below and the stop (on
    # a loaded machine the default 10 s can pass there)
    argv = paged_argv(model, "--ssd-dir", str(ssd), "--write-policy", "write-back",
                      "--tail-write-delay-s", "600")
    with server(argv, log) as (client, proc, url):
        conversation(client, turns=2)
        deadline = time.monotonic() + 30   # the blocks evicted so far: written, not in flight
        while (before := live_stats(url)["manager"]["ssd"])["queue_blocks"]:
            assert time.monotonic() < deadline, before
            time.sleep(0.1)
    assert proc.returncode == 0, log.read_text()[-3000:]
    flushes = FLUSH_LINE.findall(log.read_text())
    assert len(flushes) == 1, log.read_text()[-3000:]
    (blocks, size), = flushes
    shown = json.loads(subprocess.run(
        [sys.executable, "-m", "paged_cache.cli.main", "inspect", str(ssd), "--json"],
        capture_output=True, text=True, check=True, timeout=120).stdout)["totals"]
    # the line counts the blocks and bytes the stop added to the directory
    assert int(blocks) > 0 and int(blocks) == shown["blocks"] - before["blocks"]
    assert size == format_size(shown["file_bytes"] - before["bytes"])
