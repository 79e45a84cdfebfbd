#!/usr/bin/env bash
# Run a command with the caller's own background work paused, and resume it after: benchmarks on
# 2 shared cores are meaningless while a build runs beside them. Only the process groups named in
# BELLOWS_QUIET_PGIDS (space-separated; groups the caller started, e.g. a background build's) are
# paused; nothing else on the machine is signalled. Without it the command just runs.
#   usage: BELLOWS_QUIET_PGIDS="1234 5678" scripts/quiet.sh COMMAND...
set -uo pipefail
groups=()
for g in ${BELLOWS_QUIET_PGIDS:-}; do
    [[ "$g" =~ ^[0-9]+$ ]] && kill -STOP -- "-$g" 2>/dev/null && groups+=("$g")
done
resume() { for g in "${groups[@]}"; do kill -CONT -- "-$g" 2>/dev/null; done; }
trap resume EXIT
"$@"
