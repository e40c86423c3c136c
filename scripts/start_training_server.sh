#!/usr/bin/env bash
# Start the MetaClaw remote training server (seed 000's API for `rl.backend: remote`).
#
#   export METACLAW_API_KEY="your-secret-key"
#   bash scripts/start_training_server.sh --port 8000 [--host 0.0.0.0] [--checkpoint-dir DIR] \
#        [--training-devices 0,1] [--inference-devices 2,3] [--inference-backend hf|vllm] [--log-level INFO] \
#        [--model tiny|smollm2_135m|qwen3_4b|...] [HYDRA_OVERRIDE ...]
#
# Flags set the seed's environment variables (METACLAW_PORT, METACLAW_API_KEY, ...), so a flag wins over the
# environment; anything else is passed to `python serve.py app=training_server` as a Hydra override.
# With GPUs present and no `devices=` override, training uses GPU 0 and inference GPU 1 (the seed's split).
set -euo pipefail

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
overrides=()
devices_given=0
while [[ $# -gt 0 ]]; do
  arg="$1"
  if [[ "$arg" == --*=* ]]; then  # --port=8000 → --port 8000
    set -- "${arg%%=*}" "${arg#*=}" "${@:2}"
    arg="$1"
  fi
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    --host) overrides+=("app.host=$2"); shift 2 ;;
    --port) export METACLAW_PORT="$2"; shift 2 ;;
    --api-key) export METACLAW_API_KEY="$2"; shift 2 ;;  # in the environment, not on the command line (ps)
    --checkpoint-dir) export METACLAW_CHECKPOINT_DIR="$2"; shift 2 ;;
    --training-devices) export METACLAW_TRAINING_DEVICES="$2"; shift 2 ;;
    --inference-devices) export METACLAW_INFERENCE_DEVICES="$2"; shift 2 ;;
    --inference-backend) export METACLAW_INFERENCE_BACKEND="$2"; overrides+=("backend=$2"); shift 2 ;;  # + its options
    --log-level) overrides+=("app.log_level=$2"); shift 2 ;;
    --model) overrides+=("model=$2"); shift 2 ;;
    --*) echo "unknown flag: $arg (see --help)" >&2; exit 2 ;;
    *)
      [[ "$arg" == devices=* ]] && devices_given=1
      overrides+=("$arg"); shift ;;
  esac
done

if [[ $devices_given == 0 ]]; then
  if [[ -n "${METACLAW_TRAINING_DEVICES:-}" ]]; then
    overrides+=("devices=split_gpu")  # GPU precision; the ids come from the environment
  elif command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    if [[ "$gpus" -ge 2 ]]; then overrides+=("devices=split_gpu"); elif [[ "$gpus" -eq 1 ]]; then overrides+=("devices=single_gpu"); fi
  fi
fi

exec "$PYTHON" serve.py app=training_server "${overrides[@]}"
