"""The run directory's one layout owner: versions are read as data (the adapter folder's record, the request's
field), and run directories of the old layout (no record) still load."""

from __future__ import annotations

import json

import pytest

from metaclaw.modules.adapter_writer import AdapterWriter, clean_leftovers
from metaclaw.runfiles.layout import ADAPTER_INFO, RunLayout, adapter_version, write_adapter_info
from metaclaw.serving.engines.adapters import AdapterRegistry
from metaclaw.serving.protocol import RequestError, parse_load_request


def test_a_version_is_the_folders_record_not_its_name(tmp_path):
    folder = RunLayout(tmp_path).adapters()
    renamed = folder.path / "step-000005"
    renamed.mkdir(parents=True)
    write_adapter_info(renamed, 7)
    assert adapter_version(renamed) == 7
    assert folder.versions() == [(7, renamed)] and folder.find(7) == renamed and folder.find(5) is None


def test_an_old_run_dir_without_records_still_loads(tmp_path):
    """A run directory written before `metaclaw_adapter.json` existed: versions from the old `step-NNNNNN` names."""
    layout = RunLayout(tmp_path)
    for step in (2, 10):
        (tmp_path / "adapters" / f"step-{step:06d}").mkdir(parents=True)
    (tmp_path / "adapters" / "agents" / "alice" / "step-000004").mkdir(parents=True)
    (tmp_path / "adapters" / "imported-20260101T000000Z").mkdir()
    assert [v for v, _ in layout.adapters().versions()] == [2, 10]
    assert [v for v, _ in layout.adapters("alice").versions()] == [4]
    assert sorted(layout.all_adapters()) == ["alice", "default"]
    assert adapter_version(tmp_path / "adapters" / "imported-20260101T000000Z") is None
    assert layout.adapters().newest_at_or_before(9) == (2, tmp_path / "adapters" / "step-000002")


def test_the_writer_uses_the_layout_for_every_file(tmp_path):
    writer = AdapterWriter(tmp_path, keep_last=1, adapter="alice")
    assert writer.adapters == tmp_path / "adapters" / "agents" / "alice"
    assert writer.checkpoint_path == tmp_path / "checkpoints" / "last.ckpt"
    for step in (1, 2):
        writer.adapter_dir(step).mkdir(parents=True)
        write_adapter_info(writer.adapter_dir(step), step)
    writer.prune()
    assert [v for v, _ in writer.folder.versions()] == [2]
    writer.write_latest(2, writer.adapter_dir(2), "policy:alice", None)
    assert json.loads((writer.adapters / "latest.json").read_text())["version"] == 2
    (writer.adapters / ".step-000003-abcd").mkdir()
    writer.checkpoint_tmp.parent.mkdir(parents=True)
    writer.checkpoint_tmp.write_bytes(b"half")
    assert [str(p) for p in clean_leftovers(tmp_path)] == ["adapters/agents/alice/.step-000003-abcd",
                                                           "checkpoints/last.ckpt.tmp"]  # fmt: skip


def test_the_server_takes_the_version_from_the_request_else_the_record(tmp_path):
    registry = AdapterRegistry()
    plain = tmp_path / "my-adapter"
    plain.mkdir()
    assert registry.next_version("policy", plain, 12) == 12  # the trainer's published version, sent as data
    assert registry.next_version("policy", plain) == 1  # nothing recorded: the previous version + 1
    write_adapter_info(plain, 30)
    assert registry.next_version("policy", plain) == 30
    assert json.loads((plain / ADAPTER_INFO).read_text()) == {"version": 30}


@pytest.mark.parametrize("bad", [-1, "3", 2.5, True])
def test_a_load_request_with_a_bad_version_is_refused_naming_the_field(bad):
    assert parse_load_request({"lora_name": "p", "lora_path": "/x", "adapter_version": 4}) == ("p", "/x", 4)
    with pytest.raises(RequestError, match="adapter_version"):
        parse_load_request({"lora_name": "p", "lora_path": "/x", "adapter_version": bad})
