"""`bench/perf/gpu_check.py --smoke`: the GPU check's whole pipeline (build, LoRA training, serve, hot-swap) on CPU."""

from __future__ import annotations

import importlib.util
import json

from bench.harness import collect
from tests.conftest import REPO


def test_gpu_check_smoke_prints_every_figure(capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "perf" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = gpu_check.main(["--smoke"])
    assert list(collect(capsys.readouterr().out.splitlines()).values()) == [json.loads(json.dumps(out))]  # the schema
    train, serve = out["train"], out["serve"]
    assert {"tokens_per_s", "mfu_6n_dense", "mfu_4n_frozen_base", "peak_memory_gib", "params_matmul_N"} <= set(train)
    assert train["steps_measured"] >= 1 and train["tokens_per_s"] > 0 and train["peak_memory_gib"] > 0
    assert train["params_trainable"] < train["params_total"]  # LoRA only
    assert train["mfu_6n_dense"] is None  # CPU: no peak to divide by, never a made-up figure
    assert serve["swaps"] == 2 and serve["swap_latency_ms_median"] > 0 and serve["decode_tokens"] >= 1
    assert gpu_check.QWEN3_4B["hidden_size"] == 2560 and gpu_check.QWEN3_4B["num_hidden_layers"] == 36
