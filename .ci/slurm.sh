#!/usr/bin/env bash
# A real single-node SLURM cluster for CI, started by hand (no systemd here).
#
#   bash .ci/slurm.sh start   install Debian's slurm + munge if missing, write a
#                             slurm.conf, start munged, slurmctld and slurmd, wait
#                             for the node to be idle
#   bash .ci/slurm.sh stop    stop the three daemons by their PIDs, remove the link
#
# Everything (config, key, spool, logs, pid files) lives under $STAGEREPLAY_SLURM_DIR
# (default /tmp/stagereplay-slurm). The one thing outside it is a link
# /etc/slurm/slurm.conf -> that config: the executor's job step strips every SLURM_*
# variable (SLURM_CONF too) before its inner srun, which then finds its config only
# at the compiled-in default path. An existing /etc/slurm/slurm.conf is never touched.
set -euo pipefail

DIR="${STAGEREPLAY_SLURM_DIR:-/tmp/stagereplay-slurm}"
CONF="$DIR/slurm.conf"
SYSTEM_CONF=/etc/slurm/slurm.conf
DAEMONS=(slurmd slurmctld munged)  # stop order: node, controller, then authentication

log() { echo "slurm.sh: $*" >&2; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return
  fi
  if [ "$(id -u)" != 0 ]; then
    log "slurm is not installed and this is not root — run: apt-get install slurmctld slurmd slurm-client munge"
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine may have no package lists yet: update once, then retry.
  apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge >"$DIR/apt.log" 2>&1 \
    || { apt-get update >>"$DIR/apt.log" 2>&1 \
         && apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge >>"$DIR/apt.log" 2>&1; } \
    || { tail -n 5 "$DIR/apt.log" >&2; log "apt-get install of slurm failed (log: $DIR/apt.log) — check the Debian package source"; exit 1; }
}

write_config() {
  local cpus memory
  cpus=$(nproc)
  # Half the machine's memory: slurmd drains a node that reports less than RealMemory.
  memory=$(awk '/^MemTotal/ {print int($2 / 1024 / 2)}' /proc/meminfo)
  rm -rf "$DIR/spool" "$DIR/log"  # a fresh cluster: no jobs left over from an earlier run
  mkdir -p "$DIR/spool/ctld" "$DIR/spool/d" "$DIR/log" "$DIR/run"
  cat >"$CONF" <<EOF
# Single-node test cluster written by .ci/slurm.sh (not for production use).
ClusterName=stagereplay-ci
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/run/munge.socket
SlurmctldPort=${STAGEREPLAY_SLURMCTLD_PORT:-16817}
SlurmdPort=${STAGEREPLAY_SLURMD_PORT:-16818}
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
# No cgroups in a container: track processes by parent id, no task affinity.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
# CPUs and memory are consumable, so jobs share the node as their resources allow;
# without DefMemPerCPU a job that names no memory takes the whole node.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=500
# Finished jobs stay visible to squeue for an hour: the executor polls squeue
# (there is no slurmdbd for sacct), and a job forgotten too early would look lost.
MinJobAge=3600
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=ci Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

# The PID from our pid file, only while it still names that daemon (a stale file's PID may be reused).
pid_of() {
  local pid
  [ -s "$DIR/run/$1.pid" ] || return 1
  pid=$(cat "$DIR/run/$1.pid")
  [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = "$1" ] || return 1
  echo "$pid"
}

start() {
  mkdir -p "$DIR"
  if pid=$(pid_of slurmctld); then
    log "already running (slurmctld pid $pid); to restart run: bash .ci/slurm.sh stop"
    return
  fi
  install_packages
  write_config
  if [ -e "$SYSTEM_CONF" ] || [ -L "$SYSTEM_CONF" ]; then
    if [ "$(readlink "$SYSTEM_CONF" || true)" != "$CONF" ]; then
      log "$SYSTEM_CONF exists and is not ours: this machine has its own SLURM — run the tests against it, not this test cluster"
      exit 1
    fi
  else
    mkdir -p "$(dirname "$SYSTEM_CONF")"
    ln -s "$CONF" "$SYSTEM_CONF"
  fi
  if [ ! -s "$DIR/munge.key" ]; then
    dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none
  fi
  chmod 0400 "$DIR/munge.key"
  mkdir -p "$DIR/munge" && chmod 0700 "$DIR/munge"
  # --force: munged refuses to run as root or with a key outside /etc/munge otherwise.
  munged --force --socket="$DIR/run/munge.socket" --key-file="$DIR/munge.key" \
    --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed"
  slurmctld -f "$CONF"
  slurmd -f "$CONF" -N localhost
  local waited=0
  until sinfo --noheader --states=idle --format=%n 2>/dev/null | grep -qx localhost; do
    if [ "$waited" -ge 60 ]; then
      log "the node did not become idle within 60 s — see $DIR/log/slurmctld.log and slurmd.log"
      sinfo -N -l >&2 || true
      tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
      stop
      exit 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
  log "single-node cluster up after ${waited}s ($(sinfo --noheader --format='%c CPUs, %m MB' | head -n 1))"
}

stop() {
  local daemon pid
  for daemon in "${DAEMONS[@]}"; do
    if pid=$(pid_of "$daemon"); then
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$DIR/run/$daemon.pid"
  done
  if [ "$(readlink "$SYSTEM_CONF" 2>/dev/null || true)" = "$CONF" ]; then
    rm -f "$SYSTEM_CONF"
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) log "usage: bash .ci/slurm.sh start|stop"; exit 2 ;;
esac
