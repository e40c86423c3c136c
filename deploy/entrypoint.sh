#!/bin/sh
# The container's entry point: the proxy's key from a secret file (METACLAW_PROXY_API_KEY_FILE, e.g. a compose or
# Docker secret) or the environment (METACLAW_PROXY_API_KEY); refuses to serve on the network without one.
set -eu
if [ -n "${METACLAW_PROXY_API_KEY_FILE:-}" ] && [ -r "$METACLAW_PROXY_API_KEY_FILE" ]; then
  METACLAW_PROXY_API_KEY=$(cat "$METACLAW_PROXY_API_KEY_FILE")
  export METACLAW_PROXY_API_KEY
fi
if [ -z "${METACLAW_PROXY_API_KEY:-}" ]; then
  echo "metaclaw: no proxy key: set METACLAW_PROXY_API_KEY or mount a secret at METACLAW_PROXY_API_KEY_FILE" \
       "(docs/operate.md, 'Keys')" >&2
  exit 64
fi
exec metaclaw "$@"
