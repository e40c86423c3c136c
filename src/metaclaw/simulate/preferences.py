"""Hidden user preferences: config data (`kind` + params) checked by code (one verifier per kind).

A preference set comes from config (`preference.rules`) as a list of `{kind: ..., <params>}` mappings, validated
against the typed schemas below; an unknown kind or a missing parameter fails with a message naming it.
`check(reply)` returns one `Violation` per broken rule: what was wrong (`problem`) and the rule as a person would
state it (`instruction`), which the simulated user turns into its correction and OPD turns into the hint.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*(?:\s?%)?")
BULLET = re.compile(r"^\s*(?:[-*•]|(?P<item>\d+)[.)])\s+\S", re.M)  # a list item; `item`: a numbered one's number
SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")  # a run of terminal marks before whitespace or the end (CLaaS's split)
# Emoji blocks counted whatever a character's category (unassigned code points among them; CLaaS's list): flags,
# pictographs and emoticons, transport, supplemental symbols and symbols extended-A.
EMOJI_BLOCKS = ((0x1F1E0, 0x1F1FF), (0x1F300, 0x1F64F), (0x1F680, 0x1F6FF), (0x1F900, 0x1FAFF))
DEFAULT_UNITS = (
    "%|percent|°[cf]?|degrees?|celsius|fahrenheit|k|kelvin|mm|cm|m|km|meters?|metres?|kilometers?|kilometres?|"
    "miles?|feet|foot|ft|inch(?:es)?|in|yards?|mg|g|kg|grams?|kilograms?|pounds?|lbs?|oz|ounces?|ml|l|liters?|"
    "litres?|cups?|tablespoons?|tbsp|teaspoons?|tsp|gallons?|s|sec|seconds?|min|minutes?|h|hrs?|hours?|days?|"
    "weeks?|months?|years?|calories|kcal|cal|steps|times|reps|sets|words|bytes|kb|mb|gb|tb|mbps|gbps|ghz|hz|"
    "w|kw|watts?|v|volts?|mph|km/h|kph|usd|dollars?|\\$|€|euros?|people|countries|bones|items|pages|letters"
)


def _quote(text: str, limit: int = 40) -> str:
    text = " ".join(text.split())
    return f"'{text[:limit]}{'...' if len(text) > limit else ''}'"


@dataclass(frozen=True)
class Violation:
    """One broken rule: what the reply did wrong and the rule as the user states it."""

    kind: str
    problem: str
    instruction: str


class _Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def instruction(self) -> str:
        raise NotImplementedError

    def problem(self, reply: str) -> str | None:
        """None when `reply` complies, else what is wrong with it."""
        raise NotImplementedError

    def check(self, reply: str) -> Violation | None:
        problem = self.problem(reply)
        return None if problem is None else Violation(self.kind, problem, self.instruction())  # type: ignore[attr-defined]


class StartsWith(_Rule):
    """Format: the reply opens with a fixed phrase (case-sensitive, leading whitespace ignored)."""

    kind: Literal["starts_with"] = "starts_with"
    text: str = Field(min_length=1)

    def instruction(self) -> str:
        return f"Always start your reply with '{self.text}'."

    def problem(self, reply: str) -> str | None:
        body = reply.lstrip()
        return None if body.startswith(self.text) else f"Your reply started with {_quote(body[:30] or '(nothing)')}"


class EndsWith(_Rule):
    """Format: the reply closes with a sign-off (trailing whitespace ignored)."""

    kind: Literal["ends_with"] = "ends_with"
    text: str = Field(min_length=1)

    def instruction(self) -> str:
        return f"Always end your reply with '{self.text}'."

    def problem(self, reply: str) -> str | None:
        return None if reply.rstrip().endswith(self.text) else f"Your reply did not end with '{self.text}'"


class MaxWords(_Rule):
    """Format: at most `limit` words."""

    kind: Literal["max_words"] = "max_words"
    limit: int = Field(ge=1)

    def instruction(self) -> str:
        return f"Keep your reply under {self.limit} words."

    def problem(self, reply: str) -> str | None:
        n = len(reply.split())
        return None if n <= self.limit else f"Your reply had {n} words"


def sentences(text: str) -> int:
    """Sentences in `text`, as CLaaS's `concise` verifier counts them: the non-blank pieces between runs of `.`,
    `!` or `?` followed by whitespace or the end. "3.5" does not split, "e.g. " does; "?!" and "..." end one
    sentence; text with no mark (an unfinished sentence, a list without full stops) is one sentence."""
    return sum(1 for piece in SENTENCE_END.split(text.strip()) if piece.strip())


def is_emoji(char: str) -> bool:
    """An emoji as CLaaS's `no_emoji` verifier counts one: any Unicode 'Symbol, other' (so also ©, ™ and °)
    or a character of the supplementary pictograph blocks."""
    code = ord(char)
    return unicodedata.category(char) == "So" or any(lo <= code <= hi for lo, hi in EMOJI_BLOCKS)


class MaxSentences(_Rule):
    """Format: at most `limit` sentences, and (`min_words`) enough words to answer at all."""

    kind: Literal["max_sentences"] = "max_sentences"
    limit: int = Field(ge=1)
    min_words: int = Field(default=0, ge=0)

    def instruction(self) -> str:
        floor = f", but answer in at least {self.min_words} words" if self.min_words else ""
        return f"Keep your reply to {self.limit} sentence{'s' if self.limit > 1 else ''} or fewer{floor}."

    def problem(self, reply: str) -> str | None:
        words = len(reply.split())
        if words < self.min_words:
            return f"Your reply had only {words} word{'s' if words != 1 else ''}"
        n = sentences(reply)
        return None if n <= self.limit else f"Your reply had {n} sentences"


class NoEmoji(_Rule):
    """Style: no emoji (`is_emoji`)."""

    kind: Literal["no_emoji"] = "no_emoji"

    def instruction(self) -> str:
        return "Never use emoji."

    def problem(self, reply: str) -> str | None:
        found = [c for c in reply if is_emoji(c)]
        return None if not found else f"Your reply used {len(found)} emoji"


class Bullets(_Rule):
    """Style: the answer is a bullet (or numbered) list of at least `min_items` items."""

    kind: Literal["bullets"] = "bullets"
    min_items: int = Field(default=2, ge=1)

    def instruction(self) -> str:
        return f"Answer as a bullet list with at least {self.min_items} points."

    def problem(self, reply: str) -> str | None:
        n = len(BULLET.findall(reply))
        return None if n >= self.min_items else f"Your reply had {n} bullet points"


class NoExclamation(_Rule):
    """Style: no exclamation marks."""

    kind: Literal["no_exclamation"] = "no_exclamation"

    def instruction(self) -> str:
        return "Never use exclamation marks."

    def problem(self, reply: str) -> str | None:
        n = reply.count("!")
        return None if n == 0 else f"Your reply used {n} exclamation mark{'s' if n > 1 else ''}"


def numbers(reply: str) -> list[re.Match[str]]:
    """The reply's numbers in digits, without the numbers of a numbered list's items: "1. Preheat the oven" states
    no figure (a list alone won `gives_number` in the main job; `states_units` asked such a marker for a unit)."""
    markers = {m.start("item") for m in BULLET.finditer(reply) if m.group("item")}
    return [m for m in NUMBER.finditer(reply) if m.start() not in markers]


class GivesNumber(_Rule):
    """Content: the reply states at least one number in digits."""

    kind: Literal["gives_number"] = "gives_number"

    def instruction(self) -> str:
        return "Always give a concrete number, written in digits."

    def problem(self, reply: str) -> str | None:
        return None if numbers(reply) else "Your reply gave no number"


class StatesUnits(_Rule):
    """Content: at least one number, and every number is followed by a unit (regex alternatives in `units`)."""

    kind: Literal["states_units"] = "states_units"
    units: str = DEFAULT_UNITS

    def instruction(self) -> str:
        return "Always give numbers with their units (for example 5 km, 20 minutes, 3 cups)."

    def problem(self, reply: str) -> str | None:
        unit = re.compile(rf"\s?(?:{self.units})(?![a-z])", re.I)
        found = numbers(reply)
        if not found:
            return "Your reply gave no number with a unit"
        bare = [m.group().strip() for m in found if not m.group().endswith("%") and not unit.match(reply, m.end())]
        return f"These numbers had no unit: {', '.join(bare[:3])}" if bare else None


class Matches(_Rule):
    """Any rule a regular expression can state; `description` is the rule in the user's words."""

    kind: Literal["regex"] = "regex"
    pattern: str = Field(min_length=1)
    description: str = Field(min_length=1)
    must_match: bool = True

    def instruction(self) -> str:
        return self.description if self.description.endswith(".") else f"{self.description}."

    def problem(self, reply: str) -> str | None:
        found = re.search(self.pattern, reply, re.S) is not None
        if found == self.must_match:
            return None
        return "Your reply did not follow that" if self.must_match else "Your reply did exactly what I asked you not to"


Rule = Annotated[
    StartsWith
    | EndsWith
    | MaxWords
    | MaxSentences
    | Bullets
    | NoExclamation
    | NoEmoji
    | GivesNumber
    | StatesUnits
    | Matches,
    Field(discriminator="kind"),
]
_RULES = TypeAdapter(list[Rule])
KINDS = ("starts_with", "ends_with", "max_words", "max_sentences", "bullets", "no_exclamation", "no_emoji",
         "gives_number", "states_units", "regex")  # fmt: skip


class PreferenceSet:
    """The user's hidden preferences: every rule must hold for a reply to comply.

    Args:
        rules: `{kind, **params}` mappings (e.g. from `preference.rules`); validated, unknown kinds refused.
    """

    def __init__(self, rules: Iterable[Mapping[str, Any]]) -> None:
        rules = [dict(r) for r in rules]
        if not rules:
            raise ValueError("preference.rules is empty: the simulated user needs at least one preference")
        self.rules: list[_Rule] = _RULES.validate_python(rules)

    def check(self, reply: str) -> list[Violation]:
        """The rules `reply` breaks (empty: it complies). An empty reply never complies: nothing was answered."""
        broken = [v for v in (r.check(reply) for r in self.rules) if v is not None]
        if not reply.strip():
            broken.insert(0, Violation("answered", "Your reply was empty", "Please answer the question."))
        return broken

    def complies(self, reply: str) -> bool:
        return not self.check(reply)

    def describe(self) -> str:
        return " ".join(r.instruction() for r in self.rules)
