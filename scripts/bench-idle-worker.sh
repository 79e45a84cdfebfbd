#!/usr/bin/env bash
# What an idle worker costs (docs/BENCHMARKS.md, "An idle worker"): the CPU time a simulated
# worker with no request and no subscriber uses over SECONDS (default 30), after a 3 s settle.
#   usage: scripts/bench-idle-worker.sh [path/to/bellows-worker]
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
bin="${1:-}"
if [[ -z "$bin" ]]; then
    cargo build --release -q -p bellows-worker
    bin="$CARGO_TARGET_DIR/release/bellows-worker"
fi
seconds="${SECONDS_IDLE:-30}"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
metrics=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
RUST_LOG=warn "$bin" serve --engine sim --listen "127.0.0.1:$port" --metrics-listen "127.0.0.1:$metrics" >/dev/null 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true' EXIT
sleep 3
ticks() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
t0=$(ticks)
sleep "$seconds"
t1=$(ticks)
hz=$(getconf CLK_TCK)
python3 -c "import sys; t=($t1-$t0)/$hz; print(f'idle worker: {t*1000:.0f} ms of CPU in $seconds s = {100*t/$seconds:.2f}% of a core')"
