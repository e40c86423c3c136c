"""Skills: a library of short Markdown instructions, retrieved per request, injected, and evolved from failures.

Public API::

    Skill, SkillLibrary, BM25Ranker, EmbeddingRanker, SkillRanker, extract_query,
    SkillInjector, SkillEvolver, FailedTurn, EvolutionResult
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metaclaw.skills.evolve import EvolutionResult, FailedTurn, SkillEvolver
from metaclaw.skills.inject import SkillInjector
from metaclaw.skills.library import DEFAULT_AGENT_ID, SkillLibrary, bank_dir, default_root
from metaclaw.skills.query import DEFAULT_STRIP_PATTERNS, extract_query
from metaclaw.skills.ranking import BM25Ranker, SkillRanker
from metaclaw.skills.skill import Skill, SkillFormatError, validate_agent_id, validate_skill_name

if TYPE_CHECKING:
    from metaclaw.skills.embedding import EmbeddingRanker


def __getattr__(name: str) -> Any:
    # EmbeddingRanker pulls numpy/torch/transformers lazily; keep `import metaclaw.skills` light.
    if name == "EmbeddingRanker":
        from metaclaw.skills.embedding import EmbeddingRanker

        return EmbeddingRanker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BM25Ranker",
    "DEFAULT_AGENT_ID",
    "DEFAULT_STRIP_PATTERNS",
    "EmbeddingRanker",
    "EvolutionResult",
    "FailedTurn",
    "Skill",
    "SkillEvolver",
    "SkillFormatError",
    "SkillInjector",
    "SkillLibrary",
    "SkillRanker",
    "bank_dir",
    "default_root",
    "extract_query",
    "validate_agent_id",
    "validate_skill_name",
]
