"""`devices.eval_server`: live evaluation on a policy server process of its own (docs/online_loop.md "Where
evaluation runs"). The device plan decides it; the gate measures the served adapter where it measures the
candidate, so the evaluation server is given the agent's served adapter, same name and version, before each
decision that compares with it."""

from __future__ import annotations

import httpx
import pytest

from metaclaw.devices import DevicePlanError, plan_devices
from metaclaw.evaluation.gate import Track
from metaclaw.loop.eval_wiring import build_evaluator
from metaclaw.loop.live import server_nodes
from metaclaw.loop.policy_server import PolicyServerProcess
from metaclaw.wire.client import Endpoint, load_adapter
from tests.entrypoints.test_train import compose_train
from tests.serving.conftest import train_fixed_answer_adapter

AUTO = {"train": "auto", "infer": "auto"}
HF = {"name": "auto"}


def test_the_device_plan_gives_evaluation_a_server_of_its_own_on_a_shared_cpu():
    cpu = {**AUTO, "train": [], "infer": []}
    assert plan_devices(cpu, HF, 0, False, cpu_count=2, serves_here=True).eval_server  # the 2-core default
    assert "evaluation: a server of its own" in plan_devices(cpu, HF, 0, False, 2, serves_here=True).describe()
    assert not plan_devices(cpu, HF, 0, False, cpu_count=1, serves_here=True).eval_server  # one core: no room
    assert not plan_devices(cpu, HF, 0, False, cpu_count=2, serves_here=False).eval_server  # serve.py alone
    assert not plan_devices(AUTO, HF, 1, True, cpu_count=16, serves_here=True).eval_server  # GPU: vLLM batches both
    assert not plan_devices({**cpu, "eval_server": False}, HF, 0, False, 2, serves_here=True).eval_server
    assert plan_devices({**AUTO, "eval_server": True}, HF, 1, True, 16, serves_here=True).eval_server  # asked for
    # an explicit value stands (serve.py re-plans the devices node train.py resolved: it must read back the same)
    assert plan_devices({**cpu, "eval_server": True}, HF, 0, False, 2, serves_here=False).eval_server
    with pytest.raises(DevicePlanError, match=r"devices\.eval_server must be auto, true or false, got 'yes'"):
        plan_devices({**cpu, "eval_server": "yes"}, HF, 0, False, 2, serves_here=True)


def _card(url: str, name: str) -> dict | None:
    cards = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return next((c for c in cards if c["id"] == name), None)


def test_the_gate_measures_the_served_adapter_on_the_evaluation_server(tmp_path, tiny_spec):
    """Two servers from one run's config (the agent's and evaluation's, one run dir, one adapter root): after
    the agent's server is given a new version, the gate's view of what is served loads that version, under the
    served name, into the evaluation server; the next decision finds it there."""
    cfg = compose_train(tmp_path, "model=tiny", "rollout=simulated_user")
    nodes = server_nodes(cfg)
    policy = PolicyServerProcess(nodes, run_dir=tmp_path, role="policy", max_restarts=0)
    evaluation = PolicyServerProcess(nodes, run_dir=tmp_path, role="eval", max_restarts=0)
    assert policy.folder != evaluation.folder and evaluation.folder.name == "eval-server"
    versions = [train_fixed_answer_adapter(tiny_spec, tmp_path / "adapters" / f"step-{v:06d}", steps=1)
                for v in (3, 4)]  # fmt: skip
    try:
        for server in (policy, evaluation):
            server.launch()
        for server in (policy, evaluation):
            server.wait_ready()
        assert policy.port != evaluation.port and (evaluation.folder / "serve_config.yaml").exists()
        live = build_evaluator(cfg)
        assert live is not None
        live.bind(policy.url, eval_url=evaluation.url)
        assert live.gatekeeper.eval_url == evaluation.url and live.gatekeeper.server_url == policy.url
        track = Track("default", None, lora_name="policy")
        assert live.gatekeeper.served_model(track) == ("tiny", 0)  # the base model answers: nothing to give
        assert _card(evaluation.url, "policy") is None
        for version, path in zip((3, 4), versions, strict=True):
            load_adapter(Endpoint(policy.url), "policy", str(path), version=version)
            assert live.gatekeeper.served_model(track) == ("policy", version)
            there = _card(evaluation.url, "policy")
            assert there is not None and there["adapter_version"] == version and there["root"] == str(path)
        live.rebind_eval()  # evaluation's server lost: back to the agent's, nothing mirrored
        assert live.gatekeeper.eval_url == policy.url
    finally:
        policy.stop()
        evaluation.stop()


def test_evaluation_goes_back_to_the_agents_server_when_its_own_dies(tmp_path):
    """Past its restarts (here none), a dead evaluation server is said loudly and evaluation moves to the
    agent's server; the run goes on (no stop requested)."""
    import os
    import signal
    import time
    from contextlib import ExitStack

    from metaclaw.loop.live import Live, start_policy_server

    cfg = compose_train(tmp_path, "model=tiny", "rollout=proxy", "serving.process.max_restarts=0",
                        "serving.process.poll_s=0.2")  # fmt: skip
    live = Live()
    moved: list[bool] = []
    with ExitStack() as stack:
        start_policy_server(cfg, live, stack, evaluation=True)
        assert live.eval_server is not None and live.eval_server.url != live.server_url
        live.extras["on_eval_server_lost"] = lambda: moved.append(True)
        os.killpg(live.eval_server.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while live.eval_server is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert live.eval_server is None and moved == [True]
        assert not live.stop.stopping and httpx.get(f"{live.server_url}/health", timeout=5).status_code == 200
