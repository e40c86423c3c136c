"""Redacted views for the judge, the teacher and the skill evolver when they are off this machine.

`PrivacyPolicy.redacts_for(endpoint)` decides per call from the component's destination: redacted text
everywhere but this run's own policy server (its address and key, `PrivacyPolicy.bind_own_server`) and the owner's
`privacy.trusted_outbound` (`privacy.outbound`). The live loop wraps the judge, teacher and evolver
(`metaclaw.loop.wiring`). Turns holding a secret never get here at
all: they are stored `dropped` and the scorer only reads pending ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from metaclaw.privacy.policy import PrivacyPolicy
from metaclaw.store import Sample


def _redacts(policy: PrivacyPolicy, component: Any) -> bool:
    """Whether `component`'s calls get redacted text: by its `endpoint` (`metaclaw.wire.client.Endpoint`; a rule
    judge has none: it runs here and sends nothing)."""
    return policy.redacts_for(getattr(component, "endpoint", None))


class RedactingJudge:
    """A judge that reads `policy.view(sample)` (every secret and personal-data item redacted) whenever its
    destination gets redacted text; decided per call, so a judge re-pointed later is covered."""

    def __init__(self, judge: Any, policy: PrivacyPolicy) -> None:
        self.judge, self.policy = judge, policy

    def _view(self, sample: Sample) -> Sample:
        return self.policy.view(sample) if _redacts(self.policy, self.judge) else sample

    async def reward(self, sample: Sample) -> Any:
        return await self.judge.reward(self._view(sample))

    async def hint(self, sample: Sample) -> str | None:
        return await self.judge.hint(self._view(sample))

    def __getattr__(self, name: str) -> Any:  # bind(), model, base_url, ...: the wrapped judge's
        return getattr(self.judge, name)


class RedactingEvolver:
    """A skill evolver that is handed redacted copies of the failed turns when its destination gets redacted text."""

    def __init__(self, evolver: Any, policy: PrivacyPolicy) -> None:
        self.evolver, self.policy = evolver, policy

    def evolve(self, agent_id: str, failed_turns: Sequence[Mapping[str, Any]]) -> Any:
        if _redacts(self.policy, self.evolver):
            failed_turns = self.policy.view_turns(failed_turns)
        return self.evolver.evolve(agent_id, failed_turns)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.evolver, name)


def teacher_renderer(render: Callable[[Sample, str], list[int]], teacher: Any, policy: PrivacyPolicy):
    """The teacher's prompt renderer, fed a redacted copy of the turn when the teacher's destination gets redacted
    text (its conditioning then differs from the student's by the placeholders as well as the hint)."""

    def rendered(sample: Sample, hint: str) -> list[int]:
        return render(policy.view(sample) if _redacts(policy, teacher) else sample, hint)

    return rendered
