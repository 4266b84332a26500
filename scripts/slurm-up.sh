#!/usr/bin/env bash
# Start a throw-away SLURM cluster on this machine: two emulated nodes with fake GPUs, plus accounting.
#
# For CI (.ci/run) and for trying `cluster=slurm` on a laptop. Needs root (it installs Debian packages,
# creates fake GPU device files, adds the node names to /etc/hosts and runs the daemons as root).
# Idempotent: when the cluster is already up (its pid files name live daemons and `sinfo` answers) it
# does nothing. Otherwise it wipes the state folder and starts fresh (job ids restart at 1, with an empty
# accounting database). Stop it with scripts/slurm-down.sh (by pid files).
#
# Knobs (environment variables, defaults in brackets):
#   SLURM_UP_DIR           state folder: configs, pid files, logs, spool, accounting database [/tmp/pnpscale-slurm]
#   SLURM_UP_NODES         emulated nodes, named n1..nN [2]
#   SLURM_UP_GPUS          fake GPUs per node (Gres=gpu:N, character devices aliasing /dev/null) [4]
#   SLURM_UP_CPUS          CPUs per node as SLURM sees them (may exceed the real cores) [8]
#   SLURM_UP_MEM_MB        memory per node as SLURM sees it, in MB [4096]
#   SLURM_UP_PARTITION     name of the (default) partition holding every node [debug]
#   SLURM_UP_CTLD_PORT     slurmctld port [6817]
#   SLURM_UP_DBD_PORT      slurmdbd port [6819]
#   SLURM_UP_DB_PORT       MariaDB port (127.0.0.1 only) [16820]
#   SLURM_UP_NODE_PORT     first slurmd port; node i listens on NODE_PORT+i-1 [17001]
#   SLURM_UP_INSTALL       1: apt-get install the missing Debian packages; 0: fail if missing [1]
#   SLURM_UP_LINK_CONF     1: make /etc/slurm/slurm.conf a link to the generated config, so sbatch/sinfo/
#                          sacct/submitit find it; 0: leave /etc alone (then export SLURM_CONF=$SLURM_UP_DIR/etc/slurm.conf) [1]
#   SLURM_UP_TIMEOUT_S     seconds to wait for each daemon and for the nodes to be idle [60]
#   SLURM_UP_FIRST_JOB_ID  first job id [derived from the clock, so that a restarted cluster never reuses the
#                          ids (and submitit folders, .submitit/<job id>/) of an earlier one]
set -euo pipefail

DIR=${SLURM_UP_DIR:-/tmp/pnpscale-slurm}
NODES=${SLURM_UP_NODES:-2}
GPUS=${SLURM_UP_GPUS:-4}
CPUS=${SLURM_UP_CPUS:-8}
MEM_MB=${SLURM_UP_MEM_MB:-4096}
PARTITION=${SLURM_UP_PARTITION:-debug}
CTLD_PORT=${SLURM_UP_CTLD_PORT:-6817}
DBD_PORT=${SLURM_UP_DBD_PORT:-6819}
DB_PORT=${SLURM_UP_DB_PORT:-16820}
NODE_PORT=${SLURM_UP_NODE_PORT:-17001}
INSTALL=${SLURM_UP_INSTALL:-1}
LINK_CONF=${SLURM_UP_LINK_CONF:-1}
TIMEOUT_S=${SLURM_UP_TIMEOUT_S:-60}
FIRST_JOB_ID=${SLURM_UP_FIRST_JOB_ID:-$(( $(date +%s) % 50000000 + 1000 ))}
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
HOSTS_MARK="# pnpscale-slurm"

say() { echo "slurm-up: $*"; }
die() { echo "slurm-up: error: $*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "needs root (Debian packages, device files, /etc/hosts, daemons run as root)"
[[ $NODES =~ ^[1-9][0-9]*$ && $GPUS =~ ^[0-9]+$ && $CPUS =~ ^[1-9][0-9]*$ ]] \
  || die "SLURM_UP_NODES, SLURM_UP_GPUS, SLURM_UP_CPUS must be integers (nodes, cpus >= 1)"
NODE_NAMES=()
for i in $(seq 1 "$NODES"); do NODE_NAMES+=("n$i"); done
export SLURM_CONF=$DIR/etc/slurm.conf

alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

all_alive() {
  local f
  for f in munged mariadbd slurmdbd slurmctld "${NODE_NAMES[@]/#/slurmd-}"; do
    alive "$DIR/run/$f.pid" || return 1
  done
}

wait_for() {  # wait_for WHAT COMMAND...: retry COMMAND until it succeeds or TIMEOUT_S passes
  local what=$1; shift
  local t0=$SECONDS
  until "$@" >/dev/null 2>&1; do
    (( SECONDS - t0 < TIMEOUT_S )) || die "$what did not come up within ${TIMEOUT_S}s (logs: $DIR/log/)"
    sleep 0.2
  done
}

if all_alive && timeout 10 sinfo >/dev/null 2>&1; then
  say "already up (state: $DIR); stop with scripts/slurm-down.sh"
  exit 0
fi

# --- packages --------------------------------------------------------------------------------------
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if (( ${#missing[@]} )); then
  [[ $INSTALL == 1 ]] || die "missing Debian packages: ${missing[*]} (SLURM_UP_INSTALL=0)"
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # The packages' own services are not started here (no init system in containers); we start our own.
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- fresh state -----------------------------------------------------------------------------------
if [[ -d $DIR ]]; then
  SLURM_DOWN_DIR=$DIR "$(dirname "$0")/slurm-down.sh" >/dev/null || true
  rm -rf "$DIR"
fi
mkdir -p "$DIR"/{etc,run/munge,log,state,spool,dev,mysql}
chmod 700 "$DIR/etc"
HOST=$(hostname -s)

if [[ $LINK_CONF == 1 ]]; then
  mkdir -p /etc/slurm
  link=/etc/slurm/slurm.conf
  if [[ -e $link || -L $link ]] && [[ "$(readlink "$link" || true)" != "$SLURM_CONF" ]]; then
    if [[ -L $link && "$(readlink "$link")" == */pnpscale-*/etc/slurm.conf ]] || grep -q "^# pnpscale-slurm" "$link" 2>/dev/null; then
      rm -f "$link"  # a link left by an earlier throw-away cluster
    else
      die "$link exists and is not ours: set SLURM_UP_LINK_CONF=0 and export SLURM_CONF=$SLURM_CONF"
    fi
  fi
  ln -sfn "$SLURM_CONF" "$link"
fi

for n in "${NODE_NAMES[@]}"; do
  getent hosts "$n" >/dev/null || echo "127.0.0.1 $n $HOSTS_MARK" >> /etc/hosts
  for g in $(seq 0 $((GPUS - 1))); do mknod "$DIR/dev/$n-gpu$g" c 1 3; done
done

# --- configs ---------------------------------------------------------------------------------------
MUNGE_SOCKET=$DIR/run/munge/munge.socket.2
{
  echo "# pnpscale-slurm: throw-away localhost cluster written by scripts/slurm-up.sh"
  cat <<EOF
ClusterName=pnpscale
FirstJobId=$FIRST_JOB_ID
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
EnforcePartLimits=ALL
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCKET
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
EOF
  for i in $(seq 1 "$NODES"); do
    echo "NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((NODE_PORT + i - 1)) CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:$GPUS State=UNKNOWN"
  done
  echo "PartitionName=$PARTITION Nodes=$(IFS=,; echo "${NODE_NAMES[*]}") Default=YES MaxTime=INFINITE State=UP"
} > "$SLURM_CONF"

: > "$DIR/etc/gres.conf"
for n in "${NODE_NAMES[@]}"; do
  (( GPUS > 0 )) && echo "NodeName=$n Name=gpu File=$DIR/dev/$n-gpu[0-$((GPUS - 1))]" >> "$DIR/etc/gres.conf"
done

DB_PASS=pnpscale
cat > "$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
chmod 600 "$DIR/etc/slurmdbd.conf"

# --- daemons ---------------------------------------------------------------------------------------
dd if=/dev/urandom of="$DIR/etc/munge.key" bs=1024 count=1 status=none
chmod 600 "$DIR/etc/munge.key"
munged --socket="$MUNGE_SOCKET" --key-file="$DIR/etc/munge.key" --pid-file="$DIR/run/munged.pid" \
  --log-file="$DIR/log/munged.log" --seed-file="$DIR/run/munged.seed"
wait_for munged munge -n -S "$MUNGE_SOCKET"

mariadb-install-db --no-defaults --datadir="$DIR/mysql" --user=root --auth-root-authentication-method=socket \
  --skip-test-db > "$DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed (log: $DIR/log/mariadb-install.log)"
DB_SOCKET=$DIR/run/mysqld.sock
setsid mariadbd --no-defaults --datadir="$DIR/mysql" --user=root --socket="$DB_SOCKET" \
  --pid-file="$DIR/run/mariadbd.pid" --port="$DB_PORT" --bind-address=127.0.0.1 --log-error="$DIR/log/mariadb.log" \
  --innodb-buffer-pool-size=64M --skip-log-bin </dev/null >/dev/null 2>&1 &
wait_for mariadbd mariadb --no-defaults --socket="$DB_SOCKET" -u root -e "select 1"
mariadb --no-defaults --socket="$DB_SOCKET" -u root -e "
  CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
  CREATE USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"

slurmdbd
wait_for slurmdbd sacctmgr -n list cluster
sacctmgr -i add cluster pnpscale >/dev/null 2>&1 || true

slurmctld
wait_for slurmctld scontrol ping
for n in "${NODE_NAMES[@]}"; do slurmd -N "$n"; done
nodes_idle() { [[ $(sinfo -h -N -o "%T" | grep -c -E "^idle") -ge $NODES ]]; }
wait_for "nodes ${NODE_NAMES[*]}" nodes_idle

say "up: partition $PARTITION, nodes ${NODE_NAMES[*]} x ${CPUS} CPUs x ${GPUS} fake GPUs, accounting on, first job id $FIRST_JOB_ID (state: $DIR)"
sinfo -N -o "%N %P %T %c %G"
