"""Issue 31, finding 7 (and the key part of 10): a rollback is written to the served pointer (`latest.json`), so a
restart of the policy server serves the rolled-back adapter, not the newest one, and `status` tells the truth.

The policy server is the live loop's own: `PolicyServerProcess` (real serve.py, tiny model) with its watchdog and
`reload_latest_adapter` as the restart hook, exactly as `train.py rollout=proxy` wires it. It is SIGKILLed and
comes back by itself.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
import torch
from hydra import compose, initialize_config_dir

from metaclaw.config import CONFIG_DIR, register_resolvers
from metaclaw.control.plane import ControlPlane
from metaclaw.loop.live import reload_latest_adapter, server_nodes
from metaclaw.loop.policy_server import PolicyServerProcess
from metaclaw.modules.adapter_writer import AdapterWriter
from metaclaw.wire.client import Endpoint, load_adapter

KEY = "rollback-restart-key"


def _served(url: str) -> str | None:
    cards = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()["data"]
    return next((c.get("root") for c in cards if c.get("id") == "policy"), None)


@pytest.mark.slow
def test_a_rollback_survives_a_policy_server_restart(tmp_path: Path) -> None:
    from metaclaw.modules.loading import ModelSpec
    from metaclaw.modules.policy import LoraPolicy

    run_dir = tmp_path / "run"
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="train", overrides=["model=tiny", f"run_dir={run_dir}"])
    server = PolicyServerProcess(server_nodes(cfg), run_dir=run_dir, api_key=KEY, max_restarts=1, poll_s=0.2,
                                 startup_timeout_s=300)  # fmt: skip
    restarted, died = threading.Event(), []
    with server:
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode(errors="replace")
        assert KEY not in cmdline  # the key travels in the server's environment, never in `ps`
        server.watch(on_restart=lambda: (reload_latest_adapter(run_dir, Endpoint(server.url, KEY)), restarted.set()),
                     on_death=died.append)  # fmt: skip
        policy = LoraPolicy(ModelSpec(name="tiny", path="tiny", dtype="float32", max_seq_len=1024).load_model(),
                            rank=4, alpha=8)  # fmt: skip
        writer = AdapterWriter(run_dir)
        for step in (1, 2):  # publish as the trainer does: adapter dir, hot-load, served pointer
            with torch.no_grad():
                for p in policy.parameters():
                    if p.requires_grad:
                        p.add_(0.01)
            target = policy.save_adapter(writer.adapter_dir(step))
            load_adapter(Endpoint(server.url, KEY), "policy", str(target), 60)
            writer.write_latest(step, target, "policy", None)

        plane = ControlPlane(run_dir, lora_name="policy", server_api_key=KEY)
        plane.server_url = server.url
        plane.rollback(1)
        assert _served(server.url).endswith("step-000001")
        pointer = json.loads((run_dir / "adapters" / "latest.json").read_text())
        assert pointer["version"] == 1 and pointer["rolled_back"] is True

        os.killpg(server.proc.pid, signal.SIGKILL)  # the watchdog restarts it and reloads the served pointer
        assert restarted.wait(300), f"not restarted: {died}"
        assert _served(server.url).endswith("step-000001")  # old main: step-000002, the newest published
        status = plane.status()
        assert status["served_adapter"]["path"].endswith("step-000001")
        assert status["served_adapter"]["source"] == "policy server"
