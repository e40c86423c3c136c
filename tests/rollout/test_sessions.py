"""Sessions without ids (derived from the conversation), session keys other clients send, and the table's bounds.

Driven with the real `openai` client through the real proxy and a scripted upstream whose replies are numbered,
so two conversations that open alike still get different replies, as with a sampling model.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaclaw.rollout.conversation import Query
from metaclaw.rollout.fit import ClientFit, ContextPolicy, ImagePolicy
from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.session_tracker import SessionTracker
from metaclaw.rollout.testing import scripted_upstream
from metaclaw.store import SampleStore, SessionLog
from tests.rollout.conftest import make_harness


@pytest.fixture
def numbered_upstream() -> Iterator[ThreadedServer]:
    counter = itertools.count(1)
    with ThreadedServer(scripted_upstream(reply=lambda body: f"Reply number {next(counter)}.")) as srv:
        yield srv


@pytest.fixture
def h(tmp_path, numbered_upstream):
    yield from make_harness(tmp_path, numbered_upstream)


class Chat:
    """One conversation as a chat client keeps it: the whole history resent each turn."""

    def __init__(self, client: openai.OpenAI, *opening: dict, **kw) -> None:
        self.client, self.messages, self.kw = client, list(opening), kw

    def say(self, text: str, system: str | None = None, stream: bool = False, **kw) -> str:
        self.messages.append({"role": "user", "content": text})
        msgs = self.messages if system is None else [{"role": "system", "content": system}, *self.messages]
        args = {**self.kw, **kw}
        if stream:
            chunks = self.client.chat.completions.create(model="m", messages=msgs, stream=True, **args)
            reply = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        else:
            reply = self.client.chat.completions.create(model="m", messages=msgs, **args).choices[0].message.content
        self.messages.append({"role": "assistant", "content": reply})
        return reply


def oai(h) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{h.url}/v1", api_key="unused", max_retries=0)


def sessions(store: SampleStore) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in store.select():
        out.setdefault(s.session_id, []).append(s)
    return out


def test_interleaved_conversations_with_equal_openings_stay_apart(h):
    a, b = Chat(oai(h)), Chat(oai(h))
    a.say("hi")
    b.say("hi")
    b.say("tell me about b")
    a.say("tell me about a", stream=True)
    b.say("more b")
    a.say("more a")
    got = sessions(h.store)
    assert len(got) == 2
    for turns in got.values():
        assert [s.turn_index for s in turns] == [0, 1, 2]
    by_first_next = {turns[0].text.next_state: turns for turns in got.values()}
    assert set(by_first_next) == {"tell me about a", "tell me about b"}
    assert by_first_next["tell me about a"][1].text.next_state == "more a"
    assert by_first_next["tell me about b"][1].text.next_state == "more b"
    # each turn's stored messages are its own conversation's
    assert all(s.text.messages[-1]["content"].endswith(" a") for s in by_first_next["tell me about a"][1:])


def test_identical_conversations_pair_up_instead_of_merging(tmp_path, upstream):
    for h in make_harness(tmp_path, upstream):  # constant replies: the two conversations are indistinguishable
        a, b = Chat(oai(h)), Chat(oai(h))
        a.say("hi"), b.say("hi"), a.say("ok"), b.say("ok"), a.say("bye"), b.say("bye")
        got = sessions(h.store)
        assert sorted(len(t) for t in got.values()) == [3, 3]
        assert all([s.text.next_state for s in t] == ["ok", "bye", None] for t in got.values())


def test_a_changing_system_prompt_does_not_split_a_session(h):
    c = Chat(oai(h))
    for i, text in enumerate(["what time is it?", "and now?", "thanks"]):
        c.say(text, system=f"You are helpful. Current time: 12:0{i}:{i * 7:02d}")
    [turns] = sessions(h.store).values()
    assert [s.turn_index for s in turns] == [0, 1, 2]
    assert [s.text.next_state for s in turns] == ["and now?", "thanks", None]


def test_trimmed_history_edited_reply_and_tool_turns_continue(h):
    c = Chat(oai(h))
    c.say("first question")
    c.say("second question")
    c.messages = c.messages[2:]  # the client dropped its oldest exchange (context window)
    c.say("third question")
    c.messages[-1]["content"] += "  "  # whitespace differences do not matter
    c.messages[-1]["content"] = "[edited] " + c.messages[-1]["content"]  # the client rewrote the reply
    c.say("fourth question")
    [turns] = sessions(h.store).values()
    assert [s.text.next_state for s in turns] == ["second question", "third question", "fourth question", None]

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    t = Chat(oai(h), tools=tools)
    t.say("please use the tool", stream=True)  # the reply is a tool call
    fn = {"name": "get_weather", "arguments": '{"city":"Berlin"}'}  # the client's own id and argument spacing
    t.messages[-1] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "x9", "type": "function", "function": fn}],
    }
    t.messages.append({"role": "tool", "tool_call_id": "x9", "content": "18C"})
    t.client.chat.completions.create(model="m", messages=t.messages, tools=tools)
    tool_turns = [v for k, v in sessions(h.store).items() if k != turns[0].session_id]
    assert [[s.turn_index for s in v] for v in tool_turns] == [[0, 1]]
    assert tool_turns[0][0].text.next_state == "[tool result] 18C"


def test_openclaws_transient_context_message_does_not_split_its_session(h):
    """OpenClaw (2026.9.6, recorded in tests/conformance/recorded/openclaw.jsonl) appends a message of runtime
    context after the person's message on every request and leaves it out of the history it sends next."""
    client, history, replies = oai(h), [], []
    for i, text in enumerate(["What is in notes.txt?", "Thanks! A fun fact?", "Keep it shorter.", "Bye."]):
        history.append({"role": "user", "content": text})
        extra = {"role": "user", "content": f"<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> run {i} <<<END>>>"}
        reply = client.chat.completions.create(model="m", messages=[*history, extra]).choices[0].message.content
        replies.append(reply)
        history.append({"role": "assistant", "content": reply})
    [turns] = sessions(h.store).values()
    assert [s.turn_index for s in turns] == [0, 1, 2, 3]
    assert [(s.text.next_state or "").split("\n")[0] for s in turns] == ["Thanks! A fun fact?", "Keep it shorter.",
                                                                           "Bye.", ""]  # fmt: skip
    # a stranger who knows the opening but not the reply it got starts a session of its own
    client.chat.completions.create(model="m", messages=[history[0], {"role": "assistant", "content": "other"},
                                                         {"role": "user", "content": "hijack"}])  # fmt: skip
    assert len(sessions(h.store)) == 2


def test_a_turn_whose_reply_the_fitted_prompt_dropped_still_gets_its_reaction(tmp_path, upstream, tiny_tokenizer):
    """The context policy may drop the previous exchange from what the model sees; the previous turn's reaction
    (its next state) is read from what the client sent (OpenClaw's turns were never trained before)."""
    fit = ClientFit(ImagePolicy(), ContextPolicy(tokenizer=tiny_tokenizer, max_context_tokens=300, reserve_tokens=16))
    for h in make_harness(tmp_path, upstream, fit=fit):
        c = Chat(oai(h), {"role": "system", "content": "You are helpful."})
        c.say("first question")
        c.say("No, that is wrong. " + " ".join(f"w{i}" for i in range(120)))
        [turns] = sessions(h.store).values()
        assert turns[1].meta.fit.context["messages_dropped"] >= 2  # the first exchange is gone from the prompt
        assert (turns[0].text.next_state or "").startswith("No, that is wrong.")


def test_a_failed_turn_leaves_the_session_open_for_the_retry(h):
    c = Chat(oai(h))
    c.say("hi")
    h.proxy.base_model = "no-such-model"
    with pytest.raises(openai.NotFoundError):
        c.say("second")
    h.proxy.base_model = "tiny"
    c.messages.pop()  # the client retries the same request
    c.say("second")
    [turns] = sessions(h.store).values()
    assert [(s.turn_index, s.text.next_state) for s in turns] == [(0, "second"), (2, None)]


def test_session_keys_other_clients_send(h):
    c = oai(h)
    # OpenClaw-RL's user simulator: one `user` per conversation, equal openings, its own system prompt per turn
    sims = {u: [{"role": "user", "content": "hello"}] for u in ("sim-1", "sim-2")}
    for turn in range(3):
        for user, msgs in sims.items():
            sys_msg = {"role": "system", "content": f"Simulated user, turn {turn}"}
            r = c.chat.completions.create(model="m", messages=[sys_msg, *msgs], user=user)
            msgs += [{"role": "assistant", "content": f"rephrased {turn}"}, {"role": "user", "content": f"q{turn}"}]
            assert r.id.startswith("chatcmpl-")
    got = sessions(h.store)  # `user` partitions derived sessions (it is a person, not a conversation: security.md)
    assert sorted([s.turn_index for s in v] for v in got.values()) == [[0, 1, 2], [0, 1, 2]]
    assert not {"sim-1", "sim-2"} & set(got)
    assert all(s.meta["session_source"] == "user" for v in got.values() for s in v)
    assert h.upstream_state["requests"][-1]["user"] == "sim-2"  # OpenAI's own field is forwarded

    # MetaClaw's body fields: read by the proxy, never forwarded (a strict upstream would refuse them)
    extra = {"session_id": "body-s", "turn_type": "main", "session_done": True}
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], user="u", extra_body=extra)
    sent = h.upstream_state["requests"][-1]
    assert not {"session_id", "turn_type", "session_done"} & set(sent) and sent["user"] == "u"
    [s] = sessions(h.store)["body-s"]
    assert s.meta["session_source"] == "body"
    assert ("default", "body-s") in h.proxy.sessions.log.done_sessions()
    n = h.store.count()
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "t"}], extra_body={"turn_type": "side"})
    assert h.store.count() == n  # a side turn by body field
    # headers beat body fields
    c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "y"}],
        user="u2",
        extra_body={"session_id": "body-2"},
        extra_headers={"X-Session-Id": "hdr-2"},
    )
    assert h.store.select()[-1].session_id == "hdr-2" and h.store.select()[-1].meta["session_source"] == "header"
    for bad in ({"session_id": ""}, {"session_id": 5}, {"turn_type": "odd"}, {"session_done": "maybe"}, {"user": 1}):
        r = httpx.post(f"{h.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **bad})
        assert r.status_code == 400 and next(iter(bad)) in r.json()["error"]["message"]


def _tracker(tmp_path, **kw) -> SessionTracker:
    store = SampleStore(tmp_path / "s.sqlite")
    return SessionTracker(store, SessionLog(store.path), **kw)


def _open(tracker: SessionTracker, text: str) -> tuple:
    q = Query.of([{"role": "user", "content": text}], "a")
    state, _ = tracker.claim(q)
    tracker.set_tail(state, q.tail({"role": "assistant", "content": "r"}))
    return state, Query.of([{"role": "user", "content": text}, {"role": "assistant", "content": "r"}], "a")


def test_session_table_is_bounded_lru(tmp_path):
    t = _tracker(tmp_path, max_sessions=2, idle_s=3600)
    s1, q1 = _open(t, "one")
    s2, q2 = _open(t, "two")
    t.state("a", "explicit")  # third entry: the least recently used (s1) goes
    assert len(t) == 2 and t.stats["evicted"] == 1
    assert t.claim(q1)[0] is not s1  # forgotten: its conversation continues as a new session
    busy = [t.state("a", f"busy{i}") for i in range(2)]
    turns = [t.begin_turn(b)[0] for b in busy]  # sessions with a turn in flight are never evicted ...
    t.state("a", "x")
    assert len(t) == 3  # ... so the table is over its bound while they are
    for b, turn in zip(busy, turns, strict=True):
        t.end_turn(b, turn, None)
    t.state("a", "y")
    assert [k for _, k in t._sessions] == ["x", "y"] and t.stats["evicted"] == 6


def test_idle_sessions_expire(tmp_path, monkeypatch):
    t = _tracker(tmp_path, max_sessions=100, idle_s=10)
    s1, q1 = _open(t, "one")
    s1.seen_at -= 11
    t.state("a", "new")
    assert t.stats["expired"] == 1 and t.peek(q1) is None
    with pytest.raises(ValueError):
        _tracker(tmp_path, max_sessions=0)


def test_a_restarted_proxy_finds_derived_sessions_in_the_store(tmp_path, numbered_upstream):
    first = make_harness(tmp_path, numbered_upstream)
    h = next(first)
    a, b = Chat(oai(h)), Chat(oai(h))
    a.say("hi"), b.say("hi"), a.say("second a")
    first.close()  # the proxy stops; the store stays
    second = make_harness(tmp_path, numbered_upstream)
    h2 = next(second)
    a.client = b.client = oai(h2)
    b.say("second b")
    a.say("third a")
    old = a.messages[:2]
    Chat(oai(h2), *old).say("a fork from turn 0")  # not the session's last turn any more: a new session
    second.close()
    got = sorted(sessions(h2.store).values(), key=len)
    assert [[s.turn_index for s in t] for t in got] == [[0], [0, 1], [0, 1, 2]]
    assert [s.text.next_state for s in got[2]] == ["second a", "third a", None]
    assert [s.text.next_state for s in got[1]] == ["second b", None]
    assert h2.proxy.sessions.stats["derived_recovered"] == 2


def test_anthropic_clients_send_session_keys_too(h):
    import anthropic

    c = anthropic.Anthropic(base_url=h.url, api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    for text in ("more", "bye"):
        r = c.messages.create(model="m", max_tokens=8, messages=msgs, metadata={"user_id": "claude-user"})
        msgs += [{"role": "assistant", "content": r.content[0].text + " (edited)"}, {"role": "user", "content": text}]
    c.messages.create(model="m", max_tokens=8, messages=msgs[:1], extra_body={"session_id": "s-body"})
    got = sessions(h.store)
    assert sorted((k == "s-body", [s.turn_index for s in v]) for k, v in got.items()) == [(False, [0, 1]),
                                                                                        (True, [0])]  # fmt: skip
    assert "session_id" not in h.upstream_state["requests"][-1]


@settings(max_examples=60, deadline=None)
@given(order=st.lists(st.integers(0, 3), min_size=1, max_size=24), same_replies=st.booleans())
def test_any_interleaving_keeps_conversations_apart(order, same_replies):
    """Four conversations that all say "hi" then "more", interleaved at random, system prompt changing every
    request: with distinct replies each keeps its own session; with identical replies (indistinguishable) the
    sessions still hold one conversation's worth of turns each."""
    with tempfile.TemporaryDirectory() as tmp:
        tracker = _tracker(Path(tmp))
        history: dict[int, list] = {c: [] for c in range(4)}
        owner: dict[int, object] = {}
        turns: dict[int, int] = {}
        for step, c in enumerate(order):
            msgs = [*history[c], {"role": "user", "content": "more" if history[c] else "hi"}]
            q = Query.of([{"role": "system", "content": f"time {step}"}, *msgs], "a")
            state, _ = tracker.claim(q)
            reply = {"role": "assistant", "content": "same" if same_replies else f"reply {step}"}
            tracker.set_tail(state, q.tail(reply))
            history[c] = [*msgs, reply]
            turns[id(state)] = turns.get(id(state), 0) + 1
            if not same_replies:
                assert owner.setdefault(c, state) is state
        per_conversation = sorted(len(h) // 2 for h in history.values() if h)
        assert sorted(turns.values()) == per_conversation


@pytest.mark.parametrize("session_id", ["a\r\nSet-Cookie: x=1", "line\nbreak", "caf\u00e9\u2603", "nul\x00"])
def test_a_session_id_that_cannot_be_a_header_is_refused_before_capture(h, session_id):
    """Issue 43 (finding 8): the id is sent back as a header; one that cannot be (CR/LF, non-Latin-1) is a 400, and
    the turn is not captured (it was a 500 or a dropped connection, with the turn stored)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "session_id": session_id}
    r = httpx.post(f"{h.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "session_id" in r.json()["error"]["message"]
    assert h.store.select() == []


def test_an_end_user_name_in_any_script_is_still_accepted(h):
    """`user` is never sent back as a header: only session ids need to be header-safe."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "user": "\u738b\u5c0f\u660e \U0001f600"}
    assert httpx.post(f"{h.url}/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_an_agents_transient_runtime_message_is_no_reaction():
    """OpenClaw appends its runtime context to every request and leaves it out of the next one's history: the
    recorded requests' next states are the person's words only; a client without such a message keeps all."""
    import json
    from pathlib import Path

    from metaclaw.rollout.session_tracker import SessionState, reaction_messages
    from metaclaw.wire.normalize import next_state_text

    recorded = Path(__file__).parents[1] / "conformance" / "recorded" / "openclaw.jsonl"
    bodies = [json.loads(line)["body"] for line in recorded.read_text().splitlines() if line.strip()]
    assert len(bodies) >= 3 and all("OPENCLAW_INTERNAL_CONTEXT" in json.dumps(b["messages"][-1]) for b in bodies)
    state, texts = SessionState(), []
    for body in bodies:
        texts.append(next_state_text(reaction_messages(body["messages"], state)))
    assert texts[0] == ""  # the first turn reacts to nothing
    for text in texts[1:]:
        assert text and "OPENCLAW_INTERNAL_CONTEXT" not in text and "openclaw turn" in text, text

    plain, state = [{"role": "user", "content": "q1"}], SessionState()
    assert reaction_messages(plain, state) == []
    plain += [
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "No."},
        {"role": "tool", "content": "x"},
    ]
    assert [m["content"] for m in reaction_messages(plain, state)] == ["No.", "x"]  # nothing dropped


def test_person_text_is_the_persons_words_without_what_the_agent_wrote():
    from metaclaw.wire.normalize import person_text

    reminder = ("<system-reminder>\nOutput token limit hit. Resume directly \u2014 no apology, no recap of what you "
                "were doing.\n</system-reminder>")  # fmt: skip
    assert person_text(reminder) == ""  # Claude Code's own continuation (recorded)
    assert person_text(f"{reminder}\nNo, shorter please.") == "No, shorter please."
    assert person_text("[Sat 2026-11-28 18:12 UTC] Thanks, that's all for now.") == "Thanks, that's all for now."
    ctx = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nActive exec sessions: none\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"
    assert person_text(f"Great, thanks.\n\n{ctx}") == "Great, thanks."
    for kept in ("Use <b>bold</b> here, not <i>.", "[draft] is wrong", "See [2026-11-28 report] above"):
        assert person_text(kept) == kept  # inline markup and other brackets are the person's
