"""The processes train.py starts: one config reaches the server, children die with their parent, a dead server is
restarted or stops the run loudly, and SIGTERM stops the live service cleanly (real train.py, serve.py, LitServe)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from omegaconf import OmegaConf

from metaclaw.devices import resolve_devices
from metaclaw.modules.loading import ModelSpec
from metaclaw.store import SampleStore
from tests.e2e.lifecycle import (
    ONE_SERVER,
    descendants,
    kill_tree,
    launch_train,
    models,
    server_pid,
    wait_for,
    wait_gone,
)
from tests.procs import free_port
from tests.test_configs import _compose

KEY = "test-server-key"


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _serve_overrides(port: int) -> list[str]:
    return [f"serve.port={port}", f"serve.api_key={KEY}"]


def test_every_override_given_to_train_reaches_the_server_it_starts_and_sigterm_stops_the_service(tmp_path):
    """Issue 11.1 + 14.1: what the running server reports is the run's config; rollout=proxy runs until SIGTERM."""
    local = ModelSpec(name="tiny", path="tiny", dtype="float32", max_seq_len=1024).local_dir()  # a local HF dir
    port = free_port()
    overrides = [
        "rollout=proxy", f"rollout.proxy.port={free_port()}",
        f"model.path={local}", "model.name=tiny-local", "model.max_seq_len=768",
        "backend=hf", "backend.max_batch_size=3", "devices=cpu", "devices.colocate_infer_memory=0.5",
        "serve.max_concurrency=7", "serve.default_max_tokens=33", "serve.request_timeout_s=77",
        "serve.max_body_bytes=123456", *_serve_overrides(port),
    ]  # fmt: skip
    run_dir = tmp_path / "run"
    proc, out = launch_train(run_dir, *overrides)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the policy server", lambda: models(url, KEY) is not None, proc=proc, log=out)
        report = models(url, KEY)["data"][0]["metaclaw"]
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key reached it too

        expected = _compose("train", ["model=tiny", *overrides], run_dir)  # what train.py composed
        resolve_devices(expected, gpu_count=0, vllm_available=False, serves_here=True)
        for node in ("model", "backend", "devices"):
            assert report[node] == OmegaConf.to_container(expected[node], resolve=True), node
        serve = OmegaConf.to_container(expected.serve, resolve=True)
        serve.pop("api_key")
        serve["adapter_root"] = str((run_dir / "adapters").resolve())
        assert report["serve"] == {**serve, "auth": "bearer key"}
        # the thread budget of the device plan reached the engine's worker process (devices.cpu_threads.serve)
        threads = expected.devices.cpu_threads.serve
        assert threads is not None and report["devices"]["cpu_threads"]["serve"] == threads
        assert report["effective"] == {
            "model_path": str(local),
            "max_seq_len": 768,
            "backend": "hf",
            "device": "cpu",
            "dtype": "float32",
            "torch_threads": threads,
            "tool_call_format": "hermes",
        }  # fmt: skip  (its template's, serve: auto)
        assert models(url, KEY)["data"][0]["max_model_len"] == 768

        time.sleep(2.0)  # waiting for samples, with no timeout: the service stays up
        assert proc.poll() is None
        children = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, out.read_text()[-3000:]
        assert not wait_gone(children), "processes of the run outlived it"
        assert "Stopping: received SIGTERM" in out.read_text()
    finally:
        kill_tree(proc)


def test_sigkill_of_train_leaves_no_process_and_sigkill_of_serve_main_takes_its_workers(tmp_path):
    """Issue 9.3: children die with their parent on every path (train.py SIGKILL; serve.py main SIGKILL)."""
    port, proxy_port = free_port(), free_port()
    proc, out = launch_train(tmp_path / "run", "rollout=proxy", f"rollout.proxy.port={proxy_port}",
                             "serving.process.max_restarts=1", ONE_SERVER, *_serve_overrides(port))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        # the proxy comes up only after train.py has seen the server start: a kill before that is a failed start
        wait_for("the proxy", lambda: _up(f"http://127.0.0.1:{proxy_port}/health"), proc=proc, log=out)
        main = server_pid(proc)
        workers = descendants(main)
        assert workers, "LitServe runs its engine and API server in child processes"
        os.kill(main, signal.SIGKILL)  # only serve.py's main process
        assert not wait_gone(workers), "serve.py's workers outlived it"

        wait_for("the restarted server", lambda: models(url, KEY) is not None, proc=proc, log=out)
        everything = descendants(proc.pid)
        assert len(everything) > len(workers)
        os.kill(proc.pid, signal.SIGKILL)  # only train.py
        assert not wait_gone(everything), "processes of the run outlived train.py"
    finally:
        kill_tree(proc)


def test_a_dead_server_is_restarted_then_the_run_stops_nonzero_naming_it(tmp_path):
    """Issue 9.4: a server that dies is restarted (bounded) with the newest adapter; past the bound the run exits 1."""
    port = free_port()
    proc, out = launch_train(tmp_path / "run", "rollout=replay", "trainer.max_steps=1000", ONE_SERVER,
                             "serving.process.max_restarts=1", "serving.process.poll_s=0.5",
                             *_serve_overrides(port))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    adapters = tmp_path / "run" / "adapters"
    try:
        wait_for("a published adapter", lambda: (adapters / "latest.json").exists(), proc=proc, log=out, timeout=300)
        first = server_pid(proc)
        os.kill(first, signal.SIGKILL)

        def restarted_with_adapter() -> bool:  # a new serve.py, with the newest adapter loaded into it
            listing = models(url, KEY)
            return server_pid(proc) not in (None, first) and listing is not None and \
                "policy" in {m["id"] for m in listing["data"]}  # fmt: skip

        wait_for("the restarted server with the adapter", restarted_with_adapter, proc=proc, log=out)
        assert "restarting it (1/1" in out.read_text()
        os.kill(server_pid(proc), signal.SIGKILL)
        code = proc.wait(timeout=120)
        text = out.read_text()
        assert code == 1, text[-3000:]
        assert "Run stopped: the policy server (metaclaw serve, pid" in text and "gave up after 1 restart" in text
        store = SampleStore(tmp_path / "run" / "samples.sqlite")
        assert store.counts()["claimed"] == 0  # consistent: unpublished claims went back to ready
    finally:
        kill_tree(proc)


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _gate(tmp_path, seconds: float) -> tuple[str, object]:
    marker = tmp_path / "in-step"
    gate = f"+callbacks.gate={{_target_:tests.e2e.step_gate.HoldStep,marker:'{marker}',step:2,seconds:{seconds}}}"
    return gate, marker


@pytest.mark.slow
@pytest.mark.parametrize("on_signal", ["finish", "abandon"])
def test_sigterm_mid_step(tmp_path, on_signal):
    """Issue 14.1: SIGTERM inside step 3 either finishes and publishes it, or abandons it leaving its samples."""
    gate, marker = _gate(tmp_path, 8.0 if on_signal == "finish" else 600.0)
    run = tmp_path / "run"
    proc, out = launch_train(run, "trainer.max_steps=1000", f"stop.on_signal={on_signal}", gate)
    try:
        wait_for("step 3 to start", marker.exists, proc=proc, log=out, timeout=300)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, out.read_text()[-3000:]
    finally:
        kill_tree(proc)
    published = sorted(p.name for p in (run / "adapters").glob("step-*"))
    store = SampleStore(run / "samples.sqlite")
    counts = store.counts()
    assert counts["claimed"] == 0
    if on_signal == "finish":
        assert published == ["step-000001", "step-000002", "step-000003"]
        assert {s.claimed_step for s in store.select("consumed")} == {0, 1, 2}
    else:
        assert published == ["step-000001", "step-000002"]
        # no checkpoint covers steps 1-2 (publish.checkpoint_every_n_steps: 4; an abandoned step is never
        # checkpointed, it may have stopped mid-update): their samples and step 3's wait for the next run
        assert not store.select("consumed")
        assert {s.claimed_step for s in store.select("ready")} == {None} and counts["ready"] >= 3


@pytest.mark.slow
def test_sigterm_mid_request_lets_it_finish(tmp_path):
    """Issue 14.1: the proxy stops accepting, the request in flight streams to its end and its turn is stored."""
    port, proxy_port = free_port(), free_port()
    run = tmp_path / "run"
    proc, out = launch_train(run, "rollout=proxy", f"rollout.proxy.port={proxy_port}", *_serve_overrides(port))
    try:
        wait_for("the proxy", lambda: _up(f"http://127.0.0.1:{proxy_port}/health"), proc=proc, log=out)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="metaclaw", messages=[{"role": "user", "content": "Count to a thousand."}], max_tokens=300,
            stream=True,
        )  # fmt: skip
        first = next(iter(stream))
        sent = threading.Timer(0.0, os.kill, (proc.pid, signal.SIGTERM))
        sent.start()
        chunks = [first, *stream]
        assert chunks[-1].choices and chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert proc.wait(timeout=120) == 0, out.read_text()[-3000:]
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{proxy_port}/health", timeout=2)
    finally:
        kill_tree(proc)
    assert SampleStore(run / "samples.sqlite").count() >= 1  # the turn in flight was captured
