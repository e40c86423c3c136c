"""End to end on CPU: a real `serve.py`, the proxy and scorer inside `train()`, and the real `openai` client
driving multi-turn sessions; samples are scored, a step is taken, the adapter is published and served."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from metaclaw.config import CONFIG_DIR, register_resolvers
from metaclaw.rollout.server import free_port
from metaclaw.training import train
from tests.procs import wait_for_health

REPO = Path(__file__).resolve().parents[2]
register_resolvers()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def compose_live(run_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["model=tiny", "logger=csv", f"hydra.run.dir={run_dir}", f"run_dir={run_dir}", *overrides],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    return cfg


def drive(base_url: str, errors: list) -> None:
    """Sessions with and without headers, streaming and not, one with tool calls, until training stops."""
    try:
        wait_for_health(base_url)
        c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        for cycle in range(20):
            hdr = {"X-Session-Id": f"h{cycle}", "X-Agent-Id": "e2e"}
            msgs = [{"role": "user", "content": f"What is the capital of France? ({cycle})"}]
            for reply in ["No, that's wrong. It is Paris.", "Thanks, perfect."]:
                r = c.chat.completions.create(model="metaclaw", messages=msgs, max_tokens=8, extra_headers=hdr)
                msgs += [
                    {"role": "assistant", "content": r.choices[0].message.content or ""},
                    {"role": "user", "content": reply},
                ]
            done = {**hdr, "X-Session-Done": "true"}
            stream = c.chat.completions.create(
                model="metaclaw", messages=msgs, max_tokens=8, stream=True, extra_headers=done
            )
            assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) is not None
            tool_msgs = [
                {"role": "system", "content": f"Agent {cycle}"},
                {"role": "user", "content": "Weather in Berlin?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            ]
            got = c.chat.completions.create(model="metaclaw", messages=tool_msgs, tools=TOOLS, max_tokens=8)
            said = got.choices[0].message  # sent back as received: a continuation carries the recorded reply
            reply = {"role": "assistant", "content": said.content or ""}
            if said.tool_calls:
                reply["tool_calls"] = [tc.model_dump() for tc in said.tool_calls]
            tool_msgs += [reply, {"role": "user", "content": "great, thanks"}]
            c.chat.completions.create(model="metaclaw", messages=tool_msgs, tools=TOOLS, max_tokens=8, stream=True)
    except openai.APIConnectionError:
        pass  # training finished and the proxy went away
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_live_loop_captures_scores_trains_and_hot_swaps(policy_server):
    server_url, run_dir = policy_server
    port = free_port()
    cfg = compose_live(
        run_dir,
        "rollout=proxy",
        "method=rl",
        f"serving.url={server_url}",
        f"rollout.proxy.port={port}",
        "trainer.max_steps=2",
        "data.batch_size=2",
        "rollout.min_batch_size=1",
        "rollout.scoring.session_idle_s=2",
        "rollout.wait_timeout_s=120",
        "publish.gate.enabled=false",  # the hot-swap mechanics (the gate: tests/evaluation/test_proxy_gate.py)
    )
    errors: list = []
    driver = threading.Thread(target=drive, args=(f"http://127.0.0.1:{port}", errors), daemon=True)
    driver.start()
    metrics, objects = train(cfg)
    driver.join(timeout=60)
    assert not errors, errors
    assert metrics["train/global_step"] == 2
    # health counters reach the logger: turns captured, failures, backlog
    assert metrics["rollout/captured"] >= 2 and metrics["rollout/capture_failures"] == 0
    assert metrics["rollout/judge_failures"] == 0 and "rollout/backlog" in metrics
    assert metrics["train/publish_failures"] == 0
    store = objects["store"]
    samples = store.select()
    sessions = {s.session_id for s in samples}
    assert any(s.startswith("h") for s in sessions) and any(s.startswith("auto-") for s in sessions)
    assert any(s.reward is not None for s in samples)
    # each step took samples: consumed, or handed back by a zero-advantage step (a batch of one, or of equal
    # rewards, has advantage 0: `SampleStore.defer`) to train beside other rewards
    assert store.counts().get("consumed", 0) + sum(1 for s in samples if s.meta.deferred) >= 2
    assert all(s.adapter_version in (0, 1, 2) for s in samples)
    tool_turns = [s for s in samples if s.meta.get("tools")]
    assert tool_turns and any(s.text.next_state == "great, thanks" for s in tool_turns)
    assert sorted(p.name for p in (run_dir / "adapters").glob("step-*")) == ["step-000001", "step-000002"]
    assert list((run_dir / "adapters" / "step-000002").glob("*.safetensors"))
    r = httpx.post(
        f"{server_url}/v1/chat/completions",
        timeout=60,
        json={"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert r.status_code == 200
    assert r.headers.get("x-metaclaw-adapter-version") == "2" or r.json().get("adapter_version") == 2
