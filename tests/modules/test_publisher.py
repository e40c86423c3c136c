"""AdapterPublisher: leftovers of a kill mid-write are cleaned at start; hot-load failures; served version."""

from __future__ import annotations

from pathlib import Path

from metaclaw.modules.publisher import AdapterPublisher


class _Trainer:
    """The few trainer attributes `setup` reads (rank 0 of one process)."""

    is_global_zero = True
    global_step = 0
    datamodule = None


def test_leftover_temp_dirs_from_a_kill_mid_write_are_cleaned_at_start(tmp_path):
    adapters = tmp_path / "adapters"
    kept = adapters / "step-000002"
    kept.mkdir(parents=True)
    (kept / "adapter_model.safetensors").write_bytes(b"x")
    for leftover in (".step-000003-k2j4x9", ".step-000002.old"):  # write_dir_atomically's temp and old dirs
        (adapters / leftover).mkdir()
        (adapters / leftover / "adapter_model.safetensors").write_bytes(b"half")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt.tmp").write_bytes(b"half")
    publisher = AdapterPublisher(str(tmp_path), str(tmp_path / "s.sqlite"))
    publisher.setup(_Trainer(), None, "fit")
    assert sorted(p.name for p in adapters.iterdir()) == ["step-000002"]
    assert (kept / "adapter_model.safetensors").read_bytes() == b"x"
    assert not (tmp_path / "checkpoints" / "last.ckpt.tmp").exists()
    assert publisher.cleaned == [
        Path("adapters/.step-000002.old"),
        Path("adapters/.step-000003-k2j4x9"),
        Path("checkpoints/last.ckpt.tmp"),
    ]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused


def test_resume_counts_staleness_from_the_resumed_version(tmp_path):
    from metaclaw.store import Sample, SampleStore
    from metaclaw.training import train
    from tests.entrypoints.test_train import compose_train

    train(compose_train(tmp_path, "trainer.max_steps=2"))  # adapters v1, v2; 8 of the 16 shipped samples left
    store = SampleStore(tmp_path / "samples.sqlite")
    fresh = [
        store.insert(Sample([1, 2, 3], [4, 5], [-1.0, -1.0], reward=1.0, status="ready", adapter_version=2))
        for _ in range(4)
    ]
    metrics, objs = train(compose_train(tmp_path, "trainer.max_steps=3", "data.max_staleness=1"))
    # resumed at v2: the base model's (v0) samples are 2 versions old and dropped; v2's are trained at step 2
    assert metrics["train/global_step"] == 3
    stale = [s for s in store.select("dropped") if s.meta["dropped"].startswith("stale")]
    assert len(stale) == 8 and all(s.meta["dropped"] == "stale:v0<v1" for s in stale)
    assert {store.get(i).status for i in fresh} == {"consumed"}
    assert objs["publisher"].served_version == 3 and objs["datamodule"].adapter_version == 3


def test_failed_hot_loads_keep_samples_fresh_then_stop_the_run(tmp_path, caplog):
    import pytest

    from metaclaw.modules.publisher import HotLoadError
    from metaclaw.store import SampleStore
    from metaclaw.training import train
    from tests.entrypoints.test_train import compose_train

    cfg = compose_train(
        tmp_path,
        "trainer.max_steps=8",
        "data.max_staleness=2",  # counted from the trainer too: v0 is 2 behind at step 3
        f"publish.server_url=http://127.0.0.1:{_closed_port()}",
        "publish.max_hot_load_failures=3",
    )
    with pytest.raises(HotLoadError, match="failed to load 3 adapters in a row"):
        train(cfg)
    store = SampleStore(tmp_path / "samples.sqlite")
    # v0's samples stay within the bound: nothing was dropped, three steps trained, then the run stopped
    assert not [s for s in store.select("dropped") if s.meta["dropped"].startswith("stale")]
    assert (tmp_path / "adapters" / "step-000003").exists()
    assert not (tmp_path / "adapters" / "step-000004").exists()


def test_an_asynchronous_hot_load_does_not_hold_the_step_and_settles_in_order(tmp_path):
    """The server answers the load only when the test lets it: `serve` has returned long before, the version is
    learnt at `settle`; a second load waits for the first one, so versions arrive in order."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from metaclaw.modules.hot_load import HotLoader

    release, received = threading.Event(), []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(body["lora_path"])
            release.wait(30)
            reply = json.dumps({"adapter_version": int(body["lora_path"][-6:])}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        loader = HotLoader(f"http://127.0.0.1:{server.server_port}", asynchronous=True)
        assert loader.serve(tmp_path / "step-000001", 1) == 0  # returned while the server holds the request
        assert not release.is_set() and loader.served_version == 0
        release.set()
        loader.settle()
        assert loader.served_version == 1 and len(received) == 1
        loader.serve(tmp_path / "step-000002", 2)
        loader.settle()
        assert loader.served_version == 2 and [Path(p).name for p in received] == ["step-000001", "step-000002"]
    finally:
        server.shutdown()


def test_checkpoints_every_k_steps_lose_nothing_and_train_nothing_twice(tmp_path, caplog):
    """Issue 29.4: with `checkpoint_every_n_steps=2` a run that dies after step 3 (three failed hot-loads) has a
    checkpoint at step 2 only: step 2's samples are still claimed, not consumed, and adapter v3 is the served
    pointer. The restart resumes at step 2, trains those samples again there (not the lost run's v3), and at the
    end every sample was consumed by exactly one step of the surviving run."""
    import json
    from collections import Counter

    import pytest
    import torch

    from metaclaw.modules.publisher import HotLoadError
    from metaclaw.store import SampleStore
    from metaclaw.training import train
    from tests.entrypoints.test_train import compose_train

    cfg = compose_train(
        tmp_path,
        "trainer.max_steps=8",
        f"publish.server_url=http://127.0.0.1:{_closed_port()}",
        "publish.max_hot_load_failures=3",
        "publish.hot_load_async=false",
        "publish.checkpoint_every_n_steps=2",
    )
    with pytest.raises(HotLoadError):
        train(cfg)  # dies at step 3's publish, like a crash: no end-of-training checkpoint
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 2
    store = SampleStore(tmp_path / "samples.sqlite")
    assert {s.claimed_step for s in store.select("consumed")} == {0, 1}
    assert 2 in {s.claimed_step for s in store.select("claimed")}  # step 3 trained them; no checkpoint covers it
    assert json.loads((tmp_path / "adapters" / "latest.json").read_text())["version"] == 3

    metrics, objs = train(compose_train(tmp_path, "trainer.max_steps=4", "publish.checkpoint_every_n_steps=2"))
    assert metrics["train/global_step"] == 4
    assert "newer than the checkpoint" in caplog.text
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 4
    assert store.counts()["claimed"] == 0
    per_step = Counter(s.claimed_step for s in store.select("consumed"))
    assert sorted(per_step) == [0, 1, 2, 3] and len(set(per_step.values())) == 1, per_step
    assert json.loads((tmp_path / "adapters" / "latest.json").read_text())["version"] == 4


def test_the_last_step_is_checkpointed_whatever_the_cadence(tmp_path):
    """Training ends between two checkpoints: the end writes one, so a restart redoes nothing."""
    import torch

    from metaclaw.store import SampleStore
    from metaclaw.training import train
    from tests.entrypoints.test_train import compose_train

    metrics, objs = train(compose_train(tmp_path, "trainer.max_steps=3", "publish.checkpoint_every_n_steps=2"))
    assert objs["publisher"].checkpointed_step == 3
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 3
    store = SampleStore(tmp_path / "samples.sqlite")
    assert {s.claimed_step for s in store.select("consumed")} == {0, 1, 2} and store.counts()["claimed"] == 0


def test_settle_from_another_thread_while_serve_starts_a_load_never_sees_an_unstarted_thread(tmp_path, monkeypatch):
    """CI's crash (`cannot join thread before it is started`): the gate's thread called `serve` while the step's
    thread settled. Here every load thread, just before it starts, lets another thread settle the loader: that
    settle must find no load or a started one, and both loads still reach the server in order."""
    import threading

    from metaclaw.modules import hot_load

    loader = hot_load.HotLoader("http://127.0.0.1:9", asynchronous=True, max_failures=None, timeout_s=0.5)
    loaded, errors, plain_thread = [], [], threading.Thread
    monkeypatch.setattr(loader, "_load", lambda path, step: loaded.append(step) or step)

    class Racing(plain_thread):
        def start(self) -> None:
            def settle_elsewhere() -> None:
                try:
                    loader.settle()
                except RuntimeError as exc:
                    errors.append(str(exc))

            other = plain_thread(target=settle_elsewhere)
            other.start()
            other.join()
            super().start()

    monkeypatch.setattr(hot_load.threading, "Thread", Racing)
    loader.serve(tmp_path / "step-000001", 1)
    loader.serve(tmp_path / "step-000002", 2)
    loader.settle()
    assert errors == [] and loaded == [1, 2] and loader.served_version == 2
