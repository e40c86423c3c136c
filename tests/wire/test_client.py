"""The one outbound client (`metaclaw.wire.client`): every call site works with a base URL with or without `/v1`
(never `/v1/v1`), against a real local HTTP server; the SDK's retry policy; no key leaks from the environment."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from metaclaw.control.plane import ControlPlane
from metaclaw.evaluation.quality import base_nll
from metaclaw.evaluation.regression import RegressionWatch
from metaclaw.modules.hot_load import HotLoader
from metaclaw.rollout.probe import probe_attach, probe_capture
from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.replay import ReplayDriver
from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.testing import scripted_upstream
from metaclaw.scoring.distill import ContextDistiller
from metaclaw.scoring.judges import LLMJudge
from metaclaw.scoring.teacher import TeacherClient
from metaclaw.simulate.user import SimulatedUser
from metaclaw.skills.evolve import SkillEvolver
from metaclaw.store import Sample, SampleStore, SampleText
from metaclaw.wire.client import CallError, Endpoint, Refused, chat, models


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    """The scripted upstream on a real port, and the `(path, Authorization)` of every request it got."""
    app = scripted_upstream()
    seen: list[tuple[str, str | None]] = []

    @app.middleware("http")
    async def record(request: Request, call_next):
        seen.append((request.url.path, request.headers.get("authorization")))
        return await call_next(request)

    with ThreadedServer(app) as srv:
        yield srv.url, seen


def _judge(url: str, tmp: Path) -> None:
    s = Sample(
        [1],
        [2],
        [-0.1],
        text=SampleText(messages=[{"role": "user", "content": "hi"}], response_text="hello", next_state="Thanks!"),
    )
    assert asyncio.run(LLMJudge(url, "tiny", votes=1).reward(s)).detail["errors"] == 0


def _evolver(url: str, tmp: Path) -> None:
    assert SkillEvolver(tmp / "skills", base_url=url, model="tiny").complete([{"role": "user", "content": "hi"}])


def _teacher(url: str, tmp: Path) -> None:
    assert asyncio.run(TeacherClient(url, "tiny").logprobs([1, 2], [3])) == [-0.5]


def _evaluator(url: str, tmp: Path) -> None:
    assert base_nll(Endpoint(url), "tiny", [1, 2], [3, 4]) == pytest.approx(0.5)


def _gate(url: str, tmp: Path) -> None:
    store = SampleStore(tmp / "store.db")
    try:
        assert RegressionWatch(store, lambda step, agent: {}).served(Endpoint(url), "nobody") is None
    finally:
        store.close()


def _hot_loader(url: str, tmp: Path) -> None:
    (tmp / "step-000001").mkdir(exist_ok=True)
    loader = HotLoader(url, "policy")
    loader._load(tmp / "step-000001", 1)
    assert loader.stats["hot_load_failures"] == 0


def _distiller(url: str, tmp: Path) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "return_token_ids": True,
    }
    replies, _ = ContextDistiller(url, "tiny")._ask(body)
    assert replies[0].token_ids


def _control_plane(url: str, tmp: Path) -> None:
    store = SampleStore(tmp / "plane.db")
    try:
        plane = ControlPlane(tmp / "run", store)
        plane.server_url = url
        assert plane.served_adapters()["default"]["source"] == "policy server (base model only)"
    finally:
        store.close()


def _probe(url: str, tmp: Path) -> None:
    probe_capture(url)
    probe_attach(url, None, "tiny", 16)


def _simulated_user(url: str, tmp: Path) -> None:
    user = SimulatedUser(url, [{"kind": "no_exclamation"}], model="tiny")
    assert user.ask([{"role": "user", "content": "hi"}], {}, anthropic=False, max_tokens=8)


def _replay(url: str, tmp: Path) -> None:
    path = tmp / "conversations.jsonl"
    path.write_text('{"turns": ["hi"]}\n')
    driver = ReplayDriver(url, str(path), model="tiny")
    assert driver.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


def _proxy_models(url: str, tmp: Path) -> None:
    store = SampleStore(tmp / "proxy.db")
    try:
        proxy = RolloutProxy(store, url, policy_model="policy", model_refresh_s=0)
        asyncio.run(proxy.refresh_models())
        assert "tiny" in proxy.upstream_models
    finally:
        store.close()


CALL_SITES: dict[str, Callable[[str, Path], None]] = {
    "judge": _judge, "evolver": _evolver, "teacher": _teacher, "distiller": _distiller, "evaluator": _evaluator,
    "gate": _gate, "control_plane": _control_plane,
    "hot_loader": _hot_loader, "probe": _probe, "simulated_user": _simulated_user, "replay": _replay,
    "proxy_models": _proxy_models,
}  # fmt: skip


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
@pytest.mark.parametrize("site", sorted(CALL_SITES))
def test_every_call_site_works_with_or_without_v1(upstream, tmp_path, site, suffix):
    url, seen = upstream
    before = len(seen)
    CALL_SITES[site](url + suffix, tmp_path)
    paths = [p for p, _ in seen[before:]]
    assert paths, f"{site} sent nothing"
    assert all(p.startswith("/v1/") and not p.startswith("/v1/v1") for p in paths), paths


def test_the_address_rule():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", " http://h:8000/v1/ "):
        assert Endpoint(url).v1 == "http://h:8000/v1" and Endpoint(url).root == "http://h:8000"
    assert "secret" not in repr(Endpoint("http://h", "secret"))
    assert Endpoint.of(Endpoint("http://h", "k")) == Endpoint("http://h", "k")


def test_a_key_is_sent_and_no_key_sends_none_even_with_openai_api_key_set(upstream, monkeypatch):
    url, seen = upstream
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    before = len(seen)
    models(Endpoint(url))
    models(Endpoint(url, "run-key"))
    assert [a for _, a in seen[before:]] == [None, "Bearer run-key"]


def test_refusals_and_silence_are_call_errors(upstream):
    url, _ = upstream
    with pytest.raises(Refused) as refused:
        chat(Endpoint(url), {"model": "nobody", "messages": []}, max_retries=0)
    assert refused.value.status_code == 404 and isinstance(refused.value, CallError)
    with ThreadedServer(FastAPI()) as gone, pytest.raises(Refused):  # a real server without the route
        models(Endpoint(gone.url))
    with pytest.raises(CallError):
        models(Endpoint("http://127.0.0.1:9"), timeout=2)


def _flaky(first: Callable[[], object]) -> tuple[FastAPI, list[float]]:
    """A server whose first chat request gets `first()` (a response or a sleep), every later one an answer."""
    app, hits = FastAPI(), []

    @app.post("/v1/chat/completions")
    async def chat_route(request: Request):
        hits.append(time.monotonic())
        if len(hits) == 1:
            out = first()
            if out is not None:
                return out
            await asyncio.sleep(3)
        return {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}

    return app, hits


@pytest.mark.parametrize(
    "first",
    [
        lambda: JSONResponse({"error": {"message": "slow down"}}, status_code=429, headers={"retry-after": "0"}),
        lambda: JSONResponse({"error": {"message": "boom"}}, status_code=503, headers={"retry-after": "0"}),
        lambda: None,  # a read timeout
    ],
    ids=["429", "503", "read-timeout"],
)
def test_one_retry_policy_retries_429_5xx_and_read_timeouts(first):
    app, hits = _flaky(first)
    with ThreadedServer(app) as srv:
        reply = chat(Endpoint(srv.url), {"model": "m", "messages": []}, timeout=1.0, max_retries=1)
    assert reply["choices"][0]["message"]["content"] == "ok" and len(hits) == 2


def test_a_client_error_is_not_retried():
    app, hits = _flaky(lambda: JSONResponse({"error": {"message": "bad"}}, status_code=400))
    with ThreadedServer(app) as srv, pytest.raises(Refused):
        chat(Endpoint(srv.url), {"model": "m", "messages": []}, max_retries=2)
    assert len(hits) == 1
