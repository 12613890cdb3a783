#!/usr/bin/env bash
# The GPU suite, run on a lent GPU machine (no network) from the repository root with .whl/
# carried (benchmarks/gpu/bundle.sh made it on the development machine):
#
#   bash benchmarks/gpu/suite.sh                  # every stage, about 9 minutes on an H100
#   bash benchmarks/gpu/suite.sh --stages 3,6     # rerun only what a fix changed
#   bash benchmarks/gpu/suite.sh --rehearse       # CPU, smoke sizes (the default test run does this)
#
# It installs the carried wheels into a temporary folder put on PYTHONPATH (no index, no
# network), unpacks redis-server from the carried Debian packages, makes the checkout
# importable as `splitserve`, then hands over to benchmarks/gpu/suite.py, which checks the
# versions, runs the stages, each under its own time budget, and writes each stage's JSON as it
# ends into $OUT when set, else benchmarks/results/gpu/ (--out DIR overrides both).
#
# Options of its own: --bundle DIR (default .whl), --python PATH (default $PYTHON, else python3).
# Everything else goes to suite.py (--stages, --deadline-s, --rehearse, --out).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUNDLE="$ROOT/.whl"
PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT:-$ROOT/benchmarks/results/gpu}"
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) BUNDLE="$(cd "$2" && pwd)"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --out) OUT_DIR="$2"; shift 2 ;;
    *) PASS+=("$1"); shift ;;
  esac
done
STARTED="$(date +%s.%N)"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
exec > >(tee "$OUT_DIR/suite.log") 2>&1
cd "$ROOT"

[ -d "$BUNDLE" ] || { echo "suite.sh: no bundle at $BUNDLE: run bash benchmarks/gpu/bundle.sh on the development machine and carry .whl" >&2; exit 2; }
SITE="$(mktemp -d "${TMPDIR:-/tmp}/splitserve-suite.XXXXXX")"
trap 'rm -rf "$SITE"' EXIT
echo "[suite] installing $(ls "$BUNDLE"/*.whl | wc -l) carried wheels into $SITE (no index)"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
  --target "$SITE/python" "$BUNDLE"/*.whl || { echo "suite.sh: installing the carried wheels failed" >&2; exit 2; }
ln -s "$ROOT" "$SITE/python/splitserve"  # the checkout is the package (pyproject.toml's package-dir)

# redis-server from the carried Debian packages, its libraries beside it; a wrapper on PATH runs
# it through its own name (the binary picks its mode by the name it was started as).
mkdir -p "$SITE/bin" "$SITE/redis"
for deb in "$BUNDLE"/deb/*.deb; do dpkg-deb -x "$deb" "$SITE/redis" || echo "suite.sh: could not unpack $deb" >&2; done
cat > "$SITE/bin/redis-server" <<WRAP
#!/bin/sh
LD_LIBRARY_PATH="$SITE/redis/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$SITE/redis/usr/bin/redis-server" "\$@"
WRAP
chmod +x "$SITE/bin/redis-server"

export PYTHONPATH="$SITE/python${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
export SPLITSERVE_CACHE="$SITE/cache" SPLITSERVE_GPU_MODEL_DIR="$BUNDLE/model"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PIP_NO_INDEX=1
"$PYTHON" -m splitserve.benchmarks.gpu.suite --out "$OUT_DIR" --bundle "$BUNDLE" --started-at "$STARTED" "${PASS[@]}"
