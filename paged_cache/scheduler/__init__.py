"""Engine side of paged-cache: requests, block-aligned chunked prefill, boundary snapshots."""

from paged_cache.scheduler.engine import Scheduler
from paged_cache.scheduler.request import GenerationResult, Request, State
from paged_cache.scheduler.snapshots import SnapshotStore

__all__ = ["GenerationResult", "Request", "Scheduler", "SnapshotStore", "State"]
