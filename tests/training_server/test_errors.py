"""Bad input gets a 4xx JSON error naming the field, and the server keeps working."""

from __future__ import annotations

import httpx
import pytest

from .helpers import BATCH, PROMPT

GOOD = BATCH[0]


def _fb(sid: str, **changes) -> dict:
    return {"session_id": sid, "datums": [GOOD], **changes}


BAD_TRAINING = {
    "mismatched lengths": (lambda sid: _fb(sid, datums=[{**GOOD, "advantages": [0.0, 1.0]}]), "advantages"),
    "empty datums": (lambda sid: _fb(sid, datums=[]), "datums"),
    "empty tokens": (lambda sid: _fb(sid, datums=[{**GOOD, "model_input_tokens": []}]), "model_input_tokens"),
    "unknown loss_fn": (lambda sid: _fb(sid, loss_fn="dpo"), "loss_fn"),
    "bad loss_fn_config": (lambda sid: _fb(sid, loss_fn="ppo", loss_fn_config={"nope": 1}), "loss_fn_config.nope"),
    "clip out of range": (
        lambda sid: _fb(sid, loss_fn="ppo", loss_fn_config={"clip_low": 2.0}),
        "loss_fn_config.clip_low",
    ),
    "clip as a string": (
        lambda sid: _fb(sid, loss_fn="ppo", loss_fn_config={"clip_high": "0.3"}),
        "loss_fn_config.clip_high",
    ),
    "clip for importance_sampling": (
        lambda sid: _fb(sid, loss_fn="importance_sampling", loss_fn_config={"clip_low": 0.1}),
        "loss_fn_config.clip_low",
    ),
    "unknown aggregation": (
        lambda sid: _fb(sid, loss_fn_config={"aggregation": "max"}),
        "loss_fn_config.aggregation",
    ),
    "both clip forms": (
        lambda sid: _fb(sid, loss_fn="cispo", loss_fn_config={"clip_low": 0.1, "clip_low_threshold": 0.9}),
        "loss_fn_config",
    ),
    "NaN advantage": (lambda sid: _fb(sid, datums=[{**GOOD, "advantages": [float("nan")] * 8}]), "advantages"),
    "inf logprob": (lambda sid: _fb(sid, datums=[{**GOOD, "logprobs": [float("-inf")] * 8}]), "logprobs"),
    "token outside vocab": (lambda sid: _fb(sid, datums=[{**GOOD, "target_tokens": [10**6] * 8}]), "target_tokens"),
    "negative token": (lambda sid: _fb(sid, datums=[{**GOOD, "model_input_tokens": [-1] * 8}]), "model_input_tokens"),
    "tokens as strings": (
        lambda sid: _fb(sid, datums=[{**GOOD, "model_input_tokens": ["a"] * 8}]),
        "model_input_tokens",
    ),
    "missing advantages": (
        lambda sid: _fb(sid, datums=[{k: v for k, v in GOOD.items() if k != "advantages"}]),
        "advantages",
    ),
    "datums not a list": (lambda sid: _fb(sid, datums={"a": 1}), "datums"),
    "missing session_id": (lambda sid: {"datums": [GOOD]}, "session_id"),
}


@pytest.mark.parametrize("case", list(BAD_TRAINING), ids=list(BAD_TRAINING))
def test_bad_training_input_is_400_naming_the_field(server, session_id, case) -> None:
    build, field = BAD_TRAINING[case]
    r = server.post("/v1/train/forward_backward", build(session_id))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] or field in (error["param"] or ""), error


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/train/optim_step", {"learning_rate": -1.0}, "learning_rate"),
        ("/v1/train/optim_step", {"learning_rate": "fast"}, "learning_rate"),
        ("/v1/sample", {"tokens": []}, "tokens"),
        ("/v1/sample", {"tokens": [10**6]}, "tokens"),
        ("/v1/sample", {"tokens": PROMPT, "num_samples": 1000}, "num_samples"),
        ("/v1/sample", {"tokens": PROMPT, "top_p": 0.0}, "top_p"),
        ("/v1/sample", {"tokens": PROMPT, "temperature": float("nan")}, "temperature"),
        ("/v1/lora/create", {"rank": 0}, "rank"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/sample", {"tokens": PROMPT, "seed": 2**70}, "seed"),
        ("/v1/sample", {"tokens": PROMPT, "seed": -1}, "seed"),
        ("/v1/sample", {"tokens": PROMPT, "stop": [10**6]}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**70}, "seed"),
        ("/v1/chat/completions", {"messages": [{"role": "bogus", "content": "hi"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"junk": 1}]}]}, "messages.0.content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [1, 2]}]}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": 3}]}]},
            "messages.0.tool_calls",
        ),
    ],
)
def test_bad_request_fields(server, session_id, path, body, field) -> None:
    if path.startswith("/v1/train") or path in ("/v1/sample", "/v1/chat/completions"):
        body = {"session_id": session_id, **body}
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] or field in (error["param"] or ""), error


def test_malformed_json_is_400(server) -> None:
    r = server.client.post(
        "/v1/train/optim_step", content=b'{"session_id": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = server.client.post("/v1/sample", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


@pytest.mark.parametrize("path", ["/v1/train/forward_backward", "/v1/train/optim_step", "/v1/weights/save"])
def test_unknown_session_is_404(server, path) -> None:
    r = server.post(path, {"session_id": "deadbeef", "datums": [GOOD], "name": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "session_id" and "deadbeef" in r.json()["error"]["message"]
    assert server.post("/v1/sample", {"tokens": PROMPT, "session_id": "deadbeef"}).status_code == 404


@pytest.mark.parametrize(
    ("path", "key", "value"),
    [
        ("/v1/weights/save", "name", "../escape"),
        ("/v1/weights/save", "name", "/etc/metaclaw_evil"),
        ("/v1/weights/save", "name", "."),
        ("/v1/checkpoint/save", "name", "../../outside"),
        ("/v1/checkpoint/load", "path", "../../../etc"),
        ("/v1/checkpoint/load", "path", "/tmp"),
        ("/v1/checkpoint/load", "path", "does_not_exist"),
    ],
)
def test_path_tricks_are_400(server, session_id, path, key, value) -> None:
    r = server.post(path, {"session_id": session_id, key: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == key


@pytest.mark.parametrize("path", ["/v1/weights/save", "/v1/checkpoint/save"])
@pytest.mark.parametrize("name", ["x" * 256, "é" * 128, "a" * 4096, "a/b", ".hidden", "a\x00b"])
def test_bad_names_are_400_without_server_paths(server, session_id, path, name) -> None:
    r = server.post(path, {"session_id": session_id, "name": name})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "name"
    assert str(server.checkpoint_dir.resolve()) not in r.text and "/tmp" not in r.text, r.text


def test_longest_name_is_saved(server, session_id) -> None:
    out = server.ok("/v1/weights/save", {"session_id": session_id, "name": "n" * 200})
    assert out["adapter_path"].endswith("/" + "n" * 200)


def test_no_absolute_path_in_load_errors(server, session_id) -> None:
    for path in ("does_not_exist", "/etc", "../../x", f"{server.checkpoint_dir}/checkpoints/{session_id}/nope"):
        r = server.post("/v1/checkpoint/load", {"session_id": session_id, "path": path})
        assert r.status_code == 400, r.text
        assert str(server.checkpoint_dir.resolve()) not in r.json()["error"]["message"], r.text


def test_openapi_declares_400_not_422(server) -> None:
    doc = server.client.get("/openapi.json").json()
    for path, item in doc["paths"].items():
        for method, op in item.items():
            codes = set(op["responses"])
            assert "422" not in codes, (method, path)
            if method == "post":
                assert "400" in codes, (method, path)
    fb = doc["paths"]["/v1/train/forward_backward"]["post"]["responses"]["400"]["content"]["application/json"]
    assert fb["schema"]["$ref"].endswith("/ErrorBody")
    assert "507" in doc["paths"]["/v1/weights/save"]["post"]["responses"]
    assert "429" in doc["paths"]["/v1/lora/create"]["post"]["responses"]


def test_auth(server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        r = httpx.post(f"{server.url}/v1/lora/create", json={"base_model": "tiny", "rank": 4}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(
        f"{server.url}/v1/sample", json={"tokens": PROMPT}, headers={"Authorization": "Bearer " + "x" * 10000}
    )
    assert r.status_code == 401


def test_base_model_mismatch_while_sessions_live_is_409(server, session_id) -> None:
    r = server.post("/v1/lora/create", {"base_model": "Qwen/Qwen3-4B", "rank": 4})
    assert r.status_code == 409 and r.json()["error"]["param"] == "base_model"
    r = server.post("/v1/lora/create", {"base_model": "tiny", "rank": 8})
    assert r.status_code == 409 and r.json()["error"]["param"] == "rank"


def test_server_still_works_after_errors(server, session_id) -> None:
    out = server.ok("/v1/train/forward_backward", {"session_id": session_id, "datums": BATCH})
    assert out["num_datums"] == len(BATCH)
    assert server.ok("/v1/train/optim_step", {"session_id": session_id, "learning_rate": 1e-4})["status"] == "ok"
