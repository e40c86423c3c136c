"""Every bench script runs, as a user starts it, in its smallest mode on the tiny model, and writes JSON lines that
match the bench's one schema (`bench.harness.results.Record`). A script that stops printing, breaks after a move, or
writes a line outside the schema fails here. The slow ones (a whole `train.py` run) carry the `slow` marker:
`pytest -m slow tests/entrypoints/test_bench_scripts.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from bench.harness import collect
from tests.conftest import REPO

BENCH = REPO / "bench"


def _bench(script: str, *args: str, timeout: float = 600, runs: int = 1) -> Any:
    """Run `bench/<script>` from the repo root; validate every stdout line; the report (or `runs` reports)."""
    assert (BENCH / script).is_file(), script
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, f"bench/{script}", *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines, f"{script} printed nothing"
    reports = collect(lines)  # every line validated against the schema
    assert len(reports) == runs, f"{script}: {len(reports)} runs in its output"
    benches = {json.loads(line)["bench"] for line in lines}
    assert benches == {script.removesuffix(".py")}
    return next(iter(reports.values())) if runs == 1 else list(reports.values())


# ---- perf/ --------------------------------------------------------------------------------------------------------
def test_hf_batching_measures_the_linger_off_and_on():
    out = _bench("perf/hf_batching.py", "--model", "tiny", "--requests", "6", "--clients", "2", "--rounds", "1")
    off, on = out["runs"]
    assert off["batch_linger_s"] == 0.0 and on["batch_linger_s"] == 0.25  # the composed config's value
    for run in (off, on):
        assert sum(int(size) * n for size, n in run["batches"].items()) == 6  # every request answered, once
    assert out["speedup"] > 0 and out["clients"] == 2


def test_generation_bench_runs_on_the_packaged_config():
    out = _bench("perf/generation.py", "--model", "tiny", "--quick", "--no-llama-cpp", "--threads", "1")
    assert out["runs"] and all(r["tokens_per_s"] > 0 for r in out["runs"].values())
    assert all(r["round_tokens_per_s"] == [r["median_tokens_per_s"]] for r in out["runs"].values())  # --quick: 1 round
    assert out["limit_tokens_per_s"]["b1"] > 0 and out["llama_cpp"]["status"] == "skipped"
    if out["onnx"]["status"] == "ok":  # the quantised engine side by side, against its own limit (issue 46)
        assert {f"onnx_{q}/b{b}/t1" for q in ("int8", "fp32") for b in (1, 2, 4)} <= set(out["runs"])
        assert out["limit_tokens_per_s"]["onnx_int8_b1"] > out["limit_tokens_per_s"]["b1"]


def test_decode_precision_bench_measures_speed_and_the_logprob_gap():
    out = _bench("perf/decode_precision.py", "--model", "tiny", "--batches", "1", "--tokens", "4", "--replies", "2")
    assert set(out["tokens_per_s"]) == {"fp32", "bf16", "int8_dynamic"}
    assert all(v["b1"] > 0 for v in out["tokens_per_s"].values())
    for gap in out["logprob_gap"].values():  # 2 replies of 4 tokens each, every one compared
        assert gap["tokens"] == 8 and 0.0 <= gap["mean"] <= gap["max"]


def test_prefix_reuse_bench_compares_the_cache_off_and_on(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime", reason="the ONNX engine needs the onnx extra: pip install 'metaclaw[onnx]'")
    monkeypatch.setenv("METACLAW_CACHE", str(tmp_path))
    out = _bench("perf/prefix_reuse.py", "--model", "tiny", "--rounds", "1", "--clients", "2", "--max-tokens", "4",
                 "--system-tokens", "40")  # fmt: skip
    assert set(out["engines"]) == {"hf-off", "hf-on", "onnx-off", "onnx-on"} and out["system_tokens"] > 20
    for kind in ("hf", "onnx"):
        off, on = out["engines"][f"{kind}-off"], out["engines"][f"{kind}-on"]
        assert off["turns"] == on["turns"] == 2 * 3  # two conversations of three turns through each engine
        assert "cache" not in off and on["cache"]["hits"] >= 5  # turns 2-3 find turn 1, turn 1 the system prompt
        assert 0 < on["cache"]["reused_share"] < 1 and out["speedup_wall"][kind] > 0
    assert out["onnx_on_over_hf_on_wall"] > 0 and out["prefix_cache_mb"] == 1024  # backend/hf.yaml


def test_eval_batch_bench_decodes_each_batch_size():
    out = _bench("perf/eval_batch.py", "--model", "tiny", "--prompts", "2", "--max-tokens", "2", "--sizes", "2", "1")
    assert set(out["tokens_per_s"]) == {"2", "1"} and all(v > 0 for v in out["tokens_per_s"].values())
    assert out["batches"]["2"] and out["b2_over_b1"] > 0


@pytest.mark.slow
def test_agents_memory_bench_measures_one_model_and_per_agent_runs():
    out = _bench("perf/agents_memory.py", "--model", "tiny", "--agents", "1", "--prompt", "8", "--response", "4",
                 "--rank", "2")  # fmt: skip
    (n,) = out["agents"]
    row = out["agents"]["1"]
    assert n == "1" and row["one_model"]["peak_rss_mib"] > 0 and row["per_agent_runs_peak_rss_mib"] > 0
    assert row["one_model"]["adapters_mib"] > 0


@pytest.mark.slow
def test_logprob_memory_bench_compares_the_old_and_new_paths():
    out = _bench("perf/logprob_memory.py", "--model", "tiny", "--prompt", "16", "--response", "4", "--steps", "1",
                 "--chunk", "8", "--checkpointing", "off")  # fmt: skip
    assert set(out["cases"]) == {"old/checkpointing_off", "new/checkpointing_off"}
    assert all(c["step_s_median"] > 0 for c in out["cases"].values())
    assert out["agreement_with_old/checkpointing_off"]["new/checkpointing_off"]["max_abs_logprob_diff"] < 1e-4


def test_train_step_bench_times_lightning_against_the_hand_loop():
    out = _bench("perf/train_step.py", "--model", "tiny", "--batch", "1", "--seq", "16", "--rounds", "1",
                 "--steps", "2")  # fmt: skip
    assert out["hand_s_per_step_median"] > 0 and out["lightning_s_per_step_median"] > 0
    assert out["steps_measured_each"] == 1 and out["tokens_per_step"] == 15


def test_proxy_overhead_bench_measures_both_sides(tmp_path):
    out = _bench("perf/proxy_overhead.py", "--concurrency", "1", "--requests", "4", "--rounds", "1", "--stream-only",
                 "--placement", "shared", "--store-dir", str(tmp_path))  # fmt: skip
    (res,) = out["results"]
    assert res["concurrency"] == 1 and res["requests_per_side"] == 4 and res["stream"] is True
    assert res["direct_ms"]["p50"] > 0 and res["proxied_ms"]["p50"] > 0 and res["throughput_rps"]["proxied"] > 0


@pytest.mark.slow
def test_serve_throughput_bench_swaps_an_adapter():
    out = _bench("perf/serve_throughput.py", "--model", "tiny", "--requests", "2", "--concurrency", "1",
                 "--max-tokens", "2", "--swaps", "1")  # fmt: skip
    assert out["base"]["requests_per_s"] > 0 and out["adapter"]["requests_per_s"] > 0
    assert out["swap_publish_to_first_response_ms_median"] > 0


@pytest.mark.slow
def test_training_server_sessions_bench_reaches_the_cap():
    out = _bench("perf/training_server_sessions.py", "--model", "tiny", "--cycles", "2", "--max-sessions", "2")
    assert out["live_sessions_before_429"] == 2 and "max_sessions" in out["refusal"] and out["rss_mb_after_warmup"] > 0


@pytest.mark.slow
def test_training_server_throughput_bench_runs_three_arms():
    out = _bench("perf/training_server_throughput.py", "--model", "tiny", "--datums", "1", "--min-len", "8",
                 "--max-len", "16", "--repeats", "1")  # fmt: skip
    assert out["server_tokens_per_s"] > 0 and out["engine_in_process_tokens_per_s"] > 0
    assert out["torch_peft_tokens_per_s"] > 0


@pytest.mark.slow
def test_cpu_share_bench_serves_and_trains_side_by_side():
    out = _bench("perf/cpu_share.py", "--model", "tiny", "--seconds", "3", "--users", "1", "--budgets", "auto",
                 "--batch", "1", "--seq", "16")  # fmt: skip
    (run,) = out["runs"]
    assert run["budget"] == "auto" and run["serve_threads"] >= 1 and run["train_threads"] >= 1  # the budget applied
    assert run["train_steps"] >= 1 and run["replies_per_min"] > 0 and run["request_errors"] == 0


@pytest.mark.slow
def test_cycle_profile_bench_breaks_a_short_main_job_down(tmp_path):
    out = _bench("perf/cycle_profile.py", "--minutes", "0.3", "--out", str(tmp_path), "model=tiny", timeout=900)
    assert out["rc"] == 0 and out["run"]["wall_s"] > 0 and out["run"]["cpu_s"] > 0
    assert "generation" in out["phases"] and "model=tiny" in out["command"]


@pytest.mark.slow
def test_gate_latency_bench_times_two_gates(tmp_path):
    out = _bench("perf/gate_latency.py", "--model", "tiny", "--turns", "3", "--reply-tokens", "4",
                 "--turns-file", str(tmp_path / "turns.json"))  # fmt: skip
    assert [g["gate"] for g in out["gates"]] == ["cold", "warm"] and out["turns"] == 3


def test_reeval_measures_a_runs_base_and_last_adapters_with_more_replies(tmp_path, tiny_spec):
    """bench/tools/reeval.py: each run's own evaluation settings, `--samples-per-prompt` replies per prompt, the
    base measured once for runs that share settings; an adapter that always answers "The answer is 42." complies
    where the base model does not, whether it is the run's final adapter or the one it served at the end."""
    import shutil

    from tests.serving.conftest import FIXED_ANSWER, train_fixed_answer_adapter

    rule = {"kind": "regex", "pattern": FIXED_ANSWER.replace(".", r"\."), "description": "Say the fixed answer"}
    config = {"seed": 0, "preference": {"rules": [rule], "system": None},
              "eval": {"n_prompts": 3, "seed": "${seed}", "max_tokens": 12, "temperature": 0.0},
              "rollout": {"simulated_user": {"tasks_file": None, "max_tokens": 24, "temperature": 1.0}}}  # fmt: skip
    runs = [tmp_path / "job" / "run", tmp_path / "job2"]
    fixed = train_fixed_answer_adapter(tiny_spec, runs[0] / "adapters" / "step-000007")
    shutil.copytree(fixed, runs[1] / "adapters" / "step-000009")
    for run in runs:
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
        # the served pointer: the first run serves its final adapter, the second one it did not replace (step 7)
        (run / "adapters" / "latest.json").write_text(json.dumps({"version": 7, "path": str(fixed)}))
    (runs[0] / "eval.jsonl").write_text(json.dumps({"adapter": "step-000007", "compliance": 1.0, "n": 3}) + "\n")
    replies = tmp_path / "replies.json"
    out = _bench("tools/reeval.py", *map(str, runs), "--model", "tiny", "--samples-per-prompt", "2",
                 "--replies", str(replies))  # fmt: skip
    first, second = out["runs"]["job/run"], out["runs"]["job2"]  # named below the folder they share
    assert first["settings"] == {"system": None, "tasks_file": None, "n_prompts": 3, "seed": 0, "max_tokens": 12,
                                 "temperature": 0.0}  # fmt: skip
    base, fin = first["points"]["base"], first["points"]["final"]
    assert base["n"] == fin["n"] == 6 and fin["adapter"] == "step-000007" and "served" not in first["points"]
    assert fin["compliance"] == 1.0 and base["compliance"] == 0.0 and first["gain_points"] == 100.0
    assert fin["run_compliance"] == {"compliance": 1.0, "n": 3} and base["run_compliance"] is None
    assert second["points"]["base"] == base  # one base measurement for both runs
    assert second["points"]["served"]["adapter"] == "step-000007" and second["points"]["served"]["compliance"] == 1.0
    assert second["points"]["final"]["adapter"] == "step-000009" and second["gain_points"] == 100.0
    texts = json.loads(replies.read_text())
    assert len(texts["job/run"]["final"]) == 6 and all(FIXED_ANSWER in t for t in texts["job/run"]["final"])
    assert set(texts["job2"]) == {"base", "final", "served"}


def test_reeval_names_runs_below_their_shared_folder_and_refuses_a_run_twice(tmp_path):
    from bench.tools.reeval import labels_of

    a, b = tmp_path / "s20" / "onnx-1" / "run", tmp_path / "s21" / "onnx-1" / "run"
    assert labels_of([a, b]) == ["s20/onnx-1/run", "s21/onnx-1/run"]  # the same folder names, two sessions
    assert labels_of([a]) == ["onnx-1/run"]
    with pytest.raises(SystemExit, match="the same run twice"):
        labels_of([a, a])


# ---- studies/ -----------------------------------------------------------------------------------------------------
def test_redaction_bench_finds_the_planted_secrets():
    out = _bench("studies/redaction.py", "--per-kind", "1", "--clean", "4")
    assert out["planted_items"] == 21 and out["clean_turns"] == 4  # one item per secret kind and PII category
    assert out["recall"]["secret (all)"] == 1.0 and out["clean_dropped_rate"]["clean (all)"] == 0.0


def test_secret_recall_reads_plugin_tests_without_running_them(tmp_path):
    (tmp_path / "aws_key_test.py").write_text(textwrap.dedent('''
        import pytest

        @pytest.mark.parametrize("line, should_flag", [
            ("aws_secret_access_key = 'wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY'", True),
            ("version = '1.2.3'", False),
        ])
        def test_x(line, should_flag):
            raise SystemExit("never run")
    '''))  # fmt: skip
    out = _bench("studies/secret_recall.py", str(tmp_path))
    assert out["positives"] == out["negatives"] == 1 and out["per_plugin"]["aws_key"]["found"] == 1
    assert out["recall"] == 1.0 and out["false_flag_rate"] == 0.0 and out["encoded_recall"]["of"] == 1


@pytest.mark.slow
def test_skills_retrieval_bench_ranks_the_labelled_queries():
    out = _bench("studies/skills_retrieval.py", "--repeats", "1")
    assert out["queries"] == 26 and 0 < out["bm25"]["precision_at_3"] <= out["bm25"]["max_precision_at_3"]
    assert 0 < out["embedding"]["precision_at_3"] <= 1


@pytest.mark.slow
def test_reactions_bench_scores_a_labelled_set_against_the_rule_judge(tmp_path):
    rows = [{"text": "No, that's wrong. Shorter please.", "label": -1, "style": "plain"},
            {"text": "Perfect, thanks!", "label": 1, "style": "plain"},
            {"text": "What about the weekend?", "label": 0, "style": "plain"}]  # fmt: skip
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _bench("studies/reactions.py", "--data", str(data))
    assert out["n"] == 3 and out["labels"] == {"-1": 1, "0": 1, "1": 1}
    assert 0 <= out["reactions"]["accuracy"] <= 1 and 0 <= out["rule"]["accuracy"] <= 1


@pytest.mark.slow
def test_reaction_head_bench_reads_each_held_out_set_with_a_head_fitted_on_the_others(tmp_path):
    train = [("No, that's wrong. Shorter please.", -1, "correction"), ("Perfect, thanks!", 1, "praise"),
             ("What about the weekend?", 0, "follow_up"), ("Too long, cut it down.", -1, "correction"),
             ("Great answer, thank you.", 1, "praise"), ("Now do the same for Paris.", 0, "follow_up")]  # fmt: skip
    held = [("Why is it so long?", -1, "correction"), ("Could you also add a packing list?", 0, "follow_up")]
    for name, rows in (("reactions_train", train), ("reactions_no_verdict_s26", held)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": t, "label": y, "kind": "-", "category": c}) + "\n" for t, y, c in rows)
        )
    out = _bench("studies/reaction_head.py", "--data-dir", str(tmp_path))
    assert set(out) == {"reactions_no_verdict_s26"}  # only the held-out sets present; the training set is never one
    got = out["reactions_no_verdict_s26"]
    assert got["n"] == 2  # the held-out set's own rows, none of the fitted set's
    assert set(got["head"]) == set(got["reader"]) == {"corrections_as_minus1", "follow_ups_not_minus1",
                                                      "no_verdict_not_minus1", "accuracy"}  # fmt: skip


@pytest.mark.slow
def test_hint_signal_bench_scores_replies_with_and_without_the_hint():
    out = _bench("studies/hint_signal.py", "--model", "tiny", "--prompts", "2", "--samples", "1")
    assert out["replies"] == 2 and 0 <= out["compliance_plain"] <= 1 and out["mean_abs_token_delta"] >= 0


@pytest.mark.slow
def test_distill_signal_bench_measures_each_form():
    out = _bench("studies/distill_signal.py", "--model", "tiny", "--prompts", "1", "--samples", "1", "--max-tokens",
                 "4", "--forms", "prefix")  # fmt: skip
    assert set(out["forms"]) == {"prefix"} and out["forms"]["prefix"]["replies"] == 1 and out["prompts"] == 1


@pytest.mark.slow
def test_export_parity_bench_exports_a_synthetic_adapter(tmp_path):
    out = _bench("studies/export_parity.py", "--model", "tiny", "--formats", "peft", "--out", str(tmp_path))
    peft = out["results"]["peft"]
    assert out["model"] == "tiny" and peft["tokens"] > 0 and peft["max_abs_diff"] <= peft["tolerance"]


@pytest.mark.slow
def test_tool_calls_study_counts_parsed_calls_through_the_policy_server():
    out = _bench("studies/tool_calls.py", "--model", "tiny", "--replies", "1", "--max-tokens", "4")
    assert out["replies"] == 8 and len(out["cases"]) == 8  # 4 requests, with and without the system prompt
    assert out["with_tool_call"] == sum(c["with_tool_call"] for c in out["cases"].values()) <= out["replies"]


# ---- tools/ -------------------------------------------------------------------------------------------------------
def test_log_lines_counts_kinds_steps_duplicates_and_adverts(tmp_path):
    run = tmp_path / "run"
    (run / "adapters" / "step-000002").mkdir(parents=True)
    lines = [
        "[2026-11-28 10:00:00,000][metaclaw.loop.live][INFO] - Rollout proxy ready: point your agent at base_url=x",
        "[2026-11-28 10:00:01,000][metaclaw.modules.publisher][INFO] - Published adapter v1 at /r/adapters/step-000001",
        "[2026-11-28 10:00:01,100][metaclaw.modules.publisher][INFO] - Published adapter v1 at /r/adapters/step-000001",
        "[2026-11-28 10:00:02,000][lightning.pytorch][INFO] - 💡 Tip: try installing litlogger",
        "[2026-11-28 10:00:03,000][metaclaw.modules.publisher][INFO] - Published adapter v2 at /r/adapters/step-000002",
    ]
    (run / "train.log").write_text("\n".join(lines) + "\n")
    out = _bench("tools/log_lines.py", str(run))
    assert out["steps"] == 3 and out["startup_info_lines"] == 1 and out["info_lines"] == 5  # 3 publish lines
    assert out["kinds"]["metaclaw.modules.publisher: Published adapter v# at PATH"] == 3
    assert len(out["duplicates"]) == 1 and len(out["adverts"]) == 1


# ---- runs/ (a whole train.py each: slow) -------------------------------------------------------------------------
@pytest.mark.slow
def test_learning_bench_runs_the_main_job_briefly(tmp_path):
    out = _bench("runs/learning.py", "--model", "tiny", "--minutes", "0.2", "--methods", "rl", "--skills", "off",
                 "--out", str(tmp_path))  # fmt: skip
    (run,) = out["runs"]
    assert run["returncode"] == 0 and run["method"] == "rl" and Path(out["plot"]).exists()


@pytest.mark.slow
def test_soak_bench_streams_through_the_live_loop(tmp_path):
    out = _bench("runs/soak.py", "--minutes", "0.2", "--streams", "1", "--max-tokens", "4", "--run-dir",
                 str(tmp_path / "run"))  # fmt: skip
    assert out["requests"] >= 1 and out["failed_requests"] == 0 and out["train_exit"] is not None


@pytest.mark.slow
def test_substance_study_reports_each_cut_and_the_swapped_replies():
    out = _bench("studies/substance.py", "--model", "tiny", "--samples", "1", "--max-tokens", "4", "--tops", "1,5")
    assert out["replies"] == out["questions"] > 50 and set(out["tops"]) == {"1", "5"}
    for top in out["tops"].values():
        assert set(top) == {"whole", "first_1", "first_3", "swapped"} and all(0 <= v <= 1 for v in top.values())
    assert out["tops"]["1"]["swapped"] <= out["tops"]["5"]["swapped"]
