#!/usr/bin/env bash
# Bring up a Slurm of N nodes on localhost for the tests (Debian/Ubuntu, root, no systemd needed).
# Idempotent: safe to call when it is already running. Tear down with tests/slurm/down.sh.
#
#   bash tests/slurm/up.sh        # installs slurmctld slurmd slurm-client munge if missing
#   RESILIENT_SLURM_NODES=1 bash tests/slurm/up.sh      # one node only
#
# Nodes n1..nN (default 3) are node aliases of this host: one slurmd each (`slurmd -N n2`), its
# own port and spool directory; `SLURMD_NODENAME` and `SLURM_NODEID` differ per node, the host
# name does not, and MPI's shared-memory split follows Slurm's nodes (`srun -N 2 --mpi=pmi2`).
# Partition `debug` (the default) is n1 alone, the one-node cluster every single-node test
# expects; partition `multi` is every node, for the multi-node tests (`-p multi -N 2`).
#
# Facts this relies on (measured on the CI machine kind): ~12 s from a fresh machine; each node
# claims 8 CPUs (config_overrides) so that 4-rank MPI jobs fit on 2 real cores; MpiDefault=pmi2
# lets `srun -n 4` start a real 4-rank job with the PyPI mpich wheel; KillWait=5 keeps walltime
# tests short; MinJobAge=600 keeps finished jobs visible to `squeue` (no accounting DB here);
# AuthInfo=cred_expire=10 lets a requeued job start again ~11 s after `scontrol requeue`
# instead of 121 s (slurmctld holds it with Reason=BeginTime for cred_expire + 1 s; 5 is the
# least Slurm accepts, a smaller value falls back to the default 120).
#
# Already running with this very slurm.conf: nothing to do. Running with another one (an older
# version of this script): the daemons are restarted with the new one.
set -euo pipefail
S=${RESILIENT_SLURM_DIR:-/tmp/resilient-slurm}
N=${RESILIENT_SLURM_NODES:-3}
export DEBIAN_FRONTEND=noninteractive

if [[ $(id -u) != 0 ]]; then
    echo "tests/slurm/up.sh: needs root (apt-get, daemons); skipping" >&2
    exit 2
fi

# Close every inherited descriptor above 2 before exec, so no daemon keeps a CI output pipe open.
closefds() { for fd in /proc/self/fd/*; do n=${fd##*/}; [[ $n -gt 2 ]] && eval "exec $n>&-" 2>/dev/null; done; true; }
detach() { (closefds; exec "$@") </dev/null >/dev/null 2>&1; }

# all N nodes up (idle, or busy with jobs)
nodes_up() {
    local up
    up=$(sinfo -h -N -p multi -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated)$') || true
    [[ ${up:-0} -ge $N ]]
}

# Slurm's Epilog, on each node at the end of every job, as sites clean /dev/shm there: MPICH
# names its shared-memory segments after the job and step IDs (mpich_shm_<world>_<node>) and
# leaves them behind when ranks are killed (a lost node, scancel); a requeued job reuses both
# IDs, so its ranks would open the stale segment ("Out of memory" in MPI_Init) or hang. Only
# segments that no process maps are removed (here every node shares this host's /dev/shm).
mkdir -p "$S"
cat >"$S/epilog.sh" <<'EPILOG'
#!/bin/bash
shopt -s nullglob
used=$(cat /proc/[0-9]*/maps 2>/dev/null | grep -o '/dev/shm/mpich_[a-z]*_[0-9a-f_]*' | sort -u)
for f in /dev/shm/mpich_shm_* /dev/shm/mpich_vci_*; do
    grep -qxF "$f" <<<"$used" || rm -f "$f"
done
exit 0
EPILOG
chmod 755 "$S/epilog.sh"

host=$(hostname -s)
mem=$(awk '/MemTotal/ {m = int($2 / 1024 / 2); if (m > 8000) m = 8000; print m}' /proc/meminfo)
nodes="n1" ports=17001
((N > 1)) && nodes="n[1-$N]" ports="17001-$((17000 + N))"
conf=$(cat <<CONF
ClusterName=resilientci
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$S/state/ctld
SlurmdSpoolDir=$S/state/d.%n
SlurmctldPidFile=$S/state/slurmctld.pid
SlurmdPidFile=$S/state/slurmd.%n.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd.%n.log
MailProg=/bin/true
Epilog=$S/epilog.sh
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$S/log/jobcomp.txt
MpiDefault=pmi2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=10
SlurmdTimeout=10
MessageTimeout=10
InactiveLimit=0
KillWait=5
OverTimeLimit=0
MinJobAge=600
SchedulerParameters=sched_interval=2,bf_interval=2
NodeName=${nodes} NodeHostname=${host} NodeAddr=127.0.0.1 Port=${ports} CPUs=8 RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=n1 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
PartitionName=multi Nodes=${nodes} MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
)

if command -v sinfo >/dev/null && nodes_up && [[ -s $S/state/slurmctld.pid ]] &&
    [[ $(sinfo -h -N -p multi -o '%N' 2>/dev/null | sort -u | wc -l) -eq $N ]] &&
    [[ -f /etc/slurm/slurm.conf && $(cat /etc/slurm/slurm.conf) == "$conf" ]]; then
    echo "slurm: already running ($(sinfo -h -o '%P %D %T %c' | tr '\n' ' '))"
    exit 0
fi

pkgs=(slurmctld slurmd slurm-client munge)
if ! dpkg -s "${pkgs[@]}" >/dev/null 2>&1; then
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi

mkdir -p "$S/state/ctld" "$S/log" /etc/slurm
for i in $(seq 1 "$N"); do mkdir -p "$S/state/d.n$i"; done
printf '%s\n' "$conf" >/etc/slurm/slurm.conf

if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --force
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
fi
mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
if ! munge -n >/dev/null 2>&1; then
    detach runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 1 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
fi

# A previous instance (from an earlier test run) is stopped first: its PIDs are in $S/state.
bash "$(dirname "$0")/down.sh" --keep-munge >/dev/null 2>&1 || true
detach /usr/sbin/slurmctld
for i in $(seq 1 "$N"); do detach /usr/sbin/slurmd -N "n$i"; done
for _ in $(seq 1 150); do nodes_up && break; sleep 0.2; done
if ! nodes_up; then
    echo "slurm: not every node became idle" >&2
    sinfo -N >&2 || true
    tail -n 30 "$S/log/slurmctld.log" "$S"/log/slurmd.*.log >&2 || true
    exit 1
fi
echo "slurm: up ($(sinfo -h -o '%P %D %T cpus=%c' | tr '\n' ' '))"
