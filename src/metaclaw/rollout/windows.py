"""The `mode=auto` hook: a Lightning callback slot that gates training steps to scheduler windows.

The real scheduler (idle / sleep / calendar) plugs in through `mode.scheduler._target_`; until then the
window is always open.
"""

from __future__ import annotations

import lightning as L


class AlwaysOpen(L.Callback):
    """A training window that never closes: `mode=auto` without a configured scheduler behaves like `mode=rl`."""

    def is_open(self) -> bool:
        return True
