"""`ComplianceEvaluator`: sample held-out prompts from the policy server and score the replies with the verifier.

It talks to the policy server directly (not through the proxy), so evaluation turns are never captured as
training data. `score(model)` asks every chosen prompt `samples_per_prompt` times (the base model's name or an
adapter's) and returns the share of replies that comply with every preference, plus per-rule failure rates,
and their quality (`metaclaw.evaluation.quality`): the base model's NLL per token of each reply, the share of
good replies (compliant and fluent) and cheap diversity signals. Each compliance figure carries its 95% Wilson
score interval (`ci_low`, `ci_high`). With a `BaselineCache`, the base model's replies are sampled once per
(model files, engine, messages, sampling, max_tokens) and reused by later runs (`metaclaw.evaluation.cache`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from metaclaw import profiling
from metaclaw.evaluation.cache import BaselineCache
from metaclaw.evaluation.collapse import CollapseStats, collapse_stats
from metaclaw.evaluation.quality import base_nll, fluency, text_stats
from metaclaw.simulate.preferences import PreferenceSet
from metaclaw.simulate.tasks import load_tasks
from metaclaw.thinking import Thinking, read_answer
from metaclaw.wire.client import Endpoint, chat

EVAL_USER = "metaclaw-eval"  # the OpenAI `user` field of evaluation requests: the server counts their cost apart


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% for z = 1.96); (0, 1) when n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class ReplyQuality:
    """How the replies read beside compliance: base-model NLL, fluent and good shares, diversity, junk."""

    nll: float | None = None  # the base model's mean NLL per token of these replies (nats); None: quality off
    fluent: float | None = None  # share of replies with NLL <= the base model's own mean + nll_margin
    good: float | None = None  # share of replies that comply and are fluent
    nll_threshold: float | None = None
    distinct_2: float = 0.0
    distinct_replies: float = 0.0
    junk: float = 0.0


_COLLAPSE_KEYS = ("top_opening", "top_opening_share", "opening_entropy", "self_rouge_l")


@dataclass
class EvalResult:
    """Compliance of one model on the held-out prompts; `as_dict` is the flat eval.jsonl record."""

    model: str
    compliance: float
    n: int
    failures: dict[str, float] = field(default_factory=dict)  # per rule kind: share of replies breaking it
    errors: int = 0
    seconds: float = 0.0
    examples: list[str] = field(default_factory=list)
    quality: ReplyQuality = field(default_factory=ReplyQuality)
    reward: float | None = None  # judge fallback: the mean judge reward of the held-out turns
    ci_low: float | None = None  # 95% Wilson interval of `compliance`
    ci_high: float | None = None
    cached: bool = False  # the base model's replies came from the cache (sampled by an earlier run)
    collapse: CollapseStats | None = None  # collapse onto a stock phrase (evaluation.collapse); None: not measured
    also: dict[str, float] = field(default_factory=dict)  # the same replies' compliance with each `also` verifier
    also_failing: dict[str, list[str]] = field(default_factory=dict)  # per `also` verifier: replies that broke it

    def as_dict(self) -> dict[str, Any]:
        """The record as eval.jsonl stores it: one flat object, the quality and collapse figures among the rest."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("quality", "collapse")}
        head = {k: out.pop(k) for k in ("model", "compliance", "n", "failures", "errors", "seconds", "examples")}
        collapse = asdict(self.collapse) if self.collapse is not None else dict.fromkeys(_COLLAPSE_KEYS)
        return {**head, **asdict(self.quality), **out, **collapse}


@dataclass(frozen=True)
class HeldoutAsks:
    """How the held-out prompts are asked: as the simulated user asks (`ComplianceEvaluator`'s arguments)."""

    samples_per_prompt: int = 1
    max_tokens: int = 32
    temperature: float = 1.0
    system: str | None = None
    thinking: Thinking = field(default_factory=lambda: Thinking.of(None))


@dataclass(frozen=True)
class BaselineReuse:
    """Where the base model's replies are reused from, and what identifies it (`eval.cache`)."""

    cache: BaselineCache | None = None
    parts: dict[str, Any] | None = None  # the served base model beyond its name (files' hash, engine, dtype)
    name: str | None = None  # the model name whose replies are cached (the server's base model name)


@dataclass(frozen=True)
class Verifiers:
    """What a held-out reply is checked against: the run's preference (`main`), and other kinds' verifiers whose
    compliance on the same replies is reported beside it (`also`, e.g. a preference that must stay kept)."""

    main: PreferenceSet
    also: dict[str, PreferenceSet]


class ComplianceEvaluator:
    """Held-out compliance of a served model.

    Args:
        server_url: the policy server's base URL (no `/v1`).
        preferences: the hidden rules (`[{kind, ...}]`) the replies are checked against.
        tasks_file: JSONL of tasks; None: the packaged ones.
        split: the held-out split's name.
        n_prompts: prompts asked per evaluation (a fixed, seeded subset; all when larger than the split).
        samples_per_prompt: replies sampled per prompt.
        max_tokens: per reply (as the simulated user asks).
        temperature: sampling temperature (as the simulated user asks, so the figure is what the user sees).
        system: system prompt, as the simulated user sends it.
        api_key: the server's key.
        timeout_s: per request.
        concurrency: requests in flight.
        seed: which prompts.
        keep_examples: replies kept in the result for the log.
        injector: with skills on, the proxy's skill injector: held-out prompts get the skills the agent would
            (`inject(messages, agent_id)`), so the figure is what the user sees.
        agent_id: whose skills.
        base_model: the server's base model name: replies are scored under it (None: no NLL, no `good`).
        nll_margin: a reply is fluent when its base NLL is at most the base model's own mean plus this (nats).
        cache: where the base model's replies are reused from (None: sampled every run).
        cache_parts: what identifies the served base model beyond its name (model files' hash, engine, dtype);
            the cache is used only when given.
        baseline_name: the model name whose replies are cached (the server's base model name).
        thinking: `model.thinking` (`metaclaw.thinking.Thinking`), as the simulated user sends it; the verifier
            reads the answer, never the reasoning.
        also: more verifiers by name, checked on the same replies (`EvalResult.also`): that training for one
            preference keeps another (a bench's `--also-verify`).
    """

    def __init__(
        self,
        server_url: str,
        preferences: list[Mapping[str, Any]] | PreferenceSet,
        tasks_file: str | None = None,
        split: str = "heldout",
        n_prompts: int = 16,
        samples_per_prompt: int = 1,
        max_tokens: int = 32,
        temperature: float = 1.0,
        system: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        concurrency: int = 2,
        seed: int = 0,
        keep_examples: int = 3,
        injector: Any = None,
        agent_id: str = "simulated-user",
        base_model: str | None = None,
        nll_margin: float = 1.0,
        cache: BaselineCache | None = None,
        cache_parts: dict[str, Any] | None = None,
        baseline_name: str | None = None,
        thinking: Thinking | Mapping[str, Any] | None = None,
        also: Mapping[str, list[Mapping[str, Any]] | PreferenceSet] | None = None,
    ) -> None:
        if n_prompts < 1 or samples_per_prompt < 1 or concurrency < 1:
            raise ValueError("eval: n_prompts, samples_per_prompt and concurrency must be >= 1")
        self.verify = Verifiers(
            preferences if isinstance(preferences, PreferenceSet) else PreferenceSet(preferences),
            {name: r if isinstance(r, PreferenceSet) else PreferenceSet(r) for name, r in (also or {}).items()},
        )
        tasks = load_tasks(tasks_file, split)
        self.prompts = [t.prompt for t in random.Random(seed).sample(tasks, min(n_prompts, len(tasks)))]
        self.api_key, self.timeout_s = api_key, timeout_s
        self.rebind(server_url)
        self.asks = HeldoutAsks(samples_per_prompt, max_tokens, temperature, system, Thinking.of(thinking))
        self.concurrency, self.keep_examples = concurrency, keep_examples
        self.injector, self.agent_id = injector, agent_id
        self.base_model, self.nll_margin = base_model, nll_margin
        self.reference_nll: float | None = None  # the base model's mean NLL of its own replies (first scored)
        self.reuse = BaselineReuse(cache, cache_parts, baseline_name or base_model)

    def rebind(self, server_url: str) -> None:
        """Ask `server_url` (a policy server's base URL) from now on."""
        self.server_url = server_url.rstrip("/")
        self.endpoint = Endpoint(server_url, self.api_key)

    def _messages(self, prompt: str) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.asks.system}] if self.asks.system else []
        messages.append({"role": "user", "content": prompt})
        if self.injector is not None:
            messages, _ = self.injector.inject(messages, self.agent_id)
        return messages

    def _cache_key(self, model: str, jobs: list[str]) -> tuple[str, dict[str, Any]] | None:
        """The cache entry of `model`'s replies to `jobs`, when `model` is the base model and a cache is set."""
        if self.reuse.cache is None or self.reuse.parts is None or model != self.reuse.name:
            return None
        parts = {
            "model": model,
            **self.reuse.parts,
            "messages": [self._messages(p) for p in jobs],
            **self.asks.thinking.fields(self.asks.max_tokens),
            "temperature": self.asks.temperature,
            "quality": bool(self.base_model),
        }
        return self.reuse.cache.key(parts), parts

    def has_cached(self, model: str) -> bool:
        """Whether `model`'s replies are in the cache (scoring it then asks no server)."""
        jobs = [p for p in self.prompts for _ in range(self.asks.samples_per_prompt)]
        entry = self._cache_key(model, jobs)
        return entry is not None and self.reuse.cache.get(entry[0]) is not None  # type: ignore[union-attr]

    def _sample(self, model: str, jobs: list[str]) -> tuple[list[tuple[str, float | None] | None], bool]:
        """Every job's reply (None: the request failed) and whether they came from the cache.

        Two phases, each with `concurrency` requests in flight: every reply is asked first, then every reply's
        base NLL. The server samples concurrent requests for one model in one batched generate, so asking them
        all at once keeps them together: a thread that scored its reply before asking the next one desynchronised
        the batch (293 generate batches for 8 evaluations of 32 replies in a 10-minute main job, i.e. batch ~1)."""
        entry = self._cache_key(model, jobs)
        if entry is not None:
            stored = self.reuse.cache.get(entry[0])  # type: ignore[union-attr]
            if stored is not None and len(stored) == len(jobs):
                return [(r["text"], r["nll"]) for r in stored], True
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="eval") as pool:
            asked = list(pool.map(lambda p: self._timed(self._ask, model, p), jobs))
            replies = list(pool.map(lambda a: None if a is None else self._timed(self._scored, a), asked))
        if entry is not None and all(r is not None for r in replies):
            self.reuse.cache.put(entry[0], [{"text": r[0], "nll": r[1]} for r in replies], entry[1])  # type: ignore[union-attr,index]
        return replies, False

    @staticmethod
    def _timed(fn: Any, *args: Any) -> Any:
        with profiling.phase("eval_client", cpu="thread"):
            return fn(*args)

    def _ask(self, model: str, prompt: str) -> tuple[str, list[int], list[int]] | None:
        """`model`'s reply to `prompt`: its text and, when replies are scored, the prompt's and reply's token ids
        (None: the request failed, counted as an error, never as a compliant or failing reply)."""
        try:
            fields = self.asks.thinking.fields(self.asks.max_tokens)
            body = {"model": model, "messages": self._messages(prompt), "max_tokens": fields.pop("max_tokens"),
                    "temperature": self.asks.temperature, "user": EVAL_USER, **fields,
                    **({"return_token_ids": True} if self.base_model else {})}  # fmt: skip
            raw = chat(self.endpoint, body, self.timeout_s, max_retries=1)
            choice = raw["choices"][0]
            text = read_answer(choice.get("message") or {}, choice.get("finish_reason"), "evaluator",
                               self.asks.max_tokens)  # fmt: skip
            if not self.base_model:
                return text, [], []
            prompt_ids, reply_ids = raw.get("prompt_token_ids"), raw["choices"][0].get("token_ids")
            if not prompt_ids or reply_ids is None:
                raise ValueError("the policy server returned no token ids (return_token_ids)")
        except Exception:  # noqa: BLE001 - counted as an error
            return None
        return text, list(prompt_ids), list(reply_ids)

    def _scored(self, asked: tuple[str, list[int], list[int]]) -> tuple[str, float | None] | None:
        """The reply's text and base NLL per token (None: not scored, or an empty reply); None when the scoring
        request failed (the reply counts as an error)."""
        if not self.base_model:
            return asked[0], None
        try:
            return asked[0], base_nll(self.endpoint, self.base_model, asked[1], asked[2], self.timeout_s,
                                      user=EVAL_USER)  # fmt: skip
        except Exception:  # noqa: BLE001 - counted as an error
            return None

    def score(self, model: str) -> EvalResult:
        """Ask every held-out prompt; the share of replies that comply (errors excluded, and counted)."""
        if self.base_model and self.reference_nll is None and model != self.base_model:
            self.score(self.base_model)  # fluency is measured against the base model's own replies
        t0 = time.monotonic()
        jobs = [p for p in self.prompts for _ in range(self.asks.samples_per_prompt)]
        replies, cached = self._sample(model, jobs)
        done = [r for r in replies if r is not None]
        errors = len(replies) - len(done)
        if not done:
            raise RuntimeError(f"eval: every request to {model!r} failed ({errors} errors)")
        ok_replies = [text for text, _ in done]
        nlls = [nll for _, nll in done]
        broken: dict[str, int] = {}
        compliant: list[bool] = []
        for reply in ok_replies:
            violations = self.verify.main.check(reply)
            compliant.append(not violations)
            for v in violations:
                broken[v.kind] = broken.get(v.kind, 0) + 1
        n = len(ok_replies)
        quality = self._quality(model, compliant, nlls)
        stats = text_stats(ok_replies)
        by_prompt: dict[str, list[str]] = {}
        for prompt, answered in zip(jobs, replies, strict=True):
            if answered is not None:
                by_prompt.setdefault(prompt, []).append(answered[0])
        collapse = collapse_stats(list(by_prompt.values()))
        # each `also` verifier's failing replies, read and not only counted (a ° or ™ is a "So" symbol as an emoji is)
        also_broken = {name: [r for r in ok_replies if not p.complies(r)] for name, p in self.verify.also.items()}
        low, high = wilson_interval(sum(compliant), n)
        return EvalResult(
            model=model,
            compliance=sum(compliant) / n,
            ci_low=low,
            ci_high=high,
            cached=cached,
            n=n,
            failures={k: c / n for k, c in sorted(broken.items())},
            errors=errors,
            seconds=time.monotonic() - t0,
            examples=ok_replies[: self.keep_examples],
            quality=ReplyQuality(
                **quality, distinct_2=stats.distinct_2, distinct_replies=stats.distinct_replies, junk=stats.junk
            ),  # fmt: skip
            collapse=collapse,
            also={name: (n - len(bad)) / n for name, bad in also_broken.items()},
            also_failing={name: bad[: self.keep_examples] for name, bad in also_broken.items()},
        )

    def _quality(self, model: str, compliant: list[bool], nlls: list[float | None]) -> dict[str, float | None]:
        """Mean base NLL, fluent and good shares; the base model's own mean becomes the reference."""
        if not self.base_model:
            return {}
        if model == self.base_model and self.reference_nll is None:
            self.reference_nll = fluency(nlls, compliant, None, 0.0)["nll"]
        return fluency(nlls, compliant, self.reference_nll, self.nll_margin)
