"""Each API family's exact error shape, everywhere, as its real SDK reads it: OpenAI's `{"error": {"message",
"type", "param", "code"}}` (code a string or null) on every non-Anthropic route and unknown path, Anthropic's
`{"type": "error", "error": {"type", "message"}}` on `/v1/messages*` (401 and 413 included); an upstream that
fails mid-stream ends each stream with the family's error (never a normal end), and the turn is not captured."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import closing, contextmanager

import anthropic
import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from metaclaw.rollout.server import ThreadedServer
from tests.rollout.conftest import make_harness

OPENAI_KEYS = {"message", "type", "param", "code"}


def assert_openai_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status and r.headers["content-type"].startswith("application/json"), r.text
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == OPENAI_KEYS, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    return err


def assert_anthropic_shape(r: httpx.Response, status: int, type_: str) -> dict:
    assert r.status_code == status, r.text
    assert set(r.json()) == {"type", "error"} and r.json()["type"] == "error", r.text
    assert set(r.json()["error"]) == {"type", "message"} and r.json()["error"]["type"] == type_
    return r.json()["error"]


@contextmanager
def proxy_in_front_of(tmp_path, app: FastAPI) -> Iterator:
    """A proxy (own store) in front of `app`, both on free ports; both stopped on exit."""
    app.state.scripted = {}
    with ThreadedServer(app) as up, closing(make_harness(tmp_path, up)) as harnesses:
        yield next(harnesses)


@pytest.fixture
def keyed(tmp_path, upstream):
    yield from make_harness(tmp_path, upstream, api_key="right-key", max_body_bytes=4096)


def test_openai_routes_and_unknown_paths_answer_openai_shape(keyed):
    h, auth = keyed, {"Authorization": "Bearer right-key"}
    for method, path in [("GET", "/v1/nope"), ("POST", "/v1/chat/completion"), ("GET", "/nothing/here")]:
        err = assert_openai_shape(httpx.request(method, f"{h.url}{path}", headers=auth, json={}), 404)
        assert path in err["message"] and err["code"] == "unknown_url"
    err = assert_openai_shape(httpx.get(f"{h.url}/v1/chat/completions", headers=auth), 405)
    assert "GET" in err["message"]
    err = assert_openai_shape(httpx.post(f"{h.url}/v1/chat/completions", headers=auth,
                                         json={"model": "m", "messages": "hi"}), 400)  # fmt: skip
    assert "messages" in err["message"]
    err = assert_openai_shape(httpx.post(f"{h.url}/v1/chat/completions", json={}), 401)
    assert err["code"] == "invalid_api_key"
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 8000}]}
    err = assert_openai_shape(httpx.post(f"{h.url}/v1/chat/completions", headers=auth, json=big), 413)
    assert err["code"] == "request_too_large"


def test_openai_sdk_raises_its_classes(keyed):
    client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="right-key", max_retries=0, timeout=30)
    assert client.models.retrieve("metaclaw").id == "metaclaw"
    assert [m.id for m in client.models.list()] == ["metaclaw"]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert "gpt-4o" in e.value.message and e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert "temperature" in e.value.message and e.value.code is None
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


def test_anthropic_routes_answer_anthropic_shape_everywhere(keyed):
    h, auth = keyed, {"x-api-key": "right-key"}
    assert_anthropic_shape(httpx.post(f"{h.url}/v1/messages", json={}), 401, "authentication_error")
    big = {"model": "c", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 8000}]}
    assert_anthropic_shape(httpx.post(f"{h.url}/v1/messages", headers=auth, json=big), 413, "request_too_large")
    assert_anthropic_shape(httpx.post(f"{h.url}/v1/messages", headers=auth, json={"model": "c"}), 400,
                           "invalid_request_error")  # fmt: skip
    assert_anthropic_shape(httpx.post(f"{h.url}/v1/messages/batches", headers=auth, json={}), 404, "not_found_error")
    assert_anthropic_shape(httpx.get(f"{h.url}/v1/messages", headers=auth), 405, "invalid_request_error")
    assert_anthropic_shape(httpx.post(f"{h.url}/v1/messages", headers={**auth, "content-type": "text/plain"},
                                      content=b"{}"), 415, "invalid_request_error")  # fmt: skip


def test_anthropic_sdk_raises_its_classes(keyed):
    client = anthropic.Anthropic(base_url=keyed.url, api_key="right-key", max_retries=0, timeout=30)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="c", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert "max_tokens" in e.value.message and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(
            model="c", max_tokens=4, messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(model="c", max_tokens=4, messages=[{"role": "user", "content": "x" * 8000}])
    assert e.value.status_code == 413 and e.value.body["error"]["type"] == "request_too_large"


def test_upstream_errors_are_reshaped_per_family(tmp_path):
    """An upstream's own error (here vLLM's shape: an integer code) reaches the client in the client's shape."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny"}]}

    @app.post("/v1/chat/completions")
    async def chat() -> JSONResponse:
        body = {"object": "error", "message": "engine overloaded", "type": "BadRequestError", "code": 429}
        return JSONResponse({"error": body}, status_code=429)

    with proxy_in_front_of(tmp_path, app) as h:
        err = assert_openai_shape(httpx.post(f"{h.url}/v1/chat/completions",
                                             json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                                  429)  # fmt: skip
        assert err["message"] == "engine overloaded" and err["code"] is None
        r = httpx.post(f"{h.url}/v1/messages", json={"model": "c", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert assert_anthropic_shape(r, 429, "rate_limit_error")["message"] == "engine overloaded"


def failing_upstream(how: str) -> FastAPI:
    """One real chunk, then the policy server's mid-stream error event (`error`) or a dropped connection (`drop`)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        await request.json()

        async def gen() -> Iterator[str]:
            choice = {"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None,
                      "logprobs": {"content": [{"token": "Hel", "logprob": -0.5}]}, "token_ids": [7]}  # fmt: skip
            chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "tiny", "choices": [choice],
                     "prompt_token_ids": [1, 2, 3]}  # fmt: skip
            yield f"data: {json.dumps(chunk)}\n\n"
            if how == "drop":
                raise RuntimeError("the engine process died")
            error = {"message": "engine crashed", "type": "internal_server_error", "code": 500, "param": None}
            yield f"data: {json.dumps({'error': error})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.mark.parametrize("how", ["error", "drop"])
def test_mid_stream_failure_ends_each_stream_with_its_error(tmp_path, how):
    messages = [{"role": "user", "content": "hi"}]
    with proxy_in_front_of(tmp_path, failing_upstream(how)) as h:
        oa = openai.OpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0, timeout=30)
        with pytest.raises(openai.APIError) as e:
            list(oa.chat.completions.create(model="m", messages=messages, stream=True))
        assert ("engine crashed" if how == "error" else "mid-stream") in e.value.message
        assert e.value.body.get("code") is None or isinstance(e.value.body["code"], str)

        an = anthropic.Anthropic(base_url=h.url, api_key="k", max_retries=0, timeout=30)
        with pytest.raises(anthropic.APIStatusError) as e, an.messages.stream(model="c", max_tokens=8,
                                                                             messages=messages) as stream:  # fmt: skip
            list(stream)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
        raw = httpx.post(f"{h.url}/v1/messages", json={"model": "c", "max_tokens": 8, "messages": messages,
                                                       "stream": True}).text  # fmt: skip
        assert "event: error" in raw and "message_stop" not in raw and "end_turn" not in raw

        events = list(oa.responses.create(model="codex", input="hi", stream=True))
        assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
        assert events[-1].response.error.message
        assert h.store.count() == 0 and h.proxy.stats["upstream_errors"] >= (3 if how == "drop" else 0)
        assert httpx.get(f"{h.url}/health").json()["status"] == "ok"


def test_streamed_legacy_completions_pass_through_uncaptured(tmp_path):
    """`/v1/completions` streamed (as vLLM serves it): chunks passed on with the client's model id, nothing stored;
    an error chunk in OpenAI's shape."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        assert body["model"] == "tiny"  # mapped like chat

        async def gen() -> Iterator[str]:
            for text in ("Once", " upon"):
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
                chunk = {"id": "c1", "object": "text_completion", "model": "tiny", "created": 1, "choices": [choice]}
                yield f"data: {json.dumps(chunk)}\n\n"
            if body["prompt"] == "fail":
                yield f"data: {json.dumps({'error': {'message': 'engine crashed', 'code': 500}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    with proxy_in_front_of(tmp_path, app) as h:
        oa = openai.OpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0, timeout=30)
        chunks = list(oa.completions.create(model="davinci", prompt="tell", max_tokens=4, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == "Once upon" and {c.model for c in chunks} == {"davinci"}
        with pytest.raises(openai.APIError) as e:
            list(oa.completions.create(model="davinci", prompt="fail", max_tokens=4, stream=True))
        assert e.value.message == "engine crashed" and e.value.body["code"] is None
        assert h.store.count() == 0
