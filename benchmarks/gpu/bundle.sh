#!/usr/bin/env bash
# Packs, on the development machine, what the GPU suite needs on a lent GPU machine that
# has no network and carries at most 64 MiB per command. Writes the ignored folder .whl/:
#
#   .whl/*.whl      wheels of the packages the suite imports that the lent image lacks
#                   (carried.txt), for CPython 3.12 on x86-64 manylinux, at the versions
#                   this machine's venv runs (deploy/requirements.txt's pins)
#   .whl/deb/*.deb  Debian's redis-server and the libraries it needs beyond the image's
#   .whl/model/     the bundled model's config and tokenizer, no weights (the suite runs
#                   random weights of its shape: --load-format dummy)
#
# Prints what it took and the size that travels (the tree plus .whl), and fails when that
# is over BUNDLE_LIMIT_MIB. Needs deploy/setup.sh first (the venv, the converted model).
#
#   bash benchmarks/gpu/bundle.sh [--python-version 3.12] [--dest DIR]
#
# --python-version picks the wheels' interpreter (3.12: the lent image's; the CPU rehearsal
# passes this machine's); --dest writes elsewhere than .whl/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${SPLITSERVE_VENV:-$ROOT/.venv}/bin/python"
PYVER=3.12
DEST="$ROOT/.whl"
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYVER="$2"; shift 2 ;;
    --dest) DEST="$2"; shift 2 ;;
    *) echo "bundle.sh: unknown argument $1 (use --python-version X.Y, --dest DIR)" >&2; exit 2 ;;
  esac
done
# The wheels: benchmarks/gpu/carried.txt's first column.
mapfile -t CARRIED < <(sed -e 's/#.*//' "$ROOT/benchmarks/gpu/carried.txt" | awk 'NF {print $1}')
DEBS=(redis-server redis-tools liblzf1 libjemalloc2 libatomic1)
BUNDLE_LIMIT_MIB=48  # of the 64 MiB a device command carries: room for results and growth

[ -x "$PY" ] || { echo "bundle.sh: no venv at $PY; run deploy/setup.sh first" >&2; exit 1; }
rm -rf "$DEST"
mkdir -p "$DEST/deb" "$DEST/model"

pins=()
for name in "${CARRIED[@]}"; do
  version="$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")" || {
    echo "bundle.sh: $name is not installed in $PY's venv; run deploy/setup.sh" >&2; exit 1; }
  pins+=("$name==$version")
done
platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux2010_x86_64)
for n in $(seq 5 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
echo "[bundle] wheels for CPython $PYVER x86-64: ${pins[*]}"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PYVER" --implementation cp "${platforms[@]}" -d "$DEST" "${pins[@]}" 2>&1 \
  | { grep -v "is ignored: it is neither a file nor a directory" || true; }
count="$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)"
[ "$count" -eq "${#CARRIED[@]}" ] || { echo "bundle.sh: got $count wheels for ${#CARRIED[@]} packages" >&2; exit 1; }

echo "[bundle] Debian packages: ${DEBS[*]}"
if ! (cd "$DEST/deb" && apt-get download -q "${DEBS[@]}" >/dev/null 2>&1); then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q >/dev/null
  (cd "$DEST/deb" && apt-get download -q "${DEBS[@]}" >/dev/null)
fi

model="$("$PY" -m splitserve.engine.models.convert | tail -n 1)"
find "$model" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$DEST/model/" \;
[ -f "$DEST/model/config.json" ] && [ -f "$DEST/model/tokenizer.json" ] || {
  echo "bundle.sh: $model lacks config.json or tokenizer.json" >&2; exit 1; }

echo "[bundle] took:"
(cd "$DEST" && find . -type f -printf '%s %p\n' | sort -k2 | awk '{printf "  %8.1f KiB  %s\n", $1/1024, $2}')
bundle_bytes="$(du -sb "$DEST" | cut -f1)"
tree_bytes="$(cd "$ROOT" && git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)"
total=$((bundle_bytes + tree_bytes))
awk -v b="$bundle_bytes" -v t="$tree_bytes" -v l="$BUNDLE_LIMIT_MIB" 'BEGIN {
  printf "[bundle] %s: %.1f MiB; the tree: %.1f MiB; together %.1f MiB of the %d MiB limit\n",
         "'"$DEST"'", b / 1048576, t / 1048576, (b + t) / 1048576, l }'
if [ "$total" -gt $((BUNDLE_LIMIT_MIB << 20)) ]; then
  echo "bundle.sh: over $BUNDLE_LIMIT_MIB MiB: a device command would not carry it" >&2
  exit 1
fi
