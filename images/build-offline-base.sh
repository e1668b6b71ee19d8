#!/usr/bin/env bash
# Builds the base image for hosts with no container registry, from Debian's
# package mirror and the Python package index only: debootstrap a minimal
# bookworm with python3, make a venv at /opt/venv (so `python` and `pip` are on
# PATH, as on the official PyTorch image the Dockerfile defaults to), install
# the torch + torchvision pair of images/torch-pair.txt and what it needs into
# it, at the versions and hashes of the lock requirements/torch.txt (`make lock`;
# as the official image has its own pair), and `docker import` the tree. The tree
# before the pair is imported too, as ps-compose-python:bookworm: the base of the
# images that need a Python and no torch (the MLflow server's).
#
#   images/build-offline-base.sh            # skips when the image exists with this lock
#   FORCE=1 images/build-offline-base.sh    # rebuilds
#   OFFLINE_BASE_IMAGE=name:tag images/build-offline-base.sh   # another image name
#
# Needs root (debootstrap, chroot) and a running Docker daemon. uv (from `make
# setup`, or UV=...) installs the lock's wheels in the tree; without it, pip on the
# host (the project's .venv, or PIP=...) downloads them and the tree's pip installs them.
set -euo pipefail
# debootstrap and chroot live in /usr/sbin on Debian and Ubuntu, which a
# non-login PATH (/usr/bin:/bin) does not search.
PATH=$PATH:/usr/local/sbin:/usr/sbin:/sbin

IMAGE=${OFFLINE_BASE_IMAGE:-ps-compose-base:bookworm}
PYTHON_IMAGE=${OFFLINE_PYTHON_IMAGE:-ps-compose-python:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOTFS=$HERE/rootfs
CACHE=$HERE/.cache/debootstrap
ROOT=$(dirname "$HERE")
LOCK=$ROOT/requirements/torch.txt
SPEC=$(grep -v '^[[:space:]]*#' "$HERE/torch-pair.txt" | xargs)
KEY=$(sha256sum "$LOCK" | cut -c1-16)
LABEL=ps-compose.torch       # the pair, for people and for CI's clean-up (.ci/run)
LOCK_LABEL=ps-compose.lock   # the first 16 hex digits of requirements/torch.txt's sha256
PIP=${PIP:-$ROOT/.venv/bin/pip}
[ -x "$PIP" ] || PIP="python3 -m pip"

# One build at a time (CI starts one early, in the background): a second waits,
# then finds the image built.
mkdir -p "$HERE/.cache"
exec 9>"$HERE/.cache/base.lock"
flock 9

lock_of() {  # $1: an image; the lock it was built from, empty if none
    local have
    have=$(docker image inspect -f "{{ index .Config.Labels \"$LOCK_LABEL\" }}" "$1" 2>/dev/null || true)
    [ "$have" != "<no value>" ] || have=""
    echo "$have"
}
have=$(lock_of "$IMAGE")
if [ -z "${FORCE:-}" ] && [ "$have" = "$KEY" ] && [ "$(lock_of "$PYTHON_IMAGE")" = "$KEY" ]; then
    echo "base image $IMAGE exists with $SPEC of lock $KEY, and $PYTHON_IMAGE: nothing to do (FORCE=1 rebuilds them)"
    exit 0
fi
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE was built from lock '${have:-none}', not $KEY (requirements/torch.txt), or $PYTHON_IMAGE is missing: rebuilding them"
fi
if [ "$(id -u)" != 0 ]; then
    echo "error: debootstrap needs root; run: sudo $0" >&2
    exit 2
fi
# Every host tool by its full path, found before any `env -i` clears PATH.
need() { command -v "$1" || { echo "error: $1 missing; run: make engine (or apt-get install $2)" >&2; exit 2; }; }
DEBOOTSTRAP=$(need debootstrap debootstrap)
CHROOT=$(need chroot coreutils)

# What debootstrap may leave mounted in the tree, unmounted before the tree is
# tarred or removed (tree-mounts.sh).
# shellcheck source=tree-mounts.sh
. "$HERE/tree-mounts.sh"

start=$SECONDS
remove_tree
trap remove_tree EXIT
mkdir -p "$CACHE"
# python3-venv brings ensurepip's pip wheel; nothing else is needed to install wheels.
"$DEBOOTSTRAP" --variant=minbase --include=python3,python3-venv --cache-dir="$CACHE" \
    bookworm "$ROOTFS" "$MIRROR" >"$HERE/.cache/debootstrap.log" 2>&1 \
    || { tail -20 "$HERE/.cache/debootstrap.log" >&2; exit 1; }
unmount_tree
if [ -n "$(mounted_below)" ]; then
    echo "error: still mounted in the tree after debootstrap: $(mounted_below | xargs)" >&2
    exit 1
fi
echo "debootstrap: $((SECONDS - start)) s"

"$CHROOT" "$ROOTFS" /usr/bin/python3 -m venv /opt/venv
# Keep it small: no package lists, caches, docs or translations in the images.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/* \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
       "$ROOTFS"/usr/share/locale/* "$ROOTFS"/var/log/*
find "$ROOTFS" -path "$ROOTFS/opt/venv" -prune -o -name __pycache__ -prune -exec rm -rf {} +
import_tree() {  # $1: the image; $2: what it holds
    tar -C "$ROOTFS" --one-file-system -c . | docker import \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python"]' \
        --change "LABEL $LABEL=\"$2\" $LOCK_LABEL=\"$KEY\"" \
        --message "debootstrap --variant=minbase bookworm + python3 venv${2:+ + $2}" \
        - "$1" >/dev/null
}
# The Python alone (its label says: no torch); CI's clean-up finds it by the label as the base.
import_tree "$PYTHON_IMAGE" "none"
docker run --rm "$PYTHON_IMAGE" python -c 'import sys; print("python", sys.version.split()[0], "ok")'

# The lock's wheels, for the image's interpreter (CPython 3.11, manylinux x86_64),
# each checked against the lock's hashes and installed in the tree's venv; none is
# kept beside the tree, where they would hold 2.7 GB more while `docker import`
# copies it. The lock leaves out triton (0.9 GB): it serves torch.compile's GPU
# kernels only, and importing torch does not need it.
WHEELS=$ROOTFS/tmp/wheels
mkdir -p "$WHEELS"
cp "$LOCK" "$WHEELS/torch.txt"
# The tree's installers see none of the host's settings (PIP_*/UV_* variables, config files).
in_tree() { env -i PATH=/opt/venv/bin:/usr/bin:/bin HOME=/root PIP_CONFIG_FILE=/dev/null UV_NO_CONFIG=1 "$CHROOT" "$ROOTFS" "$@"; }
# uv (the one `make setup` installs in .cache/, or UV=...), run in the tree: it downloads,
# checks and unpacks on every core and compiles the bytecode as pip does (beside CI's venv
# and first tests: 67 s, pip's download and install 151 s). Its cache lives in the tree's
# /tmp, on the venv's disk, and goes with it.
UV=${UV:-$(ls -d "$ROOT"/.cache/uv-*/bin/uv 2>/dev/null | sort -V | tail -1 || true)}
with_uv() {
    [ -n "$UV" ] && [ -x "$UV" ] || return 1
    cp "$UV" "$ROOTFS/tmp/uv"
    # It downloads as the host does: through the host's proxy, trusting the host's CAs (a
    # proxy that inspects TLS signs with a CA the tree's own bundle does not hold).
    local settings=(UV_CACHE_DIR=/tmp/uv-cache) ca=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt} v
    if [ -r "$ca" ]; then
        cp "$ca" "$ROOTFS/tmp/host-ca.pem"
        settings+=(SSL_CERT_FILE=/tmp/host-ca.pem)
    fi
    for v in HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
        [ -z "${!v:-}" ] || settings+=("$v=${!v}")
    done
    in_tree env "${settings[@]}" /tmp/uv pip install -q --python /opt/venv/bin/python \
        --compile-bytecode --no-deps --require-hashes -r /tmp/wheels/torch.txt
}
with_pip() {
    target=(--only-binary=:all: --implementation cp --python-version 3.11 --abi cp311
            --platform manylinux2014_x86_64)
    for v in $(seq 17 36); do target+=(--platform "manylinux_2_${v}_x86_64"); done
    # shellcheck disable=SC2086 # PIP may be "python3 -m pip"
    $PIP download -q --no-cache-dir --no-deps --require-hashes -d "$WHEELS" "${target[@]}" -r "$LOCK"
    echo "torch wheels: $(du -sm "$WHEELS" | cut -f1) MB, after $((SECONDS - start)) s"
    in_tree pip install -q --no-cache-dir --disable-pip-version-check --no-index --find-links /tmp/wheels \
        --no-deps --require-hashes -r /tmp/wheels/torch.txt
}
if with_uv; then
    installer="uv ($("$UV" --version))"
else
    [ -z "$UV" ] || echo "uv could not install the pair in the tree (above); pip downloads and installs it instead" >&2
    rm -rf "$ROOTFS/tmp/uv-cache" "$ROOTFS/opt/venv"  # whatever it left: a venv made afresh
    "$CHROOT" "$ROOTFS" /usr/bin/python3 -m venv /opt/venv
    with_pip
    installer=pip
fi
rm -rf "$WHEELS" "$ROOTFS/tmp/uv" "$ROOTFS/tmp/uv-cache" "$ROOTFS/tmp/host-ca.pem"
echo "torch pair installed by $installer: $((SECONDS - start)) s"
# (torch's own bytecode stays: without it every process would compile torch at import.)
import_tree "$IMAGE" "$SPEC"
docker run --rm "$IMAGE" python -c 'import sys, torch, torchvision
print("python", sys.version.split()[0], "torch", torch.__version__, "torchvision", torchvision.__version__, "ok")'
echo "base image $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'), built in $((SECONDS - start)) s"
