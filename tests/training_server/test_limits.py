"""Bounded: session cap (429), explicit delete, idle expiry that frees the session's tensors, disk quotas (507)."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from metaclaw.config import CONFIG_DIR, register_resolvers
from metaclaw.training_server.engine import TrainingEngine
from metaclaw.training_server.errors import ApiError
from metaclaw.training_server.schemas import ForwardBackwardRequest, OptimStepRequest
from metaclaw.training_server.settings import ServerSettings
from metaclaw.training_server.storage import dir_size

from .helpers import BATCH, step
from .launch import Server, training_server

CONF = CONFIG_DIR
QUOTA_MB = 0.2


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    overrides = [
        "app.limits.max_sessions=2",
        f"app.limits.adapter_quota_mb={QUOTA_MB}",
        f"app.limits.checkpoint_quota_mb={QUOTA_MB}",
    ]
    with training_server(tmp_path_factory.mktemp("limits"), overrides) as server:
        yield server


def test_session_cap_is_429_and_delete_frees_a_place(srv: Server) -> None:
    a, b = srv.create(), srv.create()
    r = srv.post("/v1/lora/create", {"base_model": "tiny", "rank": 4})
    assert r.status_code == 429, r.text
    assert "max_sessions" in r.json()["error"]["message"] and r.json()["error"]["type"] == "session_limit_error"
    assert sorted(srv.sessions()) == sorted([a, b])

    assert srv.client.delete(f"/v1/lora/{a}").json() == {"status": "ok", "session_id": a, "deleted": True}
    assert srv.sessions() == [b]
    assert srv.client.delete(f"/v1/lora/{a}").status_code == 404
    assert srv.post("/v1/train/optim_step", {"session_id": a}).status_code == 404
    c = srv.create()
    assert srv.ok("/v1/lora/delete", {"session_id": c})["deleted"] is True
    assert srv.ok("/v1/lora/delete", {"session_id": b})["deleted"] is True
    assert srv.sessions() == []


def _partials(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*")]


@pytest.mark.parametrize("route", ["/v1/weights/save", "/v1/checkpoint/save"])
def test_disk_quota_is_507_and_leaves_nothing_behind(srv: Server, route: str) -> None:
    sid = srv.create()
    area = srv.checkpoint_dir / ("adapters" if "weights" in route else "checkpoints")
    step(srv, sid)
    refused = None
    for i in range(40):
        r = srv.post(route, {"session_id": sid, "name": f"q{i}"})
        if r.status_code == 507:
            refused = (i, r.json()["error"])
            break
        assert r.status_code == 200, r.text
    assert refused is not None, "the quota never bit"
    i, error = refused
    assert error["type"] == "insufficient_storage_error" and "quota" in error["message"]
    assert str(srv.checkpoint_dir) not in error["message"] and "/tmp" not in error["message"]
    assert not (area / sid / f"q{i}").exists() and _partials(area) == []
    assert dir_size(area) <= QUOTA_MB * 2**20
    # overwriting an existing save replaces it within the quota
    assert srv.post(route, {"session_id": sid, "name": "q0"}).status_code == 200
    srv.client.delete(f"/v1/lora/{sid}").raise_for_status()


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TrainingEngine:
    monkeypatch.setenv("METACLAW_CHECKPOINT_DIR", str(tmp_path))
    register_resolvers()
    overrides = ["app=training_server", "model=tiny", "app.limits.session_idle_s=60", "app.limits.max_sessions=3"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("serve", overrides=overrides)
    eng = TrainingEngine(ServerSettings.from_config(cfg))
    eng.load_base()
    return eng


def _trained(engine: TrainingEngine):
    session, _ = engine.create_session("tiny", 4)
    engine.forward_backward(session, ForwardBackwardRequest(session_id=session.session_id, datums=BATCH))
    engine.optim_step(session, OptimStepRequest(session_id=session.session_id, learning_rate=1e-2))
    engine.forward_backward(session, ForwardBackwardRequest(session_id=session.session_id, datums=BATCH))
    return session


def test_delete_and_idle_expiry_free_the_session_tensors(engine: TrainingEngine) -> None:
    first = _trained(engine)
    second = _trained(engine)  # bound to the slot now, with pending gradients
    adam = [v for st in first.optimizer.state.values() for v in st.values() if hasattr(v, "shape")]
    refs = {
        "first.weights": [weakref.ref(t) for t in first.weights.values()],
        "first.adam": [weakref.ref(v) for v in adam],
        "second.weights": [weakref.ref(t) for t in second.weights.values()],
        "second.grads": [weakref.ref(p.grad) for p in engine.slot.params.values() if p.grad is not None],
    }  # fmt: skip
    assert all(refs.values()), {k: len(v) for k, v in refs.items()}
    del adam
    first_id, second_id = first.session_id, second.session_id

    now = max(first.last_used, second.last_used)
    first.last_used = now - 100  # idle for 100 s (limit 60); second was used just now
    assert engine.expire_idle(now) == [first_id]
    assert list(engine.sessions) == [second_id] and engine.latest is second
    assert engine.delete_session(second)["deleted"] is True
    del first, second
    gc.collect()
    assert engine.sessions == {} and engine.latest is None
    alive = {k: sum(r() is not None for r in v) for k, v in refs.items()}
    assert alive == {k: 0 for k in refs}, alive


def test_cap_counts_live_sessions_only(engine: TrainingEngine) -> None:
    sessions = [engine.create_session("tiny", 4)[0] for _ in range(3)]
    with pytest.raises(ApiError) as err:
        engine.create_session("tiny", 4)
    assert err.value.status == 429
    engine.expire_idle(max(s.last_used for s in sessions) + 61)  # all idle: expired, places free again
    assert engine.sessions == {} and engine.create_session("tiny", 4)[0].session_id


def test_idle_sessions_expire_on_a_live_server(tmp_path: Path) -> None:
    overrides = ["app.limits.session_idle_s=3", "app.limits.sweep_interval_s=0.5"]
    with training_server(tmp_path, overrides) as server:
        idle, busy = server.create(), server.create()
        deadline = time.monotonic() + 30
        while idle in server.sessions() and time.monotonic() < deadline:
            server.ok("/v1/train/optim_step", {"session_id": busy})  # any request naming it keeps it alive
            time.sleep(0.3)
        assert server.sessions() == [busy]
        r = server.post("/v1/train/optim_step", {"session_id": idle})
        assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"


def test_work_queued_for_a_deleted_session_is_404(engine: TrainingEngine) -> None:
    from metaclaw.serving.sampling import SamplingParams

    session, _ = engine.create_session("tiny", 4)
    engine.delete_session(session)  # e.g. expired while the request waited for the model thread
    calls = [
        lambda: engine.forward_backward(session, ForwardBackwardRequest(session_id=session.session_id, datums=BATCH)),
        lambda: engine.optim_step(session, OptimStepRequest(session_id=session.session_id)),
        lambda: engine.save_weights(session, "x"),
        lambda: engine.save_checkpoint(session, "x"),
        lambda: engine.sample(session, [1, 2, 3], SamplingParams(max_tokens=2), False),
    ]
    for call in calls:
        with pytest.raises(ApiError) as err:
            call()
        assert err.value.status == 404 and err.value.param == "session_id"
    assert not (engine.adapters.root / session.session_id).exists()
