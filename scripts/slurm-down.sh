#!/usr/bin/env bash
# Stop the throw-away SLURM cluster started by scripts/slurm-up.sh, by its pid files (never by name).
#
# Idempotent: daemons that are not running are skipped. Keeps the state folder (logs) unless
# SLURM_DOWN_PURGE=1; removes the /etc/slurm/slurm.conf link and the /etc/hosts lines slurm-up.sh added.
#
# Knobs (environment variables, defaults in brackets):
#   SLURM_DOWN_DIR     state folder of the cluster [$SLURM_UP_DIR, else /tmp/pnpscale-slurm]
#   SLURM_DOWN_PURGE   1: also delete the state folder [0]
#   SLURM_DOWN_WAIT_S  seconds to wait for each daemon to exit before SIGKILL [15]
set -uo pipefail

DIR=${SLURM_DOWN_DIR:-${SLURM_UP_DIR:-/tmp/pnpscale-slurm}}
PURGE=${SLURM_DOWN_PURGE:-0}
WAIT_S=${SLURM_DOWN_WAIT_S:-15}
HOSTS_MARK="# pnpscale-slurm"

say() { echo "slurm-down: $*"; }

stop_pid_file() {  # stop_pid_file FILE: SIGTERM the pid in FILE, wait, then SIGKILL
  local f=$1 pid t0
  [[ -s $f ]] || return 0
  pid=$(cat "$f")
  if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    t0=$SECONDS
    while kill -0 "$pid" 2>/dev/null && (( SECONDS - t0 < WAIT_S )); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      say "$(basename "$f" .pid) (pid $pid) did not exit in ${WAIT_S}s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null
    fi
    say "stopped $(basename "$f" .pid) (pid $pid)"
  fi
  rm -f "$f"
}

if [[ -d $DIR/run ]]; then
  # compute nodes first (their jobs end with them), then the controller, accounting, database, auth
  for f in "$DIR"/run/slurmd-*.pid; do [[ -e $f ]] && stop_pid_file "$f"; done
  for d in slurmctld slurmdbd mariadbd munged; do stop_pid_file "$DIR/run/$d.pid"; done
else
  say "no cluster state at $DIR"
fi

link=/etc/slurm/slurm.conf
if [[ -L $link && "$(readlink "$link")" == "$DIR/etc/slurm.conf" ]]; then rm -f "$link"; fi
if grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null; then
  # /etc/hosts may be a bind mount: rewrite it in place rather than replacing the file
  kept=$(grep -v "$HOSTS_MARK" /etc/hosts)
  printf '%s\n' "$kept" > /etc/hosts
fi
if [[ $PURGE == 1 ]]; then rm -rf "$DIR"; say "removed $DIR"; fi
exit 0
