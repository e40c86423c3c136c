"""The scheduler gates a real Lightning fit: nothing is claimed while the window is closed, a user who comes back
mid-step lets that step finish and publish, training resumes when the window reopens; `abandon` drops the step."""

from __future__ import annotations

import threading
import time
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import lightning as L
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from safetensors.torch import load_file

from metaclaw.config import CONFIG_DIR
from metaclaw.datamodules import RolloutDataModule
from metaclaw.modules.online_rl import OnlineRLModule
from metaclaw.modules.publisher import AdapterPublisher
from metaclaw.scheduler import IdleScheduler
from metaclaw.store import Sample, SampleStore
from tests.scheduler.fakes import FakeClock, FakeIdle

CONF = CONFIG_DIR


def fill(store: SampleStore, n: int) -> None:
    store.insert_many([
        Sample(prompt_ids=[1, 2, 3 + i], response_ids=[7, 8, 9], behaviour_logprobs=[-1.0] * 3,
               reward=1.0 if i % 2 else -1.0, status="ready", session_id=f"s{i}")
        for i in range(n)
    ])  # fmt: skip


class UserReturnsDuringStep(L.Callback):
    """Mid-step `step` (after its forward pass), the user comes back."""

    def __init__(self, step: int, idle: FakeIdle) -> None:
        self.step, self.idle, self.fired = step, idle, threading.Event()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step and not self.fired.is_set():
            self.idle.back()
            self.fired.set()


def build(tmp_path: Path, tiny_policy, on_user_return: str, max_steps: int):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["model=tiny", "rollout=store", f"run_dir={tmp_path}"])
    store_path = str(tmp_path / "samples.sqlite")
    clock = FakeClock(datetime(2026, 11, 23, 12, 0, tzinfo=ZoneInfo("Europe/Berlin")))
    idle = FakeIdle(clock)
    scheduler = IdleScheduler(str(tmp_path), store_path, sleep_start=None, sleep_end=None, idle_threshold_minutes=30,
                              idle_source=idle, on_user_return=on_user_return, poll_s=0.05, clock=clock)  # fmt: skip
    module = OnlineRLModule(policy=tiny_policy, loss=instantiate(cfg.loss), advantage=instantiate(cfg.method.advantage),
                            optimizer=instantiate(cfg.optimizer), kl=instantiate(cfg.kl))  # fmt: skip
    datamodule = RolloutDataModule(store_path, batch_size=2, max_tokens=None, wait_timeout_s=30.0, pad_id=0,
                                   gate=scheduler.wait_until_open)  # fmt: skip
    returns = UserReturnsDuringStep(1, idle)
    logger = CSVLogger(str(tmp_path), name="csv", version="")
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[AdapterPublisher(str(tmp_path), store_path, checkpoint_every_n_steps=1),
                                   scheduler, returns])  # fmt: skip
    return trainer, module, datamodule, scheduler, clock, idle, returns


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_returning_user_pauses_training_after_the_step_is_published(tmp_path, tiny_policy):
    store = SampleStore(tmp_path / "samples.sqlite")
    fill(store, 12)
    trainer, module, datamodule, scheduler, clock, idle, returns = build(tmp_path, tiny_policy, "finish", 4)
    fit = threading.Thread(target=trainer.fit, args=(module,), kwargs={"datamodule": datamodule})
    fit.start()
    try:
        time.sleep(1.0)
        assert trainer.global_step == 0 and store.counts()["claimed"] == 0  # closed: nothing claimed
        clock.advance(minutes=31)  # the user (and the agent) went away
        idle.away(31)
        wait_for(returns.fired.is_set)
        wait_for(lambda: (tmp_path / "adapters" / "step-000002").exists())  # the interrupted step was published
        time.sleep(1.0)
        assert trainer.global_step == 2 and fit.is_alive()  # ...and training waits
        counts = store.counts()
        assert counts["consumed"] == 4 and counts["claimed"] == 2 and counts["ready"] == 6, counts
        assert not scheduler.state.window_open
        assert store.select("claimed")[0].claimed_step == 2  # fetched ahead while the window was open
        clock.advance(minutes=31)  # away again
        idle.away(31)
        fit.join(120)
        assert not fit.is_alive() and trainer.global_step == 4
        assert store.counts()["consumed"] == 8
        metrics = (tmp_path / "csv" / "metrics.csv").read_text()
        assert all(f"sched/{m}" in metrics for m in ("window_open", "waited_s", "samples_waiting"))
    finally:
        scheduler.stop()
        fit.join(30)
        store.close()


def test_abandon_drops_the_interrupted_step_and_releases_its_samples(tmp_path, tiny_policy):
    store = SampleStore(tmp_path / "samples.sqlite")
    fill(store, 12)
    trainer, module, datamodule, scheduler, clock, idle, returns = build(tmp_path, tiny_policy, "abandon", 3)
    clock.advance(minutes=31)
    idle.away(31)
    before = {n: p.detach().clone() for n, p in tiny_policy.named_parameters() if p.requires_grad}
    fit = threading.Thread(target=trainer.fit, args=(module,), kwargs={"datamodule": datamodule})
    fit.start()
    try:
        wait_for(returns.fired.is_set)
        wait_for(lambda: (tmp_path / "adapters" / "step-000002").exists())
        time.sleep(0.5)
        counts = store.counts()
        # step 0 trained and consumed; step 1 abandoned (its 2 samples are ready again); step 2 fetched ahead
        assert counts["consumed"] == 2 and counts["claimed"] == 2 and counts["ready"] == 8, counts
        first, second = (load_file(str(tmp_path / "adapters" / f"step-00000{i}" / "adapter_model.safetensors"))
                         for i in (1, 2))  # fmt: skip
        assert all(first[k].equal(second[k]) for k in first)  # the abandoned step changed no weight
        trained = {n: p.detach() for n, p in tiny_policy.named_parameters() if p.requires_grad}
        assert any(not before[n].equal(trained[n]) for n in before)  # step 0 did train
    finally:
        scheduler.stop()
        fit.join(60)
        store.close()
    assert not fit.is_alive()
