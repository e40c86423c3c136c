"""Issue 9 item 1: request and file data never reach Hydra/OmegaConf, interpolation, pickle, eval or import by name.

Every entry point where outside data is parsed gets an interpolation (`${oc.env:HOME}`) and a `_target_` key; each
must refuse it (4xx / a validation error) or keep it as inert text, and nothing may be written or resolved.

Audit (grep of `src/` for instantiate / OmegaConf.create|merge|load / pickle / torch.load / eval / import_module /
__import__ / _target_): `instantiate` is only called on the composed config (training.py, serving/policy_app.py,
loop/live.py, the training server's settings and optimizer); the training server's loss registry resolves its
trusted `app.losses` nodes once at start and builds losses from validated kwargs; adapters and checkpoints are
safetensors + JSON (no pickle, no torch.load); skill front matter is `yaml.safe_load`; evolver replies, store rows
and checkpoint `state.json` are `json.loads` into validated structures.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.training_server.helpers import BATCH
from tests.training_server.launch import Server, training_server

HOME = os.path.expanduser("~")
INTERPOLATIONS = ["${oc.env:HOME}", "${oc.create:{a: 1}}", "${oc.decode:'1'}"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    with training_server(tmp_path_factory.mktemp("code_execution")) as server:
        yield server, server.create()


def _fb(sid: str, config: object, loss_fn: str = "ppo") -> dict:
    return {"session_id": sid, "datums": BATCH[:1], "loss_fn": loss_fn, "loss_fn_config": config}


# ---- training server: loss_fn_config ------------------------------------------------------------------------
@pytest.mark.parametrize("value", INTERPOLATIONS)
@pytest.mark.parametrize("key", ["aggregation", "clip_low", "clip_high_threshold"])
def test_loss_fn_config_interpolation_is_400_and_not_resolved(srv, key: str, value: str) -> None:
    server, sid = srv
    r = server.post("/v1/train/forward_backward", _fb(sid, {key: value}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"loss_fn_config.{key}"
    assert HOME not in r.text, r.text


def test_aggregation_env_interpolation_does_not_echo_home(srv) -> None:
    server, sid = srv
    r = server.post("/v1/train/forward_backward", _fb(sid, {"aggregation": "${oc.env:HOME}"}, "importance_sampling"))
    assert r.status_code == 400 and HOME not in r.text, r.text


@pytest.mark.parametrize(
    "config",
    [
        {"_target_": "metaclaw.losses.ppo.PPOLoss"},
        {"_target_": "builtins.print", "aggregation": "sum"},
        {"_partial_": True},
        {"aggregation": {"_target_": "builtins.str"}},
    ],
)
def test_loss_fn_config_target_key_is_400(srv, config: dict) -> None:
    server, sid = srv
    r = server.post("/v1/train/forward_backward", _fb(sid, config))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("loss_fn_config.")


def test_nested_write_text_target_writes_nothing(srv, tmp_path: Path) -> None:
    server, sid = srv
    victim = tmp_path / "pwned.pth"
    nested = {
        "_target_": "pathlib.Path.write_text",
        "self": {"_target_": "pathlib.Path", "_args_": [str(victim)]},
        "data": "import os; os.system('true')",
    }
    for config in ({"aggregation": nested}, {"clip_low": nested}, {"extra": nested}, nested):
        r = server.post("/v1/train/forward_backward", _fb(sid, config))
        assert r.status_code == 400, r.text
    assert not victim.exists()
    # and the server still trains with a valid config
    ok = server.ok("/v1/train/forward_backward", _fb(sid, {"clip_low_threshold": 0.8, "aggregation": "sum"}))
    assert ok["status"] == "ok"


# ---- training server: other request strings ----------------------------------------------------------------
@pytest.mark.parametrize("value", INTERPOLATIONS)
def test_interpolations_in_names_and_ids_stay_inert(srv, value: str) -> None:
    server, sid = srv
    for path, body in (
        ("/v1/weights/save", {"session_id": sid, "name": value}),
        ("/v1/checkpoint/save", {"session_id": sid, "name": value}),
        ("/v1/checkpoint/load", {"session_id": sid, "path": value}),
        ("/v1/train/optim_step", {"session_id": value}),
        ("/v1/sample", {"session_id": value, "tokens": [1, 2]}),
    ):
        r = server.post(path, body)
        assert r.status_code in (400, 404), (path, r.text)
        assert HOME not in r.text, (path, r.text)


# ---- training server: checkpoint files ----------------------------------------------------------------------
def test_checkpoint_state_file_with_target_or_interpolation_is_refused(srv) -> None:
    server, sid = srv
    saved = Path(server.ok("/v1/checkpoint/save", {"session_id": sid, "name": "genuine"})["path"])
    state = json.loads((saved / "state.json").read_text())
    shared = server.checkpoint_dir / "checkpoints" / "shared"
    tampered = {
        "lr_interpolation": lambda s: s["optimizer"]["param_groups"][0].update(lr="${oc.env:HOME}"),
        "group_target": lambda s: s["optimizer"]["param_groups"][0].update(_target_="builtins.exec"),
        "extra_string": lambda s: s["optimizer"]["param_groups"][0].update(foreach="${oc.env:HOME}"),
        "top_level_target": lambda s: s.update(_target_="os.system"),
        "scalar_string": lambda s: s["optimizer"].update(scalars={"0": {"step": "${oc.env:HOME}"}}),
    }
    for name, change in tampered.items():
        target = shared / name
        target.mkdir(parents=True)
        for f in saved.iterdir():
            if f.is_file():
                (target / f.name).write_bytes(f.read_bytes())
        (target / "adapter").mkdir()
        for f in (saved / "adapter").iterdir():
            (target / "adapter" / f.name).write_bytes(f.read_bytes())
        bad = json.loads(json.dumps(state))
        change(bad)
        (target / "state.json").write_text(json.dumps(bad))
        r = server.post("/v1/checkpoint/load", {"session_id": sid, "path": f"shared/{name}"})
        assert r.status_code == 400, (name, r.text)
        assert HOME not in r.text and "state.json" in r.json()["error"]["message"], (name, r.text)
    assert server.ok("/v1/checkpoint/load", {"session_id": sid, "path": "genuine"})["status"] == "ok"


# ---- policy server: adapter_config.json ---------------------------------------------------------------------
def test_adapter_config_target_and_interpolation_stay_inert(srv, tmp_path: Path) -> None:
    from metaclaw.serving.engines.base import AdapterError
    from metaclaw.serving.engines.hf import read_adapter

    server, sid = srv
    saved = Path(server.ok("/v1/weights/save", {"session_id": sid, "name": "for_policy"})["adapter_path"])
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for f in saved.iterdir():
        (adapter / f.name).write_bytes(f.read_bytes())
    config = json.loads((adapter / "adapter_config.json").read_text())
    victim = tmp_path / "pwned"
    config.update(
        _target_="pathlib.Path.write_text", base_model_name_or_path="${oc.env:HOME}", revision="${oc.env:HOME}"
    )
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    lora, state = read_adapter(adapter)  # unknown keys are dropped by PEFT; strings stay strings
    assert lora.base_model_name_or_path == "${oc.env:HOME}" and lora.revision == "${oc.env:HOME}"
    assert not hasattr(lora, "_target_") and state
    config["self"] = {"_target_": "pathlib.Path", "_args_": [str(victim)]}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError):  # a key that collides with the constructor is refused
        read_adapter(adapter)
    assert not victim.exists()


# ---- skills: SKILL.md files and evolver replies -------------------------------------------------------------
def test_skill_front_matter_target_and_interpolation_stay_text() -> None:
    from metaclaw.skills.skill import Skill

    text = (
        "---\nname: safe-skill\ndescription: ${oc.env:HOME}\ncategory: general\n"
        "_target_: os.system\nmetadata:\n  _args_: ['touch /tmp/pwned']\n---\n\nBody ${oc.env:HOME} {{ 7*7 }}\n"
    )
    skill = Skill.from_markdown(text)
    assert skill.description == "${oc.env:HOME}" and "${oc.env:HOME}" in skill.body and "{{ 7*7 }}" in skill.body
    assert skill.extra["_target_"] == "os.system"  # kept as data, never looked up
    assert HOME not in skill.to_markdown()
    with pytest.raises(ValueError):
        Skill.from_markdown("---\nname: !!python/object/apply:os.system ['true']\n---\nbody\n")


def test_evolver_reply_target_and_interpolation_stay_text() -> None:
    from metaclaw.skills.proposals import ProposalError, parse_reply, validate_proposal

    reply = json.dumps(
        {
            "skills": [
                {
                    "action": "add",
                    "name": "check-paths",
                    "description": "${oc.env:HOME}",
                    "category": "general",
                    "body": "Always ${oc.env:HOME} and {{ config }} stay literal text here.",
                    "_target_": "builtins.exec",
                },
                {"_target_": "os.system", "_args_": ["true"]},
            ]
        }
    )
    raw = parse_reply(f"<think>x</think>```json\n{reply}\n```")
    proposal = validate_proposal(raw[0])
    assert proposal.skill.description == "${oc.env:HOME}" and "${oc.env:HOME}" in proposal.skill.body
    with pytest.raises(ProposalError):
        validate_proposal(raw[1])


# ---- sample store rows --------------------------------------------------------------------------------------
def test_store_rows_keep_interpolations_and_targets_as_data(tmp_path: Path) -> None:
    from metaclaw.store import Sample, SampleStore, SampleText

    store = SampleStore(tmp_path / "samples.db")
    try:
        meta = {"_target_": "os.system", "note": "${oc.env:HOME}"}
        messages = [{"role": "user", "content": "${oc.env:HOME}", "_target_": "builtins.exec"}]
        sid = store.insert(
            Sample(
                prompt_ids=[1, 2],
                response_ids=[3],
                behaviour_logprobs=[-0.5],
                meta=meta,
                text=SampleText(messages=messages),
            )
        )
        row = store.get(sid)
        assert row.meta == meta and row.text.messages == messages
    finally:
        store.close()


# ---- chat template: message text is data, not template source ----------------------------------------------
def test_chat_content_is_not_template_source() -> None:
    from metaclaw.modules.loading import ModelSpec
    from metaclaw.training_server.chat import prompt_ids
    from metaclaw.training_server.schemas import ChatCompletionRequest

    tokenizer = ModelSpec(name="tiny", path="tiny").load_tokenizer()
    text = "{{ 7*7 }} {% raw %} ${oc.env:HOME}"
    req = ChatCompletionRequest(messages=[{"role": "user", "content": text}])
    decoded = tokenizer.decode(prompt_ids(tokenizer, req))
    assert text in decoded and "49" not in decoded and HOME not in decoded
