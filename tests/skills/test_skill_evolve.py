"""SkillEvolver against a scripted local OpenAI-compatible endpoint."""

from __future__ import annotations

import json

from metaclaw.skills import FailedTurn, SkillEvolver, SkillInjector, SkillLibrary

NEW_SKILL = {
    "action": "add",
    "name": "pin-dependency-versions",
    "description": "When adding a Python or npm dependency, pin a version range and update the lock file.",
    "category": "dependencies",
    "body": "- Add the dependency with a version constraint (e.g. ~=2.3).\n- Regenerate and commit the lock file.",
}
DUPLICATE = {
    "action": "add",
    "name": "confirm-work-before-reporting",
    "description": "Before telling the user a task is finished or a bug is fixed, run the tests or build that "
    "prove it.",
    "category": "verification",
    "body": "- Run the relevant test, build or command after every change.\n- Report what you observed, e.g. the "
    "number of passing tests, not what you expect.\n- If you cannot run the check, say so and tell the user what "
    "to run.\n- Re-read the request and make sure every part was done.",
}
TURNS = [
    {
        "sample_id": "s-1",
        "messages": [{"role": "user", "content": "add requests to the project"}],
        "response": "Added `requests` to requirements.txt.",
        "reward": -1.0,
    },
    FailedTurn("s-2", "user: install numpy\nassistant: done", "pip install numpy", 0.0),
    {"sample_id": "s-ok", "prompt": "fine", "response": "fine", "reward": 1.0},  # not a failure: ignored
]


def fenced(*skills: dict) -> str:
    return "Here you go:\n```json\n" + json.dumps({"skills": list(skills)}) + "\n```"


def make(root, llm, **kw) -> SkillEvolver:
    kw = {"timeout_s": 5, "approval": "auto_safe", **kw}  # what these tests check: accepted skills served at once
    return SkillEvolver(root, base_url=llm.base_url, model="judge", api_key="k", **kw)


def test_accepted_skill_written_logged_and_generation_bumped(root, llm):
    llm.replies.append(fenced(NEW_SKILL))
    result = make(root, llm).evolve("alice", TURNS)
    assert result.error is None and result.accepted_names == ["pin-dependency-versions"]
    assert result.generation == 1
    lib = SkillLibrary(root, "alice")
    skill = lib.get("pin-dependency-versions")
    assert skill.source == "agent" and skill.category == "dependencies"
    assert (root / "alice" / "pin-dependency-versions" / "SKILL.md").is_file()
    (entry,) = lib.history()
    assert entry["accepted"] and entry["action"] == "add" and entry["source_sample_ids"] == ["s-1", "s-2"]
    assert "ts" in entry and entry["generation"] == 1
    assert SkillInjector(root).generation("alice") == 1 and SkillLibrary(root, "bob").get(skill.name) is None
    req = llm.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer k" and req["json"]["model"] == "judge"
    prompt = req["json"]["messages"][1]["content"]
    assert "add requests to the project" in prompt and "s-ok" not in prompt and "safe-shell-commands" in prompt


def test_invalid_json_refused_and_logged(root, llm):
    llm.replies.append("I think you should add a skill about dependencies {not json")
    result = make(root, llm).evolve("alice", TURNS)
    assert result.accepted == [] and result.error and "JSON" in result.error
    assert "it began: 'I think you should add a skill" in result.error  # what came back, to see why
    (entry,) = SkillLibrary(root, "alice").history()
    assert entry["action"] == "parse" and not entry["accepted"] and entry["source_sample_ids"] == ["s-1", "s-2"]
    assert SkillLibrary(root, "alice").generation == 0


def test_duplicates_refused_by_name_and_similarity(root, llm, embedding_ranker):
    same_name = dict(NEW_SKILL, name="safe-shell-commands")
    llm.replies.append(fenced(same_name, DUPLICATE, NEW_SKILL, NEW_SKILL))
    result = make(root, llm, max_proposals=4).evolve("alice", TURNS[:1])
    assert result.accepted_names == ["pin-dependency-versions"]
    reasons = [e["reason"] for e in result.rejected]
    assert "already exists" in reasons[0]
    assert "too similar to existing skill 'verify-before-claiming-done'" in reasons[1]
    assert "within the reply" in reasons[2]
    assert len(SkillLibrary(root, "alice").history()) == 4
    # the embedding ranker finds the same near-duplicate
    llm.replies.append(fenced(DUPLICATE))
    result = make(root, llm, ranker=embedding_ranker).evolve("bob", TURNS[:1])
    assert result.accepted == [] and "verify-before-claiming-done" in result.rejected[0]["reason"]


def test_schema_violations_and_edit(root, llm):
    bad = [
        dict(NEW_SKILL, action="delete"),
        dict(NEW_SKILL, name="../etc/passwd"),
        dict(NEW_SKILL, description=""),
        dict(NEW_SKILL, body="x" * 5000),
        dict(NEW_SKILL, action="edit", name="no-such-skill"),
        "not an object",
    ]
    edit = {
        "action": "edit",
        "name": "safe-shell-commands",
        "description": "Run shell commands safely.",
        "category": "safety",
        "body": "- Confirm before rm -rf.\n- Prefer --dry-run first.",
    }
    llm.replies.append(json.dumps({"skills": [*bad, edit]}))
    result = make(root, llm, max_proposals=10).evolve("alice", TURNS)
    assert result.accepted_names == ["safe-shell-commands"] and len(result.rejected) == len(bad)
    assert SkillLibrary(root, "alice").get("safe-shell-commands").body.startswith("- Confirm")
    assert "dry-run first" not in SkillLibrary(root, "bob").get("safe-shell-commands").body


def test_retries_then_succeeds_and_request_failure_is_logged(root, llm):
    llm.replies.extend([503, fenced(NEW_SKILL)])
    result = make(root, llm, max_retries=1).evolve("alice", TURNS)
    assert result.accepted_names == ["pin-dependency-versions"] and len(llm.requests) == 2
    llm.replies.extend([500, 500])
    result = make(root, llm, max_retries=1).evolve("alice", TURNS)
    assert result.error and "500" in result.error
    assert SkillLibrary(root, "alice").history()[-1]["action"] == "request"
    dead = SkillEvolver(root, base_url="http://127.0.0.1:9/v1", model="m", timeout_s=1, max_retries=0)
    assert dead.evolve("alice", TURNS).error


def test_a_reply_that_times_out_is_retried_by_the_one_policy(root, llm):
    """A read timeout is retried as every outbound call retries it (`metaclaw.wire.client`: the SDK's policy),
    `max_retries` times, and then said: the evolver has no retry loop of its own."""
    llm.delay_s = 1.5
    result = make(root, llm, max_retries=1, timeout_s=0.3).evolve("alice", TURNS)
    assert result.error and "timed out" in result.error
    assert len(llm.requests) == 2  # the first try and one retry


def test_no_failed_turns_no_request(root, llm):
    result = make(root, llm).evolve("alice", [TURNS[2]])
    assert result.accepted == [] and result.rejected == [] and llm.requests == []


def test_a_request_over_the_models_context_is_retried_smaller(root, llm):
    """The embedded model has 2,048 tokens: eight long failed turns overflow it. The evolver leaves out the older
    half of the turns, then shortens the last one, instead of losing the evolution to a 400."""
    long = [{"sample_id": i, "messages": [{"role": "user", "content": f"question {i} " + "x" * 3000}],
             "response": "no", "reward": -1.0} for i in range(8)]  # fmt: skip
    base = sum(len(m["content"]) for m in make(root, llm).build_messages(SkillLibrary(root, "alice"), [], 1))
    llm.context_chars = base + 1200  # room for one turn of about 1,000 characters
    llm.replies.append(fenced(NEW_SKILL))
    result = make(root, llm, max_turn_chars=3000).evolve("alice", long)
    assert result.error is None and result.accepted_names == ["pin-dependency-versions"]
    sent = [r["json"]["messages"][1]["content"] for r in llm.requests]
    assert [p.count("### sample") for p in sent] == [8, 4, 2, 1, 1]  # halved turns, then halved text
    assert "### sample 7" in sent[-1] and len(sent[-1]) < len(sent[-2])  # the newest turn kept, shortened
    llm.context_chars = base  # not even the smallest turn fits: said, not retried forever
    result = make(root, llm).evolve("alice", long)
    assert result.error and "context_length_exceeded" in result.error
    assert SkillLibrary(root, "alice").history()[-1]["action"] == "request"


def test_an_evolver_that_keeps_giving_nothing_usable_backs_off_and_recovers(root, llm, caplog):
    """A model that cannot write the evolver's JSON (SmolLM2 in 16 of 16 tries) is asked less and less often,
    with a warning; the failed turns stay queued, and one usable reply ends the back-off."""
    from metaclaw.skills.hooks import PAUSE_AFTER, EvolutionScheduler

    scheduler = EvolutionScheduler(make(root, llm, max_retries=0))

    def session(i: int) -> None:
        scheduler.note("alice", i, -1.0, [{"role": "user", "content": f"q{i}"}], "bad reply")
        scheduler.session_finished("alice", f"s{i}")
        assert scheduler.drain(30)

    llm.replies.extend(["not json"] * 10)
    asked = []
    for i in range(12):
        session(i)
        asked.append(len(llm.requests))
    # asked at sessions 1-3; then 2 skipped, asked (4th failure), 4 skipped, asked again
    assert asked == [1, 2, 3, 3, 3, 4, 4, 4, 4, 4, 5, 5]
    assert scheduler.stats["unusable"] == 5 and scheduler.stats["skipped"] == 7
    assert "backs off" in caplog.text and "not valid JSON" in caplog.text
    assert llm.requests[-1]["json"]["messages"][1]["content"].count("### sample") == 5  # skipped ones kept: 6-10
    llm.replies[:] = [fenced(NEW_SKILL)] + ["not json"] * PAUSE_AFTER
    for i in range(12, 20):  # skipped until the back-off ends, then a usable reply
        session(i)
        if scheduler.stats["accepted"]:
            break
    assert scheduler.stats["accepted"] == 1
    for i in range(20, 20 + PAUSE_AFTER):  # the count starts again: asked every time until PAUSE_AFTER failures
        before = len(llm.requests)
        session(i)
        assert len(llm.requests) == before + 1
    scheduler.close(5)
