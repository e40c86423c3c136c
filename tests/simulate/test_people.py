"""People of the real-path bench: their phrasing pools, and how they talk to a real proxy (no session headers)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from metaclaw.config import CONFIG_DIR
from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.testing import scripted_upstream
from metaclaw.scoring.judges import RuleJudge
from metaclaw.simulate import user as simulated
from metaclaw.simulate.people import POOLS, SESSION_HEADERS, People, PreferenceKind, kinds, phrasings
from metaclaw.simulate.tasks import load_tasks
from metaclaw.store import SampleStore
from tests.conftest import REPO


def _all_phrases() -> list[str]:
    return [p for phrases in phrasings().values() for p in phrases]


def test_every_kind_has_enough_varied_phrasings_and_a_verifier():
    assert len(kinds()) >= 3
    presets = {r["kind"] for f in (CONFIG_DIR / "preference").glob("*.yaml")
               for r in yaml.safe_load(f.read_text())["rules"]}  # fmt: skip
    not_preset = [k for k in kinds() if not {r["kind"] for r in PreferenceKind.load(k).rules} <= presets - {"regex"}]
    assert not_preset, "at least one kind must be outside the simulated user's presets"
    for name in kinds():
        full = PreferenceKind.load(name, "all")
        assert len(full.praise) >= 60 and len(full.correction) >= 60, name
        assert len(set(full.correction)) == len(full.correction)
        train, held = PreferenceKind.load(name, "train"), PreferenceKind.load(name, "heldout")
        assert set(train.correction).isdisjoint(held.correction) and held.correction
        assert set(train.correction) | set(held.correction) == set(full.correction)
        full.verifier.check("some reply")  # the rules validate
    summary = PreferenceKind.load("summary_first").verifier
    assert summary.complies("Boil it for 6 minutes.\n\nThen cool it in cold water for a while before peeling.")
    assert not summary.complies("When it comes to boiling eggs there are many factors to weigh, such as size, "
                                "altitude and how runny you like the yolk, so it depends.")  # fmt: skip
    for stock in ("Sam. Eggs take a while.", "1. Boil them.", "You're welcome! Boil them.", "Boil it for 6 minutes."):
        assert not summary.complies(stock), stock  # one or two words are no summary; a summary needs details after
    you = PreferenceKind.load("address_you").verifier
    assert you.complies("You should boil it for 6 minutes.") and not you.complies("Eggs boil in 6 minutes.")


def test_phrasings_avoid_the_rule_judge_the_simulated_user_and_the_judge_tests():
    judge = RuleJudge()  # its defaults (conf/judge/rule.yaml defers to them)
    phrases = _all_phrases()
    assert [p for p in phrases if judge.negative.search(p) or judge.positive.search(p)] == []
    assert simulated.THANKS not in phrases and simulated.CORRECTION not in phrases
    mine = {POOLS.resolve(), (REPO / "tests" / "simulate" / "test_people.py").resolve()}
    texts = [
        f.read_text(errors="replace").lower()
        for d in ("tests", "bench")
        for f in (REPO / d).rglob("*")
        if f.is_file() and f.suffix in (".py", ".json", ".jsonl", ".yaml", ".txt") and f.resolve() not in mine
    ]
    reused = [p for p in phrases if len(p.split()) >= 3 and any(p.lower() in t for t in texts)]
    assert reused == [], "phrasings also used by tests or benches (the judge's own data)"


CLAAS_FEEDBACK = (  # CLaaS's feedback strings (claas/eval/configs/preference/*.yaml)
    "Your name is Kuro, always introduce yourself as Kuro",
    "Be more concise, keep responses under 3 sentences",
    "Don't use any emojis in your responses",
)


@pytest.mark.parametrize("name", ["identity", "concise", "no_emoji"])
def test_claas_probes_are_only_held_out_never_what_people_say_or_ask(name):
    """CLaaS's probe prompts are the held-out set only: no opening, reaction or question of the people repeats
    one, and no phrasing repeats CLaaS's feedback string."""
    path = REPO / "bench" / "data" / f"claas_{name}_probes.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 10 and {r["split"] for r in rows} == {"heldout"}
    assert all(r["source"].startswith("kfallah/CLaaS") for r in rows)
    probes = [r["prompt"].lower() for r in rows]
    full = PreferenceKind.load(name, "all")
    ours = [x.lower() for x in (*full.openings, *full.correction, *full.praise)]
    ours += [t.prompt.lower() for t in load_tasks(None, "train")]  # what people ask
    assert not [p for p in probes for x in ours if p == x or (len(p.split()) >= 3 and p.rstrip("?.!") in x)]
    assert not [x for x in ours for f in CLAAS_FEEDBACK if f.lower().rstrip(".") in x]


def test_concise_and_no_emoji_people_hold_claas_verifiers():
    concise = PreferenceKind.load("concise").verifier
    assert concise.complies("Python is a readable language used for scripts, data work and the web.")
    assert not concise.complies("Python.")  # too short to answer
    assert not concise.complies("It is old. It is readable. It is popular. It is free, and it runs anywhere.")
    no_emoji = PreferenceKind.load("no_emoji").verifier
    assert no_emoji.complies("Hello, how can I help?") and not no_emoji.complies("Hello! 😊 How can I help?")


def _reply(body):
    """Complies with `number` on the first reply of a conversation only."""
    return "About 12 minutes." if len(body["messages"]) == 1 else "It depends on many things."


@pytest.fixture
def proxy(tmp_path):
    with ThreadedServer(scripted_upstream(_reply)) as upstream:
        store = SampleStore(tmp_path / "samples.sqlite")
        with ThreadedServer(create_app(RolloutProxy(store, upstream.url, base_model="tiny"), api_key="k")) as srv:
            yield srv.url, store


def test_people_talk_like_users_and_react_only_in_their_next_message(proxy):
    url, store = proxy
    people = People(f"{url}/v1", PreferenceKind.load("number"), people=2, api_key="k", anthropic_share=0.5,
                    max_conversations=2, seed=3).start()  # fmt: skip
    people.join(120)
    people.stop()
    summary = people.summary()
    assert summary["errors"] == 0 and summary["conversations"] == 4 and summary["replies"] == 16
    assert 0 < summary["anthropic_replies"] < 16  # both SDKs
    assert summary["session_headers_sent"] == 0 and summary["requests"] == 17  # /v1/models once, then 16 turns
    assert not set(summary["request_headers"]) & set(SESSION_HEADERS)
    turns = people.turn_records()
    for t in turns:  # the first reply complies, the others do not; the 4th is never reacted to
        assert t["complied"] == (t["index"] == 0)
        assert t["reaction"] == (None if t["index"] == 3 else ("praise" if t["index"] == 0 else "correction"))
        assert (t["next_message"] is None) == (t["index"] == 3)
        if t["index"] == 2:  # the closing reaction is alone: no question after it
            assert t["next_message"] in PreferenceKind.load("number").correction
    samples = store.select()
    assert len(samples) == 16
    assert {s.meta.get("session_source") for s in samples} == {"derived"}  # the proxy found the conversations
    assert len({s.session_id for s in samples}) == 4
    assert sorted(s.text.next_state is None for s in samples).count(True) == 4


def test_identity_openings_are_ours_with_held_out_ones_apart_and_other_kinds_have_none():
    train, held = PreferenceKind.load("identity", "train"), PreferenceKind.load("identity", "heldout")
    assert train.openings and held.openings and set(train.openings).isdisjoint(held.openings)
    # CLaaS's probes are never an opening: test_claas_probes_are_only_held_out_never_what_people_say_or_ask
    assert PreferenceKind.load("number").openings == ()
    assert not train.verifier.complies("I'm an AI assistant.") and train.verifier.complies("Hi, I'm KURO.")


def _one_person(url: str, conversations: int, seed: int, **habits: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One person with these habits through the proxy at `url`, to the end: their summary and turns."""
    people = People(f"{url}/v1", PreferenceKind.load("number"), people=1, api_key="k",
                    max_conversations=conversations, seed=seed, **habits)  # fmt: skip
    people.start()
    people.join(120)
    people.stop()
    return people.summary(), people.turn_records()


def test_people_in_human_mode_skip_react_late_and_send_no_verdict_messages(proxy):
    """Half the replies reacted to, a share of those late (here 2-3 s: the store's reopen rule is tested with a
    10-minute gap in tests/scoring), the rest followed by the next question, a follow-up task or a correction
    of the person's own request: kind-free words that judge no reply."""
    url, store = proxy
    summary, turns = _one_person(url, conversations=6, seed=5, react_share=0.5, late_share=0.5, late_s=(2.0, 3.0))
    assert summary["errors"] == 0 and summary["late"] >= 1 and summary["no_verdict"] >= 1
    assert 0 < summary["reacted"] < summary["replies"] - summary["conversations"]  # some replies got no reaction
    late = [t for t in turns if t["late_s"] > 0]
    assert all(t["late_s"] >= 2.0 and t["reaction"] in ("praise", "correction") for t in late)
    pools = yaml.safe_load(POOLS.read_text())
    for t in turns:
        if t["reaction"] == "followup":
            assert t["next_message"] in pools["followups"]
        if t["reaction"] == "own_correction":
            assert t["next_message"] in pools["own_corrections"]
    next_states = {s.text.next_state for s in store.select()}
    assert all(t["next_message"] in next_states for t in late)  # each late reaction reached the turn it answers
    with pytest.raises(ValueError, match="react_share"):
        People(f"{url}/v1", PreferenceKind.load("number"), react_share=1.5)


def test_a_person_keeps_talking_while_conversations_wait_for_a_late_reaction_and_comes_back_to_each(proxy):
    """People who mean to react late start other conversations meanwhile (a bound of 2 open ones kept each person
    idle for minutes: 39 turns in 10 minutes of a human-mode run). Once out of new conversations they come back to
    every one left open, so every late reaction is still sent."""
    url, _ = proxy
    summary, turns = _one_person(url, conversations=3, seed=2, react_share=1.0, late_share=1.0, late_s=(3.0, 3.5))
    assert summary["errors"] == 0 and summary["conversations"] == 3
    assert len(turns) == 12 and summary["late"] == 9  # every reaction came late, and each was sent
    first_turns = max(t["sent_at"] for t in turns if t["index"] == 0)
    first_late = min(t["replied_at"] + t["late_s"] for t in turns if t["late_s"] > 0)
    assert first_turns < first_late  # all three conversations opened before the first late reaction was due
