"""The bench's shared harness: the one results schema (a report's figures as JSON lines and back), the results file,
the process helpers (start, wait for health, stop the group), and the suite's own rules: every script writes through
the harness and has a smoke test."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from bench.harness import Record, collect, free_port, publish, serving, start, stop_group, wait_healthy
from bench.harness.results import KINDS, records, unit_of
from tests.conftest import REPO

BENCH = REPO / "bench"
REPORT = {
    "model": "tiny",
    "runs": [{"batch_linger_s": 0.0, "batches": {"1": 6}}, {"batch_linger_s": 0.25, "batches": {"2": 3}}],
    "tokens_per_s": {"fp32": {"b1": 12.5}},
    "kinds": {"metaclaw.x: Published adapter v# at PATH/step ~1": 3},  # a key with `/` and `~` in it
    "ok": True,
    "missing": None,
}


def _lines(report, params=None, script="bench/perf/hf_batching.py") -> list[str]:
    return [r.model_dump_json() for r in records(script, params or {"model": "tiny"}, report)]


def test_a_report_is_one_line_per_figure_and_reads_back_whole():
    lines = _lines(REPORT)
    assert len(lines) == 9  # one per leaf
    rows = [json.loads(line) for line in lines]
    assert {r["bench"] for r in rows} == {"perf/hf_batching"} and len({r["run"] for r in rows}) == 1
    assert {r["metric"] for r in rows} >= {"runs/1/batch_linger_s", "tokens_per_s/fp32/b1",
                                           "kinds/metaclaw.x: Published adapter v# at PATH~1step ~01"}  # fmt: skip
    row = next(r for r in rows if r["metric"] == "tokens_per_s/fp32/b1")
    assert row["value"] == 12.5 and row["unit"] == "tokens/s" and row["params"] == {"model": "tiny"}
    assert len(row["load"]) == 3 and row["machine"]["cores"] >= 1 and row["commit"]
    assert collect(lines) == {rows[0]["run"]: REPORT}


def test_non_finite_figures_are_written_as_null_never_as_nan():
    (line,) = _lines({"ratio": math.nan})
    assert json.loads(line)["value"] is None and "NaN" not in line


def test_units_follow_the_key_or_its_nearest_ancestor():
    assert unit_of(["wall_s"]) == "s" and unit_of(["swap_ms_median"]) == "ms"
    assert unit_of(["tokens_per_s", "fp32", "b1"]) == "tokens/s" and unit_of(["replies_per_min"]) == "1/min"
    assert unit_of(["peak_rss_mib"]) == "MiB" and unit_of(["recall", "jwt"]) == "fraction"
    assert unit_of(["speedup"]) == "x" and unit_of(["lightning_over_hand"]) == "x"
    assert unit_of(["mfu_6n_dense"]) == "fraction" and unit_of(["swap_ms_median"]) == "ms"
    assert unit_of(["model"]) == "" and unit_of(["runs", "0", "turns"]) == "" and unit_of(["hit_at_3"]) == ""


@pytest.mark.parametrize(
    "change",
    [
        {"extra": 1},  # a field outside the schema
        {"bench": "hf_batching"},  # not <kind>/<name>
        {"value": {"nested": 1}},  # a figure is a scalar
        {"load": [1.0, 2.0]},  # 1, 5 and 15 minutes
        {"ts": "yesterday"},
    ],
)
def test_a_line_outside_the_schema_is_refused(change):
    row = json.loads(_lines({"x_s": 1.0})[0]) | change
    with pytest.raises(ValidationError):
        Record.model_validate_json(json.dumps(row))


def test_publish_prints_the_lines_and_appends_them_to_the_results_file(tmp_path, capsys):
    results = tmp_path / "docs" / "bench.jsonl"
    args = argparse.Namespace(model="tiny", out=Path("/tmp/x"), sizes=[2, 1], results=results)
    publish("bench/perf/eval_batch.py", args, {"wall_s": 1.5})
    publish("bench/perf/eval_batch.py", args, {"wall_s": 2.5})
    printed = capsys.readouterr().out.splitlines()
    kept = results.read_text().splitlines()
    assert printed == kept and len(kept) == 2  # the same lines, appended run after run
    reports = collect(kept)
    assert list(reports.values()) == [{"wall_s": 1.5}, {"wall_s": 2.5}]
    params = json.loads(kept[0])["params"]
    assert params == {"model": "tiny", "out": "/tmp/x", "sizes": [2, 1]}  # paths as text, --results not a param


def test_serving_waits_for_health_and_stops_the_whole_group(tmp_path):
    port = free_port()
    # a parent that starts the server as its child: stopping the group must reach the child too
    code = (f"import subprocess, sys; subprocess.Popen([sys.executable, '-m', 'http.server', '{port}', "
            f"'--bind', '127.0.0.1']).wait()")  # fmt: skip
    with serving([sys.executable, "-c", code], f"http://127.0.0.1:{port}/", tmp_path / "log", timeout_s=60) as proc:
        assert proc.poll() is None
    assert proc.poll() is not None
    with pytest.raises(RuntimeError):  # the child is gone with its parent: nothing answers
        wait_healthy(start([sys.executable, "-c", "import time; time.sleep(30)"], None),
                     f"http://127.0.0.1:{port}/", timeout_s=1)  # fmt: skip


def test_a_server_that_exits_fails_loudly_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    proc = start([sys.executable, "-c", "print('no model here', flush=True); raise SystemExit(3)"], log)
    with pytest.raises(RuntimeError, match=r"(?s)exited with 3.*no model here"):
        wait_healthy(proc, f"http://127.0.0.1:{free_port()}/health", log, timeout_s=60)
    assert stop_group(proc) == 3


def _scripts() -> list[Path]:
    """Every runnable bench script (a `__main__` block); library modules such as `runs/real_path.py` are not."""
    return sorted(p for kind in KINDS for p in (BENCH / kind).glob("*.py") if '__name__ == "__main__"' in p.read_text())


def test_every_bench_script_is_filed_by_kind_and_writes_through_the_harness():
    assert not [p.name for p in BENCH.glob("*.py") if p.name != "__init__.py"], "bench/ holds folders by kind only"
    scripts = _scripts()
    assert len(scripts) >= 27
    for script in scripts:
        text = script.read_text()
        # every stdout line a smoke test reads is validated against the schema; here: each goes through the writer
        assert "publish(" in text and "add_results_argument(" in text, f"{script.name} does not write JSON lines"


def test_every_bench_script_has_a_smoke_test():
    tests = "".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    missing = [f"{p.parent.name}/{p.name}" for p in _scripts() if f"{p.parent.name}/{p.name}" not in tests]
    assert missing == []


def test_the_results_kept_in_the_repo_are_data_under_the_schema():
    kept = REPO / "docs" / "results" / "bench.jsonl"
    reports = collect(kept.read_text().splitlines())  # every line validated
    assert reports and all(isinstance(r, dict) and r for r in reports.values())
