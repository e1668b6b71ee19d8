#!/usr/bin/env bash
# Fills images/wheelhouse/ with wheels of the app's Python dependencies (the
# `app` extra of pyproject.toml, torch pinned to a CPU build) for the offline
# image: CPython 3.11 (Debian bookworm's python3), manylinux x86_64. The
# Dockerfile installs them with `pip install --no-index --find-links`.
#
#   images/wheelhouse.sh                      # skips when up to date
#   TORCH=torch==2.13.0+cpu PIP=pip images/wheelhouse.sh
#
# torch's CPU wheels are not on PyPI: pip finds them through PIP_FIND_LINKS (a
# directory holding the wheel) or, failing that, PyTorch's CPU index.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
OUT=$HERE/wheelhouse
PIP=${PIP:-$ROOT/.venv/bin/pip}
PYTHON=$(dirname "$PIP")/python
TORCH=${TORCH:-torch==2.13.0+cpu}
case $TORCH in *+cpu) ;; torch==*) TORCH=$TORCH+cpu ;; esac  # never the CUDA build

reqs=$("$PYTHON" "$HERE/requirements.py" "$ROOT/pyproject.toml" app)
key=$(printf '%s\n%s\n' "$TORCH" "$reqs" | sha256sum | cut -c1-16)
if [ -z "${FORCE:-}" ] && [ "$(cat "$OUT/.key" 2>/dev/null)" = "$key" ]; then
    echo "wheelhouse $OUT is up to date: nothing to do (FORCE=1 refills it)"
    exit 0
fi

start=$SECONDS
mkdir -p "$OUT"
rm -f "$OUT"/*.whl "$OUT/.key"
# The image's interpreter, not the host's: pip picks wheels for these tags only.
target=(--only-binary=:all: --implementation cp --python-version 3.11 --abi cp311
        --platform manylinux2014_x86_64)
for v in $(seq 17 36); do target+=(--platform "manylinux_2_${v}_x86_64"); done

# shellcheck disable=SC2086 # one requirement a word
if ! "$PIP" download -q -d "$OUT" "${target[@]}" "$TORCH" $reqs; then
    echo "retrying with PyTorch's CPU index for $TORCH" >&2
    "$PIP" download -q -d "$OUT" "${target[@]}" \
        --extra-index-url https://download.pytorch.org/whl/cpu "$TORCH" $reqs
fi
echo "$key" >"$OUT/.key"
echo "wheelhouse: $(ls "$OUT"/*.whl | wc -l) wheels, $(du -sm "$OUT" | cut -f1) MB, in $((SECONDS - start)) s"
