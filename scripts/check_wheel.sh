#!/usr/bin/env bash
# Build metaclaw's wheel, install it into a fresh venv and run it from outside any clone: `metaclaw --help`,
# `metaclaw train model=tiny trainer.max_steps=2` (the demo: simulated user, proxy, the policy server it starts)
# and a `metaclaw serve` start/stop. Prints one JSON line per check; exits non-zero on the first failure.
#   bash scripts/check_wheel.sh [WORK_DIR]      (default: a new temp dir; PYTHON picks the interpreter)
# The venv borrows torch & co from $PYTHON's venv (nothing is downloaded), but metaclaw itself must come from the
# wheel: the script checks `metaclaw.__file__`.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
WORK=${1:-$(mktemp -d /tmp/metaclaw-wheel.XXXXXX)}
mkdir -p "$WORK"
cd "$WORK"   # nothing below runs inside the clone
export HF_HUB_OFFLINE=1 WANDB_MODE=offline PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH

echo "== building the wheel into $WORK/dist"
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation "$REPO" -w "$WORK/dist"
WHEEL=$(ls "$WORK"/dist/metaclaw-*.whl)
echo "== a fresh venv ($WORK/venv) with the wheel"
# The dependencies come from $PYTHON's site-packages, seen through a folder of links that leaves out metaclaw
# itself (an editable install there must not answer the import) and sentencepiece, which metaclaw no longer declares
# and nothing it installs requires (accelerate is peft's dependency, so it stays).
BASE=$("$PYTHON" -c "import sys; print(sys.base_prefix)")
SITE=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$WORK/deps"
for entry in "$SITE"/*; do
  case "$(basename "$entry")" in
    metaclaw*|__editable__*metaclaw*|_metaclaw*|sentencepiece*|*.pth) ;;
    *) ln -sfn "$entry" "$WORK/deps/" ;;
  esac
done
"$BASE/bin/python3" -m venv "$WORK/venv"
echo "$WORK/deps" > "$("$WORK/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/deps.pth"
"$WORK/venv/bin/python" -m pip install -q --no-deps --no-index "$WHEEL"
VENV_SITE=$("$WORK/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
FILE=$("$WORK/venv/bin/python" -c "import metaclaw; print(metaclaw.__file__)")
case "$FILE" in
  "$VENV_SITE"/metaclaw/*) echo "{\"check\": \"import\", \"ok\": true, \"file\": \"$FILE\"}" ;;
  *) echo "{\"check\": \"import\", \"ok\": false, \"file\": \"$FILE\"}"; exit 1 ;;
esac
# pip check sees the base venv too (where some packages are installed --no-deps on purpose): metaclaw's own lines must be absent
if "$WORK/venv/bin/python" -m pip check 2>&1 | grep -i "^metaclaw "; then echo '{"check": "pip check", "ok": false}'; exit 1; fi
echo '{"check": "pip check (metaclaw)", "ok": true}'
"$WORK/venv/bin/metaclaw" --help > "$WORK/help.out" && grep -q "model  *.*tiny" "$WORK/help.out" && echo '{"check": "help", "ok": true}'

echo "== metaclaw train model=tiny trainer.max_steps=2 (from $WORK)"
"$WORK/venv/bin/metaclaw" train model=tiny trainer.max_steps=2 "hydra.run.dir=$WORK/run" > "$WORK/train.out" 2>&1 \
  || { tail -40 "$WORK/train.out"; echo '{"check": "train", "ok": false}'; exit 1; }
test -f "$WORK/run/adapters/step-000002/adapter_model.safetensors"
grep -q "metaclaw serve" "$WORK/run/train.log"   # the policy server it started came from the package
echo '{"check": "train", "ok": true}'

echo "== metaclaw serve model=tiny: start, /health, stop"
PORT=$("$WORK/venv/bin/python" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
setsid "$WORK/venv/bin/metaclaw" serve model=tiny "serve.port=$PORT" "hydra.run.dir=$WORK/serve" \
  > "$WORK/serve.out" 2>&1 &
SERVER=$!
trap 'kill -TERM -- -$SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  if "$WORK/venv/bin/python" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null; then
    break
  fi
  kill -0 "$SERVER" 2>/dev/null || { tail -40 "$WORK/serve.out"; echo '{"check": "serve", "ok": false}'; exit 1; }
  sleep 1
done
"$WORK/venv/bin/python" -c "import httpx; r = httpx.get('http://127.0.0.1:$PORT/v1/models'); r.raise_for_status(); print(r.json()['data'][0]['id'])" > /dev/null
kill -TERM -- -"$SERVER"
wait "$SERVER" || true
trap - EXIT
echo '{"check": "serve", "ok": true}'
echo "all checks passed (wheel $WHEEL)"
