"""The publish gate and the regression watch of the live service (`rollout=proxy` defaults), on the tiny model
with a real policy server: a damaged adapter is refused and never served; one whose estimate rests on two
effective turns is served as inconclusive; a served one that turns bad is rolled back through the control plane."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
from hydra.utils import instantiate

from metaclaw.control.plane import ControlPlane
from metaclaw.evaluation.quality import base_nll
from metaclaw.evaluation.stats import one_sided_p, snips, wilson
from metaclaw.evaluation.turns import HeldoutTurnsEvaluator
from metaclaw.loop.eval_wiring import bind_evaluator, build_evaluator, build_watch
from metaclaw.loop.wiring import heldout_share
from metaclaw.modules.publisher import AdapterPublisher
from metaclaw.store import Sample, SampleStore, SampleText
from metaclaw.wire.client import Endpoint, load_adapter, teacher_logprobs
from tests.e2e.conftest import running_policy_server
from tests.entrypoints.test_train import compose_train
from tests.serving.conftest import FIXED_ANSWER, train_fixed_answer_adapter

PROMPTS = ["Name a colour.", "What is 2 + 2?", "Say hello.", "Pick a fruit.", "Name a city.", "Count to three.",
           "Describe the sea.", "Give me a verb.", "Name an animal.", "What day is it?"]  # fmt: skip


def test_statistics():
    low, high = wilson(5, 10)
    assert low < 0.5 < high and 0.18 < low < 0.25 and wilson(0, 0) == (0.0, 1.0)
    assert snips([0.0, 0.0], [1.0, 0.0]) == (0.5, 2.0)  # on-policy: the plain mean, n_eff = n
    estimate, n_eff = snips([5.0, -5.0], [0.0, 1.0])
    assert estimate < 0.01 and 1.0 <= n_eff < 1.01  # the target policy writes only the first reply
    assert one_sided_p(1, 20, 18, 20) < 0.001 and one_sided_p(18, 20, 1, 20) > 0.99


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_spec):
    tmp = tmp_path_factory.mktemp("proxy-gate")
    with running_policy_server(tmp) as (url, run_dir):
        fixed = train_fixed_answer_adapter(tiny_spec, run_dir / "adapters" / "step-000004", steps=40)
        yield url, run_dir, fixed


def held_out_turns(
    url: str, store: SampleStore, fixed_is_good: bool, plan: list[tuple[int, str, bool]] | None = None
) -> None:
    """Held-out turns served by the base model and judged by the run's judge (`judge=auto`) from the user's
    reaction. By default two per prompt: the base model's own reply, and FIXED_ANSWER; the user corrects one and
    thanks the other. `plan`: the turns in order, each `(prompt index, "own" | "fixed", the user thanks it)`."""
    if plan is None:
        plan = [(i, kind, good) for i in range(len(PROMPTS))
                for kind, good in (("own", not fixed_is_good), ("fixed", fixed_is_good))]  # fmt: skip
    cfg = compose_train(Path(store.path).parent, "rollout=proxy")
    judge = instantiate(cfg.judge)
    tok_answer = fixed_answer_ids()
    asked: dict[int, tuple[list[int], list[int]]] = {}
    for n, (i, kind, good) in enumerate(plan):
        messages = [{"role": "user", "content": PROMPTS[i]}]
        if i not in asked:
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": messages,
                           "max_tokens": 8, "temperature": 1.0, "return_token_ids": True, "seed": i},
                           timeout=60)  # fmt: skip
            r.raise_for_status()
            body = r.json()
            asked[i] = body["prompt_token_ids"], body["choices"][0]["token_ids"]
        prompt_ids, own = asked[i]
        reply = own if kind == "own" else tok_answer
        sample = Sample(
            prompt_ids, reply, teacher_logprobs(Endpoint(url), "tiny", prompt_ids, reply), session_id=f"s{i}-{n}",
            text=SampleText(messages=messages, response_text="",
                            next_state="Thanks, that is perfect." if good else "That's wrong, not what I asked."),
            status="dropped", meta={"dropped": "heldout"},
        )  # fmt: skip
        sample.reward = asyncio.run(judge.reward(sample)).reward
        assert sample.reward == (1.0 if good else -1.0)
        store.insert(sample)


def fixed_answer_ids() -> list[int]:
    """FIXED_ANSWER as the server's tokenizer writes it (an assistant turn's tokens, end of turn included)."""
    from metaclaw.modules.loading import ModelSpec, TinyQwen3

    tok = ModelSpec(name="tiny", path="tiny", dtype="float32", max_seq_len=1024, tiny=TinyQwen3()).load_tokenizer()
    return tok(FIXED_ANSWER)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]


def models(url: str) -> dict[str, dict]:
    return {c["id"]: c for c in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


# Each prompt's own reply, 8 of 10 thanked; the fixed answer to two prompts, one thanked, one corrected: the
# fixed-answer adapter's estimate (0.5 < the served 0.75 - margin) rests on those two turns.
TWO_EFFECTIVE_TURNS = [(i, "own", i < 8) for i in range(len(PROMPTS))] + [(0, "fixed", True), (1, "fixed", False)]


@pytest.mark.parametrize(
    ("fixed_is_good", "plan"),
    [(False, None), pytest.param(True, None, marks=pytest.mark.slow), (False, TWO_EFFECTIVE_TURNS)],
    ids=["damaged-refused", "better-served", "inconclusive-served"],
)
def test_proxy_defaults_gate_candidates_on_the_judged_heldout_turns(served, tmp_path, fixed_is_good, plan):
    """`rollout=proxy` with its defaults holds out turns and gates. The fixed-answer adapter writes what users
    corrected (as if trained on inverted rewards): refused, kept on disk, never served; where users thanked that
    answer, the same adapter is better than the served base model and is served. Where its estimate is below the
    served one by more than the margin but rests on two effective turns, the evidence cannot tell: served, and the
    record says so (the old rule refused it). Off-cadence candidates wait."""
    url, run_dir, fixed = served
    unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "policy"}, timeout=30)
    assert unload.status_code in (200, 404)
    cfg = compose_train(tmp_path, "rollout=proxy")
    assert heldout_share(cfg) > 0 and cfg.publish.gate.enabled and cfg.publish.gate.rollback.enabled
    store = SampleStore(tmp_path / "samples.sqlite")
    held_out_turns(url, store, fixed_is_good, plan)
    live = build_evaluator(cfg)
    assert live is not None and live.gate
    bind_evaluator(cfg, live, url, None, store)
    publisher = AdapterPublisher(str(tmp_path), str(tmp_path / "samples.sqlite"), server_url=url, hot_load_async=False)
    candidates = []
    for step in (1, 2, 3, 4):
        target = run_dir / "adapters" / tmp_path.name / f"step-{step:06d}"  # the server loads from its root only
        shutil.copytree(fixed, target)
        candidates.append(target)
    try:
        for step, path in enumerate(candidates, 1):
            live.submit(step, path, partial(publisher._serve, step=step))
            if step < 4:
                assert "policy" not in models(url)  # not on the gate's cadence: kept, not served
        assert live.wait(300)
    finally:
        live.stop()
    rows = [json.loads(line) for line in (tmp_path / "gate.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["step"] == 4 and rows[0]["n"] == len(plan or PROMPTS * 2)
    decision = rows[0]
    served_ci, cand_ci = decision["served_ci"], decision["candidate_ci"]
    assert served_ci[0] <= decision["served"] <= served_ci[1] and cand_ci[0] <= decision["candidate"] <= cand_ci[1]
    share = 0.5 if plan is None else sum(good for _, _, good in plan) / len(plan)
    assert abs(decision["served"] - share) < 0.05  # the base model served these turns: the plain share
    assert decision["evidence"]["served"]["model"] == "tiny"
    if plan is not None:
        assert decision["decision"] == "accepted" and decision["finding"] == "inconclusive", decision
        margin = live.gatekeeper.margin
        assert abs(decision["candidate"] - 0.5) < 0.05 and decision["candidate"] < decision["served"] - margin
        assert decision["compliance_test"]["candidate_n"] < 3 and "inconclusive" in decision["note"]
        assert decision["guarded_by"] is None  # this test builds no control plane: the record says nothing watches
        assert models(url)["policy"]["root"].endswith("step-000004")
        assert live.counts["gate_accepted"] == 1 and live.counts["gate_inconclusive"] == 1
    elif fixed_is_good:
        assert decision["decision"] == "accepted", decision
        assert decision["candidate"] > 0.9
        assert models(url)["policy"]["root"].endswith("step-000004")
        assert live.counts["gate_accepted"] == 1
    else:
        assert decision["decision"] == "rejected", decision
        assert decision["candidate"] < 0.1 and "estimated compliance" in decision["reasons"][0]
        assert decision["finding"] == "worse" and decision["compliance_test"]["upper_bound"] < -live.gatekeeper.margin
        assert "policy" not in models(url)  # never served
        assert (candidates[-1] / "adapter_model.safetensors").exists()  # kept on disk
        assert live.counts["gate_rejected"] == 1
    assert live.counts["gate_held"] == 3


def test_a_served_adapter_whose_verdicts_turn_negative_is_rolled_back(served, tmp_path, tiny_spec):
    """`rollout=proxy` defaults (the watch built as the service builds it, `publish.gate.rollback`): step 4 is
    served and users take it well; step 5 replaces it and users start correcting it. The watch, on the evaluator's
    thread, compares the verdicts, rolls back to step 4 through the control plane (the policy server serves it
    again), and says so in gate.jsonl, the control status and the `rolled_back` count."""
    url, run_dir, fixed = served
    worse = run_dir / "adapters" / "step-000005"
    if not worse.exists():
        shutil.copytree(fixed, worse)
    cfg = compose_train(tmp_path, "rollout=proxy")
    store = SampleStore(tmp_path / "samples.sqlite")
    plane = ControlPlane(run_dir, store)
    plane.server_url = url
    live = build_evaluator(cfg)
    build_watch(cfg, live, store, plane)
    assert live.gate and live.watch is not None  # on by default
    live.watch_every_s = 0.2  # the cadence only (default publish.gate.rollback.every_s: 30 s)
    load_adapter(Endpoint(url), "policy", str(fixed.resolve()))  # raises unless 2xx
    first = models(url)["policy"]["adapter_version"]
    bind_evaluator(cfg, live, url, None, store)  # starts the thread: it sees step 4 served
    try:
        deadline = time.monotonic() + 60
        while first not in live.watch.paths.get("policy", {}) and time.monotonic() < deadline:
            time.sleep(0.1)
        load_adapter(Endpoint(url), "policy", str(worse.resolve()))  # raises unless 2xx
        second = models(url)["policy"]["adapter_version"]
        for version, good in ((first, 9), (second, 2)):  # the judged turns (and feedback) of each version
            for i in range(12):
                store.insert(Sample([1, 2], [3], [-1.0], session_id=f"v{version}-{i}", adapter_version=version,
                                    reward=1.0 if i < good else -1.0, status="consumed"))  # fmt: skip
        deadline = time.monotonic() + 60
        while not models(url)["policy"]["root"].endswith("step-000004") and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        live.stop()
    assert models(url)["policy"]["root"].endswith("step-000004")  # the policy server serves the earlier adapter
    record = json.loads((tmp_path / "gate.jsonl").read_text().splitlines()[0])
    assert record["decision"] == "rolled_back" and record["kind"] == "regression"
    assert record["served"]["version"] == second and record["previous"]["version"] == first
    assert record["p_value"] < 0.05 and record["served"]["ci"][1] < record["previous"]["share"]
    assert live.counts["rolled_back"] == 1
    plane.run_dir = tmp_path
    assert plane.status()["gate"][-1]["decision"] == "rolled_back"


class CountingTurns(HeldoutTurnsEvaluator):
    """The real evaluator against the real server, counting the requests the gate makes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[str] = []

    def _logprob(self, model, s):
        self.asked.append(f"logprob:{model}")
        return super()._logprob(model, s)

    def _answer(self, model, s, max_tokens):
        self.asked.append(f"own:{model}")
        return super()._answer(model, s, max_tokens)


def test_the_gate_asks_only_what_it_does_not_know(served, tmp_path):
    """A turn the served version wrote needs no request (its ratio is 1: the estimate is the one the full
    requests give, within 1e-3); another version's logprobs are asked once per turn across gates; the quality
    guard samples only the newest `quality_turns` prompts. One request at a time, a gate on two busy cores
    waited behind every user generation (over 20 minutes with SmolLM2)."""
    url, _, _ = served
    store = SampleStore(tmp_path / "samples.sqlite")
    held_out_turns(url, store, fixed_is_good=False)
    turns = CountingTurns(store, url, "tiny", concurrency=4, quality_turns=3)
    full = turns.compare("tiny", "tiny")  # no version known: every turn asked for both models
    n = full["n"]
    assert n == 2 * len(PROMPTS) and turns.asked.count("logprob:tiny") == 2 * n and turns.asked.count("own:tiny") == 3
    turns.asked.clear()
    fast = turns.compare("tiny", "tiny", served_version=0)  # the base model served every turn
    assert turns.asked.count("logprob:tiny") == n  # the candidate's only
    assert abs(fast["served"]["compliance"] - full["served"]["compliance"]) < 1e-3
    assert abs(fast["served"]["n_eff"] - full["served"]["n_eff"]) < 1e-2
    assert abs(fast["candidate"]["compliance"] - full["candidate"]["compliance"]) < 1e-3
    assert fast["quality_turns"] == 3 and abs(fast["served_nll"] - full["served_nll"]) < 1e-6
    phases = {"served_logprobs", "candidate_logprobs", "got_nll", "quality_sampling", "quality_nll"}
    assert set(fast["seconds"]) == phases and all(v >= 0 for v in fast["seconds"].values())  # the gate's cost
    newest = turns.recent()[-3:]  # the got replies' NLL on the same prompts the candidate answered, and only those
    got = [base_nll(Endpoint(url), "tiny", s.prompt_ids, s.response_ids) for s in newest]
    assert abs(fast["served_nll"] - sum(got) / 3) < 1e-6 and set(turns.memo.got_nll) == {s.id for s in newest}
    turns.asked.clear()
    turns.compare("tiny", "tiny", served_version=7)  # another version serves now: asked once ...
    assert turns.asked.count("logprob:tiny") == 2 * n
    turns.asked.clear()
    turns.compare("tiny", "tiny", served_version=7)  # ... and remembered
    assert turns.asked.count("logprob:tiny") == n
