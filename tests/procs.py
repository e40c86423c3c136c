"""Start a server subprocess in its own process group, wait for its health route, always kill the group.

One copy for the tests and the bench: `bench/harness/procs.py`.
"""

from bench.harness.procs import REPO, free_port, serving, stop_group, wait_for_health

__all__ = ["REPO", "free_port", "serving", "stop_group", "wait_for_health"]
