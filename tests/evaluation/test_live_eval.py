"""The evaluator on the tiny model and the publish gate, against a real policy server with the real openai client."""

from __future__ import annotations

import json
import sys
import time
from functools import partial

import pytest
from openai import OpenAI

from metaclaw.evaluation import ComplianceEvaluator, LiveEvaluator
from metaclaw.modules.policy import LoraPolicy
from metaclaw.modules.publisher import AdapterPublisher
from tests.e2e.conftest import running_policy_server
from tests.serving.conftest import FIXED_ANSWER, train_fixed_answer_adapter

# The fixed-answer adapter says "The answer is 42." to anything; the random base model never does.
PREFS = [{"kind": "starts_with", "text": "The answer is 42"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_spec):
    tmp = tmp_path_factory.mktemp("gate")
    with running_policy_server(tmp) as (url, run_dir):
        good = train_fixed_answer_adapter(tiny_spec, run_dir / "adapters" / "step-000001", steps=40)
        bad = LoraPolicy(tiny_spec.load_model(), rank=8, alpha=16).save_adapter(run_dir / "adapters" / "step-000002")
        yield url, run_dir, good, bad


def evaluator(url: str, **kwargs) -> ComplianceEvaluator:
    return ComplianceEvaluator(url, PREFS, n_prompts=6, max_tokens=12, temperature=0.0, concurrency=2, **kwargs)


def test_evaluator_scores_base_and_adapter_on_heldout_prompts(served):
    url, run_dir, good, _ = served
    ev = evaluator(url, also={"same": PREFS, "no_exclamation": [{"kind": "no_exclamation"}]})
    base = ev.score("tiny")
    assert base.n == 6 and base.errors == 0 and base.compliance == 0.0
    assert base.failures == {"starts_with": 1.0} and base.also["same"] == 0.0  # `also`: the same replies
    assert base.also_failing["same"] == base.examples and len(base.examples) == 3  # every reply broke it: the first 3
    live = LiveEvaluator(ev, run_dir, base_model="tiny", server_url=url)
    live.gatekeeper.load_candidate(good)
    adapted = ev.score(live.gatekeeper.eval_name)
    assert adapted.compliance == 1.0 and all(e.startswith(FIXED_ANSWER[:10]) for e in adapted.examples)
    assert adapted.also == {"same": 1.0, "no_exclamation": 1.0} and adapted.as_dict()["also"] == adapted.also
    assert adapted.also_failing == {"same": [], "no_exclamation": []}
    assert base.quality.nll is None and base.quality.good is None  # no base model named: no quality figures


def test_quality_is_the_base_models_nll_and_the_gate_refuses_a_collapse(served):
    """To the random tiny base model the fixed answer is implausible text (its greedy replies are its likeliest):
    the adapter complies 100% but its replies' base NLL is higher; a gate with a tighter NLL bound refuses it."""
    url, run_dir, good, _ = served
    ev = evaluator(url, base_model="tiny", nll_margin=0.0)
    base = ev.score("tiny")
    assert base.quality.nll is not None and base.quality.nll > 0 and ev.reference_nll == base.quality.nll
    quality = base.quality
    assert quality.nll_threshold == quality.nll and 0.0 < quality.fluent <= 1.0 and quality.good == 0.0  # none complies
    live = LiveEvaluator(ev, run_dir, base_model="tiny", server_url=url)
    live.gatekeeper.load_candidate(good)
    adapted = ev.score(live.gatekeeper.eval_name)
    assert adapted.compliance == 1.0 and adapted.quality.nll > base.quality.nll
    assert adapted.quality.good == adapted.quality.fluent  # every reply complies: good = fluent
    assert adapted.quality.distinct_replies < 0.5  # the same answer to every prompt
    hot_loads = []
    gate = LiveEvaluator(
        ev, run_dir / "gated", base_model="tiny", gate=True, server_url=url,
        max_nll_increase=(adapted.quality.nll - base.quality.nll) / 2,
    ).start(baseline=False)  # fmt: skip
    try:
        gate.submit(1, good, hot_loads.append)
        assert gate.wait(120)
    finally:
        gate.stop()
    assert hot_loads == [] and gate.counts["gate_rejected"] == 1
    decision = gate.results[-1]["gate"]
    assert decision["decision"] == "rejected" and decision["candidate"] == 1.0
    assert decision["candidate_nll"] > decision["base_nll"] and "quality collapsed" in decision["reasons"][0]


def test_gate_serves_a_better_adapter_and_refuses_a_worse_one(served):
    url, run_dir, good, bad = served
    publisher = AdapterPublisher(str(run_dir), str(run_dir / "samples.sqlite"), server_url=url, hot_load_async=False)
    live = LiveEvaluator(evaluator(url), run_dir, base_model="tiny", gate=True, margin=0.1, server_url=url).start()
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")

    def ask() -> str:
        out = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0
        )
        return out.choices[0].message.content or ""

    try:
        live.submit(1, good, partial(publisher._serve, step=1))  # 100% vs the base model's 0%: served
        assert live.wait(120)
        assert ask().startswith(FIXED_ANSWER[:10])
        live.submit(2, bad, partial(publisher._serve, step=2))  # the base model's behaviour again: 0% < 100% - margin
        assert live.wait(120)
        assert ask().startswith(FIXED_ANSWER[:10])  # still the good adapter: the worse one was never swapped in
        assert bad.exists() and (bad / "adapter_model.safetensors").exists()  # kept on disk
        assert publisher.served_version == 1
    finally:
        live.stop()
    assert live.counts["gate_accepted"] == 1 and live.counts["gate_rejected"] == 1
    rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [(r["adapter"], r.get("gate", {}).get("decision")) for r in rows] == [
        ("base", None),
        ("step-000001", "accepted"),
        ("step-000002", "rejected"),
    ]
    assert rows[2]["gate"]["decision"] == "rejected"
    assert (rows[2]["gate"]["served"], rows[2]["gate"]["candidate"]) == (1.0, 0.0)


def test_refused_candidates_in_a_row_send_the_trainer_back_to_the_served_adapter(served, tmp_path):
    """`publish.gate.rebase_after` (2): one refusal leaves the trainer on its weights; a second in a row asks the
    trainer (`Rewind`, as `forget --rollback` does) to go back to the adapter the policy server serves, named by
    the server's card, and the decision says so in gate.jsonl; a served candidate starts the count again."""
    import shutil

    from metaclaw.modules.rewind import Rewind

    url, run_dir, good, bad = served
    work = tmp_path / "run"
    name = "policy:rebase"  # a name of its own on the module's server (the other tests count "policy"'s versions)
    publisher = AdapterPublisher(str(work), str(work / "samples.sqlite"), server_url=url, hot_load_async=False,
                                 lora_name=name)  # fmt: skip
    rewind = Rewind(work)
    live = LiveEvaluator(evaluator(url), work, base_model="tiny", gate=True, server_url=url, rebase_after=2)
    live.tracks["default"].lora_name = name
    live.gatekeeper.rebase.to = lambda agent, path: rewind.request({"default": "default"}[agent], path, forget=False)
    copies = []
    for step in (13, 14, 15):  # the worse adapter as three candidates of their own (where the server loads from)
        copies.append(shutil.copytree(bad, run_dir / "adapters" / f"step-{step:06d}"))
    live.start()
    try:
        for step, path in ((1, good), (13, copies[0])):
            live.submit(step, path, partial(publisher._serve, step=step))
            assert live.wait(120)
        assert rewind.take() == ({}, 0)  # one refusal: nothing asked
        live.submit(14, copies[1], partial(publisher._serve, step=14))
        assert live.wait(120)
        pending, generation = rewind.take()
        assert pending == {"default": str(good.resolve())}  # the served adapter's directory
        assert generation == 0  # not a forget: adapters written before it may still be served
        live.submit(15, copies[2], partial(publisher._serve, step=15))  # the count starts again after a rebase
        assert live.wait(120)
        assert rewind.take() == ({}, 0)
    finally:
        live.stop()
    rows = [json.loads(line) for line in (work / "gate.jsonl").read_text().splitlines()]
    refused = [r for r in rows if r.get("decision") == "rejected"]
    assert [r["step"] for r in refused] == [13, 14, 15]
    assert [r.get("rebased_to") for r in refused] == [None, str(good.resolve()), None]


def test_gate_off_hot_loads_at_once_and_evaluates_on_cadence(served, tmp_path):
    url, _, good, bad = served
    loaded = []
    live = LiveEvaluator(evaluator(url), tmp_path, base_model="tiny", every_n_adapters=2, server_url=url)
    live.start(baseline=False)
    try:
        live.submit(1, good, loaded.append)
        live.submit(2, bad, loaded.append)
        assert loaded == [good, bad]  # never waits for an evaluation
        assert live.wait(120)
    finally:
        live.stop()
    assert [r["adapter"] for r in live.results] == ["step-000002"]  # every 2nd adapter


def test_agent_gates_decide_per_agent_against_each_agents_served_adapter(served, tmp_path):
    """Two agents, one evaluator each: alice's adapter is compared with alice's served one, the default agent's
    with the default one; records carry `agent_id`, metrics are `eval/*` and `agent/alice/eval/*`."""
    from types import SimpleNamespace

    import httpx
    from lightning.pytorch.loggers import CSVLogger

    from metaclaw.modules.hot_load import HotLoader

    url, _, good, bad = served
    default_loader, alice_loader = (HotLoader(url, name, None, 60.0, 3) for name in ("policy", "policy:alice"))
    live = LiveEvaluator(evaluator(url), tmp_path, base_model="tiny", gate=True, margin=0.1, server_url=url,
                         max_pending=3)  # fmt: skip
    live.add_agent("alice", evaluator(url))
    live.start()  # both agents' base model first
    try:
        live.submit(1, good, partial(alice_loader.serve, step=1), agent="alice")  # 100% vs base 0%: served
        live.submit(2, bad, partial(alice_loader.serve, step=2), agent="alice")  # 0% < alice's served 100%: refused
        live.submit(2, bad, partial(default_loader.serve, step=2))  # 0% vs the default agent's served base 0%: served
        assert live.wait(180)
    finally:
        live.stop()
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["agent_id"], r["adapter"], r.get("gate", {}).get("decision")) for r in rows] == [
        ("default", "base", None),
        ("alice", "base", None),
        ("alice", "step-000001", "accepted"),
        ("alice", "step-000002", "rejected"),
        ("default", "step-000002", "accepted"),
    ]
    assert (rows[3]["gate"]["served"], rows[3]["gate"]["candidate"]) == (1.0, 0.0)
    assert (rows[4]["gate"]["served"], rows[4]["gate"]["candidate"]) == (0.0, 0.0)
    served_now = {m["id"]: m.get("root") for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    assert served_now["policy:alice"].endswith("step-000001") and served_now["policy"].endswith("step-000002")
    assert alice_loader.served_version == 1 and default_loader.served_version == 2
    assert live.tracks["alice"].counts["gate_rejected"] == 1 and live.counts["gate_rejected"] == 0
    logger = CSVLogger(tmp_path, name="csv", version="")
    live.flush(SimpleNamespace(loggers=[logger]))
    logger.save()
    header = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"eval/compliance", "eval/gate_accepted", "agent/alice/eval/compliance"} <= set(header)
    assert "agent/alice/eval/gate_rejected" in header and "agent/default/eval/compliance" not in header


def test_the_base_models_replies_are_sampled_once_and_reused_by_a_later_run(served, tmp_path):
    """The second run scores the base model from the cache without asking any server (its URL is dead); a change
    of what identifies the model misses the cache; adapters are never cached."""
    from metaclaw.evaluation.cache import BaselineCache

    url, run_dir, good, _ = served
    cache = BaselineCache(tmp_path / "cache", max_entries=4)
    parts = {"model_files": "abc"}
    first = evaluator(url, base_model="tiny", cache=cache, cache_parts=parts, baseline_name="tiny").score("tiny")
    assert not first.cached and first.ci_low <= first.compliance <= first.ci_high
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    dead = "http://127.0.0.1:9"
    again = evaluator(dead, base_model="tiny", cache=cache, cache_parts=parts, baseline_name="tiny").score("tiny")
    assert again.cached and again.quality.nll == first.quality.nll
    assert (again.compliance, again.n) == (first.compliance, first.n)
    with pytest.raises(RuntimeError, match="every request"):  # other model files: a miss, sampled again
        evaluator(dead, base_model="tiny", cache=cache, cache_parts={"model_files": "xyz"}, baseline_name="tiny").score(
            "tiny"
        )
    ev = evaluator(url, base_model="tiny", cache=cache, cache_parts=parts, baseline_name="tiny")
    live = LiveEvaluator(ev, run_dir, base_model="tiny", server_url=url)
    live.gatekeeper.load_candidate(good)
    assert not ev.score(live.gatekeeper.eval_name).cached  # an adapter is always sampled
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1


def test_the_default_evaluation_asks_every_reply_in_one_batch_before_scoring(tmp_path):
    """An evaluation's replies are sampled together (the HF engine batches concurrent requests): the default
    `eval.concurrency` covers `eval.n_prompts`, and the base-NLL scoring waits until every reply is in. With 4 in
    flight and each thread scoring its reply before asking the next, a 10-minute main job ran 293 generate batches
    for 8 evaluations of 32 replies (batch ~1: 23 tokens/s where one batch of 32 gives 110)."""
    from omegaconf import OmegaConf

    from metaclaw.config import CONFIG_DIR
    from tests.procs import free_port, serving

    ev_cfg = OmegaConf.load(CONFIG_DIR / "eval" / "heldout.yaml")  # the default eval group (train.yaml's)
    assert ev_cfg.concurrency >= ev_cfg.n_prompts
    profile = tmp_path / "profile"
    port = free_port()
    cmd = [
        sys.executable,
        "serve.py",
        "model=tiny",
        "backend.max_batch_size=64",
        "backend.cpu_engine=hf",  # the instrument: its batch counts and linger (what the evaluator asks is the test)
        f"serve.port={port}",
        f"hydra.run.dir={tmp_path / 'server'}",
    ]  # train.py's backend (batches of up to 64)
    env = {"METACLAW_PROFILE_DIR": str(profile), "METACLAW_PROFILE_EVERY_S": "0.2"}
    with serving(cmd, f"http://127.0.0.1:{port}/health", tmp_path / "server.log", env=env):
        # replies long enough that a batch is still running when the last requests arrive (with 16 tokens the tiny
        # model answered so fast on a loaded machine that 32 requests in flight took 9 batches)
        ev = ComplianceEvaluator(f"http://127.0.0.1:{port}", PREFS, n_prompts=ev_cfg.n_prompts, max_tokens=48,
                                 temperature=1.0, concurrency=ev_cfg.concurrency, base_model="tiny")  # fmt: skip
        result = ev.score("tiny")
        assert result.n == ev_cfg.n_prompts and result.errors == 0 and result.quality.nll is not None
        time.sleep(1.0)  # the next profile snapshot
        phases = {}
        for f in profile.glob("server-worker-*.json"):
            phases.update(json.loads(f.read_text())["phases"])
    batches, scores = phases["generate:metaclaw-eval"]["n"], phases["score:metaclaw-eval"]["n"]
    assert 1 <= scores <= ev_cfg.n_prompts  # the replies' base-NLL forwards (concurrent ones share a batch)
    # 4 in flight cannot take fewer than n / 4 batches; the tiny model answers fast enough that some requests
    # still arrive after a batch started, so a few batches remain
    assert batches < ev_cfg.n_prompts / 4, f"{ev_cfg.n_prompts} replies took {batches} generate batches"
