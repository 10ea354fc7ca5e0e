#!/usr/bin/env bash
# A one-machine Slurm cluster on localhost: munged, slurmctld and slurmd, one node, one partition.
#
#   scripts/slurm-local.sh start [--no-install]   # install (Debian's slurm-wlm, munge) and start;
#                                                 # a no-op when it already runs
#   scripts/slurm-local.sh status                 # the node's state; exit 1 when it is not up
#   scripts/slurm-local.sh env                    # `export SLURM_CONF=...` for sbatch, srun, sinfo
#   scripts/slurm-local.sh stop                   # stop the three daemons it started
#
# Then:  eval "$(scripts/slurm-local.sh env)"; sbatch --nodes=1 --ntasks=3 --overcommit \
#            deploy/slurm/ps.sbatch digits --max-steps 300 --train-dir "$PWD/runs/digits"
#
# Everything lives under TOWERFLOW_SLURM_DIR (default /var/lib/towerflow-slurm): the munge key and
# socket, slurm.conf, state, spool, pid and log files. The system's own Slurm or munge
# configuration (/etc/slurm, /etc/munge) is never touched. The node is called `localhost`
# (address 127.0.0.1), with this machine's real CPUs and memory (`slurmd -C`); no cgroups
# (proctrack/linuxproc, task/none). slurmctld listens on TOWERFLOW_SLURM_PORT (default 16817),
# slurmd on the next port, so a system Slurm on 6817/6818 is left alone.
#
# The daemons run as root: as root, the script runs them itself; otherwise through `sudo -n`.
#
# Exit status: 0 done; 1 failed; 2 usage; 3 Slurm cannot be installed or started on this
# machine (not root and no password-less sudo, no apt-get, no Slurm and --no-install).
set -euo pipefail

DIR=${TOWERFLOW_SLURM_DIR:-/var/lib/towerflow-slurm}
PORT=${TOWERFLOW_SLURM_PORT:-16817}
WAIT=${TOWERFLOW_SLURM_WAIT:-60}
CONF=$DIR/etc/slurm.conf
NODE=localhost
PACKAGES=(slurm-wlm munge)
COMMANDS=(munged slurmctld slurmd sbatch srun sinfo scontrol squeue)

say() { echo "slurm-local: $*" >&2; }
unavailable() { say "$*"; exit 3; }
fail() { say "$*"; exit 1; }

privileged() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    else
        sudo -n "$@"
    fi
}

can_be_root() {
    [ "$(id -u)" -eq 0 ] || { command -v sudo >/dev/null && sudo -n true 2>/dev/null; }
}

missing_commands() {
    local c
    for c in "${COMMANDS[@]}"; do
        PATH=$PATH:/usr/sbin:/sbin command -v "$c" >/dev/null || echo "$c"
    done
}

install() {
    local missing
    missing=$(missing_commands)
    [ -z "$missing" ] && return 0
    [ "${NO_INSTALL:-0}" = 1 ] && unavailable "Slurm is not installed (missing: $(echo $missing));" \
        "run scripts/slurm-local.sh start without --no-install, or apt-get install ${PACKAGES[*]}"
    command -v apt-get >/dev/null || unavailable "Slurm is not installed and there is no apt-get;" \
        "install ${PACKAGES[*]} with this system's package manager"
    say "installing ${PACKAGES[*]}"
    privileged env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 \
        && privileged env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            "${PACKAGES[@]}" >&2 \
        || unavailable "apt-get install ${PACKAGES[*]} failed"
}

# pid in pid file $1 if that process runs the program $2
running_pid() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ] \
        && echo "$pid"
}

node_state() {
    SLURM_CONF=$CONF timeout 10 sinfo --noheader --nodes="$NODE" --Node --format=%T 2>/dev/null \
        | head -n 1
}

write_config() {
    local node_line
    node_line=$(PATH=$PATH:/usr/sbin slurmd -C | head -n 1) \
        || fail "slurmd -C cannot describe this machine"
    node_line=$(sed -E "s/^NodeName=[^ ]+/NodeName=$NODE NodeAddr=127.0.0.1/" <<<"$node_line")
    privileged mkdir -p "$DIR/etc" "$DIR/munge" "$DIR/state" "$DIR/spool" "$DIR/run" "$DIR/log"
    privileged chmod 0755 "$DIR" "$DIR/etc" "$DIR/munge" "$DIR/log"
    privileged chmod 0700 "$DIR/state"
    privileged tee "$CONF" >/dev/null <<CONF
# Written by scripts/slurm-local.sh: a one-machine cluster for tests.
ClusterName=towerflow-local
SlurmctldHost=$NODE
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge=300
KillWait=10
InactiveLimit=0
$node_line State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
    privileged chmod 0644 "$CONF"
}

start_munged() {
    running_pid "$DIR/run/munged.pid" munged >/dev/null && return 0
    if ! privileged test -s "$DIR/munge/munge.key"; then
        privileged sh -c "umask 077; dd if=/dev/urandom of='$DIR/munge/munge.key' bs=1024 count=1 \
            status=none"
    fi
    privileged env PATH="$PATH:/usr/sbin" munged --force --key-file="$DIR/munge/munge.key" \
        --socket="$DIR/munge/munge.socket" --pid-file="$DIR/run/munged.pid" \
        --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
        || fail "munged did not start; see $DIR/log/munged.log"
}

start_daemon() {  # slurmctld | slurmd
    running_pid "$DIR/run/$1.pid" "$1" >/dev/null && return 0
    local args=()
    [ "$1" = slurmd ] && args=(-N "$NODE")
    privileged env SLURM_CONF="$CONF" PATH="$PATH:/usr/sbin" "$1" "${args[@]}" \
        || fail "$1 did not start; see $DIR/log/$1.log"
}

wait_idle() {
    local deadline=$((SECONDS + WAIT)) state=""
    while [ $SECONDS -lt $deadline ]; do
        state=$(node_state || true)
        case $state in
            idle|mixed|allocated) return 0 ;;
            down*|drain*|fail*)
                SLURM_CONF=$CONF privileged scontrol update nodename="$NODE" state=resume \
                    2>/dev/null || true ;;
        esac
        sleep 1
    done
    fail "node $NODE is ${state:-not reported by sinfo} after ${WAIT}s; see $DIR/log/"
}

do_start() {
    if [ -r "$CONF" ] && running_pid "$DIR/run/slurmctld.pid" slurmctld >/dev/null \
        && running_pid "$DIR/run/slurmd.pid" slurmd >/dev/null \
        && running_pid "$DIR/run/munged.pid" munged >/dev/null; then
        wait_idle
        say "already running; node $NODE is $(node_state)"
        return 0
    fi
    can_be_root || unavailable "starting Slurm's daemons needs root: run as root or with" \
        "password-less sudo"
    install
    running_pid "$DIR/run/slurmctld.pid" slurmctld >/dev/null || write_config
    start_munged
    start_daemon slurmctld
    start_daemon slurmd
    wait_idle
    say "node $NODE is $(node_state); export SLURM_CONF=$CONF"
}

do_stop() {
    local name pid
    for name in slurmd slurmctld munged; do
        pid=$(running_pid "$DIR/run/$name.pid" "$name") || continue
        privileged kill -TERM "$pid"
        local deadline=$((SECONDS + 30))
        while [ -d "/proc/$pid" ] && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
        [ -d "/proc/$pid" ] && privileged kill -KILL "$pid"
        say "stopped $name ($pid)"
    done
}

do_status() {
    local state
    state=$(node_state || true)
    [ -n "$state" ] || { say "not running (SLURM_CONF=$CONF)"; exit 1; }
    echo "$NODE $state"
}

main() {
    local command=${1:-start}
    [ $# -gt 0 ] && shift
    NO_INSTALL=0
    for arg in "$@"; do
        case $arg in
            --no-install) NO_INSTALL=1 ;;
            *) say "unknown option $arg"; exit 2 ;;
        esac
    done
    case $command in
        start) do_start ;;
        stop) do_stop ;;
        status) do_status ;;
        env) echo "export SLURM_CONF=$CONF" ;;
        -h|--help|help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' ;;
        *) say "unknown command $command; use start, stop, status or env"; exit 2 ;;
    esac
}

main "$@"
