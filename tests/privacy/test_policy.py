"""The privacy stage in the store's write path: a secret never reaches the SQLite file (nor its WAL), the turn
is settled `dropped` (reason `secret`) without token ids; personal data follows its category's action."""

from __future__ import annotations

import asyncio

import pytest

from metaclaw.privacy import PrivacyPolicy
from metaclaw.privacy.outbound import RedactingEvolver, RedactingJudge, teacher_renderer
from metaclaw.store import GroupCommitWriter, Sample, SampleStore, SampleText
from metaclaw.wire.client import Endpoint

KEY = "sk-proj-" + "Zq7Lm2Xc9Vb4Nn1Kp8Rt5Wy3" * 2
EMAIL = "maria.keller@fastmail.fm"
CARD = "4111 1111 1111 1111"


def sample(text: str, response: str = "Sure.", **kw) -> Sample:
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": text}]
    return Sample(
        prompt_ids=[5, 6, 7],
        response_ids=[8, 9],
        behaviour_logprobs=[-0.5, -0.25],
        text=SampleText(messages=messages, response_text=response),
        **kw,
    )


def file_bytes(store: SampleStore) -> bytes:
    """The database file and its WAL, as they are on disk now."""
    out = store.path.read_bytes()
    wal = store.path.with_name(store.path.name + "-wal")
    return out + (wal.read_bytes() if wal.exists() else b"")


@pytest.fixture
def store(tmp_path):
    s = SampleStore(tmp_path / "samples.sqlite", screen=PrivacyPolicy())
    yield s
    s.close()


def test_a_turn_holding_a_secret_is_dropped_redacted_and_never_in_the_file(store):
    with GroupCommitWriter(store) as writer:  # the proxy's write path
        bad = writer.insert(sample(f"$ cat .env\nOPENAI_API_KEY={KEY}\nwhy does the client fail?"))
        good = writer.insert(sample("How do I list files?"))
        writer.submit_next_state(good, f"That failed, my key is {KEY}").result()
    s = store.get(bad)
    assert s.status == "dropped" and s.meta["dropped"] == "secret" and "openai_key" in s.meta["privacy"]["secret_kinds"]
    assert s.prompt_ids == [] and s.response_ids == [] and s.behaviour_logprobs == []  # the ids spell the key
    assert s.meta["privacy"]["tokens_discarded"] == {"prompt": 3, "response": 2}
    assert (
        "[REDACTED:" in s.text.messages[1]["content"] and "why does the client fail?" in s.text.messages[1]["content"]
    )
    g = store.get(good)
    assert g.status == "pending" and g.prompt_ids == [5, 6, 7] and "[REDACTED:" in g.text.next_state
    assert store.dropped_reasons() == {"secret": 1}
    assert store.select("pending") == [g]  # what the scorer (judge, teacher, evolver) reads: the key is not there
    assert KEY.encode() not in file_bytes(store) and KEY[8:30].encode() not in file_bytes(store)


def test_a_secret_in_the_reply_drops_the_turn_too(store):
    sid = store.insert(sample("print the deploy token", response=f"Here it is: {KEY}"))
    assert store.get(sid).meta["dropped"] == "secret" and KEY.encode() not in file_bytes(store)


def test_pii_follows_its_category(store):
    kept = store.insert(sample(f"Mail the report to {EMAIL}, my server is 81.2.69.160"))
    s = store.get(kept)  # email: redact_text (token ids kept, trained on); ip: keep
    assert s.status == "pending" and s.prompt_ids == [5, 6, 7] and EMAIL not in s.text.messages[1]["content"]
    assert "81.2.69.160" in s.text.messages[1]["content"] and s.meta["privacy"]["pii_redacted"] == ["email"]
    card = store.get(store.insert(sample(f"my card {CARD} was declined")))  # card: drop
    assert card.status == "dropped" and card.meta["dropped"] == "pii:card" and card.prompt_ids == []
    assert EMAIL.encode() not in file_bytes(store) and CARD.encode() not in file_bytes(store)
    assert store.dropped_reasons() == {"pii": 1}


def test_feedback_text_is_screened(store):
    sid = store.insert(sample("How do I list files?"))
    store.add_feedback(sid, {"score": -1.0, "text": f"use {KEY} next time"})
    assert KEY not in store.get(sid).meta["feedback"]["text"]


def test_policy_refuses_unknown_settings():
    with pytest.raises(ValueError, match="privacy.pii.email"):
        PrivacyPolicy(pii={"email": "hide"})
    with pytest.raises(ValueError, match="privacy.pii.names"):
        PrivacyPolicy(pii={"names": "drop"})
    with pytest.raises(ValueError, match="privacy.outbound"):
        PrivacyPolicy(outbound="sometimes")


class Recorder:
    def __init__(self, base_url: str | None, api_key: str | None = None) -> None:
        self.endpoint, self.seen = Endpoint(base_url, api_key) if base_url else None, []

    async def reward(self, s: Sample):
        self.seen.append(s)
        return 1.0

    def evolve(self, agent_id, turns):
        self.seen += list(turns)


def test_outbound_calls_off_this_machine_get_redacted_text():
    policy = PrivacyPolicy()  # email: redact_text, ip: keep; outbound: redact_untrusted redacts every category
    policy.bind_own_server(Endpoint("http://127.0.0.1:8000", "run-key"))  # this run's policy server (loop.wiring)
    s = sample(f"ping 81.2.69.160 and mail {EMAIL}")  # stored as is with keep; here: straight from a store
    s.text.next_state = f"also cc {EMAIL}"
    local, remote = Recorder("http://127.0.0.1:8000", "run-key"), Recorder("https://judge.example.com")
    asyncio.run(RedactingJudge(local, policy).reward(s))
    asyncio.run(RedactingJudge(remote, policy).reward(s))
    assert EMAIL in local.seen[0].text.messages[1]["content"]  # our own server: the stored text
    sent = remote.seen[0]
    assert "81.2.69.160" not in sent.text.messages[1]["content"] and EMAIL not in sent.text.messages[1]["content"]
    assert EMAIL not in sent.text.next_state and EMAIL in s.text.next_state  # a copy: the sample itself is unchanged
    evolver = Recorder("https://api.example.com/v1")
    RedactingEvolver(evolver, policy).evolve("a", [{"sample_id": 1, "messages": s.text.messages, "response": EMAIL}])
    assert EMAIL not in str(evolver.seen)
    seen = []
    render = teacher_renderer(
        lambda smp, hint: seen.append(smp.text.messages) or [1], Recorder("http://10.0.0.9"), policy
    )
    render(s, "hint")
    assert EMAIL not in str(seen)
    assert not PrivacyPolicy(outbound="off").redacts_for(Endpoint("https://judge.example.com"))
    assert PrivacyPolicy(outbound="redact_all").redacts_for(Endpoint("http://localhost:1"))


def test_a_loopback_url_that_is_not_this_runs_server_gets_redacted_text():
    """Issue 43, finding 8: the decision was the URL's alone, so any process on 127.0.0.1 (another user's server,
    a port taken after ours went away) got the stored text. Now only this run's own server, by address AND key,
    and what the owner lists in `privacy.trusted_outbound`, do."""
    policy = PrivacyPolicy(trusted_outbound=["http://127.0.0.1:9000/v1/"])
    policy.bind_own_server(Endpoint("http://127.0.0.1:8000", "run-key"))
    s = sample(f"mail {EMAIL}")
    strangers = [Recorder("http://127.0.0.1:8001", "run-key"),  # a loopback URL that is not ours
                 Recorder("http://localhost:8000", "other-key"),  # our port, someone else's key
                 Recorder("http://[::1]:8000"),  # no key at all
                 Recorder("http://127.0.0.1:8000", None)]  # fmt: skip
    for judge in strangers:
        asyncio.run(RedactingJudge(judge, policy).reward(s))
        assert EMAIL not in judge.seen[0].text.messages[1]["content"], judge.endpoint
    evolver = Recorder("http://127.0.0.1:8001/v1", "run-key")
    RedactingEvolver(evolver, policy).evolve("a", [{"sample_id": 1, "messages": s.text.messages, "response": EMAIL}])
    assert EMAIL not in str(evolver.seen)
    ours = [
        Recorder("http://127.0.0.1:8000/", "run-key"),
        Recorder("http://127.0.0.1:8000/v1", "run-key"),
        Recorder("http://127.0.0.1:9000", "any"),
    ]  # our server (the evolver's /v1 too); the owner's trusted one
    for judge in ours:
        asyncio.run(RedactingJudge(judge, policy).reward(s))
        assert EMAIL in judge.seen[0].text.messages[1]["content"], judge.endpoint
    assert PrivacyPolicy().redacts_for(Endpoint("http://127.0.0.1:8000", "run-key"))  # no server bound: nothing is ours
    with pytest.raises(ValueError, match="redact_untrusted"):
        PrivacyPolicy(outbound="redact_external")


def test_status_shows_turns_dropped_for_a_secret(store, tmp_path):
    from metaclaw.control.cli import format_status
    from metaclaw.control.plane import ControlPlane

    store.insert(sample(f"OPENAI_API_KEY={KEY}"))
    status = ControlPlane(tmp_path, store).status()
    assert status["samples_dropped"] == {"secret": 1}
    assert "dropped:       secret 1" in format_status(status)


def test_status_shows_eval_example_replies_only_when_configured(tmp_path):
    import json

    from metaclaw.control.plane import ControlPlane

    record = {"step": 2, "adapter": "step-000002", "compliance": 0.5, "examples": ["my reply to Alice's question"]}
    (tmp_path / "eval.jsonl").write_text(json.dumps(record) + "\n")
    assert "examples" not in ControlPlane(tmp_path).status()["eval"][0]
    assert ControlPlane(tmp_path, show_text=True).status()["eval"][0]["examples"] == record["examples"]
