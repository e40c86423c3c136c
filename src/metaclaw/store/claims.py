"""Which ready samples a training step claims, and which it settles as untrainable: the freshness policy.

`plan_claim` is a pure function of the ready samples' light columns (no token blobs), so every rule is tested
without a database. The rules (docs/online_loop.md, "Freshness"):

- **Newest first.** A step trains on the newest ready samples: a live user's latest turns, produced by the
  adapter being served now. The oldest wait, and are settled by the bounds below (or the backlog bound).
- **Staleness bounds.** A sample more than `max_staleness` adapter versions behind the served adapter, or
  captured more than `max_age_s` seconds ago (a turn reopened by a late reaction: since the reaction, which is
  bounded by `LATE_REACTION_MAX_AGE_S`), is never trained: it is settled `dropped` with reason `stale`
  (kept in the store, counted in `rollout/dropped_stale`). Its behaviour logprobs come from a policy the
  trainer has moved away from, and its reward answers a reply the user no longer gets.
- **Distilled rows age, they do not lag.** A distilled row (`meta.distilled`: a reply the teacher wrote with the
  person's stated preference in context, `scoring.distill`) is trained by cross-entropy, never through an
  importance ratio, and its teacher is the base model, whatever adapter served the corrected turn. The version
  bound does not apply to it; `max_age_s` does. The teacher works behind the live traffic (it is throttled, and
  each correction costs it several forwards), so counted in versions its rows arrived stale: with the defaults,
  12 of 21 in one CLaaS identity run (session 27), and that run learnt nothing.
- **A late reaction ages from the reaction; it does not lag.** A turn the person reacted to after its session went
  idle (`meta.late_reaction`, reopened by the store within `LATE_REACTION_MAX_AGE_S`) was served minutes ago, so
  counted in versions it is stale by the time it is scored: in a 40-minute human-mode run all 131 late reactions
  were scored and none trained, 99 of them dropped by the version bound (session 32). The version bound does not
  apply to it; `max_age_s`, counted from the reaction, does. Its importance weight is bounded like every sample's
  (`loss.max_ratio`), which is what keeps the old behaviour's lag from blowing the step up.
- **Too long / old skill generation**: a sample longer than `max_sample_tokens`, or gathered under an agent's
  older skill generation, is dropped too.
- **Deferred first, never alone.** A batch whose advantages were all zero (four equal rewards) took no step; its
  samples came back `ready` with `meta.deferred` (`SampleStore.defer`). The next batch takes them first, beside at
  least one newer sample, so the rewards they are centred on differ and they get a gradient; alone they wait (the
  staleness bounds still settle them). No sample is consumed without a gradient (issue 42).
- **Many adapters** (`partition`): a batch holds one adapter's samples; among the adapters that can make a
  batch, the one trained least recently goes first (`last_trained`, from the store's `claimed_at`; never trained
  counts as longest ago; ties: the oldest fresh sample), so no adapter starves while another's traffic keeps
  coming, and its batch is its newest samples.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# the ready samples' columns a claim decides on (`n_tokens`: prompt + response, from the blobs' byte lengths)
LIGHT_READY_SQL = (
    "SELECT id, agent_id, adapter_version, created_at, (length(prompt_ids) + length(response_ids)) / ? AS n_tokens,"
    " json_extract(meta, '$.skill_generation') AS gen, json_extract(meta, '$.deferred') AS deferred,"
    " COALESCE(json_extract(meta, '$.late_reaction'), 0) AS late,"
    " json_type(meta, '$.distilled') = 'object' AS distilled FROM samples"
    " WHERE status='ready' ORDER BY id DESC"
)
# when each agent's samples were last claimed for a step (many adapters: the one trained least recently goes first)
LAST_TRAINED_SQL = "SELECT agent_id, MAX(claimed_at) FROM samples WHERE claimed_at IS NOT NULL GROUP BY agent_id"


@dataclass
class ClaimPlan:
    """What one claim does: `drops` (sample id, reason) and `batch` (ids, newest first) with each one's
    `served` adapter version (None when unknown)."""

    drops: list[tuple[int, str]] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    served: dict[int, int | None] = field(default_factory=dict)


def _per_part(value: int | Mapping[str, int] | None, part: str | None) -> int | None:
    return value.get(part) if isinstance(value, Mapping) else value


def plan_claim(
    rows: Sequence[Mapping[str, Any]],
    now: float,
    max_samples: int,
    max_tokens: int | None = None,
    max_sample_tokens: int | None = None,
    min_adapter_version: int | Mapping[str, int] | None = None,
    max_age_s: float | None = None,
    min_samples: int = 1,
    generations: Mapping[str, int] | None = None,
    partition: Callable[[str], str] | None = None,
    partitions: Collection[str] | None = None,
    served_version: int | Mapping[str, int] | None = None,
    last_trained: Mapping[str, float] | None = None,
) -> ClaimPlan:
    """Plan a claim over `rows` (ready samples, newest first: `LIGHT_READY_SQL`).

    Every ready sample that breaks a bound is dropped, whichever adapter's batch is formed, so the counts by
    reason are complete and the backlog holds only trainable samples.
    """
    plan = ClaimPlan()
    fresh: dict[str | None, list[Mapping[str, Any]]] = {}
    for r in rows:
        part = partition(r["agent_id"]) if partition is not None else None
        floor = _per_part(min_adapter_version, part)
        gen, newest = r["gen"], (generations or {}).get(r["agent_id"])
        age = now - r["created_at"] - _late(r)  # a late reaction's turn: from when the person reacted
        reason = None
        if max_sample_tokens is not None and r["n_tokens"] > max_sample_tokens:
            reason = f"too_long:{r['n_tokens']}>{max_sample_tokens}"
        elif floor is not None and r["adapter_version"] < floor and not (_flag(r, "distilled") or _late(r)):
            reason = f"stale:v{r['adapter_version']}<v{floor}"
        elif max_age_s is not None and age > max_age_s:
            reason = f"stale:age {age:.0f}s>{max_age_s:g}s"
        elif isinstance(gen, int) and newest is not None and gen < newest:
            reason = f"old_skill_generation:{gen}<{newest}"
        if reason:
            plan.drops.append((r["id"], reason))
        elif partitions is None or part in partitions:
            fresh.setdefault(part, []).append(r)
    candidates = []  # (oldest fresh id, part, batch)
    for part, part_rows in fresh.items():
        batch = _fill(part_rows, max_samples, max_tokens)
        if len(batch) >= min_samples:
            candidates.append((part_rows[-1]["id"], part, batch))
    if candidates:
        trained: dict[str | None, float] = {}  # adapter -> when its samples were last claimed (agent ids mapped)
        for agent, at in (last_trained or {}).items():
            key = partition(agent) if partition is not None else None
            trained[key] = max(trained.get(key, float("-inf")), at if at is not None else float("-inf"))
        _, _, part, batch = min((trained.get(c[1], float("-inf")), *c) for c in candidates)
        plan.batch = [r["id"] for r in batch]
        plan.served = {r["id"]: _per_part(served_version, part) for r in batch}
    return plan


def _late(row: Mapping[str, Any]) -> float:
    return float(row["late"] or 0) if "late" in row.keys() else 0.0  # noqa: SIM118 - sqlite3.Row: `in` reads values


def _flag(row: Mapping[str, Any], name: str) -> bool:
    return name in row.keys() and bool(row[name])  # noqa: SIM118 - sqlite3.Row: `in` reads values


def _deferred(row: Mapping[str, Any]) -> bool:
    return _flag(row, "deferred")


def _fill(rows: Sequence[Mapping[str, Any]], max_samples: int, max_tokens: int | None) -> list[Mapping[str, Any]]:
    """One adapter's batch from its fresh `rows` (newest first): the newest sample not deferred, then the deferred
    ones, then newer-first the rest, within `max_samples` and `max_tokens`; returned newest first. Empty when
    every row is deferred: a batch of them alone would have the same equal rewards again."""
    new = [r for r in rows if not _deferred(r)]
    if not new:
        return []
    batch, tokens = [], 0
    for r in [new[0], *(r for r in rows if _deferred(r)), *new[1:]]:
        if batch and max_tokens is not None and tokens + r["n_tokens"] > max_tokens:
            break
        batch.append(r)
        tokens += r["n_tokens"]
        if len(batch) >= max_samples:
            break
    return sorted(batch, key=lambda r: -r["id"])


@dataclass
class ServedVersions:
    """The adapter versions the policy server serves now: what a claim's staleness counts against.

    One object, shared at construction by the writer (`AdapterPublisher`, which learns what the server confirmed
    loading) and the reader (`RolloutDataModule`, which claims against it); no object sets the other's fields.
    `default` is the one adapter's version; `by_adapter` each adapter's, when agents have adapters of their own.
    """

    default: int = 0
    by_adapter: dict[str, int] = field(default_factory=dict)

    def update(self, default: int, by_adapter: Mapping[str, int] | None = None) -> None:
        self.default = default
        if by_adapter:
            self.by_adapter = dict(by_adapter)
