#!/usr/bin/env bash
# Lists (and with --kill, ends) the processes that carry a run's marker in their environment.
#
#   scripts/leftover-processes.sh MARK EXCLUDE_PID [--kill]
#
# A script that wants to know whether anything it started outlived it exports
# TOWERFLOW_RUN_MARK=<something unique> at its start: every process it starts (servers, workers,
# daemons that detach, jobs a local scheduler runs) inherits the marker. At its end it calls this
# script with the marker and its own pid. Exit status: 0 when no such process is left (after
# waiting up to TOWERFLOW_LEFTOVER_GRACE_S, default 10 s, for those already ending), 1 when some are (listed on stderr, and with --kill
# sent SIGKILL).
set -uo pipefail
mark=${1:?usage: leftover-processes.sh MARK EXCLUDE_PID [--kill]}
exclude=${2:?usage: leftover-processes.sh MARK EXCLUDE_PID [--kill]}
kill_them=${3:-}
unset TOWERFLOW_RUN_MARK  # what this script starts is not the run's

marked() {  # pids whose environment holds TOWERFLOW_RUN_MARK=$mark, not ours, not $exclude
    local d pid
    for d in /proc/[0-9]*; do
        pid=${d#/proc/}
        [ "$pid" = "$exclude" ] || [ "$pid" = "$$" ] || [ "$pid" = "$BASHPID" ] && continue
        { tr '\0' '\n' < "$d/environ"; } 2>/dev/null | grep -qxF "TOWERFLOW_RUN_MARK=$mark" \
            && echo "$pid"
    done
}

deadline=$((SECONDS + ${TOWERFLOW_LEFTOVER_GRACE_S:-10}))
left=$(marked)
while [ -n "$left" ] && [ $SECONDS -lt $deadline ]; do
    sleep 0.5
    left=$(marked)
done
[ -z "$left" ] && exit 0
echo "These processes started by this run are still running:" >&2
for pid in $left; do
    echo "  $pid $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | cut -c1-200)" >&2
done
if [ "$kill_them" = "--kill" ]; then
    # shellcheck disable=SC2086
    kill -KILL $left 2>/dev/null || true
fi
exit 1
