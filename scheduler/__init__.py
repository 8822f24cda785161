"""Engine side of paged-cache: requests, block-aligned chunked prefill, boundary snapshots."""

from scheduler.engine import Scheduler
from scheduler.request import GenerationResult, Request, State
from scheduler.snapshots import SnapshotStore

__all__ = ["GenerationResult", "Request", "Scheduler", "SnapshotStore", "State"]
