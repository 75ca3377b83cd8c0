#!/usr/bin/env bash
# A real single-machine Slurm cluster for development and CI (Slurm 22.05, as root, no
# systemd): munged, MariaDB + slurmdbd (so `sacct` works: without accounting submitit's
# cancel hangs), slurmctld and N virtual slurmd nodes n1..nN on 127.0.0.1.
#
#   bash slurm/devcluster.sh up [--nodes N]   start what is not running (idempotent)
#   bash slurm/devcluster.sh down             stop the daemons this script started
#   bash slurm/devcluster.sh status           sinfo; exit 1 unless every daemon is up
#
# Everything (config, state, logs, pid files, its own munge key and socket, its own
# MariaDB data dir) lives under $MILEPOST_DEVCLUSTER_DIR (default
# /var/lib/milepost-devcluster), on ports $MILEPOST_DEVCLUSTER_PORT+… (default 16800),
# so a system Slurm/munge/MariaDB on the machine is never touched. `down` stops daemons
# only by the pid files written here; nothing is ever killed by name.
# Clients find the config through /etc/slurm/slurm.conf (a symlink made here when that
# path is free) or `export SLURM_CONF=$MILEPOST_DEVCLUSTER_DIR/etc/slurm.conf`.
set -euo pipefail

D=${MILEPOST_DEVCLUSTER_DIR:-/var/lib/milepost-devcluster}
BASE=${MILEPOST_DEVCLUSTER_PORT:-16800}
CTLD_PORT=$((BASE + 17)); DBD_PORT=$((BASE + 19)); DB_PORT=$((BASE + 6)); NODE_PORT0=$((BASE + 100))
export SLURM_CONF=$D/etc/slurm.conf
MUNGE_SOCKET=$D/munge/munge.socket
DB_SOCKET=$D/mysql-run/mysqld.sock

log() { echo "devcluster: $*" >&2; }
die() { log "$*"; exit 1; }

pid_alive() {  # pid_alive PID COMM: a live process (not a zombie: PID 1 here does not
  # reap) whose command is COMM; checking COMM guards against a recycled pid.
  [ -r "/proc/$1/stat" ] || return 1
  [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ] || return 1
  [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ]
}

alive() {  # alive PIDFILE COMM
  [ -s "$1" ] && pid_alive "$(cat "$1")" "$2"
}

wait_for() {  # wait_for SECONDS WHAT CMD...: poll CMD until it succeeds or time is up
  local secs=$1 what=$2 end; shift 2
  end=$((SECONDS + secs))
  while [ $SECONDS -lt $end ]; do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  die "$what did not come up in ${secs}s; see $D/log/"
}

num_nodes_file() { cat "$D/nodes" 2>/dev/null || echo 0; }

pidfiles() {  # every daemon's pid file and command, in stop order (nodes first)
  local i
  for i in $(seq 1 "$(num_nodes_file)"); do echo "$D/run/slurmd-n$i.pid slurmd"; done
  echo "$D/run/slurmctld.pid slurmctld"
  echo "$D/run/slurmdbd.pid slurmdbd"
  echo "$D/mysql-run/mariadb.pid mariadbd"
  echo "$D/munge/munged.pid munged"
}

write_slurm_conf() {
  local n=$1 host cpus mem
  host=$(hostname -s); cpus=$(nproc)
  # Every virtual node gets all the cores (`-c 2` fails on two 1-CPU nodes) and a share
  # of the memory, so that jobs on both nodes cannot ask for more than the machine has.
  mem=$(awk -v n="$n" '/MemTotal/{print int($2/1024*0.8/n)}' /proc/meminfo)
  cat > "$D/etc/slurm.conf" <<EOF
# Written by slurm/devcluster.sh; rewritten by every \`up\` that starts slurmctld.
ClusterName=milepost
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=1
ReturnToService=1
KillWait=5
MpiDefault=none
MailProg=/bin/true
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# For slurmdbd connections the munge socket is read from here, not from AuthInfo.
AccountingStoragePass=$MUNGE_SOCKET
NodeName=n[1-$n] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$((NODE_PORT0 + 1))-$((NODE_PORT0 + n))] \
  CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP DefMemPerCPU=1000
EOF
  echo "$n" > "$D/nodes"
}

link_etc_conf() {
  # Let plain `sinfo`/`sbatch` (and submitit) work without SLURM_CONF, unless the
  # machine already has a Slurm config of its own: that one is left alone.
  local etc=/etc/slurm/slurm.conf
  mkdir -p /etc/slurm
  if [ ! -e "$etc" ] || [ "$(readlink "$etc")" = "$SLURM_CONF" ]; then
    ln -sfn "$SLURM_CONF" "$etc"
  else
    log "$etc exists and is not ours: export SLURM_CONF=$SLURM_CONF"
  fi
}

start_munge() {
  alive "$D/munge/munged.pid" munged && return
  [ -s "$D/munge/munge.key" ] || runuser -u munge -- mungekey --create --keyfile="$D/munge/munge.key"
  # munged refuses to run as root; it checks that its files are owned by munge.
  runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCKET" --key-file="$D/munge/munge.key" \
    --pid-file="$D/munge/munged.pid" --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed"
  wait_for 10 munged test -S "$MUNGE_SOCKET"
}

start_mariadb() {
  alive "$D/mysql-run/mariadb.pid" mariadbd && return
  if [ ! -d "$D/mysql/mysql" ]; then
    mariadb-install-db --no-defaults --user=mysql --datadir="$D/mysql" --skip-test-db \
      >"$D/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed; see $D/log/mariadb-install.log"
  fi
  # --no-defaults: ignore /etc/mysql so a system MariaDB's settings cannot leak in.
  setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$D/mysql" \
    --socket="$DB_SOCKET" --pid-file="$D/mysql-run/mariadb.pid" --port="$DB_PORT" \
    --bind-address=127.0.0.1 --skip-name-resolve --log-error="$D/log/mariadb.log" \
    </dev/null >/dev/null 2>&1 &
  wait_for 30 mariadb mariadb-admin --no-defaults --socket="$DB_SOCKET" ping
  [ -s "$D/etc/db.pass" ] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' > "$D/etc/db.pass")
  mariadb --no-defaults --socket="$DB_SOCKET" -u root -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$D/etc/db.pass")';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
}

start_slurmdbd() {
  alive "$D/run/slurmdbd.pid" slurmdbd && return
  (umask 077; cat > "$D/etc/slurmdbd.conf" <<EOF
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$D/etc/db.pass")
StorageLoc=slurm_acct_db
PidFile=$D/run/slurmdbd.pid
LogFile=$D/log/slurmdbd.log
EOF
  )
  slurmdbd  # finds slurmdbd.conf beside $SLURM_CONF
  wait_for 30 slurmdbd bash -c "exec 3<>/dev/tcp/127.0.0.1/$DBD_PORT"
}

start_slurm() {
  local n=$1 i
  if ! alive "$D/run/slurmctld.pid" slurmctld; then
    write_slurm_conf "$n"
    slurmctld -f "$SLURM_CONF"
  fi
  for i in $(seq 1 "$n"); do
    mkdir -p "$D/spool/n$i"
    alive "$D/run/slurmd-n$i.pid" slurmd || slurmd -f "$SLURM_CONF" -N "n$i"
  done
}

nodes_ready() {  # every node usable (idle, allocated, mixed or completing a job), none down
  local want=$1 up
  # A bounded sinfo: with slurmctld down it retries for a long time.
  up=$(timeout 5 sinfo -h -N -t idle,alloc,mix,comp -o %N 2>/dev/null | sort -u | wc -l)
  [ "$up" = "$want" ]
}

cmd_up() {
  local n=2
  while [ $# -gt 0 ]; do
    case $1 in
      --nodes) n=${2:?--nodes needs a number}; shift 2 ;;
      --nodes=*) n=${1#--nodes=}; shift ;;
      *) die "unknown option $1 (usage: up [--nodes N])" ;;
    esac
  done
  [[ $n =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer; got $n"
  [ "$(id -u)" -eq 0 ] || die "run as root"
  for c in slurmctld slurmd slurmdbd sinfo mariadbd munged; do
    command -v "$c" >/dev/null || [ -x "/usr/sbin/$c" ] ||
      die "$c missing: run bash slurm/devcluster-install.sh"
  done
  if alive "$D/run/slurmctld.pid" slurmctld && [ "$(num_nodes_file)" != "$n" ]; then
    die "cluster is up with $(num_nodes_file) nodes; run \`$0 down\` first to change to $n"
  fi
  mkdir -p "$D/etc" "$D/state" "$D/log" "$D/run" "$D/munge" "$D/mysql" "$D/mysql-run"
  chmod 755 "$D"
  chown munge:munge "$D/munge"; chmod 755 "$D/munge"
  chown mysql:mysql "$D/mysql" "$D/mysql-run"
  link_etc_conf
  start_munge
  start_mariadb
  start_slurmdbd
  start_slurm "$n"
  wait_for 30 "$n idle nodes" nodes_ready "$n"
  sinfo
}

stop_pid() {  # stop_pid PID COMM: TERM, wait up to 10 s, then KILL (it is ours: by pid)
  local pid=$1 comm=$2 end=$((SECONDS + 10))
  kill "$pid" 2>/dev/null || return 0
  # Wait on the pid, not the pid file: daemons unlink their pid file before they exit.
  while [ $SECONDS -lt $end ]; do pid_alive "$pid" "$comm" || return 0; sleep 0.1; done
  log "$comm (pid $pid) ignored TERM for 10 s; sending KILL"
  kill -9 "$pid" 2>/dev/null || true
}

cmd_down() {
  local f comm n=0
  # In order, one at a time: nodes, then slurmctld, then its database, then munge.
  while read -r f comm; do
    alive "$f" "$comm" || continue
    stop_pid "$(cat "$f")" "$comm"; n=$((n + 1))
  done < <(pidfiles)
  log "stopped $n daemons"
}

cmd_status() {
  local f comm bad=0
  if [ "$(num_nodes_file)" = 0 ]; then
    log "never started under $D: run \`bash slurm/devcluster.sh up\`"; exit 1
  fi
  while read -r f comm; do
    alive "$f" "$comm" || { log "$comm not running (pid file $f)"; bad=1; }
  done < <(pidfiles)
  if [ $bad = 0 ]; then timeout 10 sinfo 2>&1 || bad=1; fi
  if [ $bad = 1 ] || ! nodes_ready "$(num_nodes_file)"; then
    log "not up: run \`bash slurm/devcluster.sh up\`"; exit 1
  fi
}

case ${1:-} in
  up) shift; cmd_up "$@" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) echo "usage: $0 up [--nodes N] | down | status" >&2; exit 2 ;;
esac
