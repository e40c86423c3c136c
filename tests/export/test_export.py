"""Export and import of adapters (docs/export.md): every format on a real tiny-model run, parity measured;
an external PEFT LoRA imported, served by a restarted policy server and trained on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from metaclaw.export.cli import PROVENANCE_FILE, export
from metaclaw.export.formats import GGUF_LORA_FILE, GgufLoraLayout, read_gguf_lora
from metaclaw.export.importer import IMPORT_FILE, import_adapter
from metaclaw.export.parity import compare, reply_logprobs, served_model
from metaclaw.export.runs import ExportError, RunAdapters
from tests.procs import free_port, serving

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}


def train_tiny(run_dir: Path, steps: int, *extra: str) -> None:
    out = subprocess.run(
        [sys.executable, "train.py", "model=tiny", "rollout=store", f"trainer.max_steps={steps}",
         f"hydra.run.dir={run_dir}", *extra],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A real run directory: `train.py` on the tiny model, 2 steps with a large lr (an adapter far from zero)."""
    run_dir = tmp_path_factory.mktemp("tiny-run")
    train_tiny(run_dir, 2, "optimizer.lr=5e-2")
    return run_dir


def test_peft_export_loads_in_peft_with_the_served_logprobs(tiny_run, tmp_path):
    record = export(str(tiny_run), "latest", "default", "peft", str(tmp_path / "peft"))
    assert record["step"] == 2 and record["parity"]["max_abs_diff"] <= 1e-6 and record["parity"]["tokens"] > 20
    saved = json.loads((tmp_path / "peft" / PROVENANCE_FILE).read_text())
    assert saved["base_model"]["sha256"]["config.json"] and saved["source"]["adapter_sha256"]
    assert saved["samples_trained"] == 8  # 2 steps of batch 4, from the run's own store
    # The adapter is not a no-op: it moves the served logprobs away from the base model's.
    spec = RunAdapters.open(tiny_run).model_spec()
    tok = spec.load_tokenizer()
    base = reply_logprobs(spec.load_model().float().eval(), tok)
    served = reply_logprobs(served_model(spec, tiny_run / "adapters" / "step-000002"), tok)
    assert compare(base, served)["max_abs_diff"] > 1e-3


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_merged_export_loads_in_plain_transformers(tiny_run, tmp_path, dtype, tolerance):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = export(str(tiny_run), "1", "default", "merged", str(tmp_path / "m"), dtype=dtype)
    measured = "max_abs_diff" if dtype == "float32" else "mean_abs_diff"
    assert record["step"] == 1 and record["parity"][measured] <= record["parity"]["tolerance"]
    tolerance = record["parity"]["tolerance"]  # bf16: 1e-2, or 1.5x the base model's own bf16 noise floor
    assert tolerance == 1e-4 if dtype == "float32" else tolerance >= 1e-2
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")  # plain transformers, no PEFT, no metaclaw
    assert not any("lora" in n for n, _ in model.named_parameters())
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    spec = RunAdapters.open(tiny_run).model_spec()
    served = reply_logprobs(served_model(spec, tiny_run / "adapters" / "step-000001"), tok)
    assert compare(served, reply_logprobs(model.eval(), tok))[measured] <= tolerance


def test_gguf_lora_reads_back_as_the_served_adapter(tiny_run, tmp_path):
    record = export(str(tiny_run), "latest", "default", "gguf-lora", str(tmp_path / "g"))
    meta, tensors = read_gguf_lora(tmp_path / "g" / GGUF_LORA_FILE)
    assert meta["general.architecture"] == "qwen3" and meta["general.type"] == "adapter"
    assert meta["adapter.type"] == "lora" and meta["adapter.lora.alpha"] == 32.0
    weights = load_file(str(tiny_run / "adapters" / "step-000002" / "adapter_model.safetensors"))
    assert len(tensors) == len(weights) == record["parity"]["tensors"]
    a = weights["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    assert torch.equal(torch.from_numpy(tensors["blk.1.attn_q.weight.lora_a"].copy()), a)
    assert record["parity"]["max_abs_diff"] == 0.0


def test_llama_rope_rows_are_permuted_like_llama_cpp_and_back():
    rows = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(8, 3).numpy()  # 2 heads of 4 rows
    permuted = GgufLoraLayout.permute(rows, 2)
    assert permuted[:, 0].tolist() == [0, 6, 3, 9, 12, 18, 15, 21]  # interleaved pairs -> halves, per head
    assert (GgufLoraLayout.unpermute(permuted, 2) == rows).all()


def test_ollama_modelfile_points_at_the_base_gguf_and_the_adapter(tiny_run, tmp_path):
    with pytest.raises(ExportError, match="--base-gguf"):  # the tiny model ships no GGUF
        export(str(tiny_run), "latest", "default", "ollama", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()  # nothing half-written
    fake_base = tmp_path / "base.gguf"
    fake_base.write_bytes(b"GGUF")
    export(str(tiny_run), "latest", "default", "ollama", str(tmp_path / "o"), base_gguf=str(fake_base))
    modelfile = (tmp_path / "o" / "Modelfile").read_text().splitlines()
    assert modelfile[0] == f"FROM {fake_base.resolve()}" and modelfile[1] == f"ADAPTER ./{GGUF_LORA_FILE}"
    assert any(line.startswith('TEMPLATE """') for line in modelfile)
    assert 'PARAMETER stop "<|im_end|>"' in modelfile
    assert (tmp_path / "o" / GGUF_LORA_FILE).is_file()


def test_export_refusals_name_the_problem(tiny_run, tmp_path):
    with pytest.raises(ExportError, match="no adapter at step 7"):
        export(str(tiny_run), "7", "default", "peft", str(tmp_path / "x"))
    with pytest.raises(ExportError, match="not a directory"):
        export(str(tmp_path / "nope"), "latest", "default", "peft", str(tmp_path / "x"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export(str(tiny_run), "latest", "default", "peft", str(tmp_path / "full"))
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    out = subprocess.run([sys.executable, "-m", "metaclaw", "export", "latest", "--run-dir", str(tiny_run),
                          "--format", "peft", "--out", str(tmp_path / "cli"), "--agent", "../etc"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "export refused" in out.stderr and "--agent" in out.stderr


def external_adapter(tiny_spec, where: Path, r: int = 4, alpha: int = 8, targets=("q_proj", "v_proj")) -> Path:
    """A LoRA trained elsewhere: PEFT's own `save_pretrained`, another rank and alpha, fewer target modules."""
    torch.manual_seed(1)
    model = get_peft_model(tiny_spec.load_model().float(), LoraConfig(r=r, lora_alpha=alpha,
                           target_modules=list(targets), task_type="CAUSAL_LM"))  # fmt: skip
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    model.save_pretrained(where)
    return where


def test_import_refuses_what_does_not_fit(tiny_run, tiny_spec, tmp_path):
    ext = external_adapter(tiny_spec, tmp_path / "ext")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((ext / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not opened")
    with pytest.raises(ExportError, match="pickled weights are never loaded"):
        import_adapter(pickled, tiny_run)
    with pytest.raises(ExportError, match="rank 32 is above"):
        import_adapter(external_adapter(tiny_spec, tmp_path / "big", r=32), tiny_run)
    with pytest.raises(ExportError, match=r"target modules \['lm_head'\]"):
        import_adapter(external_adapter(tiny_spec, tmp_path / "head", targets=("q_proj", "lm_head")), tiny_run)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((ext / "adapter_config.json").read_text())
    weights = load_file(str(ext / "adapter_model.safetensors"))
    key = next(k for k in weights if "lora_A" in k)
    weights[key] = torch.zeros(4, 7)
    save_file(weights, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ExportError, match=r"shape \(4, 7\), the base model needs \(4, 64\)"):
        import_adapter(bad, tiny_run)
    config = json.loads((ext / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "meta-llama/Llama-3-8B"
    (bad / "adapter_config.json").write_text(json.dumps(config))
    save_file(load_file(str(ext / "adapter_model.safetensors")), str(bad / "adapter_model.safetensors"))
    with pytest.raises(ExportError, match="trained on 'meta-llama/Llama-3-8B'"):
        import_adapter(bad, tiny_run)
    assert not (tiny_run / "adapters" / IMPORT_FILE).exists()  # nothing installed by a refusal


def _variant(ext: Path, where: Path, weights_scale: float = 1.0, **config_changes) -> Path:
    """A copy of adapter `ext` with config fields changed (a value of `...` removes the field)."""
    where.mkdir()
    config = json.loads((ext / "adapter_config.json").read_text())
    config.update(config_changes)
    (where / "adapter_config.json").write_text(json.dumps(config))
    weights = load_file(str(ext / "adapter_model.safetensors"))
    save_file({k: v * weights_scale for k, v in weights.items()}, str(where / "adapter_model.safetensors"))
    return where


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"megatron_config": {"tensor_model_parallel_size": 1}, "megatron_core": "megatron"}, "megatron_config"),
        ({"loftq_config": {"loftq_bits": 4}}, "loftq_config"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights"),
        ({"init_lora_weights": "olora"}, "init_lora_weights"),
        ({"layer_replication": [[0, 1], [0, 1]]}, "layer_replication"),
        ({"use_dora": True}, "use_dora"),
        ({"auto_mapping": {"base_model_class": "os.system"}}, "auto_mapping"),
        ({"lora_alpha": 1e38}, "lora_alpha"),
        ({"lora_alpha": 0}, "lora_alpha"),
    ],
)
def test_import_reads_only_the_lora_fields_it_supports(tiny_run, tiny_spec, tmp_path, monkeypatch, change, refused):
    """Issue 43 (findings 6, 7): an adapter is data. A field that would reach PEFT code (megatron's import by name,
    loftq / pissa / olora initialisation, layer replication) is refused by name, as is an alpha that computes inf."""
    ext = external_adapter(tiny_spec, tmp_path / "ext")
    bad = _variant(ext, tmp_path / "bad", **change)
    (bad / "megatron").mkdir()
    (bad / "megatron" / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('code ran')\n")
    monkeypatch.chdir(bad)
    monkeypatch.syspath_prepend(str(bad))  # as `python -m metaclaw import .` run from inside the adapter
    with pytest.raises(ExportError, match=refused):
        import_adapter(bad, tiny_run)
    assert not (tmp_path / "ran").exists()
    assert not (tiny_run / "adapters" / IMPORT_FILE).exists()


def test_import_refuses_non_finite_numbers_huge_weights_and_links(tiny_run, tiny_spec, tmp_path):
    """Issue 43 (findings 6, 7): NaN alpha, weights of 1e18, a config that is a link (to /dev/zero) or huge."""
    ext = external_adapter(tiny_spec, tmp_path / "ext")
    nan = _variant(ext, tmp_path / "nan")
    (nan / "adapter_config.json").write_text((nan / "adapter_config.json").read_text().replace(
        '"lora_alpha": 8', '"lora_alpha": NaN'))  # fmt: skip
    with pytest.raises(ExportError, match="NaN"):
        import_adapter(nan, tiny_run)
    with pytest.raises(ExportError, match="over 1000"):
        import_adapter(_variant(ext, tmp_path / "huge", weights_scale=1e18), tiny_run)
    linked = _variant(ext, tmp_path / "linked")
    (linked / "adapter_config.json").unlink()
    (linked / "adapter_config.json").symlink_to("/dev/zero")
    with pytest.raises(ExportError, match="link is not followed"):
        import_adapter(linked, tiny_run)
    big = _variant(ext, tmp_path / "big", padding="x" * 70_000)
    with pytest.raises(ExportError, match="bytes, over"):
        import_adapter(big, tiny_run)
    weights_link = _variant(ext, tmp_path / "wlink")
    (weights_link / "adapter_model.safetensors").unlink()
    (weights_link / "adapter_model.safetensors").symlink_to(ext / "adapter_model.safetensors")
    with pytest.raises(ExportError, match="link is not followed"):
        import_adapter(weights_link, tiny_run)
    assert not (tiny_run / "adapters" / IMPORT_FILE).exists()


def test_a_real_peft_adapter_still_imports_with_parity(tiny_run, tiny_spec, tmp_path):
    """Every field PEFT writes at its default passes the field screen; parity is measured on a clean config."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    record = import_adapter(external_adapter(tiny_spec, tmp_path / "ext"), run)
    assert 0 <= record["parity"]["max_abs_diff"] <= 1e-4 and record["parity"]["tokens"] > 0


@pytest.mark.slow  # three train.py runs and a serve.py (~40 s): `make test-slow`; its refusals and parity stay fast
def test_imported_adapter_is_served_and_trained_on(tiny_spec, tmp_path):
    from metaclaw.loop.live import reload_latest_adapter

    run_dir = tmp_path / "run"
    train_tiny(run_dir, 2)
    ext = external_adapter(tiny_spec, tmp_path / "ext")
    record = import_adapter(ext, run_dir)
    assert record["parity"]["max_abs_diff"] <= 1e-4  # rank 4 / alpha 8 rewritten as the run's rank 16 / alpha 32
    imported = Path(record["path"])
    assert json.loads((run_dir / "adapters" / "latest.json").read_text())["path"] == str(imported)

    # Served: a restarted policy server reloads latest.json, and its replies come from the imported weights.
    port, key = free_port(), "k"
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "serve.py", "model=tiny", f"serve.port={port}", f"hydra.run.dir={tmp_path / 'srv'}",
           f"serve.adapter_root={run_dir / 'adapters'}"]  # fmt: skip
    (tmp_path / "srv").mkdir()
    with serving(cmd, f"{url}/health", tmp_path / "srv" / "server.log", env={"METACLAW_API_KEY": key}):
        reload_latest_adapter(run_dir, url, key)
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
        assert "policy" in {m["id"] for m in models["data"]}

    # Trained on: the next start of the run loads it (fresh moments), serves it and steps from it.
    train_tiny(run_dir, 3)
    assert json.loads((run_dir / "adapters" / IMPORT_FILE).read_text())["applied_at_step"] == 2
    tok = tiny_spec.load_tokenizer()
    at_import = reply_logprobs(served_model(tiny_spec, imported), tok)
    before = reply_logprobs(served_model(tiny_spec, run_dir / "adapters" / "step-000002"), tok)
    after = reply_logprobs(served_model(tiny_spec, run_dir / "adapters" / "step-000003"), tok)
    assert compare(at_import, after)["max_abs_diff"] < 0.25 * compare(before, after)["max_abs_diff"]
    a3 = load_file(str(run_dir / "adapters" / "step-000003" / "adapter_model.safetensors"))
    ai = load_file(str(imported / "adapter_model.safetensors"))
    moved = max(float((a3[k] - ai[k]).abs().max()) for k in ai)
    assert moved > 0  # one optimizer step on top of the imported weights
    # A later restart resumes from the checkpoint (which holds the imported weights trained on): no re-import.
    train_tiny(run_dir, 4)
    assert json.loads((run_dir / "adapters" / IMPORT_FILE).read_text())["applied_at_step"] == 2


@pytest.mark.slow
def test_merged_smollm2_export_gives_the_served_logprobs_in_plain_transformers(tmp_path):
    """The embedded default: a SmolLM2-135M adapter merged, loaded with transformers alone, within 1e-4."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.studies.export_parity import synthetic_run

    run_dir = synthetic_run(tmp_path / "run")
    record = export(str(run_dir), "latest", "default", "merged", str(tmp_path / "merged"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    spec = RunAdapters.open(run_dir).model_spec()
    served = reply_logprobs(served_model(spec, run_dir / "adapters" / "step-000001"), tok)
    parity = compare(served, reply_logprobs(model, tok))
    assert parity["max_abs_diff"] <= 1e-4 and record["parity"]["max_abs_diff"] <= 1e-4
    base = reply_logprobs(spec.load_model().float().eval(), tok)
    assert compare(base, served)["mean_abs_diff"] > 1e-3  # the adapter changes the replies' logprobs
    gguf_parity = export(str(run_dir), "latest", "default", "gguf-lora", str(tmp_path / "g"))["parity"]
    assert gguf_parity["max_abs_diff"] == 0.0 and gguf_parity["tensors"] == 2 * 7 * 30  # 30 layers, 7 modules


def test_export_never_deletes_what_it_did_not_create(tiny_run, tmp_path, monkeypatch):
    """Issue 43 (finding 8): `--out` filled by someone else during the export, and an unrelated `.NAME.old`
    sibling, are left as they are; the export is refused."""
    import metaclaw.export.cli as export_cli

    out = tmp_path / "out"
    sibling = tmp_path / ".out.old"
    sibling.mkdir()
    (sibling / "keep.txt").write_text("not the exporter's")

    def racing_export(adapter_dir, tmp, spec):
        out.mkdir()
        (out / "theirs.txt").write_text("created meanwhile")
        return {"check": "stub", "max_abs_diff": 0.0, "tolerance": 1.0}

    monkeypatch.setattr(export_cli, "export_peft", racing_export)
    with pytest.raises(ExportError, match="created or filled by something else"):
        export(str(tiny_run), "latest", "default", "peft", str(out))
    assert (out / "theirs.txt").read_text() == "created meanwhile" and sorted(p.name for p in out.iterdir()) == [
        "theirs.txt"]  # fmt: skip
    assert (sibling / "keep.txt").read_text() == "not the exporter's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old", "out"]  # no temporary left behind
