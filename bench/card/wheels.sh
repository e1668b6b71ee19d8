#!/usr/bin/env bash
# The wheels a lent GPU host lacks for bench/card/run.sh: it has PyTorch, torchvision and
# TensorBoard, and no network. The versions are the dev lock's (requirements/dev.txt), for
# CPython 3.10 to 3.13 on x86_64 Linux (the host's Python is not known in advance), into
# .cache/card-wheels/ (about 25 MB): carry that path with the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.cache/card-wheels
PACKAGES="pyzmq pyyaml pydantic docker safetensors shtab pytest pytest-timeout"
mkdir -p "$OUT" .cache/lock
# the dev lock's versions as plain constraints (pip takes no hashes there); each package's
# dependencies come too, at those versions: the host's own may be older than they need
grep -E '^[A-Za-z0-9_.-]+==' requirements/dev.txt | cut -d' ' -f1 > .cache/lock/card-constraints.txt
for py in 3.10 3.11 3.12 3.13; do
    # shellcheck disable=SC2086
    .venv/bin/python -m pip download -q --only-binary=:all: --python-version "$py" \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
        -c .cache/lock/card-constraints.txt -d "$OUT" $PACKAGES
done
du -sh "$OUT"
