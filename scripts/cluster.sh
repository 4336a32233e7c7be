#!/usr/bin/env bash
# A cluster on one machine: N "hosts" as network namespaces, each with its own address, joined by veth
# pairs to one bridge, so that MPI ranks in different hosts talk TCP over real (virtual) links while the
# ranks of one host share memory. Root and iproute2 only (install-deps.sh installs iproute2).
#
#   scripts/cluster.sh up N [--rate RATE] [--burst BYTES]   make hosts PREFIX0..PREFIX(N-1)
#   scripts/cluster.sh down [N]                              remove every host of the prefix, its veths and the
#                                                            bridge (idempotent; N, if given, is only checked)
#   scripts/cluster.sh hostfile [--slots S]                  print an mpirun hostfile naming the hosts
#   scripts/cluster.sh mpirun ARGS...                        mpirun across the hosts (hostfile, agent, MCA settings);
#                                                            its hostfile, one slot per host, is /run/moex-cluster/PREFIX.hosts
#   scripts/cluster.sh status                                list the hosts with their addresses and shaping
# Options (before mpirun's own arguments they come from the environment only):
#   --prefix P   (MOEX_CLUSTER_PREFIX, default moex-h)      hosts P0, P1, ...; bridge Pbr; root-side veths P0b, ...
#   --subnet S   (MOEX_CLUSTER_SUBNET, default 10.213.41)   first three octets of a private /24: host i has S.(i+1),
#                                                            the bridge S.254, the login namespace (below) S.253
# mpirun runs in a namespace of its own, PREFIXl (the login node), whose TCP gives up on an unacknowledged
# segment after ~6 s (net.ipv4.tcp_retries2 = 4; the machine's default, 15, takes ~15 minutes): when a host's
# link goes down while mpirun is ending the job, its kill order to that host's orted is never acknowledged,
# and only this ends the job (docs/comm.md, "Failures across hosts").
# Shaping (--rate 10gbit, 1gbit, 500mbit, ...): a tbf qdisc on both ends of each host's veth, so the rate holds
# in both directions of every link; --burst sets the bucket (default: what the rate moves in 4 ms, at least
# 64 KB). Only rate and burst can be shaped: delay, jitter and loss need netem, which these kernels lack.
# Traffic stays on the bridge: it has no uplink and the hosts have no route beyond the subnet.
set -Eeuo pipefail  # -E: up's clean-up trap also fires for errors inside functions

die() { echo "cluster.sh: $*" >&2; exit 2; }
usage() { sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }

prefix=${MOEX_CLUSTER_PREFIX:-moex-h}
subnet=${MOEX_CLUSTER_SUBNET:-10.213.41}
here="$(cd "$(dirname "$0")" && pwd)"

[ $# -ge 1 ] || { usage >&2; exit 2; }
case "$1" in -h|--help) usage; exit 0 ;; esac
cmd=$1
shift
n="" rate="" burst="" slots=1
args=()
while [ $# -gt 0 ]; do
  case "$cmd:$1" in
    mpirun:*) args+=("$1") ;;  # everything after `mpirun` is mpirun's (its own --prefix included)
    *:--prefix) prefix=${2:?--prefix needs a value}; shift ;;
    *:--subnet) subnet=${2:?--subnet needs a value}; shift ;;
    up:--rate) rate=${2:?--rate needs a value}; shift ;;
    up:--burst) burst=${2:?--burst needs a value}; shift ;;
    hostfile:--slots) slots=${2:?--slots needs a value}; shift ;;
    *:-h|*:--help) usage; exit 0 ;;
    up:*|down:*) [ -z "$n" ] || die "$cmd takes one N, got '$n' and '$1'"; n=$1 ;;
    *) die "unknown argument '$1' for '$cmd' (see --help)" ;;
  esac
  shift
done

# Interface names are at most 15 characters: the longest is PREFIX<index>b.
[[ "$prefix" =~ ^[a-z][a-z0-9-]{0,9}$ ]] || die "--prefix '$prefix': 1-10 characters of a-z, 0-9 and '-', starting with a letter"
[[ "$subnet" =~ ^(10\.[0-9]{1,3}\.[0-9]{1,3}|192\.168\.[0-9]{1,3})$ ]] ||
  die "--subnet '$subnet': the first three octets of a private /24 (10.x.y or 192.168.y)"
for octet in ${subnet//./ }; do
  [ "$octet" -le 255 ] || die "--subnet '$subnet': $octet is not an octet"
done
bridge=${prefix}br
login=${prefix}l
# TCP retransmissions before mpirun's connection to an orted fails: RTO 0.2 s doubling, 4 retries ~6 s.
login_tcp_retries2=4
# Written by up, removed by down: the hostfile of `cluster.sh mpirun` lives as long as the hosts do.
state_dir=/run/moex-cluster
hosts_file=$state_dir/$prefix.hosts
# `ip netns add` bind-mounts /run/netns onto itself, and the mount outlives the namespaces. When up made it (it
# did not exist), down unmounts it again once no namespace at all is left; one that was there stays.
netns_marker=$state_dir/made-run-netns

need_root() {
  [ "$(id -u)" -eq 0 ] || die "$cmd needs root (network namespaces, veth pairs and a bridge)"
  command -v ip >/dev/null || die "ip not found: install iproute2 (scripts/install-deps.sh)"
}

# Hosts of this prefix that exist now, in index order.
hosts() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}[0-9]+\$" | sort -V || true
}

down() {
  local h pids
  for h in $(hosts) $(ip netns list 2>/dev/null | awk '{print $1}' | grep -xF -- "$login" || true); do
    # Processes still inside (an orted or rank of a killed job) would keep the namespace's links alive.
    pids=$(ip netns pids "$h" 2>/dev/null || true)
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
    ip netns delete "$h" 2>/dev/null || true
  done
  # Deleting a namespace deletes its end of each veth pair and with it the root-side end; a root-side end
  # whose namespace went away some other way is removed here.
  for h in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^${prefix}([0-9]+|l)b\$" || true); do
    ip link delete "$h" 2>/dev/null || true
  done
  ! ip link show "$bridge" >/dev/null 2>&1 || ip link delete "$bridge" type bridge
  rm -f "$hosts_file"
  if [ -e "$netns_marker" ] && [ -z "$(ip netns list 2>/dev/null)" ]; then
    ! mountpoint -q /run/netns || umount /run/netns
    rmdir /run/netns 2>/dev/null || true
    rm -f "$netns_marker"
  fi
  rmdir "$state_dir" 2>/dev/null || true
}

# Bytes a tbf bucket needs for RATE: what the rate moves in 4 ms (one tick at HZ=250), at least 64 KB.
default_burst() {
  local value unit bits
  [[ "$1" =~ ^([0-9]+)(bit|kbit|mbit|gbit)$ ]] || die "--rate '$1': a whole number with bit, kbit, mbit or gbit (e.g. 10gbit)"
  value=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
  case $unit in bit) bits=$value ;; kbit) bits=$((value * 1000)) ;; mbit) bits=$((value * 1000000)) ;;
                gbit) bits=$((value * 1000000000)) ;; esac
  [ "$bits" -gt 0 ] || die "--rate '$1' must be more than 0"
  local bytes=$((bits / 8 / 250))
  echo $((bytes > 65536 ? bytes : 65536))
}

shape() {  # DEV [NETNS]: tbf at RATE on DEV's egress
  local dev=$1 ns=${2:-}
  ip ${ns:+-n "$ns"} link set "$dev" txqueuelen 1000
  tc ${ns:+-n "$ns"} qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency 100ms
}

join_bridge() {  # NETNS ADDR: a new namespace whose eth0 (ADDR/24) is a veth pair's end on the bridge
  ip netns add "$1"
  ip link add "${1}b" type veth peer name eth0 netns "$1"
  ip link set "${1}b" master "$bridge"
  ip link set "${1}b" up
  ip -n "$1" link set lo up
  ip -n "$1" addr add "$2/24" dev eth0
  ip -n "$1" link set eth0 up
}

check_n() {
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "$cmd needs N, the number of hosts (1-200), got '${n:-nothing}'"
}

up() {
  check_n
  [ -z "$rate" ] || burst=${burst:-$(default_burst "$rate")}
  [ -z "$burst" ] || [[ "$burst" =~ ^[0-9]+$ ]] || die "--burst '$burst': a number of bytes"
  [ -z "$burst" ] || [ -n "$rate" ] || die "--burst needs --rate"
  [ -z "$(hosts)" ] && ! ip link show "$bridge" >/dev/null 2>&1 && ! ip netns list | awk '{print $1}' | grep -qxF -- "$login" ||
    die "hosts of prefix $prefix exist already: '$0 down' first (or another --prefix)"
  if ip -o addr show 2>/dev/null | grep -q " inet ${subnet//./\\.}\."; then
    die "subnet $subnet.0/24 is in use on this machine: choose another --subnet"
  fi
  mkdir -p "$state_dir"
  [ -e /run/netns ] || : > "$netns_marker"
  # A half-made cluster is removed again: up either makes all N hosts or nothing.
  trap 'echo "cluster.sh: up failed; removing what it made" >&2; down' ERR
  ip link add "$bridge" type bridge
  ip addr add "$subnet.254/24" dev "$bridge"
  ip link set "$bridge" up
  local i h
  for ((i = 0; i < n; i++)); do
    h=$prefix$i
    join_bridge "$h" "$subnet.$((i + 1))"
    if [ -n "$rate" ]; then
      shape eth0 "$h"  # host -> bridge
      shape "${h}b"    # bridge -> host
    fi
  done
  # The login namespace: mpirun's, on the bridge like the hosts, unshaped (control traffic only).
  join_bridge "$login" "$subnet.253"
  # /proc/sys/net is the namespace's own inside it (no sysctl binary needed: procps is not a dependency).
  ip netns exec "$login" sh -c "echo $login_tcp_retries2 > /proc/sys/net/ipv4/tcp_retries2"
  hostfile > "$hosts_file"
  trap - ERR
  echo "cluster.sh: $n host(s) ${prefix}0..$prefix$((n - 1)) on $subnet.0/24 (bridge $bridge, $subnet.254)${rate:+, links shaped to $rate (burst $burst bytes)}"
}

hostfile() {
  [[ "$slots" =~ ^[1-9][0-9]*$ ]] || die "--slots '$slots': a positive number of ranks per host"
  local list
  list=$(hosts)
  [ -n "$list" ] || die "no hosts of prefix $prefix: run '$0 up N' first"
  local h
  for h in $list; do echo "$h slots=$slots"; done
}

case "$cmd" in
  up) need_root; up ;;
  down) need_root; [ -z "$n" ] || check_n; down ;;
  hostfile) hostfile ;;
  status)
    for h in $(hosts); do
      echo "$h $(ip -n "$h" -4 -o addr show dev eth0 | awk '{print $4}') $(tc -n "$h" qdisc show dev eth0 | head -1)"
    done ;;
  mpirun)
    need_root
    [ -f "$hosts_file" ] || die "no hosts of prefix $prefix: run '$0 up N' first"
    ip netns list | awk '{print $1}' | grep -qxF -- "$login" || die "no login namespace $login: '$0 down', then up again"
    # The settings and why: docs/comm.md, "Running across hosts". mpirun runs in the login namespace.
    exec ip netns exec "$login" mpirun --allow-run-as-root --oversubscribe --hostfile "$hosts_file" \
      --mca plm_rsh_agent "$here/cluster-agent.sh" --mca routed direct \
      --mca btl tcp,self,vader --mca btl_tcp_if_include "$subnet.0/24" --mca oob_tcp_if_include "$subnet.0/24" \
      --mca oob_tcp_keepalive_time 4 --mca oob_tcp_keepalive_intvl 2 --mca oob_tcp_keepalive_probes 3 \
      "${args[@]}" ;;
  *) die "unknown command '$cmd' (up, down, hostfile, mpirun, status)" ;;
esac
