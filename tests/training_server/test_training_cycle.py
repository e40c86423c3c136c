"""The full cycle a MetaClaw `rl.backend: remote` client drives, over plain HTTP against a real server."""

from __future__ import annotations

from pathlib import Path

import torch

from .helpers import BATCH, PROMPT, adapter, continuation_logprobs, step


def test_create_matches_seed(server) -> None:
    out = server.ok("/v1/lora/create", {"base_model": "tiny", "rank": 4})
    assert set(out) == {"session_id", "status", "model", "rank", "trainable_params"}
    assert out["status"] == "ready" and out["model"] == "tiny" and out["rank"] == 4
    trainable, total = (float(x.strip().rstrip("M")) for x in out["trainable_params"].split("/"))
    assert 0 < trainable < total


def test_full_cycle_train_save_sample_checkpoint_resume(server) -> None:
    sid = server.ok("/v1/lora/create", {"base_model": "tiny", "rank": 4})["session_id"]
    greedy = {"session_id": sid, "tokens": PROMPT, "max_tokens": 6, "temperature": 0}
    before_tokens = server.ok("/v1/sample", greedy)["sequences"][0]
    before = continuation_logprobs(server, sid)

    first = step(server, sid, k=2)
    assert first["step"] == 1 and first["grad_norm"] > 0 and first["learning_rate"] == 5e-2
    assert set(first) == {"status", "step", "grad_norm", "avg_loss", "learning_rate"}
    saved = server.ok("/v1/weights/save", {"session_id": sid, "name": "cycle_step_0001"})
    assert saved == {
        "status": "ok",
        "adapter_path": str(server.checkpoint_dir.resolve() / "adapters" / sid / "cycle_step_0001"),
        "step": 1,
    }
    assert (Path(saved["adapter_path"]) / "adapter_model.safetensors").is_file()

    after = continuation_logprobs(server, sid)
    after_tokens = server.ok("/v1/sample", greedy)["sequences"][0]
    assert after != before, "the saved adapter must change what /v1/sample scores"
    assert sum(after[:4]) > sum(before[:4]), "positive advantages must raise the continuation's logprobs"
    assert len(after_tokens["tokens"]) == len(after_tokens["logprobs"]) and before_tokens["stop_reason"] in (
        "stop",
        "length",
    )

    ckpt = server.ok("/v1/checkpoint/save", {"session_id": sid, "name": "cycle_ckpt"})
    assert ckpt == {"status": "ok", "path": str(server.checkpoint_dir.resolve() / "checkpoints" / sid / "cycle_ckpt")}

    assert step(server, sid)["step"] == 2
    straight = adapter(server.ok("/v1/weights/save", {"session_id": sid, "name": "cycle_straight"})["adapter_path"])

    loaded = server.ok("/v1/checkpoint/load", {"session_id": sid, "path": ckpt["path"]})
    assert loaded == {"status": "ok", "step": 1}
    assert step(server, sid)["step"] == 2
    resumed = adapter(server.ok("/v1/weights/save", {"session_id": sid, "name": "cycle_resumed"})["adapter_path"])

    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    first_saved = adapter(saved["adapter_path"])
    assert any(not torch.equal(first_saved[n], straight[n]) for n in straight)


def test_checkpoint_load_accepts_a_name_relative_to_the_root(server, session_id) -> None:
    server.ok("/v1/checkpoint/save", {"session_id": session_id, "name": "relative_ckpt"})
    assert server.ok("/v1/checkpoint/load", {"session_id": session_id, "path": "relative_ckpt"})["status"] == "ok"


def test_health_reports_latest_session(server, session_id) -> None:
    health = server.client.get("/v1/health").json()
    assert health["model"] == "tiny" and health["status"] == "healthy"


def test_loss_functions_and_config(server, session_id) -> None:
    for loss_fn, config in (
        ("ppo", None),
        ("cispo", {"clip_high_threshold": 5.0}),
        ("ppo", {"clip_low": 0.1, "clip_high": 0.3}),
    ):
        body = {"session_id": session_id, "datums": BATCH, "loss_fn": loss_fn, "loss_fn_config": config}
        out = server.ok("/v1/train/forward_backward", body)
        assert out["loss"] == out["loss"]  # finite, not NaN
    out = server.ok("/v1/train/optim_step", {"session_id": session_id, "learning_rate": 1e-4})
    assert out["avg_loss"] != 0.0


def test_tinker_weights_and_extra_keys(server, session_id) -> None:
    d = {**BATCH[0], "weights": [1.0] * len(BATCH[0]["target_tokens"]), "clip_low_threshold": 0.8, "something": [1]}
    out = server.ok("/v1/train/forward_backward", {"session_id": session_id, "datums": [d], "unknown": True})
    assert out["total_tokens"] == len(d["model_input_tokens"])
