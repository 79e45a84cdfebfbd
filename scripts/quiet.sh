#!/usr/bin/env bash
# Run a command with every other niced (background) process on the machine paused, and resume
# them after: benchmarks on 2 shared cores are meaningless while a build runs beside them.
#   usage: scripts/quiet.sh COMMAND...
set -uo pipefail
stopped=()
resume() { ((${#stopped[@]})) && kill -CONT "${stopped[@]}" 2>/dev/null; }
trap resume EXIT
# Repeat: a parent may have started a child between listing and stopping.
for _ in 1 2 3 4 5; do
    pids=$(ps -eo pid=,ni=,stat= | awk '$2 > 0 && $3 !~ /T/ {print $1}')
    [[ -z "$pids" ]] && break
    kill -STOP $pids 2>/dev/null
    stopped+=($pids)
    sleep 0.2
done
"$@"
