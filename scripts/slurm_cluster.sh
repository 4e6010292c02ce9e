#!/usr/bin/env bash
# slurm_cluster.sh - a real single-node SLURM cluster on this machine, for CI and for trying
# shardgen's SLURM launcher locally (Debian 12 / SLURM 22.05; no systemd, no cgroups; run as root).
#
#   bash scripts/slurm_cluster.sh start    # install missing packages, configure, start, smoke-test
#   source <(bash scripts/slurm_cluster.sh env)   # export SLURM_CONF for sbatch/srun/sacct/submitit
#   bash scripts/slurm_cluster.sh status   # daemons, node and queue
#   bash scripts/slurm_cluster.sh stop     # cancel jobs, stop every daemon (by pid file)
#
# `start` is idempotent: a second call only checks that everything is up (a few seconds), and
# restarts slurmctld/slurmd only when the generated configuration changed.
# The cluster has munged, MariaDB + slurmdbd (accounting: submitit polls job states with
# `sacct`; without it every state reads UNKNOWN), slurmctld and slurmd, all on loopback.
# Everything (config, state, logs, database, pid files) lives under $SLURM_BASE.
#
# Environment:
#   SLURM_BASE=/tmp/shardgen-slurm  where everything lives
#   SLURM_CPUS=<4 x nproc>          CPUs the node advertises (see "CPU oversubscription" below);
#                                   SLURM_CPUS=$(nproc) gives an honest node
#   SLURM_FAKE_GPUS=0               N>0: the node advertises gres gpu:fake:N, backed by character
#                                   devices made with `mknod c 1 3`, so `--gpus`/`--gres` jobs are
#                                   scheduled and see CUDA_VISIBLE_DEVICES (there is no real GPU)
#   SLURM_DB_PORT=3306              TCP port of the private MariaDB (127.0.0.1 only)
set -euo pipefail

BASE=${SLURM_BASE:-/tmp/shardgen-slurm}
CLUSTER=shardgen
HOST=$(hostname -s)
NPROC=$(nproc)
# CPU oversubscription: shardgen's SLURM tests are CPU-light (tiny models), but want e.g. a 2-task
# job and a 2-job array running at the same time. With SlurmdParameters=config_overrides slurmd
# registers the node with the CPUs written here instead of the ones it detects, so the node can
# advertise more CPUs than the machine has (without it the node is drained as "Low CPUs").
# SelectTypeParameters=CR_CPU then hands out up to $CPUS one-CPU tasks at once.
CPUS=${SLURM_CPUS:-$(( NPROC * 4 ))}
FAKE_GPUS=${SLURM_FAKE_GPUS:-0}
DB_PORT=${SLURM_DB_PORT:-3306}
MEM_MB=$(awk '/^MemTotal/ {m = int($2 / 1024) - 1024; print (m < 1024 ? 1024 : m)}' /proc/meminfo)

SLURM_CONF=$BASE/etc/slurm.conf
export SLURM_CONF
MUNGE_SOCK=$BASE/munge-run/munge.socket.2
MYSQL_SOCK=$BASE/mysql-run/mysqld.sock
PKGS="slurm-wlm munge slurmdbd mariadb-server"

# pid files, in stop order (munged's and mariadbd's are written by their own users)
PID_SLURMD=$BASE/run/slurmd.pid
PID_SLURMCTLD=$BASE/run/slurmctld.pid
PID_SLURMDBD=$BASE/run/slurmdbd.pid
PID_MARIADBD=$BASE/mysql-run/mariadbd.pid
PID_MUNGED=$BASE/munge-run/munged.pid

T0=$EPOCHREALTIME
log() { printf '[slurm_cluster +%ss] %s\n' "$(awk "BEGIN {printf \"%.1f\", $EPOCHREALTIME - $T0}")" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# running PID: true while one of PID's threads is alive. A process that has exited stays a zombie
# (kill -0 still succeeds) until its parent reaps it, and this machine's init reaps slowly (~2 s).
# Threads are checked one by one because an exited main thread also reads Z while others run.
running() {
  local t s
  for t in /proc/"$1"/task/*/stat; do
    s=$(cat "$t" 2>/dev/null) || continue
    s=${s##*) }; [ "${s%% *}" != Z ] && return 0
  done
  return 1
}
alive() { [ -s "$1" ] && running "$(cat "$1")"; }
# wait_for DESC TIMEOUT_S CMD...: retry CMD until it succeeds
wait_for() {
  local desc=$1 t=$2 end=$((SECONDS + $2)); shift 2
  while [ $SECONDS -lt $end ]; do
    if timeout 15 "$@" >/dev/null 2>&1; then log "$desc: ok"; return 0; fi
    sleep 0.2
  done
  log "$desc: timed out after ${t}s"; return 1
}
# start_failed NAME LOGFILE: show the end of the daemon's log and exit
start_failed() { log "$1 failed; last lines of $2:"; tail -n 20 "$2" >&2 2>/dev/null || true; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "must run as root (installs packages, runs daemons as munge/mysql)"; }

# ------------------------------------------------------------------------------------------------
install_packages() {
  local p missing="" made_policy=0
  for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"
  done
  [ -z "$missing" ] && return 0
  log "installing:$missing"
  # keep the packages' maintainer scripts from starting their services (there is no systemd;
  # the daemons are started below, with this script's configuration)
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; made_policy=1
  fi
  local rc=0
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends $missing >"$BASE/log/apt-install.log" 2>&1; } || rc=$?
  [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ "$rc" = 0 ] || { tail -n 20 "$BASE/log/apt-install.log" >&2; die "apt-get install failed"; }
  log "installed"
}

write_if_changed() { # write_if_changed FILE MODE (content on stdin); returns 0 if FILE changed
  local f=$1 mode=$2
  cat > "$f.new"; chmod "$mode" "$f.new"
  if cmp -s "$f.new" "$f"; then rm -f "$f.new"; return 1; fi
  mv "$f.new" "$f"; return 0
}

slurm_conf() {
  local gres=""
  [ "$FAKE_GPUS" -gt 0 ] && gres=" Gres=gpu:fake:$FAKE_GPUS"
  cat <<EOF
# Generated by shardgen scripts/slurm_cluster.sh - edits are overwritten on the next start.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
# cred_expire (minimum 5, default 120 s) also delays the restart of a requeued job
AuthInfo=socket=$MUNGE_SOCK,cred_expire=5
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool
SlurmctldPidFile=$PID_SLURMCTLD
SlurmdPidFile=$PID_SLURMD
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no systemd and no cgroups here
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# accounting (sacct) through slurmdbd; slurmdbd connections take the munge socket from
# AccountingStoragePass, not from AuthInfo
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$HOST
AccountingStoragePort=6819
AccountingStoragePass=$MUNGE_SOCK
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
# the defaults (bf_interval=30, sched_interval=60) make a requeued job wait up to a minute or two
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# the node advertises CPUs=$CPUS on a $NPROC-core machine: config_overrides makes slurmd
# register the configured CPUs instead of the detected ones (see the top of this script)
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=60
GresTypes=gpu
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB$gres State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

slurmdbd_conf() {
  cat <<EOF
# Generated by shardgen scripts/slurm_cluster.sh - edits are overwritten on the next start.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
PidFile=$PID_SLURMDBD
LogFile=$BASE/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
EOF
}

# stop_pid NAME PIDFILE [TIMEOUT_S]: SIGTERM, wait, then SIGKILL
stop_pid() {
  local name=$1 pf=$2 t=${3:-20} pid end
  alive "$pf" || { rm -f "$pf"; return 0; }
  pid=$(cat "$pf"); kill "$pid" 2>/dev/null || true
  end=$((SECONDS + t))
  while running "$pid" && [ $SECONDS -lt $end ]; do sleep 0.1; done
  if running "$pid"; then
    log "$name ($pid) did not stop in ${t}s: SIGKILL"; kill -9 "$pid" 2>/dev/null || true
    while running "$pid"; do sleep 0.1; done
  fi
  rm -f "$pf"; log "stopped $name ($pid)"
}

# ------------------------------------------------------------------------------------------------
cmd_start() {
  need_root
  [[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || die "SLURM_CPUS must be a positive integer (got '$CPUS')"
  [[ "$FAKE_GPUS" =~ ^[0-9]+$ ]] || die "SLURM_FAKE_GPUS must be a non-negative integer (got '$FAKE_GPUS')"
  mkdir -p "$BASE"/{etc,state,spool,log,run,munge,munge-run,mysql,mysql-run}
  install_packages

  # slurmctld/slurmd resolve the node name, and submitit's MASTER_ADDR is the host name
  if ! getent hosts "$HOST" >/dev/null; then echo "127.0.0.1 $HOST" >> /etc/hosts; log "added $HOST to /etc/hosts"; fi

  # ---- configuration (slurmctld/slurmd are restarted below only if it changed) ----
  local changed=0 dbd_changed=0 i
  if [ "$FAKE_GPUS" -gt 0 ]; then
    mkdir -p "$BASE/fakegpu"
    # slurmd ignores gres File= entries that are not character/block devices
    for ((i = 0; i < FAKE_GPUS; i++)); do [ -c "$BASE/fakegpu/gpu$i" ] || mknod "$BASE/fakegpu/gpu$i" c 1 3; done
    echo "NodeName=$HOST Name=gpu Type=fake File=$BASE/fakegpu/gpu[0-$((FAKE_GPUS - 1))]" \
      | write_if_changed "$BASE/etc/gres.conf" 644 && changed=1
  elif [ -e "$BASE/etc/gres.conf" ]; then
    rm -f "$BASE/etc/gres.conf"; changed=1
  fi
  slurm_conf | write_if_changed "$SLURM_CONF" 644 && changed=1
  # slurmdbd refuses a slurmdbd.conf that others can read
  slurmdbd_conf | write_if_changed "$BASE/etc/slurmdbd.conf" 600 && dbd_changed=1
  echo "export SLURM_CONF=$SLURM_CONF" > "$BASE/env.sh"
  if [ "$changed" = 1 ]; then
    log "configuration written ($SLURM_CONF: CPUs=$CPUS, fake GPUs=$FAKE_GPUS)"
    stop_pid slurmd "$PID_SLURMD"; stop_pid slurmctld "$PID_SLURMCTLD"
  fi
  [ "$dbd_changed" = 1 ] && stop_pid slurmdbd "$PID_SLURMDBD"

  # ---- munged ----
  chown munge:munge "$BASE/munge" "$BASE/munge-run"; chmod 700 "$BASE/munge"; chmod 755 "$BASE/munge-run"
  [ -s "$BASE/munge/munge.key" ] || runuser -u munge -- mungekey --create --keyfile="$BASE/munge/munge.key"
  if ! alive "$PID_MUNGED"; then
    # --force: take over a socket left behind by a munged that did not exit cleanly
    runuser -u munge -- /usr/sbin/munged --force --num-threads=10 --key-file="$BASE/munge/munge.key" \
      --socket="$MUNGE_SOCK" --pid-file="$PID_MUNGED" \
      --log-file="$BASE/munge/munged.log" --seed-file="$BASE/munge/munged.seed" \
      || start_failed munged "$BASE/munge/munged.log"
    wait_for munged 15 bash -c "munge -n -S '$MUNGE_SOCK' | unmunge -S '$MUNGE_SOCK'" \
      || start_failed munged "$BASE/munge/munged.log"
  fi

  # ---- MariaDB (private instance, loopback only) ----
  chown mysql:mysql "$BASE/mysql" "$BASE/mysql-run"
  if [ ! -d "$BASE/mysql/mysql" ]; then
    mariadb-install-db --user=mysql --datadir="$BASE/mysql" --skip-test-db \
      >"$BASE/log/mariadb-install-db.log" 2>&1 || start_failed mariadb-install-db "$BASE/log/mariadb-install-db.log"
  fi
  if ! alive "$PID_MARIADBD"; then
    setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$BASE/mysql" --socket="$MYSQL_SOCK" \
      --pid-file="$PID_MARIADBD" --bind-address=127.0.0.1 --port="$DB_PORT" \
      --log-error="$BASE/mysql-run/mariadbd.err" --innodb-buffer-pool-size=256M \
      --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
    wait_for mariadbd 60 mariadb-admin --socket="$MYSQL_SOCK" ping || start_failed mariadbd "$BASE/mysql-run/mariadbd.err"
  fi
  mariadb --socket="$MYSQL_SOCK" -u root -e "
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmpw';
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"

  # ---- slurmdbd (reads slurmdbd.conf next to $SLURM_CONF) ----
  if ! alive "$PID_SLURMDBD"; then
    /usr/sbin/slurmdbd || start_failed slurmdbd "$BASE/log/slurmdbd.log"
    wait_for slurmdbd 60 sacctmgr -n show cluster || start_failed slurmdbd "$BASE/log/slurmdbd.log"
  fi
  # register the cluster before slurmctld first talks to slurmdbd
  if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null; log "registered cluster $CLUSTER in slurmdbd"
  fi

  # ---- slurmctld ----
  if ! alive "$PID_SLURMCTLD"; then
    # slurmctld refuses a StateSaveLocation written under another ClusterName
    if [ -s "$BASE/state/clustername" ] && [ "$(cat "$BASE/state/clustername")" != "$CLUSTER" ]; then
      log "state dir belongs to cluster '$(cat "$BASE/state/clustername")': wiping it"; rm -rf "${BASE:?}/state/"*
    fi
    /usr/sbin/slurmctld || start_failed slurmctld "$BASE/log/slurmctld.log"
    wait_for slurmctld 30 bash -c "scontrol ping | grep -q UP" || start_failed slurmctld "$BASE/log/slurmctld.log"
  fi

  # ---- slurmd ----
  if ! alive "$PID_SLURMD"; then
    /usr/sbin/slurmd || start_failed slurmd "$BASE/log/slurmd.log"
  fi

  # ---- wait for the node ----
  local st="" end=$((SECONDS + 60))
  while [ $SECONDS -lt $end ]; do
    st=$(timeout 10 sinfo -h -n "$HOST" -o %T 2>/dev/null | head -n1 || true)
    case "$st" in
      idle|mixed|allocated|completing) break ;;
      down|drain*|fail*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.2
  done
  case "$st" in
    idle|mixed|allocated|completing) log "node $HOST is $st ($(scontrol show node "$HOST" | grep -o 'CPUTot=[0-9]*'))" ;;
    *) scontrol show node "$HOST" >&2 || true; start_failed "node $HOST (state '$st')" "$BASE/log/slurmd.log" ;;
  esac

  # ---- end-to-end check: munge + slurmctld + slurmd + step launch + accounting ----
  if [ "$st" = allocated ]; then
    log "node fully allocated by running jobs: skipping the srun smoke test"
  else
    wait_for "srun smoke test" 30 srun --immediate=10 -t 1 -N1 -n1 true \
      || start_failed "srun smoke test" "$BASE/log/slurmd.log"
  fi
  sacct -n -X -S now-1hour >/dev/null || start_failed sacct "$BASE/log/slurmdbd.log"
  log "ready; to use it: source <(bash $0 env)   # or: source $BASE/env.sh"
}

cmd_stop() {
  need_root
  if alive "$PID_SLURMCTLD"; then
    # cancel every job and give them KillWait to end before the daemons go
    # shellcheck disable=SC2046  # one argument per job id
    scancel --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
    local end=$((SECONDS + 15))
    while [ -n "$(squeue -h -o %i 2>/dev/null)" ] && [ $SECONDS -lt $end ]; do sleep 0.5; done
  fi
  stop_pid slurmd "$PID_SLURMD"
  stop_pid slurmctld "$PID_SLURMCTLD"
  stop_pid slurmdbd "$PID_SLURMDBD"
  stop_pid mariadbd "$PID_MARIADBD" 60
  stop_pid munged "$PID_MUNGED"
  log "stopped (state kept in $BASE; rm -rf $BASE for a clean slate)"
}

cmd_status() {
  local d pf rc=0
  for d in munged:$PID_MUNGED mariadbd:$PID_MARIADBD slurmdbd:$PID_SLURMDBD slurmctld:$PID_SLURMCTLD slurmd:$PID_SLURMD; do
    pf=${d#*:}
    if alive "$pf"; then echo "${d%%:*}: running ($(cat "$pf"))"; else echo "${d%%:*}: not running"; rc=1; fi
  done
  if [ "$rc" = 0 ]; then sinfo -N -o '%N %T %C %G'; squeue; fi
  return $rc
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  status) cmd_status ;;
  *) echo "usage: $0 {start|stop|env|status}   (SLURM_BASE=$BASE)" >&2; exit 2 ;;
esac
