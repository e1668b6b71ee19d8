#!/usr/bin/env bash
# Debian's chromium, for the TensorBoard screenshot test (tests/containers/test_tensorboard_containers.py):
# installed with apt when missing (root or sudo), so `.ci/run` on a fresh Debian 12/13 has it.
# Idempotent: prints the browser's path and does nothing else when it is there.
set -euo pipefail
SUDO=
[ "$(id -u)" = 0 ] || SUDO=sudo
if ! command -v chromium >/dev/null; then
    echo "chromium: installing Debian's chromium with apt" >&2
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
command -v chromium
