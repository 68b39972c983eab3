#!/usr/bin/env bash
# Stop the daemons tests/slurm/up.sh started, by PID only (never by process name).
#   bash tests/slurm/down.sh [--keep-munge]
S=${RESILIENT_SLURM_DIR:-/tmp/resilient-slurm}
stop() {
    local f=$1 p
    [[ -s $f ]] || return 0
    p=$(cat "$f")
    kill "$p" 2>/dev/null || return 0
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
}
for pidfile in "$S"/state/slurmd.*.pid "$S/state/slurmd.pid"; do  # one per node (and the old name)
    stop "$pidfile"
done
stop "$S/state/slurmctld.pid"
[[ ${1:-} == --keep-munge ]] || stop /run/munge/munged.pid
exit 0
