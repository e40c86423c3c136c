"""Learning from the words: which hinted context makes the embedded model follow a stated preference; prints JSON.

    python bench/studies/distill_signal.py                               # SmolLM2-135M, people's `identity` kind
    python bench/studies/distill_signal.py --kind number --prompts 8     # any people.yaml kind

Context distillation (docs/learning.md, "Learning from what people say") samples a reply with the person's
correction in context, keeps it when the correction explains it, and trains it on the prompt without the
correction. This measures, per way of putting the correction in context (`metaclaw.scoring.distill.HINTED_FORMS`),
on the people's own training openings/questions and training correction phrasings (never a held-out probe):

- `compliance`: the share of hinted replies the preference's verifier accepts;
- `gain_complying` / `gain_not`: median of log p(reply | hinted) - log p(reply | plain) per reply token (nats);
  `total_gain_*` the same over the whole reply; `auc_*`: how well each separates complying replies from the rest;
- `accepted` / `accepted_compliance`: the share the acceptance rule keeps (`accepts`), and the verifier's figure
  on those (what training would see);
- `plain_compliance`: the same replies' share without the correction (the base rate on these prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
from metaclaw.scoring.distill import HINTED_FORMS, accepts, hinted_conversation, token_gain, unasked_conversation  # noqa: E402
from metaclaw.serving.engines.hf import HFEngine  # noqa: E402
from metaclaw.serving.sampling import SamplingParams  # noqa: E402
from metaclaw.simulate.people import PreferenceKind  # noqa: E402
from metaclaw.simulate.tasks import load_tasks  # noqa: E402
from metaclaw.wire.render import chat_prompt_ids  # noqa: E402


def auc(pos: list[float], neg: list[float]) -> float | None:
    """P(a complying reply's score > a non-complying one's), ties one half."""
    if not pos or not neg:
        return None
    return round(sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg)), 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--kind", default="identity", help="a people.yaml preference kind")
    p.add_argument("--prompts", type=int, default=12, help="training openings/questions")
    p.add_argument("--samples", type=int, default=4, help="hinted replies per prompt and form")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--forms", default=",".join(HINTED_FORMS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--teacher-temperatures",
        default="1.0",
        help="comma-separated temperatures the hinted replies are sampled at; every gain is over the turn's "
        "own distribution (T=1), whatever the sampling temperature",
    )
    p.add_argument("--rows", type=Path, default=None, help="also write every reply, its gain and relevance (JSONL)")
    add_results_argument(p)
    args = p.parse_args()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={args.model}"])
    kind = PreferenceKind.load(args.kind, "train")
    engine = HFEngine.from_spec(instantiate(cfg.model))
    rng = random.Random(args.seed)
    asks = list(kind.openings[: args.prompts // 2])
    asks += [t.prompt for t in rng.sample(load_tasks(None, "train"), args.prompts - len(asks))]
    t0 = time.perf_counter()
    out: dict[str, Any] = {"model": cfg.model.name, "kind": kind.name, "prompts": len(asks), "forms": {}}
    plain_ok: list[bool] = []
    examples: dict[str, list[str]] = {}
    arms = [(f, float(t)) for f in args.forms.split(",") for t in args.teacher_temperatures.split(",")]
    for form, temp in arms:
        params = SamplingParams(n=args.samples, max_tokens=args.max_tokens, temperature=temp, seed=args.seed)
        arm = form if len(arms) == len(args.forms.split(",")) else f"{form}@{temp}"
        rows = []
        for i, ask in enumerate(asks):
            messages = [{"role": "user", "content": ask}]
            plain = chat_prompt_ids(engine.tokenizer, messages)
            first = engine.generate(plain, SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i))[0]
            reply = engine.tokenizer.decode(first.token_ids, skip_special_tokens=True)
            if (form, temp) == arms[0]:
                plain_ok.append(kind.verifier.complies(reply))
            correction = random.Random(args.seed * 1000 + i).choice(kind.correction)
            hinted = chat_prompt_ids(engine.tokenizer, hinted_conversation(messages, reply, correction, form))
            unasked = chat_prompt_ids(engine.tokenizer, unasked_conversation(messages, reply, correction, form))
            for o in engine.generate(hinted, params):
                text = engine.tokenizer.decode(o.token_ids, skip_special_tokens=True)
                base = engine.prompt_logprobs(plain, o.token_ids)
                hinted_lp = o.logprobs if temp == 1.0 else engine.prompt_logprobs(hinted, o.token_ids)
                gain = token_gain(hinted_lp, base)
                relevance = token_gain(hinted_lp, engine.prompt_logprobs(unasked, o.token_ids))
                rows.append(
                    {
                        "ok": kind.verifier.complies(text),
                        "gain": gain,
                        "accepted": accepts(gain),
                        "relevance": relevance,
                        "text": text,
                        "total": gain * len(base),
                        "plain_nll": -sum(base) / max(len(base), 1),
                    }
                )
        ok = [r for r in rows if r["ok"]]
        acc = [r for r in rows if r["accepted"]]
        med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
        out["forms"][arm] = {
            "replies": len(rows),
            "compliance": round(len(ok) / len(rows), 3),
            "gain_complying": med([r["gain"] for r in ok]),
            "gain_not": med([r["gain"] for r in rows if not r["ok"]]),
            "total_gain_complying": med([r["total"] for r in ok]),
            "total_gain_not": med([r["total"] for r in rows if not r["ok"]]),
            "auc_gain": auc([r["gain"] for r in ok], [r["gain"] for r in rows if not r["ok"]]),
            "auc_total_gain": auc([r["total"] for r in ok], [r["total"] for r in rows if not r["ok"]]),
            "accepted": round(len(acc) / len(rows), 3),
            "accepted_compliance": round(sum(r["ok"] for r in acc) / len(acc), 3) if acc else None,
            "accepted_plain_nll": med([r["plain_nll"] for r in acc]),
            "relevance_accepted_complying": med([r["relevance"] for r in acc if r["ok"]]),
            "relevance_accepted_not": med([r["relevance"] for r in acc if not r["ok"]]),
            "auc_relevance_accepted": auc(
                [r["relevance"] for r in acc if r["ok"]], [r["relevance"] for r in acc if not r["ok"]]
            ),
            "plain_nll": med([r["plain_nll"] for r in rows]),
        }
        if args.rows is not None:
            with open(args.rows, "a") as f:
                f.writelines(json.dumps({"arm": arm, **r}) + "\n" for r in rows)
        examples[arm] = [r["text"][:100] for r in rows[:: max(1, len(rows) // 4)]]
        print(json.dumps({arm: out["forms"][arm], "examples": examples[arm]}), file=sys.stderr, flush=True)
    out["plain_compliance"] = round(sum(plain_ok) / max(len(plain_ok), 1), 3)
    out["examples"] = examples
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    publish(__file__, args, out)


if __name__ == "__main__":
    main()
