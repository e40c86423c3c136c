"""Many agents through the real proxy, on CPU: a real `serve.py model=tiny`, `train()` with the proxy and scorer,
and the real `openai` client interleaving four agents' sessions:

- `alice` (listed, `rl`): her own adapter `policy:alice`, published under `adapters/agents/alice/`;
- the default agent (no header) and `carol` (not listed: the default profile): the default adapter `policy`;
- `bob` (listed, `skills_only`): answered by the base model, never captured;
- a bad id: 400 naming the header or the body field.

Every step trains one adapter on its own agents' samples only; after the run each adapter in memory is
bit-identical to its last published copy (the other adapter's later steps did not move it); each agent is
answered by its own adapter; skills and store rows stay per agent.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import httpx
import lightning as L
import openai
import pytest

from metaclaw.agents import AgentProfiles
from metaclaw.rollout.server import free_port
from metaclaw.runfiles.layout import AdapterFolder
from metaclaw.training import train
from tests.e2e.conftest import running_policy_server
from tests.e2e.test_online_loop import compose_live
from tests.procs import wait_for_health

DRIVER_DONE = threading.Event()
ALICE_SKILL = "alice-geography-facts"


class HoldUntilDriverDone(L.Callback):
    """Keeps the loop (proxy, server) up after the last step until the driver saw each agent's adapter answer."""

    def on_train_end(self, trainer: L.Trainer, *args) -> None:
        DRIVER_DONE.wait(timeout=90)


def _write_skill(root: Path, agent: str) -> None:
    folder = root / agent / ALICE_SKILL
    folder.mkdir(parents=True)
    (folder / "SKILL.md").write_text(
        f"---\nname: {ALICE_SKILL}\ndescription: capital cities of France and Spain, geography answers\n"
        "category: knowledge\n---\n- Paris is the capital of France.\n"
    )


def _drive(base_url: str, seen: list[tuple[str, dict[str, str]]], errors: list) -> None:
    """Interleave the agents' two-turn sessions until alice and the default agent were answered by their own
    adapters (or two minutes passed)."""
    try:
        wait_for_health(base_url)
        c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        for cycle in range(200):
            for agent in ("alice", None, "bob", "carol"):
                hdr = {"X-Session-Id": f"s{cycle}"} | ({"X-Agent-Id": agent} if agent else {})
                msgs = [{"role": "user", "content": f"What is the capital of France? ({cycle})"}]
                # the first turn's reaction alternates within each adapter's own sequence of sessions: a closing
                # turn is never trained (nothing reacted to it), so the verdicts a batch of two centres come from
                # first turns alone and must differ, or the step has advantage 0 and that adapter never trains.
                # alice's sessions alternate by cycle; the default profile's are default's then carol's each cycle.
                corrected = agent == "carol" or (agent == "alice" and cycle % 2 == 0)
                first = "No, that's wrong. It is Paris." if corrected else "Thanks, perfect."
                for reply, done in ((first, "false"), ("Thanks, perfect.", "true")):
                    r = c.chat.completions.with_raw_response.create(
                        model="metaclaw", messages=msgs, max_tokens=6, extra_headers={**hdr, "X-Session-Done": done}
                    )
                    seen.append((agent or "default", dict(r.headers)))
                    msgs += [{"role": "assistant", "content": r.parse().choices[0].message.content or ""},
                             {"role": "user", "content": reply}]  # fmt: skip
            names = {(a, h.get("x-metaclaw-adapter")) for a, h in seen}
            if {("alice", "policy:alice"), ("default", "policy")} <= names:
                return
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)
    finally:
        DRIVER_DONE.set()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agents-loop")
    skills = tmp / "skills"
    _write_skill(skills, "alice")
    DRIVER_DONE.clear()
    with running_policy_server(tmp) as (server_url, run_dir):
        port = free_port()
        cfg = compose_live(
            run_dir,
            "rollout=proxy",
            "method=rl",
            f"serving.url={server_url}",
            f"rollout.proxy.port={port}",
            "trainer.max_steps=8",
            "data.batch_size=2",
            "rollout.min_batch_size=2",  # a batch of one has advantage 0 and is skipped (see _drive)
            "rollout.scoring.session_idle_s=600",
            "rollout.wait_timeout_s=120",
            "+agents.alice.mode=rl",
            "+agents.bob.mode=skills_only",
            "skills.enabled=true",
            f"skills.library_root={skills}",
            "skills.evolver=null",
            "skills.injector.top_k=1",
            "skills.injector.max_chars=300",
            f"+callbacks.hold._target_={__name__}.HoldUntilDriverDone",
            "publish.gate.enabled=false",  # each agent's adapter served at once (the gate: test_proxy_gate.py)
        )
        seen: list = []
        errors: list = []
        url = f"http://127.0.0.1:{port}"
        bad = {}
        driver = threading.Thread(target=_drive, args=(url, seen, errors), daemon=True)
        driver.start()

        def probe_bad_ids() -> None:  # while the proxy is up
            while not DRIVER_DONE.is_set() and not seen:
                time.sleep(0.2)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            bad["header"] = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Agent-Id": "../etc"})
            bad["body"] = httpx.post(f"{url}/v1/chat/completions", json={**body, "agent_id": "a/b"})
            bad["feedback"] = httpx.post(f"{url}/v1/feedback", json={"response_id": "x", "score": 1},
                                         headers={"X-Agent-Id": "_shared"})  # fmt: skip

        prober = threading.Thread(target=probe_bad_ids, daemon=True)
        prober.start()
        metrics, objects = train(cfg)
        driver.join(timeout=60)
        prober.join(timeout=10)
        yield {"metrics": metrics, "objects": objects, "seen": seen, "errors": errors, "bad": bad,
               "run_dir": run_dir, "cfg": cfg}  # fmt: skip


def _steps(directory: Path) -> set[int]:
    return {version for version, _ in AdapterFolder(directory).versions()}


def _sha(path: Path) -> str:
    return hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()


def test_agent_traffic_trains_each_adapter_only_on_its_own_agents(run):
    assert not run["errors"], run["errors"]
    assert run["metrics"]["train/global_step"] == 8
    store, run_dir = run["objects"]["store"], run["run_dir"]
    agents = AgentProfiles.from_config(run["cfg"])
    trained = [s for s in store.select() if s.status in ("claimed", "consumed")]
    by_step: dict[int, set[str]] = {}
    for s in trained:
        by_step.setdefault(s.claimed_step, set()).add(agents.adapter_of(s.agent_id))
    assert all(len(adapters) == 1 for adapters in by_step.values()), by_step  # single-adapter batches
    alice_steps, default_steps = _steps(run_dir / "adapters" / "agents" / "alice"), _steps(run_dir / "adapters")
    assert alice_steps and default_steps and not alice_steps & default_steps
    for step in alice_steps:
        assert by_step[step - 1] == {"alice"}  # claim keys are 0-based: step s publishes claim s-1
    for step in default_steps:
        assert by_step[step - 1] == {"default"}
    # each adapter in memory is its last published copy, bit for bit: the other's later steps never moved it
    policy = run["objects"]["module"].policy
    tmp = run_dir / "check"
    for adapter, steps, root in (("alice", alice_steps, run_dir / "adapters" / "agents" / "alice"),
                                 ("default", default_steps, run_dir / "adapters")):  # fmt: skip
        assert _sha(policy.save_adapter(tmp / adapter, adapter)) == _sha(root / f"step-{max(steps):06d}")
    assert run["metrics"]["agent/alice/train/samples"] > 0 or "agent/default/train/samples" in run["metrics"]


def test_each_agent_is_answered_by_its_own_adapter(run):
    alice_steps = _steps(run["run_dir"] / "adapters" / "agents" / "alice")
    default_steps = _steps(run["run_dir"] / "adapters")
    served = {"alice": set(), "default": set(), "carol": set(), "bob": set()}
    for agent, headers in run["seen"]:
        name = headers.get("x-metaclaw-adapter")
        served[agent].add(name)
        if name == "policy:alice":
            assert int(headers["x-metaclaw-adapter-version"]) in alice_steps
        if name == "policy":
            assert int(headers["x-metaclaw-adapter-version"]) in default_steps
    assert "policy:alice" in served["alice"] and served["alice"] <= {None, "policy:alice"}
    assert "policy" in served["default"] and served["default"] <= {None, "policy"}
    assert served["carol"] <= {None, "policy"}  # not listed: the default profile's adapter
    assert served["bob"] == {None}  # skills_only: the base model


def test_skills_only_agent_is_answered_but_never_stored(run):
    store = run["objects"]["store"]
    assert not store.select(agent_id="bob")
    assert any(a == "bob" for a, _ in run["seen"])
    assert run["metrics"]["rollout/skills_only_turns"] > 0


def test_store_rows_and_skills_stay_with_their_agent(run):
    store = run["objects"]["store"]
    rows = {a: store.select(agent_id=a) for a in ("alice", "default", "carol")}
    assert all(rows.values())
    assert all(s.session_id.startswith("s") for r in rows.values() for s in r)
    # the question turns retrieve alice's geography skill (a "Thanks, perfect." follow-up may retrieve nothing)
    assert all(ALICE_SKILL in s.meta["skills"] for s in rows["alice"] if s.turn_index == 0)
    assert all(set(s.meta["skills"]) <= {ALICE_SKILL} for s in rows["alice"])
    assert not any(ALICE_SKILL in s.meta.get("skills", []) for s in rows["default"] + rows["carol"])


def test_bad_agent_ids_are_refused_naming_the_field(run):
    bad = run["bad"]
    assert bad["header"].status_code == 400 and "X-Agent-Id" in bad["header"].json()["error"]["message"]
    assert bad["body"].status_code == 400 and "agent_id" in bad["body"].json()["error"]["message"]
    assert bad["feedback"].status_code == 400 and "X-Agent-Id" in bad["feedback"].json()["error"]["message"]
