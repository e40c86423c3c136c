"""Plug points for skills: the proxy injects skills on main turns, the scorer hands failed turns to an evolver.

`metaclaw.skills.SkillInjector` and `SkillEvolver` satisfy these Protocols; anything else with the same
methods does too (tests use a trivial injector).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class SkillInjectorLike(Protocol):
    """Adds relevant skills to a request's messages."""

    def inject(
        self, messages: Sequence[Mapping[str, Any]], agent_id: str
    ) -> tuple[list[dict[str, Any]], list[str]]: ...

    def generation(self, agent_id: str) -> int: ...


class SkillEvolverLike(Protocol):
    """Proposes skill changes from turns that scored ≤ 0."""

    def evolve(self, agent_id: str, failed_turns: Sequence[Mapping[str, Any]]) -> Any: ...
