"""The simulated user: hidden preferences (config data) checked by verifiers (code), packaged task prompts, and
the driver that talks to the agent through the rollout proxy and answers like a person."""

from metaclaw.simulate.preferences import KINDS, PreferenceSet, Violation
from metaclaw.simulate.tasks import Task, load_tasks
from metaclaw.simulate.user import SimulatedUser, feedback

__all__ = ["KINDS", "PreferenceSet", "SimulatedUser", "Task", "Violation", "feedback", "load_tasks"]
