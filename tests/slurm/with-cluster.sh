#!/usr/bin/env bash
# Run a command against a real one-node Slurm cluster (munged, slurmctld, slurmd) that lives in a
# private network namespace, so its daemons can only be reached over that namespace's loopback.
#   usage: bash tests/slurm/with-cluster.sh WORKDIR COMMAND [ARGS...]
# Needs root and Debian's slurm-wlm (slurmctld, slurmd, slurm-client) and munge. Daemons are ended by
# the pids they wrote, when the command ends.
set -euo pipefail
work=$(realpath -m "$1"); shift
if [ -z "${FASTIO_SLURM_NETNS:-}" ]; then
  exec unshare --net --fork env FASTIO_SLURM_NETNS=1 bash "$0" "$work" "$@"
fi
ip link set lo up
# glibc's AI_ADDRCONFIG, which Slurm uses, needs an IPv4 address other than 127.0.0.1.
ip addr add 127.0.0.2/8 dev lo
host=$(hostname)
mkdir -p "$work"/{state,spool,munge,log}
chmod 700 "$work/munge"
head -c 1024 /dev/urandom > "$work/munge/munge.key"
chmod 600 "$work/munge/munge.key"
cat > "$work/slurm.conf" <<CONF
ClusterName=fastio-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$work/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
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
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$work/slurm.conf"

stop() {
  local pids=()
  for pidfile in "$work/slurmd.pid" "$work/slurmctld.pid" "$work/munge/munged.pid"; do
    [ -s "$pidfile" ] && pids+=("$(cat "$pidfile")")
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  kill "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 50); do
    alive=0
    for pid in "${pids[@]}"; do
      [ "$(ps -o stat= -p "$pid" 2>/dev/null | cut -c1)" = "" ] || [ "$(ps -o stat= -p "$pid" | cut -c1)" = Z ] || alive=1
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
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
  sinfo -h -o %T 2>/dev/null | grep -qx idle && break
  sleep 0.5
done
sinfo -h -o %T | grep -qx idle || { echo "slurm did not come up" >&2; tail -n 20 "$work"/log/*.log >&2; exit 1; }
"$@"
