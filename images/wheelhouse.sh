#!/usr/bin/env bash
# Fills images/wheelhouse/ with the wheels of the app's Python dependencies for
# the offline image, at the versions and hashes of the lock requirements/app.txt
# (`make lock`), for CPython 3.11 (Debian bookworm's python3), manylinux x86_64.
# The base's packages are not among them: the torch + torchvision pair and what
# it needs (requirements/torch.txt) are in the offline base already
# (images/build-offline-base.sh), as the official PyTorch image has its own.
# The Dockerfile installs these wheels with `pip install --no-index --find-links`.
# LOCK and OUT fill another folder from another lock the same way, and WITHOUT
# names the lock whose packages the image's base has (empty: none): the MLflow
# tracking server's image (orchestrator/tracking_image.py), FROM a Python without
# torch, takes all of requirements/tracking-server.txt into images/wheelhouse-tracking/.
#
#   images/wheelhouse.sh                      # skips when up to date
#   FORCE=1 PIP=pip images/wheelhouse.sh      # refills it
#   LOCK=requirements/tracking-server.txt OUT=images/wheelhouse-tracking WITHOUT= images/wheelhouse.sh
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
LOCK=$(realpath "${LOCK:-$ROOT/requirements/app.txt}")
OUT=$(realpath -m "${OUT:-$HERE/wheelhouse}")
PIP=${PIP:-$ROOT/.venv/bin/pip}
[ -x "$PIP" ] || PIP="python3 -m pip"

# One fill at a time (CI starts one early, in the background, and test workers build images
# side by side): a second waits, then finds it up to date.
mkdir -p "$HERE/.cache"
exec 9>"$HERE/.cache/wheelhouse.lock"
flock 9

WITHOUT=${WITHOUT-$ROOT/requirements/torch.txt}
reqs=$(python3 "$HERE/requirements.py" "$LOCK" ${WITHOUT:+--without "$WITHOUT"})
key=$(printf '%s\n' "$reqs" | sha256sum | cut -c1-16)
if [ -z "${FORCE:-}" ] && [ "$(cat "$OUT/.key" 2>/dev/null)" = "$key" ]; then
    echo "wheelhouse $OUT is up to date: nothing to do (FORCE=1 refills it)"
    exit 0
fi

start=$SECONDS
mkdir -p "$OUT"
rm -f "$OUT"/*.whl "$OUT/.key" "$OUT/requirements.txt"
# The image's interpreter, not the host's: pip picks wheels for these tags only.
target=(--only-binary=:all: --implementation cp --python-version 3.11 --abi cp311
        --platform manylinux2014_x86_64)
for v in $(seq 17 36); do target+=(--platform "manylinux_2_${v}_x86_64"); done

printf '%s\n' "$reqs" >"$OUT/requirements.txt"
# shellcheck disable=SC2086 # PIP may be "python3 -m pip"
$PIP download -q --no-deps --require-hashes -d "$OUT" "${target[@]}" -r "$OUT/requirements.txt"
echo "$key" >"$OUT/.key"
echo "wheelhouse $(basename "$OUT"): $(ls "$OUT"/*.whl | wc -l) wheels, $(du -sm "$OUT" | cut -f1) MB, in $((SECONDS - start)) s"
