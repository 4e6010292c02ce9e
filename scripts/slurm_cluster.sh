#!/usr/bin/env bash
# slurm_cluster.sh - a real SLURM cluster of one or several nodes on this machine, for CI and for
# trying shardgen's SLURM launcher locally (Debian 12 / SLURM 22.05; no systemd, no cgroups; run as root).
#
#   bash scripts/slurm_cluster.sh start [--nodes N]  # install missing packages, configure, start, smoke-test
#   source <(bash scripts/slurm_cluster.sh env)   # export SLURM_CONF for sbatch/srun/sacct/submitit
#   bash scripts/slurm_cluster.sh status   # daemons, nodes and queue
#   bash scripts/slurm_cluster.sh nodes    # the node names, one a line
#   bash scripts/slurm_cluster.sh exec NODE CMD...  # run CMD on NODE (in its namespaces), e.g. torchrun
#   bash scripts/slurm_cluster.sh stop     # cancel jobs, stop every daemon (by pid file), remove the nodes
#
# Nodes: with --nodes N >= 2 (the default is 2) each node is a slurmd in its own Linux network and UTS
# namespaces, with its own host name (node1, node2, ...) and address ($SLURM_SUBNET.11, .12, ...) on a
# bridge (shardgen-br0, $SLURM_SUBNET.1 on this host, where slurmctld listens); /etc/hosts names them,
# so ranks on one node reach the others by name (MASTER_ADDR) as on a real cluster. The file system
# and the process table stay shared. Without the default's namespaces (no iproute2, no CAP_NET_ADMIN)
# `start` falls back to one node and says why; an explicit --nodes N fails instead.
# --nodes 1 is the old single-node cluster: this host's slurmd on loopback.
#
# `start` is idempotent: a second call only checks that everything is up (a few seconds), and
# restarts slurmctld/slurmd only when the generated configuration changed.
# The cluster has munged, MariaDB + slurmdbd (accounting: submitit polls job states with
# `sacct`; without it every state reads UNKNOWN), slurmctld and slurmd, all on loopback.
# Everything (config, state, logs, database, pid files) lives under $SLURM_BASE.
#
# Environment:
#   SLURM_BASE=/tmp/shardgen-slurm  where everything lives
#   SLURM_SUBNET=10.77.0            the nodes' /24 (only inside the namespaces and the bridge made here)
#   SLURM_CPUS=<4 x nproc>          CPUs each node advertises (see "CPU oversubscription" below);
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
SUBNET=${SLURM_SUBNET:-10.77.0}
BRIDGE=shardgen-br0
HOSTS_TAG="# shardgen slurm_cluster.sh node"
FAKE_GPUS=${SLURM_FAKE_GPUS:-0}
DB_PORT=${SLURM_DB_PORT:-3306}
MEM_MB=$(awk '/^MemTotal/ {m = int($2 / 1024) - 1024; print (m < 1024 ? 1024 : m)}' /proc/meminfo)

SLURM_CONF=$BASE/etc/slurm.conf
export SLURM_CONF
MUNGE_SOCK=$BASE/munge-run/munge.socket.2
MYSQL_SOCK=$BASE/mysql-run/mysqld.sock
PKGS="slurm-wlm munge slurmdbd mariadb-server"

# pid files, in stop order (munged's and mariadbd's are written by their own users); one slurmd per
# node, its pid file named after the node (SlurmdPidFile's %n)
PID_SLURMD_OLD=$BASE/run/slurmd.pid  # written by this script's single-node versions before --nodes
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

# ---- nodes ------------------------------------------------------------------------------------
# node_names N: the nodes of an N-node cluster (one node: this host itself)
node_names() { if [ "$1" = 1 ]; then echo "$HOST"; else seq -f 'node%g' 1 "$1"; fi; }
node_addr() { if [ "$1" = 1 ]; then echo 127.0.0.1; else echo "$SUBNET.$((10 + $2))"; fi; }  # node_addr N I
# the node count of the cluster last started here (what stop/status/exec/nodes act on)
started_nodes() { if [ -s "$BASE/nodes" ]; then cat "$BASE/nodes"; else echo 1; fi; }
netns_of() { echo "/run/netns/shardgen-$1"; }
uts_of() { echo "$BASE/ns/$1.uts"; }
# on_node NAME CMD...: run CMD on node NAME, i.e. in its network and UTS namespaces (here if it has none)
on_node() {
  local name=$1; shift
  if [ -e "$(netns_of "$name")" ]; then
    nsenter --net="$(netns_of "$name")" --uts="$(uts_of "$name")" -- "$@"
  else
    "$@"
  fi
}
pid_slurmd() { echo "$BASE/run/slurmd-$1.pid"; }  # SlurmdPidFile with %n

# make_nodes N: the bridge and, per node, a network namespace joined to it by a veth pair and a UTS
# namespace with the node's host name; /etc/hosts names the nodes. Idempotent; fails (returns 1)
# where the machine cannot make namespaces.
make_nodes() {
  local n=$1 i name ns addr uts
  command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null || return 1
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge && ip addr add "$SUBNET.1/24" dev "$BRIDGE" || return 1
  fi
  ip link set "$BRIDGE" up || return 1
  mkdir -p "$BASE/ns"
  for ((i = 1; i <= n; i++)); do
    name=node$i; ns=shardgen-$name; addr=$(node_addr "$n" "$i"); uts=$(uts_of "$name")
    if [ ! -e "$(netns_of "$name")" ]; then
      ip netns add "$ns" && ip link add "sg-veth$i" type veth peer name eth0 netns "$ns" \
        && ip link set "sg-veth$i" master "$BRIDGE" && ip link set "sg-veth$i" up \
        && ip -n "$ns" addr add "$addr/24" dev eth0 && ip -n "$ns" link set eth0 up \
        && ip -n "$ns" link set lo up || return 1
    fi
    # a UTS namespace lives on (without a process in it) while bind-mounted on a file
    if ! nsenter --uts="$uts" true 2>/dev/null; then
      touch "$uts" && unshare --uts="$uts" hostname "$name" || return 1
    fi
  done
  hosts_without_nodes > "$BASE/hosts.new"
  for ((i = 1; i <= n; i++)); do echo "$(node_addr "$n" "$i") node$i $HOSTS_TAG"; done >> "$BASE/hosts.new"
  cmp -s "$BASE/hosts.new" /etc/hosts || cat "$BASE/hosts.new" > /etc/hosts  # in place: it may be a bind mount
  rm -f "$BASE/hosts.new"
  log "nodes: $(node_names "$n" | tr '\n' ' ')on bridge $BRIDGE ($SUBNET.0/24)"
}
hosts_without_nodes() { grep -vF "$HOSTS_TAG" /etc/hosts || true; }

# remove_nodes: undo make_nodes (whatever node count it made); their slurmds are stopped first
remove_nodes() {
  local ns uts pid
  for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^shardgen-node[0-9]+$/ {print $1}'); do
    # a job process that outlived its slurmd would keep the namespace alive
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns"  # takes its veth pair along
  done
  for uts in "$BASE"/ns/*.uts; do
    [ -e "$uts" ] || continue
    umount "$uts" 2>/dev/null || true; rm -f "$uts"
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
  if grep -qF "$HOSTS_TAG" /etc/hosts 2>/dev/null; then
    hosts_without_nodes > "$BASE/hosts.new"; cat "$BASE/hosts.new" > /etc/hosts; rm -f "$BASE/hosts.new"
  fi
}

# stop_slurmds: every node's slurmd, whatever node count it was started with
stop_slurmds() {
  local pf
  for pf in "$BASE"/run/slurmd-*.pid "$PID_SLURMD_OLD"; do
    [ -e "$pf" ] && stop_pid "slurmd $(basename "$pf" .pid)" "$pf"
  done
  return 0
}

write_if_changed() { # write_if_changed FILE MODE (content on stdin); returns 0 if FILE changed
  local f=$1 mode=$2
  cat > "$f.new"; chmod "$mode" "$f.new"
  if cmp -s "$f.new" "$f"; then rm -f "$f.new"; return 1; fi
  mv "$f.new" "$f"; return 0
}

slurm_conf() { # slurm_conf N
  local n=$1 gres="" i name ctl_addr=127.0.0.1
  [ "$FAKE_GPUS" -gt 0 ] && gres=" Gres=gpu:fake:$FAKE_GPUS"
  [ "$n" -gt 1 ] && ctl_addr=$SUBNET.1  # the nodes reach this host on the bridge
  cat <<EOF
# Generated by shardgen scripts/slurm_cluster.sh - edits are overwritten on the next start.
ClusterName=$CLUSTER
SlurmctldHost=$HOST($ctl_addr)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
# cred_expire (minimum 5, default 120 s) also delays the restart of a requeued job
AuthInfo=socket=$MUNGE_SOCK,cred_expire=5
StateSaveLocation=$BASE/state
# %n: the node's name (each node has its own slurmd)
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$PID_SLURMCTLD
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
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
EOF
  i=0
  for name in $(node_names "$n"); do
    i=$((i + 1)); echo "NodeName=$name NodeAddr=$(node_addr "$n" "$i") CPUs=$CPUS RealMemory=$MEM_MB$gres State=UNKNOWN"
  done
  # LLN: a job goes to the least loaded node, so one-node jobs (an array's) spread over the nodes
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP LLN=YES"
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
# choose_nodes ARG: the node count to start (ARG: a count, or "auto": 2 where namespaces work, else 1)
choose_nodes() {
  if [ "$1" = auto ]; then
    if make_nodes 2 >&2; then echo 2; return; fi
    log "WARNING: network/UTS namespaces are not available here (iproute2, CAP_NET_ADMIN): starting a" \
        "single-node cluster; tests that need two nodes will skip"
    remove_nodes >/dev/null 2>&1 || true; echo 1; return
  fi
  [ "$1" = 1 ] || make_nodes "$1" >&2 || { remove_nodes >/dev/null 2>&1 || true; die "could not make $1 nodes in network/UTS namespaces (iproute2, root with CAP_NET_ADMIN needed); --nodes 1 runs without them"; }
  echo "$1"
}

cmd_start() { # cmd_start NODES ("auto" or a count)
  need_root
  local want=$1
  [[ "$want" =~ ^(auto|[1-9][0-9]?)$ ]] || die "--nodes must be a count from 1 to 99 (got '$want')"
  [[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || die "SLURM_CPUS must be a positive integer (got '$CPUS')"
  [[ "$FAKE_GPUS" =~ ^[0-9]+$ ]] || die "SLURM_FAKE_GPUS must be a non-negative integer (got '$FAKE_GPUS')"
  mkdir -p "$BASE"/{etc,state,spool,log,run,munge,munge-run,mysql,mysql-run}
  [ "$want" != 1 ] && PKGS="$PKGS iproute2"
  install_packages

  # slurmctld/slurmd resolve the node name, and submitit's MASTER_ADDR is the host name
  if ! getent hosts "$HOST" >/dev/null; then echo "127.0.0.1 $HOST" >> /etc/hosts; log "added $HOST to /etc/hosts"; fi
  # ---- nodes: another node count than the running cluster's replaces its nodes ----
  local target=$want; [ "$want" = auto ] && target=2
  if [ "$target" != "$(started_nodes)" ]; then stop_slurmds; remove_nodes; fi
  local n; n=$(choose_nodes "$want")
  echo "$n" > "$BASE/nodes"

  # ---- configuration (slurmctld/slurmd are restarted below only if it changed) ----
  local changed=0 dbd_changed=0 i name
  if [ "$FAKE_GPUS" -gt 0 ]; then
    mkdir -p "$BASE/fakegpu"
    # slurmd ignores gres File= entries that are not character/block devices
    for ((i = 0; i < FAKE_GPUS; i++)); do [ -c "$BASE/fakegpu/gpu$i" ] || mknod "$BASE/fakegpu/gpu$i" c 1 3; done
    for name in $(node_names "$n"); do echo "NodeName=$name Name=gpu Type=fake File=$BASE/fakegpu/gpu[0-$((FAKE_GPUS - 1))]"; done \
      | write_if_changed "$BASE/etc/gres.conf" 644 && changed=1
  elif [ -e "$BASE/etc/gres.conf" ]; then
    rm -f "$BASE/etc/gres.conf"; changed=1
  fi
  slurm_conf "$n" | write_if_changed "$SLURM_CONF" 644 && changed=1
  # slurmdbd refuses a slurmdbd.conf that others can read
  slurmdbd_conf | write_if_changed "$BASE/etc/slurmdbd.conf" 600 && dbd_changed=1
  echo "export SLURM_CONF=$SLURM_CONF" > "$BASE/env.sh"
  if [ "$changed" = 1 ]; then
    log "configuration written ($SLURM_CONF: $n node(s), CPUs=$CPUS each, fake GPUs=$FAKE_GPUS)"
    stop_slurmds; stop_pid slurmctld "$PID_SLURMCTLD"
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

  # ---- one slurmd per node, each started on its node (in its namespaces) ----
  for name in $(node_names "$n"); do
    mkdir -p "$BASE/spool/$name"
    alive "$(pid_slurmd "$name")" || on_node "$name" /usr/sbin/slurmd || start_failed "slurmd on $name" "$BASE/log/slurmd-$name.log"
  done

  # ---- wait for the nodes ----
  local st busy=0
  for name in $(node_names "$n"); do
    st=$(wait_node "$name")
    case "$st" in
      idle|mixed|allocated|completing) log "node $name ($(scontrol show node "$name" | grep -o 'NodeAddr=[^ ]*\|CPUTot=[0-9]*' | tr '\n' ' '| sed 's/ $//')) is $st" ;;
      *) scontrol show node "$name" >&2 || true; start_failed "node $name (state '$st')" "$BASE/log/slurmd-$name.log" ;;
    esac
    [ "$st" = idle ] || busy=1
  done

  # ---- end-to-end check: munge + slurmctld + slurmds + a step across every node + accounting ----
  if [ "$busy" = 1 ]; then
    log "nodes in use by running jobs: skipping the srun smoke test"
  else
    local want_hosts; want_hosts=$(node_names "$n" | tr '\n' ' ')
    wait_for "srun -N$n smoke test (hosts: $want_hosts)" 30 bash -c \
        "[ \"\$(srun --immediate=10 -t 1 -N$n -n$n hostname | sort | tr '\n' ' ')\" = '$want_hosts' ]" \
      || start_failed "srun smoke test" "$BASE/log/slurmctld.log"
  fi
  sacct -n -X -S now-1hour >/dev/null || start_failed sacct "$BASE/log/slurmdbd.log"
  log "ready; to use it: source <(bash $0 env)   # or: source $BASE/env.sh"
}

# wait_node NAME: wait up to 60 s for the node to be usable (resuming it if down); prints its state
wait_node() {
  local st="" end=$((SECONDS + 60))
  while [ $SECONDS -lt $end ]; do
    st=$(timeout 10 sinfo -h -n "$1" -o %T 2>/dev/null | head -n1 || true)
    case "$st" in
      idle|mixed|allocated|completing) break ;;
      down|drain*|fail*) scontrol update nodename="$1" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.2
  done
  echo "$st"
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
  stop_slurmds
  stop_pid slurmctld "$PID_SLURMCTLD"
  stop_pid slurmdbd "$PID_SLURMDBD"
  stop_pid mariadbd "$PID_MARIADBD" 60
  stop_pid munged "$PID_MUNGED"
  remove_nodes; rm -f "$BASE/nodes"
  log "stopped (state kept in $BASE; rm -rf $BASE for a clean slate)"
}

cmd_status() {
  local d pf rc=0 name
  for d in munged:$PID_MUNGED mariadbd:$PID_MARIADBD slurmdbd:$PID_SLURMDBD slurmctld:$PID_SLURMCTLD \
           $(for name in $(node_names "$(started_nodes)"); do echo "slurmd@$name:$(pid_slurmd "$name")"; done); do
    pf=${d#*:}
    if alive "$pf"; then echo "${d%%:*}: running ($(cat "$pf"))"; else echo "${d%%:*}: not running"; rc=1; fi
  done
  if [ "$rc" = 0 ]; then sinfo -N -o '%N %T %C %G'; squeue; fi
  return $rc
}

case "${1:-}" in
  start)
    case "${2:-}" in
      "") cmd_start auto ;;
      --nodes) cmd_start "${3:-}" ;;
      --nodes=*) cmd_start "${2#--nodes=}" ;;
      *) die "start takes --nodes N (got '$2')" ;;
    esac ;;
  stop) cmd_stop ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  status) cmd_status ;;
  nodes) node_names "$(started_nodes)" ;;
  exec)
    [ $# -ge 3 ] || die "usage: $0 exec NODE CMD..."
    node_names "$(started_nodes)" | grep -qx "$2" || die "no node '$2' (nodes: $(node_names "$(started_nodes)" | tr '\n' ' '))"
    name=$2; shift 2; on_node "$name" "$@" ;;
  *) echo "usage: $0 {start [--nodes N]|stop|env|status|nodes|exec NODE CMD...}   (SLURM_BASE=$BASE)" >&2; exit 2 ;;
esac
