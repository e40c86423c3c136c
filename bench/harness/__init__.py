"""The bench's shared harness: processes (start, wait for health, stop) and results (JSON lines, one schema)."""

from bench.harness.procs import REPO, free_port, healthy, serving, start, stop_group, wait_for_health, wait_healthy
from bench.harness.results import Record, add_results_argument, collect, publish

__all__ = [
    "REPO", "Record", "add_results_argument", "collect", "free_port", "healthy", "publish", "serving", "start",
    "stop_group", "wait_for_health", "wait_healthy",
]  # fmt: skip
