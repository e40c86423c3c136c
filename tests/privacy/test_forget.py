"""`python -m metaclaw forget`: deleted down to the SQLite file bytes (file and WAL), evolved skills removed,
the adapter steps trained on the turns reported with the one to roll back to; retention of old samples."""

from __future__ import annotations

import json
import time

from metaclaw.control.cli import main
from metaclaw.privacy.forget import apply_retention
from metaclaw.skills import SkillLibrary
from metaclaw.skills.skill import Skill
from metaclaw.store import Sample, SampleMeta, SampleStore, SampleText, SessionLog

ALICE = "Alice plans tulips along the north fence of Lindenweg 14"
BOB = "Bob asks how to rebase a branch onto main"


def add(store: SampleStore, agent: str, session: str, text: str, status: str = "ready") -> int:
    return store.insert(
        Sample(
            prompt_ids=[3, 4],
            response_ids=[5],
            behaviour_logprobs=[-0.1],
            agent_id=agent,
            session_id=session,
            text=SampleText(messages=[{"role": "user", "content": text}], response_text=f"reply to: {text}"),
            status=status,
        )
    )


def on_disk(path) -> bytes:
    wal = path.with_name(path.name + "-wal")
    return path.read_bytes() + (wal.read_bytes() if wal.exists() else b"")


def test_forget_an_agent_down_to_the_file_bytes(tmp_path, capsys):
    run_dir, skills = tmp_path / "run", tmp_path / "skills"
    store = SampleStore(run_dir / "samples.sqlite")
    first = add(store, "alice", "a1", ALICE)
    add(store, "bob", "b1", BOB)
    assert store.claim_batch(step=3, max_samples=10) and store.mark_consumed(4) == 2  # trained at step 3
    add(store, "alice", "a2", ALICE + " (again)", status="pending")
    log = SessionLog(store.path)
    log.touch("alice", "a1", done=True)
    log.touch("bob", "b1", done=True)
    for step in range(1, 7):
        (run_dir / "adapters" / f"step-{step:06d}").mkdir(parents=True)
    library = SkillLibrary(skills, "alice", seed_bank=False)
    library.add(Skill("tulip-planning", "When planning a garden, list the beds first.", body=ALICE))
    library.append_history({"action": "add", "name": "tulip-planning", "source_sample_ids": [first], "accepted": True})
    assert ALICE.encode() in on_disk(store.path)

    rc = main(["forget", "--agent", "alice", "--run-dir", str(run_dir), "--skills-root", str(skills), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["samples_deleted"] == 2 and report["session_rows_deleted"] == 1
    assert report["trained_at_steps"] == [3]
    # step-000004 on learnt from the step-3 batch; step-000003 was published before it: the one to roll back to
    assert report["adapters_trained_on_them"] == {"default": [4, 5, 6]} and report["rollback_to"] == {"default": 3}
    assert report["skills_removed"] == ["alice/tulip-planning"] and not (skills / "alice" / "tulip-planning").exists()
    assert report["wal_checkpoint"][0] == 0  # the WAL was emptied (TRUNCATE)
    store.close()
    log.close()
    data = on_disk(run_dir / "samples.sqlite")
    assert b"tulips" not in data and b"Lindenweg" not in data  # not in a row, a free page or the WAL
    assert BOB.encode() in data  # the other agent's turns stay
    left = SampleStore(run_dir / "samples.sqlite")
    assert {s.agent_id for s in left.select()} == {"bob"}


def test_forget_a_session_or_before_a_date(tmp_path, capsys):
    store = SampleStore(tmp_path / "samples.sqlite")
    add(store, "alice", "a1", ALICE)
    add(store, "alice", "a2", BOB)
    assert main(["forget", "--session", "a1", "--store", str(store.path), "--skills-root", "none"]) == 0
    assert "deleted:       1 samples" in capsys.readouterr().out
    assert [s.session_id for s in store.select()] == ["a2"]
    assert main(["forget", "--before", "2000-01-01", "--store", str(store.path), "--skills-root", "none"]) == 0
    assert store.count() == 1  # nothing was captured before 2000
    assert main(["forget", "--before", "2999-01-01", "--store", str(store.path), "--skills-root", "none"]) == 0
    assert store.count() == 0 and b"rebase" not in on_disk(store.path)
    assert main(["forget", "--store", str(store.path)]) == 2  # says what it needs
    assert main(["forget", "--before", "last tuesday", "--store", str(store.path)]) == 1


def test_retention_deletes_trained_and_dropped_samples_older_than_n_days(tmp_path):
    store = SampleStore(tmp_path / "samples.sqlite")
    old_trained = add(store, "a", "s", ALICE)
    store.claim_batch(step=0, max_samples=1)
    store.mark_consumed(1)
    waiting = add(store, "a", "s", BOB)  # ready: not trained yet, kept however old
    assert apply_retention(store.path, days=30) == 0  # nothing is 30 days old yet
    assert apply_retention(store.path, days=30, now=time.time() + 31 * 86400) == 1
    assert [s.id for s in store.select()] == [waiting] and old_trained != waiting
    assert b"tulips" not in on_disk(store.path)


MARKER = "Kestrel-7q3Zx Lindenweg tulip plan for the north fence beds"


def test_forget_reaches_the_copies_outside_the_rows(tmp_path, capsys):
    """Issue 43 (finding 2): a quarantined skill made from the forgotten turn, the history quoting it, an approved
    skill's copy in another session's stored prompt, `train.log` and `eval.jsonl` lines quoting the turn, a batch
    the trainer already claimed; afterwards the marker is in no file under the run dir or the skills root (byte by
    byte), the other agent's data stays, and the report names what forget cannot erase (W&B, checkpoints)."""
    run_dir, skills = tmp_path / "run", tmp_path / "skills"
    store = SampleStore(run_dir / "samples.sqlite")
    first = add(store, "alice", "a1", MARKER)
    add(store, "bob", "b1", BOB)
    assert store.claim_batch(step=2, max_samples=10)  # claimed, not yet consumed: the trainer holds it
    store.insert(Sample(prompt_ids=[3], response_ids=[5], behaviour_logprobs=[-0.1], agent_id="alice",
                        session_id="a2", text=SampleText(messages=[{"role": "system", "content": "## Active skills\n"
                        "### fence-beds\nPlan the beds along the fence first."}, {"role": "user",
                        "content": "Water schedule?"}], response_text="Daily."), status="pending",
                        meta=SampleMeta(skills=["fence-beds"])))  # fmt: skip
    library = SkillLibrary(skills, "alice", seed_bank=False)
    provenance = {"provenance": {"source_sample_ids": [first]}}
    library.add(Skill("fence-beds", "Plan the beds along the fence first.", body="Beds first.", extra=provenance))
    library.quarantine(Skill("north-fence", "Kestrel-7q3Zx style planning.", body="Plan.", extra=provenance))
    library.append_history({"action": "add", "name": "north-fence", "source_sample_ids": [first], "accepted": False,
                            "reason": f"untrusted: repeats 8+ words ('{MARKER}')"})  # fmt: skip
    (run_dir / "train.log").write_text(f"INFO start\nWARNING skill evolution refused: '{MARKER}'\nINFO step 2\n")
    (run_dir / "eval.jsonl").write_text(json.dumps({"reply": f"About {MARKER}"}) + "\n" + json.dumps({"ok": 1}) + "\n")
    (run_dir / "wandb").mkdir()
    (run_dir / "wandb" / "output.log").write_text(f"console: {MARKER}\n")

    rc = main(["forget", "--session", "a1", "--run-dir", str(run_dir), "--skills-root", str(skills), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(report["skills_removed"]) == ["alice/fence-beds", "alice/north-fence"]
    assert report["injected_copies_deleted"] == 1 and [s.id for s in store.select(agent_id="alice")] == []
    assert report["claimed_now"] == [first] and any("already claimed" in n for n in report["notes"])
    assert any("W&B" in n and "wandb artifact rm" in n for n in report["notes"])
    assert (run_dir / "train.log").read_text() == "INFO start\nINFO step 2\n"
    store.close()
    for root in (run_dir, skills):
        for path in root.rglob("*"):
            if path.is_file():
                assert b"Kestrel-7q3Zx" not in path.read_bytes() and b"tulip plan" not in path.read_bytes(), path
    assert BOB.encode() in on_disk(run_dir / "samples.sqlite")
    assert library.pending() == [] and library.get("fence-beds") is None
