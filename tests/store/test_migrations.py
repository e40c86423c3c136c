"""A store written before the schema had a version opens, migrates and keeps every row; `Sample.meta` is a
typed record that keeps the keys it does not know. The fixture `data/store_2026-11-26.sqlite` was written by the
store of main at 1577f34 (`PRAGMA user_version` 0; the temperature both in its column and in `meta.sampling`)."""

from __future__ import annotations

import json
import shutil
import sqlite3
from array import array
from pathlib import Path

import pytest

from metaclaw.store import SCHEMA_VERSION, NewerStoreError, Sample, SampleMeta, SampleStore, SampleText

OLD = Path(__file__).parent / "data" / "store_2026-11-26.sqlite"


def _rows(path: Path) -> list[tuple]:
    with sqlite3.connect(path) as c:
        return c.execute(
            "SELECT id, status, reward, temperature, adapter_version, claimed_step, prompt_ids,"
            " response_ids, behaviour_logprobs, next_state FROM samples ORDER BY id"
        ).fetchall()


def test_an_old_store_opens_migrates_and_keeps_every_row(tmp_path):
    path = tmp_path / "samples.sqlite"
    shutil.copy(OLD, path)
    before = _rows(path)
    store = SampleStore(path)
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        stored = [m for (m,) in c.execute("SELECT json_extract(meta, '$.sampling') FROM samples WHERE id IN (1, 2)")]
    assert _rows(path) == before and len(before) == 3
    assert all("temperature" not in m for m in stored)  # stored once: the column
    captured, dropped, claimed = store.select()
    assert isinstance(captured.meta, SampleMeta)
    assert captured.meta.sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": 20}  # the column's, when read
    assert captured.meta.skill_generation == 2 and captured.meta.feedback == {"score": 0.5, "text": "ok"}
    assert captured.meta.extra == {"a_key_of_another_version": {"kept": True}}  # unknown keys are kept
    assert captured.meta["judge"] == {"verdict": "good"} and captured.meta.get("hint") is None
    assert dropped.meta.dropped == "no_next_state" and store.dropped_reasons() == {"no_next_state": 1}
    assert (claimed.status, claimed.claimed_step, claimed.meta.origin.source) == ("claimed", 4, "seed.jsonl")
    assert [s.text.next_state for s in (captured, dropped, claimed)] == [r[-1] for r in before]  # into `text`
    assert store.by_response_id("chatcmpl-abc")[0].id == captured.id  # the JSON indexes read the same keys
    store.set_score(captured.id, reward=1.0, meta={"hint": "be brief"})
    again = store.get(captured.id)
    assert again.meta.extra == {"a_key_of_another_version": {"kept": True}} and again.meta.judged.hint == "be brief"
    store.close()
    assert SampleStore(path).count() == 3  # a second open: nothing left to migrate


def test_a_store_of_a_newer_version_is_refused_naming_it(tmp_path):
    path = tmp_path / "samples.sqlite"
    SampleStore(path).close()
    with sqlite3.connect(path) as c:
        c.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(NewerStoreError, match="schema version"):
        SampleStore(path)


def test_the_record_has_named_fields_and_reads_like_the_dict_it_replaced(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    meta = {"sampling": {"temperature": 0.5, "top_p": 0.8, "top_k": -1}, "response_id": "r1", "x-new": 1}
    i = store.insert(Sample([1], [2], [-1.0], temperature=0.5, meta=meta))
    sample = store.get(i)
    assert sample.meta.response_id == "r1" and sample.meta["x-new"] == 1 and "dropped" not in sample.meta
    assert dict(sample.meta) == meta and sample.meta == meta
    with sqlite3.connect(store.path) as c:
        (text,) = c.execute("SELECT meta FROM samples WHERE id=?", (i,)).fetchone()
    assert '"temperature"' not in text  # the temperature is stored once per sample
    store.close()


def test_grouped_meta_fields_are_stored_flat_under_their_old_keys(tmp_path):
    """`SampleMeta` groups its rarer fields (`fit`, `origin`, `judged`); the stored JSON object stays flat, in the
    key order of the flat record it replaced, and reads back into the same groups."""
    flat = {"finish_reason": "length", "sampling": {"top_p": 0.9, "top_k": 20}, "has_image": True,
            "context": {"action": "truncated"}, "session_source": "derived", "response_id": "chatcmpl-x",
            "conv_tail": "t", "judge": {"verdict": "bad"}, "hint": "be brief", "dropped": "no_hint",
            "another_version": 1}  # fmt: skip
    meta = SampleMeta.of(flat)
    assert (meta.origin.finish_reason, meta.fit.has_image, meta.fit.context, meta.judged.hint) == (
        "length", True, {"action": "truncated"}, "be brief")  # fmt: skip
    assert meta.extra == {"another_version": 1} and "fit" not in meta and "origin" not in meta
    store = SampleStore(tmp_path / "samples.sqlite")
    sid = store.insert(Sample([1, 2], [3], [-0.5], meta=meta))
    with sqlite3.connect(tmp_path / "samples.sqlite") as c:
        raw = c.execute("SELECT meta FROM samples WHERE id = ?", (sid,)).fetchone()[0]
    assert json.loads(raw) == flat and list(json.loads(raw)) == list(flat)  # the same keys, the same order
    back = store.get(sid).meta
    assert back.origin.conv_tail == "t" and back.judged.judge == {"verdict": "bad"} and back.dropped == "no_hint"
    assert store.by_response_id("chatcmpl-x")[0].id == sid  # the JSON index reads the flat key
    store.close()


# The columns of the samples table as of main c7e0094, in order: grouping `Sample`'s fields (`text`) changed none.
COLUMNS = ["id", "agent_id", "session_id", "turn_index", "prompt_ids", "response_ids", "behaviour_logprobs",
           "teacher_logprobs", "reward", "adapter_version", "temperature", "status", "claimed_step", "next_state",
           "messages", "response_text", "meta", "created_at", "updated_at", "scored_at", "claimed_at",
           "served_version"]  # fmt: skip


def test_a_raw_row_of_todays_schema_reads_into_the_groups_and_round_trips(tmp_path):
    """`Sample.text` (messages, reply, next state) is a record in Python only: a row written column by column, as
    the store of c7e0094 wrote it, reads into the group, and the sample written back makes the same columns."""
    path = tmp_path / "samples.sqlite"
    SampleStore(path).close()
    messages = [{"role": "user", "content": "Capital of France?"}]
    row = {
        "agent_id": "alice", "session_id": "s1", "turn_index": 3, "prompt_ids": array("i", [1, 2, 3]).tobytes(),
        "response_ids": array("i", [4, 5]).tobytes(), "behaviour_logprobs": array("d", [-0.5, -0.25]).tobytes(),
        "teacher_logprobs": array("d", [-0.4, -0.2]).tobytes(), "reward": 1.0, "adapter_version": 7,
        "temperature": 0.7, "status": "ready", "next_state": "Thanks!", "messages": json.dumps(messages),
        "response_text": "Paris.", "meta": json.dumps({"sampling": {"top_p": 0.9, "top_k": 20}, "response_id": "r1"}),
        "created_at": 1.0, "updated_at": 1.0,
    }  # fmt: skip
    with sqlite3.connect(path) as c:
        assert [r[1] for r in c.execute("PRAGMA table_info(samples)")] == COLUMNS
        c.execute(f"INSERT INTO samples ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
    store = SampleStore(path)
    got = store.get(1)
    assert got.text == SampleText(messages=messages, response_text="Paris.", next_state="Thanks!")
    fields = (got.agent_id, got.session_id, got.turn_index, got.adapter_version, got.temperature, got.prompt_ids,
              got.response_ids, got.teacher_logprobs, got.reward, got.meta.response_id)  # fmt: skip
    assert fields == ("alice", "s1", 3, 7, 0.7, [1, 2, 3], [4, 5], [-0.4, -0.2], 1.0, "r1")
    again = store.insert(got)
    store.close()
    with sqlite3.connect(path) as c:
        c.row_factory = sqlite3.Row
        first, second = (dict(c.execute("SELECT * FROM samples WHERE id=?", (i,)).fetchone()) for i in (1, again))
    written = [k for k in row if k not in ("created_at", "updated_at")]
    assert {k: second[k] for k in written} == {k: row[k] for k in written} == {k: first[k] for k in written}
