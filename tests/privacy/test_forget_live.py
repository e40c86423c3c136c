"""`forget` against a live service (issue 43): a real `train.py model=tiny rollout=proxy` (keyed, skills on, the
skills root inside the run dir) trains on turns that carry a marker; `python -m metaclaw forget --agent ... --rollback`
then runs while the service keeps going.

Afterwards the marker is in no file under the run dir (every file's bytes, in UTF-8, UTF-16, base64 and hex), the
policy server serves the base model (nothing clean was trained before the turns), and the NEXT step trains from that
clean state: its adapter is one AdamW step from B = 0 with fresh moments, so no LoRA B weight exceeds the learning
rate (a step from the forgotten turns' weights would carry about twice that).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from metaclaw.control.cli import main
from tests.e2e.lifecycle import kill_tree, wait_for, wait_gone
from tests.procs import REPO, free_port

MARKER = "glorbfrazzle7731quux"  # no secret format, not high-entropy: the turn is stored and trained
LR = 3.0e-4  # optimizer.lr (the default)


def encodings(text: str) -> dict[str, bytes]:
    """The marker as bytes, as a file could hold it: UTF-8, UTF-16 (both orders), hex, base64 at each alignment."""
    raw = text.encode()
    out = {"utf-8": raw, "utf-16-le": text.encode("utf-16-le"), "utf-16-be": text.encode("utf-16-be"),
           "hex": raw.hex().encode()}  # fmt: skip
    for shift in range(3):  # the base64 characters that depend on the marker's bytes alone
        coded = base64.b64encode(b"\0" * shift + raw)
        start, end = (4 * shift + 2) // 3 + 1, len(coded) - 4
        out[f"base64+{shift}"] = coded[start:end]
    return out


def files_holding(root: Path, text: str) -> list[str]:
    """Every file under `root` whose bytes hold `text` in one of its `encodings` (links not followed)."""
    needles = encodings(text)
    found = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        found += [f"{path.relative_to(root)} ({name})" for name, needle in needles.items() if needle in data]
    return found


class Live:
    def __init__(self, url: str, key: str, run_dir: Path) -> None:
        self.url, self.key, self.run_dir = url, key, run_dir
        self.headers = {"Authorization": f"Bearer {key}"}

    def chat(self, agent: str, session: str, messages: list[dict], done: bool = False) -> str:
        headers = {**self.headers, "X-Agent-Id": agent, "X-Session-Id": session}
        if done:
            headers["X-Session-Done"] = "true"
        r = httpx.post(f"{self.url}/v1/chat/completions", headers=headers, timeout=120,
                       json={"model": "metaclaw", "messages": messages, "max_tokens": 8})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"].get("content") or ""

    def conversation(self, agent: str, session: str, turns: list[str]) -> None:
        """`turns` are the user's words; each later one reacts to the reply before it (a scored turn)."""
        messages: list[dict] = []
        for i, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            reply = self.chat(agent, session, messages, done=i == len(turns) - 1)
            messages.append({"role": "assistant", "content": reply})

    def status(self) -> dict:
        r = httpx.get(f"{self.url}/control/status", headers=self.headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def latest(self) -> dict:
        path = self.run_dir / "adapters" / "latest.json"
        return json.loads(path.read_text()) if path.exists() else {}


def lora_b_max(folder: str | Path) -> float:
    weights = load_file(str(Path(folder) / "adapter_model.safetensors"))
    return max(float(t.abs().max()) for k, t in weights.items() if "lora_B" in k)


@pytest.fixture
def live(tmp_path):
    run_dir, out, port, key = tmp_path / "run", tmp_path / "train.out", free_port(), secrets.token_urlsafe(24)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
           "METACLAW_PROXY_API_KEY": key}  # fmt: skip
    args = [sys.executable, "train.py", "model=tiny", "rollout=proxy", f"rollout.proxy.port={port}",
            f"hydra.run.dir={run_dir}", "devices.eval_server=false", "data.batch_size=2",
            "eval.judge_fallback.heldout_share=0",  # every session trains (evaluation has its own tests)
            "publish.gate.enabled=false",  # served at once: the adapter trained on the marker is served
            "publish.checkpoint_every_n_steps=1",  # the checkpoint holds the marker's weights too
            "skills.enabled=true", f"skills.library_root={run_dir / 'skills'}", "skills.evolve_every_n_turns=2",
            "rollout.scoring.session_idle_s=2"]  # fmt: skip
    with open(out, "wb") as f:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    service = Live(f"http://127.0.0.1:{port}", key, run_dir)

    def up() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{service.url}/v1/models", headers=service.headers, timeout=2).status_code == 200
        return False

    try:
        wait_for("the proxy", up, timeout=600, proc=proc, log=out)
        yield service, proc, out
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=120)
        kill_tree(proc)
        wait_gone([proc.pid])


def victim_session(service: Live, session: str) -> None:
    service.conversation("victim", session, [f"Remember the code word {MARKER} for the vault, please.",
                                             f"No, that is wrong: the code word is {MARKER}, say it back.",
                                             "Thanks, that is perfect."])  # fmt: skip


def other_session(service: Live, session: str) -> None:
    service.conversation("other", session, ["What is two plus two?", "No, that is wrong, think again.",
                                            "Thanks, that is right."])  # fmt: skip


def test_forget_on_a_live_service_leaves_no_byte_and_the_rollback_to_the_base_model_holds(live, capsys):
    """Each session gives two scored turns, one batch (`data.batch_size=2`). Lightning fetches the next batch before
    it runs a step, so step k runs once batch k+1 is claimed: step 1 trains the victim's first session, and its
    second session is a claimed batch when `forget` runs."""
    service, proc, out = live
    run = service.run_dir
    victim_session(service, "v1")
    victim_session(service, "v2")
    wait_for("step 1 served", lambda: service.latest().get("version") == 1, timeout=300, proc=proc, log=out)
    served = service.status()["served_adapter"]
    assert served["source"] == "policy server" and served["path"].endswith("step-000001"), served
    assert lora_b_max(served["path"]) > 0  # the step trained on the marker's turns
    assert files_holding(run, MARKER), "the marker should be stored before forget (else this test checks nothing)"

    assert main(["forget", "--agent", "victim", "--run-dir", str(run), "--skills-root", str(run / "skills"),
                 "--rollback", "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    # the policy server serves the base model: the zero adapter (step 0), every LoRA weight 0
    served = service.status()["served_adapter"]
    assert served["path"].endswith("step-000000"), (served, report["notes"])
    assert report["samples_deleted"] >= 4 and report["trained_at_steps"] == [0, 1], report
    assert len(report["claimed_now"]) == 2, report  # the second session: claimed, not trained yet
    assert report["rollback_to"] == {"default": None} and report["rolled_back"] == {"default": 0}, report
    assert all(float(t.abs().max()) == 0 for t in load_file(str(Path(served["path"]) / "adapter_model.safetensors"))
               .values())  # fmt: skip
    assert not (run / "adapters" / "step-000001").exists()  # the weights trained on the turns are gone
    assert files_holding(run, MARKER) == []

    # step 2 would train the claimed victim batch: it is dropped, and the trainer is back at the base model;
    # step 3 trains another agent's turns from that clean state: one AdamW step from B = 0
    other_session(service, "o1")
    other_session(service, "o2")
    wait_for("step 3 served", lambda: (service.latest().get("version") or 0) >= 3, timeout=300, proc=proc, log=out)
    served = service.status()["served_adapter"]
    assert served["source"] == "policy server" and served["path"].endswith("step-000003"), served
    trained = lora_b_max(served["path"])
    assert 0 < trained <= LR * (1 + 1e-3), f"max |B| {trained}: not one step from the clean state (lr {LR})"
    assert files_holding(run, MARKER) == []
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    b = [v for k, v in ckpt["state_dict"].items() if "lora_B" in k]
    assert ckpt["global_step"] == 3 and max(float(t.abs().max()) for t in b) == trained  # the clean lineage's

    proc.send_signal(signal.SIGTERM)  # what a stopping service writes (final checkpoint, logs) holds none either
    proc.wait(timeout=120)
    assert files_holding(run, MARKER) == []
