#!/usr/bin/env bash
# A throw-away single-node Slurm on this machine, to test sweeps against a real scheduler (`make test-slurm`).
#
#   scripts/local_slurm.sh start    # installs Debian's slurm-wlm and munge if missing (needs root), starts
#                                   # slurmctld and slurmd (and munged if none runs): partition "cpu", no GPUs
#   eval "$(scripts/local_slurm.sh env)"   # point sbatch, squeue, ... of this shell at it
#   scripts/local_slurm.sh status
#   scripts/local_slurm.sh stop     # stops the daemons this script started (by their recorded process ids)
#
# Everything it writes (slurm.conf, state, spool, logs, pid files) is in $KVBENCH_SLURM_DIR (default
# /tmp/kvbench-slurm); clients find the cluster through SLURM_CONF, so /etc/slurm and a cluster this machine
# already runs are left alone (other ports). There is no accounting database: `sacct` fails, and kvbench's Slurm
# launcher follows its jobs with `squeue` instead. Jobs must ask for no GPU, e.g.
#   kvbench run -m ... hydra/launcher=slurm hydra.launcher.partition=cpu hydra.launcher.gpus_per_node=0 \
#       hydra.launcher.cpus_per_task=1 hydra.launcher.mem_gb=4
set -euo pipefail

DIR=${KVBENCH_SLURM_DIR:-/tmp/kvbench-slurm}
CONF=$DIR/slurm.conf
PORT=${KVBENCH_SLURM_PORT:-6917}   # slurmctld; slurmd listens on PORT+1
export SLURM_CONF=$CONF

install_packages() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  [ "$(id -u)" = 0 ] || { echo "local_slurm: slurm-wlm and munge are not installed; run as root to install them" >&2; exit 1; }
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

start_munge() {
  pgrep -x munged >/dev/null && return   # one munged serves every Slurm on the machine
  mkdir -p /run/munge /var/log/munge
  [ -s /etc/munge/munge.key ] || mungekey --create --force >/dev/null 2>&1 || /usr/sbin/create-munge-key -f >/dev/null
  chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge
  chmod 400 /etc/munge/munge.key
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged   # daemonizes, then writes its pid file
  for _ in $(seq 20); do
    [ -s /run/munge/munged.pid ] && { cp /run/munge/munged.pid "$DIR/munged.pid"; return; }
    sleep 0.5
  done
  echo "local_slurm: munged did not start; see /var/log/munge/munged.log" >&2
  exit 1
}

write_conf() {
  local user host cpus mem
  user=$(id -un); host=$(hostname -s); cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 ))   # MB, leaving 2 GB to the system
  cat > "$CONF" <<EOF
# written by kvbench scripts/local_slurm.sh
ClusterName=kvbench
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MaxArraySize=10001
KillWait=10
InactiveLimit=0
MinJobAge=300
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=cpu Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

running() {
  [ -s "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null
}

start() {
  if running slurmctld; then echo "local_slurm: already running ($CONF)"; sinfo; return; fi
  install_packages
  mkdir -p "$DIR/state" "$DIR/spool"
  start_munge
  write_conf
  /usr/sbin/slurmctld -f "$CONF"     # daemonizes and writes its pid file
  /usr/sbin/slurmd -f "$CONF"
  for _ in $(seq 60); do
    sinfo -h -o %T 2>/dev/null | grep -q idle && { sinfo; return; }
    sleep 1
  done
  echo "local_slurm: the node did not become idle; see $DIR/slurmctld.log and $DIR/slurmd.log" >&2
  exit 1
}

stop() {
  local daemon
  for daemon in slurmd slurmctld munged; do
    if running "$daemon"; then kill "$(cat "$DIR/$daemon.pid")"; fi
    rm -f "$DIR/$daemon.pid"
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) if running slurmctld; then sinfo; else echo "local_slurm: not running"; exit 1; fi ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
