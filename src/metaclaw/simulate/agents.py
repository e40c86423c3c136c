"""Several simulated users, each its own agent (docs/agents.md "Several simulated agents").

`rollout.simulated_user` describes the main user (`agent_id`, `preferences`, ...). Its `agents` node adds more
users, keyed by their agent id; each inherits every setting of the main user and overrides what it names, most
often its hidden preference. A preference preset fits as it is (`rules` is read as `preferences`):

```bash
python train.py +agents.alice.mode=rl +preference@rollout.simulated_user.agents.alice=opening
```

Every user runs its own sessions (its own threads, tasks and `X-Agent-Id`); `SimulatedUsers` starts and stops
them together and sums their figures (`stats`, with each user's own under `stats["agents"]`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from metaclaw.simulate.user import SimulatedUser


def user_settings(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each simulated user's settings, the main user first: `agents.<id>` entries merged over the main ones.

    Raises:
        ValueError: naming the field, for an entry that is not a mapping, or one that sets both `rules` and
            `preferences`, or an agent id used twice.
    """
    main = {k: v for k, v in config.items() if k != "agents"}
    users = [main]
    for index, (agent_id, extra) in enumerate((config.get("agents") or {}).items(), start=1):
        field = f"rollout.simulated_user.agents.{agent_id}"
        if not isinstance(extra, Mapping):
            raise ValueError(f"{field} must be a mapping of simulated-user settings, got {extra!r}")
        extra = dict(extra)
        extra.pop("name", None)  # a preference preset's name
        if "rules" in extra:
            if "preferences" in extra:
                raise ValueError(f"{field} sets both `rules` and `preferences`: give one")
            extra["preferences"] = extra.pop("rules")
        users.append({**main, "seed": (main.get("seed") or 0) + index, **extra, "agent_id": str(agent_id)})
    ids = [u.get("agent_id", "simulated-user") for u in users]
    if len(set(ids)) != len(ids):
        raise ValueError(f"rollout.simulated_user.agents: each simulated user needs its own agent id, got {ids}")
    return users


class SimulatedUsers:
    """The run's simulated users, driven together; `users[0]` is the main one."""

    def __init__(self, base_url: str, config: Mapping[str, Any], api_key: str | None = None) -> None:
        self.users = [SimulatedUser(base_url, api_key=api_key, **u) for u in user_settings(config)]

    @property
    def backlog(self) -> Callable[[], int] | None:
        return self.users[0].backlog

    @backlog.setter
    def backlog(self, fn: Callable[[], int] | None) -> None:
        for u in self.users:
            u.backlog = fn

    @property
    def stats(self) -> dict[str, Any]:
        """The main user's figures summed over every user; each user's own under `agents` (when several)."""
        own = {u.agent_id: dict(u.stats) for u in self.users}
        total: dict[str, Any] = {}
        for s in own.values():
            for k, v in s.items():
                if isinstance(v, int | float) and k != "recent_compliance":
                    total[k] = total.get(k, 0) + v
        if len(self.users) > 1:
            total["agents"] = own
        elif "recent_compliance" in own[self.users[0].agent_id]:
            total["recent_compliance"] = own[self.users[0].agent_id]["recent_compliance"]
        return total

    def start(self) -> SimulatedUsers:
        for u in self.users:
            u.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        for u in self.users:
            u.stop(timeout)
