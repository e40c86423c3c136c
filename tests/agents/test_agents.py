"""The agents people use, really run (`make test-agents`): OpenClaw, Claude Code and Codex from npm and
hermes-agent from PyPI, headless,
each for five turns of one conversation (the first asks for a file read) through a recording pass-through into
`train.py rollout=proxy` on the embedded default (SmolLM2-135M, CPU). Every turn must be answered and captured;
every turn the person reacted to (all but the last) must be claimed by an optimizer step. The recordings are the
conformance fixtures (`METACLAW_RECORD_FIXTURES=1` rewrites tests/conformance/recorded/)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from metaclaw.store import SampleStore
from tests.agents.conftest import Service, agent_path
from tests.agents.recorder import Recorder, scrub
from tests.procs import REPO, free_port

pytestmark = pytest.mark.agents

# Five turns; each reacts to the reply before it (thanks, a follow-up, a correction), the last closes.
TURNS = (
    "What is in notes.txt? Read the file.",
    "Thanks! Now tell me one fun fact about pineapples.",
    "That's not what I asked for. Keep it to one short sentence.",
    "Good, that's better. What is 12 times 12?",
    "Thanks, that's all for now.",
)
RECORDED = REPO / "tests" / "conformance" / "recorded"


def openclaw(svc: Service, base: str, home: Path, work: Path, i: int, text: str) -> tuple[str, str]:
    config = home / ".openclaw" / "openclaw.json"
    if i == 0:
        config.parent.mkdir(parents=True, exist_ok=True)
        provider = {"baseUrl": f"{base}/v1", "apiKey": svc.key, "api": "openai-completions",
                    "request": {"allowPrivateNetwork": True}, "timeoutSeconds": 900,
                    "models": [{"id": "metaclaw", "name": "metaclaw", "reasoning": False, "input": ["text"],
                                "contextWindow": 32768, "maxTokens": 512}]}  # fmt: skip
        defaults = {"model": {"primary": "metaclaw/metaclaw"}, "workspace": str(work), "timeoutSeconds": 1200}
        config.write_text(json.dumps({"models": {"mode": "merge", "providers": {"metaclaw": provider}},
                                      "agents": {"defaults": defaults}}))  # fmt: skip
    cmd = ["openclaw", "agent", "--local", "--session-id", "metaclaw-agents-test", "--timeout", "900",
           "--message", text, "--json"]  # fmt: skip
    out = run(cmd, home, work, {})
    body = json.loads(out[out.index("{") :])
    body = body.get("result", body)  # `{payloads, meta}`, in some versions under `result`
    meta = body.get("meta") or {}
    assert meta.get("stopReason") not in ("error", "aborted"), meta.get("stopReason")
    texts = [p.get("text", "") for p in body.get("payloads") or [] if isinstance(p, dict)]
    return out, str(meta.get("finalAssistantVisibleText") or " ".join(texts))


def claude_code(svc: Service, base: str, home: Path, work: Path, i: int, text: str) -> tuple[str, str]:
    env = {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_AUTH_TOKEN": svc.key, "ANTHROPIC_MODEL": "metaclaw",
           "ANTHROPIC_DEFAULT_SONNET_MODEL": "metaclaw", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "metaclaw",
           "ANTHROPIC_DEFAULT_OPUS_MODEL": "metaclaw", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "API_TIMEOUT_MS": "900000"}  # fmt: skip
    cmd = ["claude", "-p", text, "--output-format", "json", *(["--continue"] if i else [])]
    out = run(cmd, home, work, env)
    body = json.loads(out[out.index("{") :])
    assert not body.get("is_error"), body.get("result")
    return out, str(body.get("result") or "")


def codex(svc: Service, base: str, home: Path, work: Path, i: int, text: str) -> tuple[str, str]:
    if i == 0:
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        (home / ".codex" / "config.toml").write_text(
            'model = "metaclaw"\nmodel_provider = "metaclaw"\n\n[model_providers.metaclaw]\nname = "metaclaw"\n'
            f'base_url = "{base}/v1"\nwire_api = "responses"\nenv_key = "METACLAW_PROXY_API_KEY"\n'
            "stream_idle_timeout_ms = 900000\n"
        )
    cmd = ["codex", "exec", *(["resume", "--last"] if i else []), "--skip-git-repo-check", "--json", text]
    out = run(cmd, home, work, {"METACLAW_PROXY_API_KEY": svc.key})
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert any(e.get("type") == "turn.completed" for e in events), out[-2000:]
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    said = [it.get("text", "") for it in items if it.get("type") == "agent_message"]
    ran = [it.get("command", "") for it in items if it.get("type") == "command_execution"]
    return out, " ".join(said + ran)


def hermes(svc: Service, base: str, home: Path, work: Path, i: int, text: str) -> tuple[str, str]:
    """hermes-agent from PyPI (.agents/hermes): a `custom` provider; it refuses a model whose card says less than
    64k tokens, so `context_length` states 64k and the proxy fits its prompt (as OpenClaw's `contextWindow`)."""
    if i == 0:
        (home / ".hermes").mkdir(parents=True, exist_ok=True)
        (home / ".hermes" / "config.yaml").write_text(
            f"model:\n  provider: custom\n  base_url: {base}/v1\n  default: metaclaw\n  api_key: {svc.key}\n"
            "  context_length: 65536\n"
        )
    session = (home / ".hermes" / "metaclaw-session").read_text().strip() if i else ""
    exe = str(REPO / ".agents" / "hermes" / "bin" / "hermes")
    full = {**os.environ, "HOME": str(home), "NO_COLOR": "1"}
    cmd = [exe, "chat", "-q", text, "-Q", *(["--resume", session] if session else [])]
    proc = subprocess.run(cmd, cwd=work, env=full, capture_output=True, text=True, timeout=1800, errors="replace")
    assert proc.returncode == 0, f"hermes exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    found = [line.split(":", 1)[1].strip() for line in (proc.stdout + proc.stderr).splitlines()
             if line.startswith("session_id:")]  # fmt: skip
    assert found, proc.stderr[-2000:]
    (home / ".hermes" / "metaclaw-session").write_text(found[-1])
    said = [line for line in proc.stdout.splitlines() if line.strip() and not line.lstrip().startswith("⚠")]
    return proc.stdout, "\n".join(line for line in said if not line.startswith("session_id:"))


def run(cmd: list[str], home: Path, work: Path, env: dict[str, str]) -> str:
    full = {**os.environ, "HOME": str(home), "PATH": agent_path(), "NO_COLOR": "1", **env}
    proc = subprocess.run(cmd, cwd=work, env=full, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{cmd[0]} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


AGENTS = {"openclaw": openclaw, "claude-code": claude_code, "codex": codex, "hermes": hermes}


@pytest.mark.parametrize("name", list(AGENTS))
def test_agent_completes_five_turns_through_the_proxy(service: Service, tmp_path: Path, name: str):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "notes.txt").write_text("The secret word is pineapple.\n")
    record = service.run_dir.parent / f"{name}.jsonl"
    turns = []
    with Recorder(service.url, record, free_port(), name) as rec:
        for i, text in enumerate(TURNS):
            tagged = f"{text} [{name} turn {i + 1}]"
            start = time.monotonic()
            _, answer = AGENTS[name](service, f"http://127.0.0.1:{rec.port}", home, work, i, tagged)
            turns.append({"wall_s": round(time.monotonic() - start, 1), "answer": answer[:200]})
            assert answer.strip(), f"{name} printed no answer on turn {i + 1}"
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    chats = [r for r in lines if r["method"] == "POST" and "count_tokens" not in r["path"]]
    assert chats and all(r["timing"].get("status") == 200 for r in chats[-len(TURNS) :]), [r["timing"] for r in chats]
    calls = sum('"tool_calls"' in json.dumps(r["body"]) or '"function_call"' in json.dumps(r["body"]) for r in chats)
    service.results[name] = {"turns": turns, "requests": [r["timing"] for r in chats], "requests_with_calls": calls}
    if os.environ.get("METACLAW_RECORD_FIXTURES") == "1":
        RECORDED.mkdir(parents=True, exist_ok=True)
        keep = [{k: v for k, v in r.items() if k != "timing"} for r in chats]
        text = "\n".join(json.dumps(scrub(r, (service.key,))) for r in keep) + "\n"
        (RECORDED / f"{name.replace('-', '_')}.jsonl").write_text(text)


def test_every_reacted_turn_is_captured_and_trained(service: Service):
    """Each agent's turns 1-4 (each has the person's next message as its reaction) are captured and claimed by an
    optimizer step; turn 5 (nothing reacted to it) is captured and never trained (`no_next_state`)."""
    store = SampleStore(service.run_dir / "samples.sqlite")
    want = {(name, i + 1) for name in AGENTS for i in range(len(TURNS) - 1)}
    deadline, state = time.monotonic() + 2400, {}
    while time.monotonic() < deadline:
        state = {}
        for s in store.select():
            msgs = s.text.messages or []
            reply = max((k for k, m in enumerate(msgs) if m.get("role") == "assistant"), default=-1)
            last = json.dumps([m.get("content") for m in msgs[reply + 1 :] if m.get("role") == "user"])
            for name in AGENTS:
                for i in range(len(TURNS)):
                    if f"[{name} turn {i + 1}]" in last:
                        state[(name, i + 1)] = (s.status, s.claimed_step, s.meta.dropped)
        if all(state.get(k, ("",))[0] == "consumed" for k in want):
            break
        time.sleep(10)
    missing = sorted(k for k in want if k not in state)
    untrained = {k: state[k] for k in want if k in state and state[k][0] != "consumed"}
    assert not missing and not untrained, f"not captured: {missing}; not trained: {untrained}"
    for name in AGENTS:
        assert state.get((name, len(TURNS)), ("?",))[0] != "consumed", f"{name}'s closing turn was trained"
    service.results["trained"] = {f"{k[0]} {k[1]}": v[1] for k, v in sorted(state.items())}
