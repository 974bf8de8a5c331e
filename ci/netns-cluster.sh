#!/usr/bin/env bash
# A cluster of K "hosts" on this machine, made of Linux namespaces: each
# host has its own network namespace (one veth into a shared bridge, an
# address from the benchmarking range 198.18.0.0/15, no default route, its
# link rate-limited with tc tbf) and, unless --shared-host, its own UTS
# (hostname) and IPC namespace, so that nothing but the network joins the
# hosts. With --shared-host the hosts share this machine's hostname and IPC
# namespace (containers on one machine that share a hostname).
#
# Namespaces on one machine are not separate machines: the hosts share the
# kernel, the CPUs, the file system (/dev/shm included) and the pid space.
#
#   ci/netns-cluster.sh run [--hosts K] [--rate RATE|none] [--shared-host] [--timeout S] -- COMMAND...
#
# runs COMMAND once per host, in that host's namespaces, all at once, with
# {node_rank}, {nnodes}, {master_addr} (host 0's address) and {addr} (this
# host's address) substituted in every argument; prints each host's exit
# status and time, exits non-zero when a host's command failed, and tears the
# cluster down on exit, also after a failure or a signal. Needs root.
#
# Sourced (`source ci/netns-cluster.sh`), it defines the functions
# cluster_up, cluster_down, host_exec, host_pids, host_signal and host_link for scripts
# such as ci/multihost-test.sh, and runs nothing.

NETNS_NET=198.18.0
NETNS_PREFIX="chorus$$"
NETNS_HOSTS=0
NETNS_HOLDERS=()

netns_die() {
    echo "netns-cluster: $*" >&2
    exit 2
}

# netns_chorus_binary PATH BUILD: sets CHORUS to PATH made absolute, or
# exits naming BUILD (the cargo command that makes it) when PATH is no
# chorus binary or one built without UCX.
netns_chorus_binary() {
    CHORUS=$(realpath "$1")
    [[ -x "$CHORUS" ]] || netns_die "$CHORUS: no chorus binary ($2)"
    "$CHORUS" conformance --backend ucx --list >/dev/null 2>&1 || netns_die "$CHORUS was built without UCX ($2)"
}

# The address of host $1 (host 0 is the master).
host_addr() { echo "$NETNS_NET.$(($1 + 1))"; }
host_ns() { echo "$NETNS_PREFIX-h$1"; }

# tbf's burst for a rate like 1gbit: 10 ms of traffic, at least 64 KiB (one
# GSO segment must fit, or tbf drops it).
netns_burst() {
    local rate=$1 n unit bits
    n=${rate%%[a-zA-Z]*}
    unit=${rate#"$n"}
    case "${unit,,}" in
        bit | "") bits=$n ;;
        kbit) bits=$((n * 1000)) ;;
        mbit) bits=$((n * 1000000)) ;;
        gbit) bits=$((n * 1000000000)) ;;
        *) netns_die "--rate $rate: give it as N[k|m|g]bit (e.g. 1gbit) or none" ;;
    esac
    [[ "$n" =~ ^[0-9]+$ && $bits -gt 0 ]] || netns_die "--rate $rate: give it as N[k|m|g]bit (e.g. 1gbit) or none"
    local burst=$((bits / 8 / 100))
    ((burst < 65536)) && burst=65536
    echo "$burst"
}

# cluster_up K RATE SHARED: builds the hosts; RATE is a tc rate or "none";
# SHARED is 1 for hosts sharing this machine's hostname and IPC namespace.
cluster_up() {
    local k=$1 rate=$2 shared=$3 burst=""
    [[ "$k" =~ ^[0-9]+$ ]] && ((k >= 2 && k <= 4)) || netns_die "--hosts $k: between 2 and 4"
    if [[ $(id -u) -ne 0 ]]; then
        netns_die "needs root (network namespaces, veths, a bridge and tc); run it as root, e.g. with sudo"
    fi
    for tool in ip tc unshare nsenter; do
        command -v "$tool" >/dev/null 2>&1 || netns_die "needs $tool (iproute2, util-linux)"
    done
    [[ "$rate" == none ]] || burst=$(netns_burst "$rate") || exit 2
    NETNS_HOSTS=$k
    local bridge="${NETNS_PREFIX}b"
    ip link add "$bridge" type bridge || netns_die "cannot create a bridge"
    ip link set "$bridge" up
    local i ns veth
    for ((i = 0; i < k; i++)); do
        ns=$(host_ns "$i")
        veth="${NETNS_PREFIX}v$i"
        ip netns add "$ns"
        ip link add "$veth" type veth peer name eth0 netns "$ns"
        ip link set "$veth" master "$bridge" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$(host_addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        if [[ -n "$burst" ]]; then
            # Both directions: eth0 limits what the host sends, the bridge
            # side what it receives.
            tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
            tc qdisc add dev "$veth" root tbf rate "$rate" burst "$burst" latency 50ms
        fi
        # A process that holds the host's namespaces: `ip netns exec` gives it
        # a mount namespace where /sys shows this host's interfaces (UCX lists
        # them there); unshare gives it its own hostname and IPC namespace.
        if [[ "$shared" == 1 ]]; then
            ip netns exec "$ns" sleep infinity &
        else
            ip netns exec "$ns" unshare --uts --ipc sh -c "hostname $ns && exec sleep infinity" &
        fi
        NETNS_HOLDERS[i]=$!
        disown "$!"
    done
    # Every holder is in place (hostname set) before anyone enters it.
    for ((i = 0; i < k; i++)); do
        local tries=0
        until host_exec "$i" true 2>/dev/null &&
            { [[ "$shared" == 1 ]] || [[ "$(host_exec "$i" hostname)" == "$(host_ns "$i")" ]]; }; do
            ((tries++ < 100)) || netns_die "host $i did not come up"
            sleep 0.05
        done
    done
    # Nothing leaves the machine: no host has a route beyond the bridge.
    for ((i = 0; i < k; i++)); do
        if host_exec "$i" ip route get 1.1.1.1 >/dev/null 2>&1; then
            netns_die "host $i has a route to 1.1.1.1; refusing to run"
        fi
    done
    # Every host reaches host 0 (a refused connection is an answer).
    for ((i = 1; i < k; i++)); do
        local answer tries=0
        until answer=$(host_exec "$i" bash -c "exec 3<>/dev/tcp/$(host_addr 0)/9" 2>&1) ||
            [[ "$answer" == *refused* ]]; do
            ((tries++ < 20)) || netns_die "host $i cannot reach host 0 at $(host_addr 0): $answer"
            sleep 0.1
        done
    done
    echo "netns-cluster: $k hosts ($(for ((i = 0; i < k; i++)); do printf '%s=%s ' "$(host_ns "$i")" "$(host_addr "$i")"; done)), rate $rate, $([[ "$shared" == 1 ]] && echo "sharing this machine's hostname and IPC namespace" || echo "each its own hostname and IPC namespace"), no route off the machine" >&2
}

# host_exec I COMMAND...: runs COMMAND in host I's namespaces.
host_exec() {
    local i=$1
    shift
    nsenter --target "${NETNS_HOLDERS[i]}" --net --uts --ipc --mount -- "$@"
}

# host_pids I: every process in host I's network namespace but its holder.
host_pids() {
    ip netns pids "$(host_ns "$1")" 2>/dev/null | grep -vx "${NETNS_HOLDERS[$1]}" || true
}

# host_signal I SIGNAL: sends SIGNAL to every process of host I at once
# (SIGSTOP first, so none of them reacts to another's death meanwhile).
host_signal() {
    local pids
    pids=$(host_pids "$1")
    [[ -z "$pids" ]] && return 0
    # shellcheck disable=SC2086
    kill -STOP $pids 2>/dev/null || true
    # shellcheck disable=SC2086
    kill "-$2" $pids 2>/dev/null || true
}

# host_link I up|down: sets host I's link (the bridge side of its veth) up
# or down; down cuts the host off the others (a partition).
host_link() { ip link set "${NETNS_PREFIX}v$1" "$2"; }

# cluster_down: kills every process of every host, then removes the
# namespaces (their veths go with them) and the bridge.
cluster_down() {
    local i ns
    for ((i = 0; i < NETNS_HOSTS; i++)); do
        ns=$(host_ns "$i")
        # shellcheck disable=SC2046
        kill -KILL $(ip netns pids "$ns" 2>/dev/null) 2>/dev/null || true
    done
    for ((i = 0; i < NETNS_HOSTS; i++)); do
        ns=$(host_ns "$i")
        local tries=0
        while [[ -n "$(ip netns pids "$ns" 2>/dev/null)" ]] && ((tries++ < 100)); do sleep 0.05; done
        # The veth now, not when the kernel frees the namespace (later, while
        # sockets of a cut-off host linger): a new cluster may reuse its name.
        ip link del "${NETNS_PREFIX}v$i" 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    ip link del "${NETNS_PREFIX}b" 2>/dev/null || true
    NETNS_HOSTS=0
}

# Seconds since $1 (an $EPOCHREALTIME), with a tenth.
netns_since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

netns_usage() {
    cat >&2 <<'EOF'
usage: ci/netns-cluster.sh run [--hosts K] [--rate RATE|none] [--shared-host] [--timeout S] -- COMMAND...
  --hosts K       2 to 4 hosts [2]
  --rate RATE     each host's link, both directions, as tc writes it (1gbit, 100mbit) or none [none]
  --shared-host   the hosts share this machine's hostname and IPC namespace [each its own]
  --timeout S     seconds the hosts' commands get before they are killed [600]
In COMMAND, {node_rank}, {nnodes}, {master_addr} and {addr} are replaced per host, e.g.
  ci/netns-cluster.sh run --hosts 2 --rate 1gbit -- target/debug/chorus launch --nproc-per-node 2 \
      --nnodes {nnodes} --node-rank {node_rank} --master-addr {master_addr} -- target/debug/chorus \
      conformance --backend ucx --world-size 4
EOF
    exit 2
}

netns_main() {
    [[ "${1:-}" == run ]] || netns_usage
    shift
    local hosts=2 rate=none shared=0 timeout=600
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --hosts) hosts=${2:?--hosts needs a value}; shift 2 ;;
            --rate) rate=${2:?--rate needs a value}; shift 2 ;;
            --shared-host) shared=1; shift ;;
            --timeout) timeout=${2:?--timeout needs a value}; shift 2 ;;
            --) shift; break ;;
            *) netns_usage ;;
        esac
    done
    [[ $# -gt 0 ]] || netns_usage
    [[ "$timeout" =~ ^[0-9]+$ && $timeout -gt 0 ]] || netns_die "--timeout $timeout: a whole number of seconds"
    trap cluster_down EXIT
    trap 'exit 130' INT TERM HUP
    cluster_up "$hosts" "$rate" "$shared"
    local i pids=() start
    start=$EPOCHREALTIME
    for ((i = 0; i < hosts; i++)); do
        local argv=() a
        for a in "$@"; do
            a=${a//\{node_rank\}/$i}
            a=${a//\{nnodes\}/$hosts}
            a=${a//\{master_addr\}/$(host_addr 0)}
            a=${a//\{addr\}/$(host_addr "$i")}
            argv+=("$a")
        done
        (
            host_exec "$i" timeout -s KILL "$timeout" "${argv[@]}" 2>&1 | sed -u "s/^/[h$i] /"
            exit "${PIPESTATUS[0]}"
        ) &
        pids+=($!)
    done
    local failed=0 rc
    for ((i = 0; i < hosts; i++)); do
        rc=0
        wait "${pids[i]}" || rc=$?
        printf 'netns-cluster: host %d exited %d after %s s\n' "$i" "$rc" "$(netns_since "$start")" >&2
        ((rc == 0)) || failed=1
    done
    return "$failed"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    set -euo pipefail
    netns_main "$@"
fi
