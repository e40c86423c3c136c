"""Does the people's substance check pass the base model's own answers and fail replies about something else? JSON.

    python bench/studies/substance.py                       # SmolLM2-135M, 2 replies to each people's question
    python bench/studies/substance.py --max-tokens 96 --samples 3

A simulated person corrects a reply that does not answer their question (`metaclaw.simulate.substance`): the
reply answers when its question is among the `top` of the people's questions most similar to it. This samples the
base model's replies to the people's own (training) questions, never a held-out probe, and reports for each `top`:

- `whole`: the share of the base model's replies that pass, as sampled;
- `first_1` / `first_3`: the same replies cut to their first sentence / three sentences (what a short reply of
  the `concise` kind looks like), each a share that passes;
- `swapped`: each reply checked against another question (a reply about something else): the share that
  wrongly passes, the check's false-pass rate on on-topic text about the wrong thing.
"""

from __future__ import annotations

import argparse
import random
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
from metaclaw.serving.engines.hf import HFEngine  # noqa: E402
from metaclaw.serving.sampling import SamplingParams  # noqa: E402
from metaclaw.simulate.preferences import SENTENCE_END  # noqa: E402
from metaclaw.simulate.substance import Substance  # noqa: E402
from metaclaw.simulate.tasks import load_tasks  # noqa: E402
from metaclaw.skills.embedding import EmbeddingRanker  # noqa: E402
from metaclaw.wire.render import chat_prompt_ids  # noqa: E402


def first(text: str, n: int) -> str:
    """The first `n` sentences of `text`, cut where CLaaS's `concise` verifier counts a sentence end."""
    ends = [m.end() for m in SENTENCE_END.finditer(text.strip())]
    return text.strip()[: ends[n - 1]].strip() if len(ends) >= n else text.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--samples", type=int, default=2, help="replies per question")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--tops", default="1,3,5,10")
    p.add_argument("--seed", type=int, default=0)
    add_results_argument(p)
    args = p.parse_args()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={args.model}"])
    engine = HFEngine.from_spec(instantiate(cfg.model))
    questions = [t.prompt for t in load_tasks(None, "train")]
    t0 = time.perf_counter()
    asked, replies = [], []
    params = SamplingParams(n=args.samples, max_tokens=args.max_tokens, temperature=1.0, seed=args.seed)
    for q in questions:
        for o in engine.generate(chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": q}]), params):
            asked.append(q)
            replies.append(engine.tokenizer.decode(o.token_ids, skip_special_tokens=True))
    sampled_s = time.perf_counter() - t0
    rng = random.Random(args.seed)
    swapped = [rng.choice([x for x in questions if x != q]) for q in asked]
    cuts = {"whole": replies, "first_1": [first(r, 1) for r in replies], "first_3": [first(r, 3) for r in replies]}
    out: dict[str, Any] = {"model": cfg.model.name, "questions": len(questions), "replies": len(replies),
                           "max_tokens": args.max_tokens, "sampled_s": round(sampled_s, 1), "tops": {}}  # fmt: skip
    substance = Substance(questions, EmbeddingRanker(), top=1)
    ranks = {name: substance.ranks(asked, texts) for name, texts in cuts.items()}
    ranks["swapped"] = substance.ranks(swapped, replies)
    for top in (int(t) for t in args.tops.split(",")):
        out["tops"][str(top)] = {name: round(sum(r < top for r in rs) / len(rs), 3) for name, rs in ranks.items()}
    failing = [(q, r) for q, r, k in zip(asked, cuts["first_3"], ranks["first_3"], strict=True) if k >= 5]
    out["examples_failing_first_3_at_top_5"] = [{"question": q, "reply": r[:200]} for q, r in failing[:6]]
    publish(__file__, args, out)


if __name__ == "__main__":
    main()
