"""Does OPD's teacher know better? The hint's direction, measured on the model's own replies; prints JSON.

    python bench/studies/hint_signal.py                          # SmolLM2-135M, preference=number, 33 prompts x 4
    python bench/studies/hint_signal.py preference=concise --samples 2   # any preference preset or override
    python bench/studies/hint_signal.py --model tiny --prompts 4 # smoke

OPD's advantage is `teacher - student` per token, the teacher being the base model with the user's correction
as a hint (seed 002, `metaclaw.scoring.hints`). It carries a signal only if the hint makes the teacher prefer
the replies that follow the preference. On the held-out prompts the base model samples `--samples` replies per
prompt (the simulated user's `max_tokens` and temperature); the preference's verifier splits them; each reply is
scored with the engine's teacher path (`score_tokens`) under the plain prompt and under the prompt + the hint
the rule judge extracts from the user's correction. Reported:

- `delta_complying` / `delta_not`: median of log p(reply | prompt + hint) - log p(reply | prompt) (nats, whole
  reply) over the replies that comply / do not;
- `auc`: the probability that a complying reply's delta exceeds a non-complying one's (0.5: the hint carries no
  direction; OPD then adds per-token noise of size `mean_abs_token_delta`);
- `compliance_plain` / `compliance_hinted`: the share of replies that comply sampled without / with the hint
  in the prompt (what the teacher would say itself).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from metaclaw.config import CONFIG_DIR  # noqa: E402
from metaclaw.scoring.hints import hinted_messages  # noqa: E402
from metaclaw.scoring.judges import RuleJudge  # noqa: E402
from metaclaw.serving.engines.hf import HFEngine  # noqa: E402
from metaclaw.serving.sampling import SamplingParams  # noqa: E402
from metaclaw.simulate.preferences import PreferenceSet  # noqa: E402
from metaclaw.simulate.tasks import load_tasks  # noqa: E402
from metaclaw.simulate.user import feedback  # noqa: E402
from metaclaw.store import Sample, SampleText  # noqa: E402
from metaclaw.wire.render import chat_prompt_ids  # noqa: E402


def auc(pos: list[float], neg: list[float]) -> float | None:
    """P(a positive's score > a negative's), ties counting one half."""
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--prompts", type=int, default=33, help="held-out prompts (33 in the packaged split)")
    p.add_argument("--samples", type=int, default=4, help="replies per prompt")
    p.add_argument("override", nargs="*", help="train.yaml overrides, e.g. preference=concise")
    add_results_argument(p)
    args = p.parse_args()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={args.model}", *args.override])
    user = cfg.rollout.simulated_user
    prefs = PreferenceSet(user.preferences)
    engine = HFEngine.from_spec(instantiate(cfg.model))
    judge = RuleJudge()
    params = SamplingParams(n=args.samples, max_tokens=int(user.max_tokens), temperature=float(user.temperature),
                            seed=int(cfg.seed))  # fmt: skip
    system = [{"role": "system", "content": user.system}] if user.system else []
    rows: list[dict[str, Any]] = []
    hinted_complies: list[bool] = []
    t0 = time.perf_counter()
    # the hint the live loop gives a reply that breaks every rule: the rule judge on the user's correction
    correction = feedback([v for v in prefs.check("") if v.kind != "answered"])
    hint = asyncio.run(judge.hint(Sample([1], [1], [0.0], text=SampleText(next_state=correction)))) or ""
    for task in load_tasks(user.tasks_file, split="heldout")[: args.prompts]:
        messages = [*system, {"role": "user", "content": task.prompt}]
        plain = chat_prompt_ids(engine.tokenizer, messages)
        hinted = chat_prompt_ids(engine.tokenizer, hinted_messages(messages, hint))
        for out in engine.generate(plain, params):
            violations = prefs.check(engine.tokenizer.decode(out.token_ids, skip_special_tokens=True))
            base = engine.prompt_logprobs(plain, out.token_ids, temperature=params.temperature)
            teacher = engine.prompt_logprobs(hinted, out.token_ids, temperature=params.temperature)
            deltas = [t - b for t, b in zip(teacher, base, strict=True)]
            rows.append({"complies": not violations, "delta": sum(deltas),
                         "abs_token_delta": sum(map(abs, deltas)) / max(len(deltas), 1)})  # fmt: skip
        for out in engine.generate(hinted, params):
            hinted_complies.append(prefs.complies(engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)))
    yes = [r["delta"] for r in rows if r["complies"]]
    no = [r["delta"] for r in rows if not r["complies"]]
    median = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    result = {
        "model": cfg.model.name,
        "preference": prefs.describe(),
        "hint": hint,
        "replies": len(rows),
        "complying": len(yes),
        "compliance_plain": round(len(yes) / max(len(rows), 1), 3),
        "compliance_hinted": round(sum(hinted_complies) / max(len(hinted_complies), 1), 3),
        "delta_complying": median(yes),
        "delta_not": median(no),
        "auc": None if auc(yes, no) is None else round(auc(yes, no), 3),
        "mean_abs_token_delta": round(statistics.mean(r["abs_token_delta"] for r in rows), 3) if rows else None,
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)},
    }
    publish(__file__, args, result)


if __name__ == "__main__":
    main()
