"""`python -m metaclaw` against a running service: a real policy server (serve.py, tiny model), the rollout proxy
with `/control/*` mounted, the scheduler and the store; rollback while the real `openai` client keeps sending.

Two agents with adapters (docs/agents.md): the default one and alice (`policy:alice`, steps 3 and 4); bob is
`skills_only`. `rollback STEP --agent alice` re-points only alice's adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch

from metaclaw.agents import AgentProfiles
from metaclaw.control.api import mount_plane
from metaclaw.control.plane import ControlPlane
from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.runfiles.layout import RunLayout
from metaclaw.scheduler import IdleScheduler
from metaclaw.store import Sample, SampleStore
from tests.e2e.conftest import running_policy_server

REPO = Path(__file__).resolve().parents[2]
KEY = "control-test-key"
AGENTS = AgentProfiles({"alice": {"mode": "rl"}, "bob": {"mode": "skills_only"}})


@dataclass
class Service:
    url: str
    server_url: str
    run_dir: Path
    store: SampleStore
    scheduler: IdleScheduler
    plane: ControlPlane


def cli(service: Service, *args: str, key: str | None = KEY) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("METACLAW_PROXY_API_KEY", None)
    if key:
        env["METACLAW_PROXY_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "metaclaw", "--run-dir", str(service.run_dir), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


def publish(run_dir: Path, server_url: str, policy, step: int, agent: str = "default") -> Path:
    """Save an adapter as the trainer does (`adapters/step-NNNNNN`, an agent's under `adapters/agents/<id>/`),
    load it under its served name, record it in its latest.json."""
    profile = AGENTS.resolve(agent)
    folder = RunLayout(run_dir).adapters(profile.adapter).path
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.01 * step)
    target = policy.save_adapter(folder / f"step-{step:06d}")
    r = httpx.post(f"{server_url}/v1/load_lora_adapter", json={"lora_name": profile.lora_name,
                   "lora_path": str(target)}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    (folder / "latest.json").write_text(json.dumps({"version": step, "path": str(target), "name": profile.lora_name}))
    return target


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Service]:
    from metaclaw.modules.loading import ModelSpec
    from metaclaw.modules.policy import LoraPolicy

    tmp_path = tmp_path_factory.mktemp("control")
    with running_policy_server(tmp_path) as (server_url, run_dir):
        policy = LoraPolicy(ModelSpec(name="tiny", path="tiny", dtype="float32", max_seq_len=1024).load_model(),
                            rank=4, alpha=8)  # fmt: skip
        for step in (1, 2):
            publish(run_dir, server_url, policy, step)
            publish(run_dir, server_url, policy, step + 2, "alice")  # alice's steps: 3 and 4
        store = SampleStore(run_dir / "samples.sqlite")
        scheduler = IdleScheduler(str(run_dir), str(store.path), sleep_start=None, sleep_end=None,
                                  idle_threshold_minutes=30, idle_source="proxy", poll_s=0.1)  # fmt: skip
        plane = ControlPlane(run_dir, store, scheduler, lora_name="policy", api_key=KEY, agents=AGENTS)
        plane.server_url = server_url
        proxy = RolloutProxy(store, server_url, base_model="tiny", policy_model="policy", agents=AGENTS)
        with ThreadedServer(mount_plane(plane, create_app(proxy, api_key=KEY))) as srv:
            plane.announce(srv.url)
            yield Service(srv.url, server_url, run_dir, store, scheduler, plane)
        store.close()


def test_status_shows_window_samples_steps_adapter_and_eval(service):
    service.store.insert_many([Sample(prompt_ids=[1, 2], response_ids=[3], behaviour_logprobs=[-1.0], reward=1.0,
                                      status="ready") for _ in range(3)])  # fmt: skip
    records = [json.dumps({"step": 1, "adapter": "step-000001", "compliance": 0.25, "time": 1.0}), "not json"]
    gate = {"decision": "accepted"}
    records.append(json.dumps({"step": 2, "adapter": "step-000002", "compliance": 0.5, "gate": gate}))
    records.append(json.dumps({"step": 3, "adapter": "step-000003", "agent_id": "alice", "compliance": 0.75}))
    (service.run_dir / "eval.jsonl").write_text("\n".join(records) + "\n")
    out = cli(service, "status")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "window:        closed" in text and "user active: idle 0 min < 30 min (proxy)" in text  # just started
    assert "next window:" in text and "if the user stays idle (proxy)" in text
    assert "samples:       3 waiting" in text
    assert "steps done:    2" in text
    assert "pace:          0.6 replies/min served, 0.0 samples/min trained (last 300s)" in text  # 3 in 5 minutes
    assert "serving:       step-000002" in text and "[policy server]" in text
    assert "step 1 (step-000001): compliance=0.25" in text
    assert "step 2 (step-000002): compliance=0.5 gate=accepted" in text
    assert "agent alice step 3 (step-000003): compliance=0.75" in text
    data = json.loads(cli(service, "status", "--json").stdout)
    assert data["window"]["open"] is False and data["samples"]["ready"] == 3 and data["steps_done"] == 2
    assert data["rates"]["replies_per_min"] == 0.6 and data["rates"]["trained_per_min"] == 0.0


def test_pause_resume_and_train_now(service):
    out = cli(service, "train-now", "--minutes", "5")
    assert out.returncode == 0 and "training window open until" in out.stdout, out.stderr
    assert service.scheduler.refresh().open
    assert cli(service, "pause").returncode == 0
    assert service.scheduler.state.paused and not service.scheduler.refresh().open
    status = cli(service, "status").stdout
    assert "paused:        yes" in status and "next window:   after resume" in status
    # the state is on disk for the next start
    assert json.loads((service.run_dir / "scheduler_state.json").read_text())["paused"] is True
    assert cli(service, "resume").returncode == 0 and not service.scheduler.state.paused


def test_auth_bad_input_and_unknown_step(service):
    out = cli(service, "status", key="wrong")
    assert out.returncode == 1 and "401" in out.stderr
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{service.url}/control/rollback", json={"step": "latest"}, headers=auth)
    assert r.status_code == 400 and "step" in r.json()["error"]["message"]
    r = httpx.post(f"{service.url}/control/train-now", json={"minutes": 5, "then": "rm -rf"},
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert r.status_code == 400 and "then" in r.json()["error"]["message"]
    out = cli(service, "rollback", "7")
    assert out.returncode == 1 and "404" in out.stderr and "kept: [1, 2]" in out.stderr
    assert httpx.get(f"{service.url}/health").status_code == 200  # the proxy is untouched


def rollback_under_load(service: Service, agents: tuple[str | None, ...], *args: str):
    """`rollback *args` while four real `openai` clients keep chatting through the proxy, as `agents` in turn:
    (the command's result, the clients' errors, `(agent, x-metaclaw-adapter)` of every answer)."""
    client = openai.OpenAI(base_url=f"{service.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    stop, errors, answered = threading.Event(), [], []

    def chat(i: int, agent: str | None) -> None:
        n = 0
        while not stop.is_set() or n < 2:
            try:
                headers = {"X-Session-Id": f"rb{i}-{n}"} | ({"X-Agent-Id": agent} if agent else {})
                r = client.chat.completions.with_raw_response.create(
                    model="metaclaw", max_tokens=4, messages=[{"role": "user", "content": f"hello {i}-{n}"}],
                    extra_headers=headers,
                )  # fmt: skip
                assert r.parse().choices[0].message.content is not None
                answered.append((agent, r.headers.get("x-metaclaw-adapter")))
            except Exception as e:  # noqa: BLE001 - every failure is reported
                errors.append(repr(e))
            n += 1

    threads = [threading.Thread(target=chat, args=(i, agents[i % len(agents)])) for i in range(4)]
    for t in threads:
        t.start()
    try:
        out = cli(service, "rollback", *args)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    return out, errors, answered


def test_rollback_under_concurrent_requests_fails_none(service):
    out, errors, answered = rollback_under_load(service, (None,), "1")
    assert out.returncode == 0, out.stderr
    assert "serving step-000001" in out.stdout and "training paused" in out.stdout
    assert errors == [] and len(answered) >= 8
    models = httpx.get(f"{service.server_url}/v1/models", timeout=10).json()["data"]
    served = next(m for m in models if m["id"] == "policy")
    assert served["root"].endswith("step-000001")
    status = json.loads(cli(service, "status", "--json").stdout)
    assert status["served_adapter"]["path"].endswith("step-000001") and status["rollback_step"] == 1
    assert status["window"]["paused"] is True
    assert cli(service, "resume").returncode == 0


def _served(server_url: str) -> dict[str, str]:
    return {m["id"]: m.get("root") for m in httpx.get(f"{server_url}/v1/models", timeout=10).json()["data"]}


def test_agent_rollback_under_concurrent_requests_repoints_only_that_agent(service):
    default_before = _served(service.server_url)["policy"]
    out, errors, answered = rollback_under_load(service, ("alice", None), "3", "--agent", "alice")
    assert out.returncode == 0, out.stderr
    assert "serving step-000003 for agent alice (policy:alice)" in out.stdout and "training paused" in out.stdout
    assert errors == [] and len(answered) >= 8
    assert {name for agent, name in answered if agent == "alice"} == {"policy:alice"}
    assert {name for agent, name in answered if agent is None} == {"policy"}
    served = _served(service.server_url)
    assert served["policy:alice"].endswith("agents/alice/step-000003")
    assert served["policy"] == default_before  # the default agent's adapter is untouched
    client = openai.OpenAI(base_url=f"{service.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    after = client.chat.completions.with_raw_response.create(
        model="metaclaw", max_tokens=2, messages=[{"role": "user", "content": "again"}],
        extra_headers={"X-Agent-Id": "alice", "X-Session-Id": "after"},
    )  # fmt: skip
    assert after.headers["x-metaclaw-adapter"] == "policy:alice"
    status = json.loads(cli(service, "status", "--json").stdout)
    assert str(status["agents"]["alice"]["adapter_version"]) == after.headers["x-metaclaw-adapter-version"]
    assert status["agents"]["alice"]["path"].endswith("agents/alice/step-000003")
    assert status["agents"]["alice"]["name"] == "policy:alice"
    assert status["served_adapter"]["path"] == default_before and "bob" not in status["agents"]
    assert (status["rollback_step"], status["rollback_agent"]) == (3, "alice")
    text = cli(service, "status").stdout
    assert "agent alice: step-000003" in text and "as policy:alice" in text and "(agent alice)" in text
    assert cli(service, "resume").returncode == 0


def test_agent_rollback_refuses_unknown_bad_and_untrained_agents_naming_them(service):
    before = _served(service.server_url)
    out = cli(service, "rollback", "1", "--agent", "carol")  # not listed: it shares the default adapter
    assert out.returncode == 1 and "404" in out.stderr and "'carol'" in out.stderr and "alice" in out.stderr
    out = cli(service, "rollback", "1", "--agent", "bob")  # skills_only: no adapter at all
    assert out.returncode == 1 and "404" in out.stderr and "'bob'" in out.stderr and "skills_only" in out.stderr
    out = cli(service, "rollback", "1", "--agent", "alice")  # alice has steps 3 and 4 only
    assert out.returncode == 1 and "404" in out.stderr and "kept: [3, 4]" in out.stderr
    auth = {"Authorization": f"Bearer {KEY}"}
    for bad in ("../etc", "a/b", "_shared", ""):
        r = httpx.post(f"{service.url}/control/rollback", json={"step": 1, "agent": bad}, headers=auth)
        assert r.status_code == 400 and "agent" in r.json()["error"]["message"], (bad, r.text)
    assert _served(service.server_url) == before  # nothing was re-pointed
    out = cli(service, "rollback", "1", "--agent", "default")  # the default adapter, named explicitly
    assert out.returncode == 0 and "serving step-000001" in out.stdout, out.stderr
    assert _served(service.server_url)["policy"].endswith("adapters/step-000001")
    assert cli(service, "resume").returncode == 0
