"""The dashboard: one local page that shows what the service learned and steers it (docs/dashboard.md).

`DashboardData` reads the figures from the run directory (eval.jsonl, gate.jsonl, adapters/, the sample store,
read-only) and, in a live service, from the control plane; `mount_dashboard` serves the page and its data route on
the proxy's port; `python -m metaclaw dashboard --run-dir DIR` serves a finished run read-only.
"""

from metaclaw.control.dashboard.data import DashboardData

__all__ = ["DashboardData"]
