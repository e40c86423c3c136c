"""Fill an empty store from a JSONL file of scored turns, tokenised for the model being trained.

Each line: `messages` (the prompt), `response` (text), `reward` (+1/-1/0 or null), optional `hint` (OPD) and
`next_state`. Behaviour logprobs come from the policy as it is (its adapter starts as the identity), teacher
logprobs from the base model given the prompt plus the hint, so the shipped store is honest for any model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from metaclaw.modules.policy import LoraPolicy
from metaclaw.scoring.hints import hinted_messages
from metaclaw.store import Sample, SampleMeta, SampleStore, SampleText
from metaclaw.store.meta import OriginMeta
from metaclaw.wire.render import chat_prompt_ids

log = logging.getLogger(__name__)


@torch.no_grad()
def response_logprobs(policy: LoraPolicy, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """Logprob of each response token after the prompt, temperature 1."""
    seq = torch.tensor([prompt_ids + response_ids])
    lp = policy.logprobs(seq[:, :-1], seq[:, 1:], torch.ones_like(seq[:, :-1]))
    return lp[0, len(prompt_ids) - 1 :].tolist()


def seed_store(
    store: SampleStore,
    path: str | Path,
    tokenizer,
    policy: LoraPolicy,
    needs_reward: bool,
    needs_teacher: bool,
    agent_id: str = "example",
) -> int:
    """Insert the file's turns; each is `ready` when it carries the signal the method needs, else `dropped`."""
    n = 0
    was_training = policy.training
    policy.eval()
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        prompt_ids = chat_prompt_ids(tokenizer, row["messages"])
        response_ids = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        teacher = None
        if row.get("hint") and needs_teacher:
            with policy.reference():
                teacher = response_logprobs(
                    policy, chat_prompt_ids(tokenizer, hinted_messages(row["messages"], row["hint"])), response_ids
                )
        usable = (needs_reward and row.get("reward") is not None) or (needs_teacher and teacher is not None)
        store.insert(
            Sample(
                prompt_ids=prompt_ids,
                response_ids=response_ids,
                behaviour_logprobs=response_logprobs(policy, prompt_ids, response_ids),
                agent_id=agent_id,
                session_id=row["session_id"],
                turn_index=row["turn_index"],
                reward=row.get("reward") if needs_reward else None,
                teacher_logprobs=teacher,
                status="ready" if usable else "dropped",
                text=SampleText(
                    messages=row["messages"], response_text=row["response"], next_state=row.get("next_state")
                ),
                meta=SampleMeta(
                    origin=OriginMeta(source=str(path)),
                    dropped=None if usable else "no_hint" if needs_teacher else "no_reward",
                ),
            )
        )
        n += 1
    policy.train(was_training)
    log.info("Seeded %s with %d example turns from %s (%s)", store.path, n, path, store.counts())
    return n
