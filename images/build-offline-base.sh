#!/usr/bin/env bash
# Builds the base image for hosts with no container registry, from Debian's
# package mirror only: debootstrap a minimal bookworm with python3, make a venv
# at /opt/venv (so `python` and `pip` are on PATH, as on the official PyTorch
# image the Dockerfile defaults to) and `docker import` the tree.
#
#   images/build-offline-base.sh            # skips when the image exists
#   FORCE=1 images/build-offline-base.sh    # rebuilds
#
# Needs root (debootstrap, chroot) and a running Docker daemon.
set -euo pipefail

IMAGE=${OFFLINE_BASE_IMAGE:-ps-compose-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOTFS=$HERE/rootfs
CACHE=$HERE/.cache/debootstrap

if [ -z "${FORCE:-}" ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE exists: nothing to do (FORCE=1 rebuilds it)"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "error: debootstrap needs root; run: sudo $0" >&2
    exit 2
fi
command -v debootstrap >/dev/null || { echo "error: debootstrap missing; run: make engine (or apt-get install debootstrap)" >&2; exit 2; }

start=$SECONDS
rm -rf "$ROOTFS"
trap 'rm -rf "$ROOTFS"' EXIT
mkdir -p "$CACHE"
# python3-venv brings ensurepip's pip wheel; nothing else is needed to install wheels.
debootstrap --variant=minbase --include=python3,python3-venv --cache-dir="$CACHE" \
    bookworm "$ROOTFS" "$MIRROR" >"$HERE/.cache/debootstrap.log" 2>&1 \
    || { tail -20 "$HERE/.cache/debootstrap.log" >&2; exit 1; }
echo "debootstrap: $((SECONDS - start)) s"

chroot "$ROOTFS" /usr/bin/python3 -m venv /opt/venv
# Keep it small: no package lists, caches, docs or translations in the image.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/* \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
       "$ROOTFS"/usr/share/locale/* "$ROOTFS"/var/log/*
find "$ROOTFS" -name __pycache__ -prune -exec rm -rf {} +

tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python"]' \
    --message "debootstrap --variant=minbase bookworm + python3 venv" \
    - "$IMAGE" >/dev/null
docker run --rm "$IMAGE" python -c 'import sys, ensurepip; print("python", sys.version.split()[0], "ok")'
echo "base image $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'), built in $((SECONDS - start)) s"
