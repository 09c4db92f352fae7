#!/usr/bin/env bash
# Run a command against a real Slurm cluster of N nodes on this machine: munged and slurmctld in a private
# network, UTS and mount namespace (host ctl, 10.231.0.1 on a private bridge), and one slurmd per
# node in a network and UTS namespace of its own (host nI, 10.231.0.(10+I), a veth on that bridge).
# Only addresses inside these namespaces are used; /etc/hosts is replaced by the cluster's own list in the
# private mount namespace only. Nothing outlives the command: every process in a node's namespace (slurmd,
# slurmstepd, job tasks) is killed, slurmctld and munged are ended by their pids, and the
# namespaces (with the bridge and veths) vanish with their last process.
#   usage: bash tests/slurm/with-cluster.sh [--nodes N] WORKDIR COMMAND [ARGS...]
# The command runs on the controller's host (sbatch, srun, scontrol work there); SLURM_CONF is exported.
# Needs root, unshare, ip (iproute2) and Debian's slurm-wlm (slurmctld, slurmd, slurm-client) and munge.
set -euo pipefail
nodes=1
if [ "${1:-}" = --nodes ]; then nodes=$2; shift 2; fi
work=$(realpath -m "$1"); shift
net=10.231.0

if [ -n "${FASTIO_SLURM_NODE:-}" ]; then
  # One node, started by the controller below with `unshare --net --uts` (this process keeps its pid: the
  # controller moves a veth named eth0 into our namespace, then creates the go file).
  i=$FASTIO_SLURM_NODE
  touch "$work/nodes/n$i.inside"
  for _ in $(seq 200); do [ -e "$work/nodes/n$i.go" ] && break; sleep 0.05; done
  hostname "n$i"
  ip link set lo up
  ip addr add "$net.$((10 + i))/24" dev eth0
  ip link set eth0 up
  exec slurmd -D -N "n$i" -f "$work/slurm.conf"
fi

if [ -z "${FASTIO_SLURM_NETNS:-}" ]; then
  exec unshare --net --uts --mount --fork env FASTIO_SLURM_NETNS=1 bash "$0" --nodes "$nodes" "$work" "$@"
fi

hostname ctl
ip link set lo up
ip link add fastio-br type bridge
ip addr add "$net.1/24" dev fastio-br
ip link set fastio-br up
mkdir -p "$work"/{state,munge,log,nodes}
chmod 700 "$work/munge"
head -c 1024 /dev/urandom > "$work/munge/munge.key"
chmod 600 "$work/munge/munge.key"
{
  echo "127.0.0.1 localhost"
  echo "$net.1 ctl"
  for i in $(seq "$nodes"); do echo "$net.$((10 + i)) n$i"; done
} > "$work/hosts"
mount --bind "$work/hosts" /etc/hosts   # this mount namespace only
# Per node (`nproc` alone would follow OMP_NUM_THREADS); at least 2, so that a node runs 2 tasks.
cpus=${FASTIO_SLURM_CPUS:-$(nproc --all)}
[ "$cpus" -ge 2 ] || cpus=2
cat > "$work/slurm.conf" <<CONF
ClusterName=fastio-test
SlurmctldHost=ctl($net.1)
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$work/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/%n
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd-%n.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
GresTypes=gpu
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
for i in $(seq "$nodes"); do
  echo "NodeName=n$i NodeAddr=$net.$((10 + i)) CPUs=$cpus State=UNKNOWN" >> "$work/slurm.conf"
done
export SLURM_CONF="$work/slurm.conf"

node_pids=()
node_nets=()
in_net() {  # the pids of every process in network namespace $1 (a node's: all of them are ours)
  local p
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/ns/net" 2>/dev/null)" = "$1" ] && echo "${p#/proc/}"
  done
  return 0
}
stop() {
  # Jobs first: slurmstepd and the tasks it started leave slurmd's process tree, but not the node's namespace.
  local pids=() net
  for net in "${node_nets[@]}"; do [ -z "$net" ] || pids+=($(in_net "$net")); done
  [ ${#pids[@]} -eq 0 ] || kill -9 "${pids[@]}" 2>/dev/null || true
  pids=()
  for pidfile in "$work/slurmctld.pid" "$work/munge/munged.pid"; do
    [ -s "$pidfile" ] && pids+=("$(cat "$pidfile")")
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  kill "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 50); do
    alive=0
    for pid in "${pids[@]}"; do
      state=$(ps -o stat= -p "$pid" 2>/dev/null | cut -c1 || true)
      [ -z "$state" ] || [ "$state" = Z ] || alive=1
    done
    [ $alive = 0 ] && return 0
    sleep 0.1
  done
  kill -9 "${pids[@]}" 2>/dev/null || true
}
trap stop EXIT

munged --socket="$work/munge/munge.socket" --key-file="$work/munge/munge.key" \
  --log-file="$work/log/munged.log" --pid-file="$work/munge/munged.pid" --seed-file="$work/munge/seed" -f
slurmctld -f "$SLURM_CONF"
for i in $(seq "$nodes"); do
  rm -f "$work/nodes/n$i".{inside,go}
  mkdir -p "$work/n$i"
  FASTIO_SLURM_NODE=$i unshare --net --uts bash "$0" --nodes "$nodes" "$work" \
    > "$work/log/node-n$i.out" 2>&1 &
  pid=$!
  node_pids+=("$pid")
  disown "$pid"
  for _ in $(seq 200); do [ -e "$work/nodes/n$i.inside" ] && break; sleep 0.05; done
  node_net=$(readlink "/proc/$pid/ns/net")
  [ "$node_net" != "$(readlink /proc/$$/ns/net)" ] || { echo "node n$i has no network namespace" >&2; exit 1; }
  node_nets+=("$node_net")
  ip link add "fastio-v$i" type veth peer name eth0 netns "$pid"
  ip link set "fastio-v$i" master fastio-br up
  touch "$work/nodes/n$i.go"
done
for _ in $(seq 120); do
  [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cx idle)" = "$nodes" ] && break
  sleep 0.5
done
[ "$(sinfo -h -N -o %T | grep -cx idle)" = "$nodes" ] || {
  echo "slurm did not come up with $nodes idle nodes" >&2; sinfo -N >&2 || true; tail -n 20 "$work"/log/* >&2; exit 1; }
"$@"
