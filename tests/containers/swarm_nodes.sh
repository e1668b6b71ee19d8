#!/usr/bin/env bash
# A two-node Docker Swarm on one Linux host, for the two-node container tests
# and the `swarm-node-loss` chaos row. Run as root.
#
#   swarm_nodes.sh up [IMAGE...]   tear down leftovers, make both nodes, put IMAGEs on each, join them
#   swarm_nodes.sh down [--all]    leave the swarm, stop both dockerds, delete the veth and namespaces
#                                  (--all: the nodes' data roots too, images included)
#   swarm_nodes.sh status          one line per node: namespace, dockerd pid, swarm state
#
# Each node is a dockerd of its own in a network namespace made here:
#   psc-n1 (10.231.0.1 on psc-v1)  <- veth pair ->  psc-n2 (10.231.0.2 on psc-v2)
# started with `nsenter --net` (`ip netns exec` remounts /sys, and dockerd then
# fails with "Devices cgroup isn't mounted") inside `unshare --uts` with the
# hostname psc-nK, so the swarm sees two hostnames. Its socket is
# unix:///var/run/docker-nK.sock; node 1 is the manager, node 2 a worker. No
# address of the root namespace is used; the host's own engine only gives the
# images (hard-linked from its image store, or `docker save` into node 1).
#
# `down` always runs to the end (every step tolerates a missing part), and `up`
# runs it first, so a crashed run's leftovers never stop the next one.
#
# Images: the nodes' data roots are kept between runs for their images only
# (a 5 GB image takes minutes to load when it cannot be linked). `up` purges each node before anything
# else: it leaves any swarm, removes every container, volume and network, so
# no state of an earlier run (a stack's checkpoint volume) is ever seen again.
# An image missing on a node (or older than the host's) is hard-linked from the
# host engine's image store (link_images.py: overlay2 on one filesystem; a
# layer's files never change once written, containers write to an upper layer
# of their own), which takes seconds; otherwise it is loaded into node 1 from
# `docker save` (minutes for 5 GB) and node 2 gets node 1's store as links.
#
#   PSC_NODES_DIR=/var/lib/psc-nodes   data roots, logs, daemon.json of the nodes
#   PSC_NODES_TIMEOUT=60               seconds to wait for a dockerd to answer
#   PSC_NODES_DEBUG=1                  a failed `up` leaves the nodes as they are, to look at them
set -uo pipefail
# ip and dockerd live in /usr/sbin or /sbin, which a non-login PATH (/usr/bin:/bin) does not search.
PATH=$PATH:/usr/local/sbin:/usr/sbin:/sbin

NODES=(1 2)
DIR=${PSC_NODES_DIR:-/var/lib/psc-nodes}
TIMEOUT=${PSC_NODES_TIMEOUT:-60}
VETH_PREFIX=psc-v
HERE=$(cd "$(dirname "$0")" && pwd)

addr() { echo "10.231.0.$1"; }
bip() { echo "172.2$((7 + $1)).0.1/16"; }  # 172.28.0.1/16, 172.29.0.1/16: inside each node's namespace
netns() { echo "psc-n$1"; }
sock() { echo "/var/run/docker-n$1.sock"; }
exec_root() { echo "/var/run/docker-n$1"; }
pidfile() { echo "/var/run/docker-n$1.pid"; }
node_docker() { local k=$1; shift; timeout 60 docker -H "unix://$(sock "$k")" "$@"; }
answers() { node_docker "$1" info >/dev/null 2>&1; }
say() { echo "swarm-nodes: $*"; }

# --- down -----------------------------------------------------------------

# The pids of processes whose command line names this node's exec root or data
# root: its dockerd, the containerd it started, container shims.
node_pids() {
    local k=$1 pid
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        if tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qE "($(exec_root "$k")|$DIR/n$k)(/| |$)"; then
            echo "$pid"
        fi
    done
}

stop_nodes() {  # stop the dockerds of nodes "$@" (at once), then whatever they left: processes, mounts, files
    local k pid deadline pids=()
    for k in "$@"; do
        pid=$(cat "$(pidfile "$k")" 2>/dev/null || true)
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill -TERM "$pid" && pids+=("$pid"); fi
    done
    deadline=$((SECONDS + 30))
    for pid in "${pids[@]}"; do
        while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    done
    for k in "$@"; do
        # A dockerd killed hard leaves its containerd and shims: end them by pid.
        for pid in $(node_pids "$k"); do kill -KILL "$pid" 2>/dev/null || true; done
        # ... and its mounts (overlay layers, shm, netns files): deepest first.
        awk -v a="$(exec_root "$k")" -v b="$DIR/n$k" \
            '$2 == a || index($2, a "/") == 1 || $2 == b || index($2, b "/") == 1 {print $2}' /proc/self/mounts \
            | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
        rm -rf "$(exec_root "$k")" "$(sock "$k")" "$(pidfile "$k")"
    done
}

purge_node() {  # nothing of an earlier run but images: no swarm, container, volume or user network
    local k=$1
    node_docker "$k" swarm leave --force >/dev/null 2>&1 || true
    local ids
    ids=$(node_docker "$k" ps -aq) && [ -z "$ids" ] || node_docker "$k" rm -f $ids >/dev/null || return 1
    node_docker "$k" volume prune -f >/dev/null && node_docker "$k" network prune -f >/dev/null
}

down() {  # $1: --all to remove the data roots too
    local k
    for k in "${NODES[@]}"; do answers "$k" && purge_node "$k"; done
    stop_nodes "${NODES[@]}"
    for k in "${NODES[@]}"; do
        ip link del "$VETH_PREFIX$k" 2>/dev/null || true  # only if it ended up in the root namespace
        ip netns del "$(netns "$k")" 2>/dev/null || true  # deletes the veth end inside it too
    done
    if [ "${1:-}" = --all ]; then
        rm -rf "$DIR"
        say "down: no node dockerd, no psc-n1/psc-n2 namespace, no psc-v1/psc-v2 link, $DIR removed"
    else
        say "down: no node dockerd, no psc-n1/psc-n2 namespace, no psc-v1/psc-v2 link; images kept in $DIR (down --all removes them)"
    fi
}

# --- up -------------------------------------------------------------------

network() {
    local k
    for k in "${NODES[@]}"; do ip netns add "$(netns "$k")" || return 1; done
    ip link add "${VETH_PREFIX}1" netns "$(netns 1)" type veth peer name "${VETH_PREFIX}2" netns "$(netns 2)" || return 1
    for k in "${NODES[@]}"; do
        ip -n "$(netns "$k")" addr add "$(addr "$k")/24" dev "$VETH_PREFIX$k" || return 1
        ip -n "$(netns "$k")" link set "$VETH_PREFIX$k" up || return 1
        ip -n "$(netns "$k")" link set lo up || return 1
    done
}

start_node() {  # dockerd in namespace psc-nK, hostname psc-nK, detached from this shell's session
    local k=$1 root="$DIR/n$k"
    mkdir -p "$root/data" && echo '{}' >"$root/daemon.json"
    setsid unshare --uts sh -c "hostname $(netns "$k") && exec nsenter --net=/var/run/netns/$(netns "$k") \
        dockerd --config-file $root/daemon.json --data-root $root/data --exec-root $(exec_root "$k") \
        --pidfile $(pidfile "$k") -H unix://$(sock "$k") --bip $(bip "$k")" \
        >"$root/dockerd.log" 2>&1 </dev/null &
}

wait_node() {
    local k=$1 deadline=$((SECONDS + TIMEOUT))
    while [ $SECONDS -lt $deadline ]; do
        answers "$k" && return 0
        sleep 0.5
    done
    say "error: the dockerd of node $k did not answer within $TIMEOUT s; the end of $DIR/n$k/dockerd.log:" >&2
    tail -20 "$DIR/n$k/dockerd.log" >&2
    return 1
}

join() {
    local token
    node_docker 1 swarm init --advertise-addr "$(addr 1)" >/dev/null || return 1
    token=$(node_docker 1 swarm join-token -q worker) || return 1
    node_docker 2 swarm join --token "$token" --advertise-addr "$(addr 2)" "$(addr 1):2377" >/dev/null || return 1
    local deadline=$((SECONDS + TIMEOUT))
    while [ $SECONDS -lt $deadline ]; do
        [ "$(node_docker 1 node ls --filter role=worker -q | wc -l)" = 1 ] \
            && [ "$(node_docker 1 node ls --format '{{.Status}}' 2>/dev/null | grep -c Ready)" = 2 ] && return 0
        sleep 0.5
    done
    say "error: node 2 did not join as a ready worker within $TIMEOUT s" >&2
    return 1
}

has_images() {  # node $1 holds each of the images "${@:2}" as the host has it
    local k=$1 img; shift
    for img in "$@"; do
        [ "$(node_docker "$k" image inspect -f '{{.Id}}' "$img" 2>/dev/null)" = "$(docker image inspect -f '{{.Id}}' "$img")" ] \
            || return 1
    done
}

images() {  # IMAGEs on both nodes: the host's image store hard-linked into each (seconds), else loaded
    [ $# -gt 0 ] || return 0
    local t=$SECONDS k
    has_images 1 "$@" && has_images 2 "$@" && return 0
    stop_nodes "${NODES[@]}"  # a node reads its image store when it starts
    for k in "${NODES[@]}"; do
        python3 "$HERE/link_images.py" "$DIR/n$k/data" "$@" || { [ $? = 3 ] && break; return 1; }
    done
    for k in "${NODES[@]}"; do start_node "$k"; done
    for k in "${NODES[@]}"; do wait_node "$k" || return 1; done
    if has_images 1 "$@" && has_images 2 "$@"; then
        say "linked $* into both nodes in $((SECONDS - t)) s"
        return 0
    fi
    load "$@"
}

load() {  # IMAGEs on both nodes: loaded into node 1, its image store hard-linked into node 2
    local t=$SECONDS k
    if ! has_images 1 "$@"; then
        docker save "$@" | docker -H "unix://$(sock 1)" load -q >/dev/null || return 1
        node_docker 1 image prune -f >/dev/null  # an older image's layers
        say "loaded $* into node 1 in $((SECONDS - t)) s"
    fi
    t=$SECONDS
    if ! has_images 2 "$@"; then
        stop_nodes "${NODES[@]}"  # a running dockerd's overlay2 directory is a mount of its own: no link across
        rm -rf "$DIR/n2/data/image" "$DIR/n2/data/overlay2"
        cp -al "$DIR/n1/data/image" "$DIR/n1/data/overlay2" "$DIR/n2/data/" || return 1
        for k in "${NODES[@]}"; do start_node "$k"; done
        for k in "${NODES[@]}"; do wait_node "$k" || return 1; done
        has_images 2 "$@" || { say "error: node 2 does not see $* after linking node 1's image store" >&2; return 1; }
        say "linked node 1's images into node 2 in $((SECONDS - t)) s"
    fi
}

up() {
    local start=$SECONDS t k
    [ "$(id -u)" = 0 ] || { say "error: needs root (network namespaces, dockerd)" >&2; return 1; }
    for cmd in ip nsenter unshare dockerd docker; do
        command -v "$cmd" >/dev/null || { say "error: $cmd not found (iproute2, util-linux, docker.io)" >&2; return 1; }
    done
    down >/dev/null
    network || return 1
    for k in "${NODES[@]}"; do start_node "$k"; done
    for k in "${NODES[@]}"; do wait_node "$k" && purge_node "$k" || return 1; done
    say "dockerds answer after $((SECONDS - start)) s"
    images "$@" || return 1
    join || return 1
    say "up in $((SECONDS - start)) s: $(node_docker 1 node ls --format '{{.Hostname}} {{.Status}} {{.ManagerStatus}}' | tr '\n' ' ')"
}

status() {
    local k
    for k in "${NODES[@]}"; do
        echo "node $k: netns $(ip netns list | grep -qw "$(netns "$k")" && echo yes || echo no)," \
            "dockerd $(cat "$(pidfile "$k")" 2>/dev/null || echo none)," \
            "swarm $(node_docker "$k" info -f '{{.Swarm.LocalNodeState}}' 2>/dev/null || echo 'no answer')"
    done
}

case "${1:-}" in
    up)
        shift
        if ! up "$@"; then
            [ -n "${PSC_NODES_DEBUG:-}" ] && exit 1
            say "up failed: tearing down" >&2
            down >&2
            exit 1
        fi ;;
    down) down "${2:-}" ;;
    status) status ;;
    *) echo "usage: $0 up [IMAGE...] | down [--all] | status" >&2; exit 2 ;;
esac
