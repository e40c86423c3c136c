"""Training server throughput: `forward_backward` + `optim_step` over HTTP vs a hand-written PyTorch + PEFT loop.

The third arm calls the server's `TrainingEngine` in-process (no HTTP), to tell transport overhead from compute.

Three arms train the same base model with the same LoRA shape on the same batch of datums (importance-sampling
loss, summed over tokens, AdamW, gradient clipping). Repeats are interleaved (server, loop, server, loop, ...) and
the medians are compared (`ratio_*` = arm / hand-written loop). Prints one JSON object.

    python bench/perf/training_server_throughput.py [--model tiny|smollm2_135m] [--datums 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, free_port, publish, serving  # noqa: E402
from metaclaw.config import LORA_TARGET_MODULES  # noqa: E402

RANK, ALPHA, LR = 16, 32, 1e-5
TARGETS = list(LORA_TARGET_MODULES)


def make_datums(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """Tinker-layout datums of varied lengths: the first quarter is prompt (advantage 0), the rest response."""
    rng = random.Random(seed)
    datums = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        tokens = [rng.randrange(10, vocab) for _ in range(length + 1)]
        n_prompt = length // 4
        adv = 1.0 if i % 2 else -1.0
        datums.append(
            {
                "model_input_tokens": tokens[:-1],
                "target_tokens": tokens[1:],
                "logprobs": [0.0] * n_prompt + [-2.0] * (length - n_prompt),
                "advantages": [0.0] * n_prompt + [adv] * (length - n_prompt),
            }
        )
    return datums


class TorchLoop:
    """The hand-written baseline: PEFT LoRA, one padded forward, IS loss (sum), backward, clip, AdamW."""

    def __init__(self, model_name: str) -> None:
        from hydra.utils import instantiate
        from omegaconf import OmegaConf
        from peft import LoraConfig, get_peft_model

        from metaclaw.config import CONFIG_DIR

        spec = instantiate(OmegaConf.load(CONFIG_DIR / "model" / f"{model_name}.yaml"))
        base = spec.load_model("cpu")
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM")
        self.model = get_peft_model(base, config)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=LR)
        self.vocab = base.get_input_embeddings().num_embeddings

    def step(self, datums: list[dict]) -> int:
        width = max(len(d["model_input_tokens"]) for d in datums)

        def pad(key: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([d[key] + [0] * (width - len(d[key])) for d in datums], dtype=dtype)

        ids, targets = pad("model_input_tokens", torch.long), pad("target_tokens", torch.long)
        behaviour, adv = pad("logprobs", torch.float32), pad("advantages", torch.float32)
        attn = torch.tensor(
            [[1] * len(d["model_input_tokens"]) + [0] * (width - len(d["model_input_tokens"])) for d in datums]
        )
        logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()
        lp = torch.gather(logits.log_softmax(-1), -1, targets.unsqueeze(-1)).squeeze(-1)
        mask = (adv != 0).float()
        ratio = torch.exp(torch.where(mask > 0, lp - behaviour, torch.zeros_like(lp)))
        loss = (-(ratio * adv) * mask).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return int(attn.sum())


def in_process_engine(model_name: str, checkpoint_dir: Path) -> Callable[[list[dict]], int]:
    """The server's engine without HTTP: one session, `forward_backward` + `optim_step` per call."""
    from hydra import compose, initialize_config_dir

    from metaclaw.config import CONFIG_DIR, register_resolvers
    from metaclaw.training_server.engine import TrainingEngine
    from metaclaw.training_server.schemas import ForwardBackwardRequest, OptimStepRequest
    from metaclaw.training_server.settings import ServerSettings

    register_resolvers()
    overrides = ["app=training_server", f"model={model_name}", f"app.checkpoint_dir={checkpoint_dir}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("serve", overrides=overrides)
    engine = TrainingEngine(ServerSettings.from_config(cfg))
    engine.load_base()
    session, _ = engine.create_session("", RANK)

    def step(datums: list[dict]) -> int:
        fb = engine.forward_backward(session, ForwardBackwardRequest(session_id=session.session_id, datums=datums))
        engine.optim_step(session, OptimStepRequest(session_id=session.session_id, learning_rate=LR))
        return fb["total_tokens"]

    return step


class ServerProcess:
    """`serve.py app=training_server` in its own process group (the harness's `serving`), and a client for it."""

    def __init__(self, model_name: str, workdir: Path, stack: ExitStack) -> None:
        port = free_port()
        env = {"METACLAW_PORT": str(port), "METACLAW_CHECKPOINT_DIR": str(workdir / "ckpt"),
               "METACLAW_API_KEY": "bench"}  # fmt: skip
        cmd = [sys.executable, "serve.py", "app=training_server", f"model={model_name}", "devices=cpu",
               "app.log_level=WARNING", f"hydra.run.dir={workdir / 'hydra'}"]  # fmt: skip
        url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer bench"}
        stack.enter_context(serving(cmd, f"{url}/v1/health", workdir / "server.log", env, timeout_s=300, headers=auth))
        self.client = stack.enter_context(httpx.Client(base_url=url, headers=auth, timeout=600))

    def post(self, path: str, body: dict) -> dict:
        r = self.client.post(path, json=body)
        r.raise_for_status()
        return r.json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a conf/model name (tiny, smollm2_135m, ...)")
    parser.add_argument("--datums", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    add_results_argument(parser)
    args = parser.parse_args()

    loop = TorchLoop(args.model)
    datums = make_datums(args.datums, args.min_len, args.max_len, loop.vocab)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        server = ServerProcess(args.model, Path(tmp), stack)
        sid = server.post("/v1/lora/create", {"base_model": "", "rank": RANK})["session_id"]  # "": the served model

        def server_step() -> int:
            fb = server.post("/v1/train/forward_backward", {"session_id": sid, "datums": datums})
            server.post("/v1/train/optim_step", {"session_id": sid, "learning_rate": LR})
            return fb["total_tokens"]

        engine_step = in_process_engine(args.model, Path(tmp) / "engine")
        arms = {"server": server_step, "engine": lambda: engine_step(datums), "torch": lambda: loop.step(datums)}
        for fn in arms.values():  # warm-up
            fn()
        tps: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(args.repeats):
            for name, fn in arms.items():
                t0 = time.perf_counter()
                tokens = fn()
                tps[name].append(tokens / (time.perf_counter() - t0))
    med = {name: statistics.median(values) for name, values in tps.items()}
    publish(
        __file__,
        args,
        {
            "model": args.model,
            "datums": args.datums,
            "tokens_per_step": tokens,
            "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(),
            "server_tokens_per_s": round(med["server"], 1),
            "engine_in_process_tokens_per_s": round(med["engine"], 1),
            "torch_peft_tokens_per_s": round(med["torch"], 1),
            "ratio_server_vs_torch": round(med["server"] / med["torch"], 3),
            "ratio_engine_vs_torch": round(med["engine"] / med["torch"], 3),
        },
    )


if __name__ == "__main__":
    main()
