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
        "data.max_staleness=0",
        f"publish.server_url=http://127.0.0.1:{_closed_port()}",
        "publish.max_hot_load_failures=3",
    )
    with pytest.raises(HotLoadError, match="failed to load 3 adapters in a row"):
        train(cfg)
    store = SampleStore(tmp_path / "samples.sqlite")
    # the server still serves v0, so v0's samples are not stale: nothing was dropped, three steps trained
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
