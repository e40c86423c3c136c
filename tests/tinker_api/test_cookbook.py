"""tinker-cookbook's own supervised and RL loops (`recipes/sl_loop.py`, `recipes/rl_loop.py`), unmodified, with
their `base_url` pointed at our server and the tiny model.

Offline edges only: the recipes' data sets come from the hub (`datasets.load_dataset`), so a few rows in the same
schema are served by a real in-memory `datasets.DatasetDict`; the tokenizer is the tiny model's, registered under
the model name with the cookbook's own `register_tokenizer`. The RL reward (GSM8K answers graded from `\\boxed{}`)
never fires for a random tiny model, so it is replaced by one that varies with the sampled text: the loop then has
non-zero advantages and trains.
"""

from __future__ import annotations

import datasets
import pytest
from tinker_cookbook import tokenizer_utils
from tinker_cookbook.recipes import rl_loop, sl_loop

from metaclaw.modules.loading import ModelSpec
from tests.tinker_api.conftest import MODEL_NAME, TINKER_KEY
from tests.training_server.launch import Server

pytestmark = [pytest.mark.tinker, pytest.mark.usefixtures("fresh_sessions")]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = ModelSpec(name="tiny", path="tiny").load_tokenizer()
    tokenizer_utils.register_tokenizer(MODEL_NAME, lambda: tokenizer)
    monkeypatch.setenv("TINKER_API_KEY", TINKER_KEY)
    rows = {
        "HuggingFaceH4/no_robots": [
            {"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w}!"}]}
            for w in ("hello", "yes", "blue", "seven", "tea", "rain")
        ],
        "openai/gsm8k": [
            {"question": f"What is {a} + {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"} for a in range(1, 7)
        ],  # fmt: skip
    }

    def load_dataset(name: str, *args: object, **kwargs: object) -> datasets.DatasetDict:
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[name])})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)


def steps(server: Server) -> list[int]:
    return [s["step"] for s in server.client.get("/v1/lora/sessions").json()["sessions"]]


def test_cookbook_supervised_loop(server: Server, tmp_path) -> None:
    config = sl_loop.Config(base_url=server.url, log_path=str(tmp_path / "sl"), model_name=MODEL_NAME,
                            batch_size=2, lora_rank=4, max_length=128, max_steps=2, save_every=1)  # fmt: skip
    sl_loop.main(config)
    assert steps(server) == [2]
    metrics = (tmp_path / "sl" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2 and '"train_mean_nll"' in metrics[0]
    saved = server.checkpoint_dir
    assert list(saved.glob("checkpoints/*/final")) and list(saved.glob("adapters/*/final"))  # kind="both"


def test_cookbook_rl_loop(server: Server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rl_loop, "get_reward", lambda response, answer: float(len(response) % 2))
    config = rl_loop.Config(base_url=server.url, log_path=str(tmp_path / "rl"), model_name=MODEL_NAME,
                            batch_size=2, group_size=4, max_tokens=8, lora_rank=4, max_steps=2,
                            loss_fn="importance_sampling", save_every=0)  # fmt: skip
    rl_loop.main(config)
    assert steps(server) and steps(server)[0] >= 1  # at least one batch had non-zero advantages and trained
