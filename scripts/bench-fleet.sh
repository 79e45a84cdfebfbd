#!/usr/bin/env bash
# One router over a fleet of simulated workers in one process (docs/BENCHMARKS.md, "One router
# over a 1,000-node fleet"): how long until every link is up, what following them costs over
# FOLLOW_S seconds (CPU, memory, links lost), then a shared-prefix workload and the placement
# histogram's percentiles from the router's /metrics.
#   usage: scripts/bench-fleet.sh
#   env:   NODES (default 1000), CONNECTIONS (default 32), REQUESTS (default 6000),
#          FOLLOW_S (default 20)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
nodes="${NODES:-1000}"
connections="${CONNECTIONS:-32}"
requests="${REQUESTS:-6000}"
follow_s="${FOLLOW_S:-20}"
cargo build --release -q --workspace --bins
bin="$CARGO_TARGET_DIR/release"
work=$(mktemp -d)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cpu_ms() { awk -v hz="$(getconf CLK_TCK)" '{print int(($14 + $15) * 1000 / hz)}' "/proc/$1/stat"; }
rss_kb() { awk '/VmRSS/{print $2}' "/proc/$1/status"; }
metric() { curl -s "http://127.0.0.1:$port/metrics" | awk -v m="$1" '$1 == m {print $2}'; }

export RUST_LOG=info
setsid "$bin/bellows-worker" fleet --nodes "$nodes" --engine sim --addresses-file "$work/addresses" \
    >"$work/fleet.log" 2>&1 &
fleet=$!
router=""
trap 'kill -TERM -- -$fleet ${router:+-$router} 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for _ in $(seq 300); do [[ -s "$work/addresses" ]] && break; sleep 0.1; done
port=$(free_port)
started=$(date +%s.%N)
setsid "$bin/bellows-router" --listen "127.0.0.1:$port" --workers "$(cat "$work/addresses")" >"$work/router.log" 2>&1 &
router=$!
up=never
for _ in $(seq 600); do
    if [[ "$(metric bellows_router_placeable_workers)" == "$nodes" ]]; then
        up=$(python3 -c "print(round($(date +%s.%N) - $started, 2))")
        break
    fi
    sleep 0.1
done
echo "nodes: $nodes; every link placeable after: $up s"
r0=$(cpu_ms "$router"); f0=$(cpu_ms "$fleet")
sleep "$follow_s"
r1=$(cpu_ms "$router"); f1=$(cpu_ms "$fleet")
echo "following for $follow_s s: router $((r1 - r0)) ms CPU, $(rss_kb "$router") kB; fleet $((f1 - f0)) ms CPU, $(rss_kb "$fleet") kB"
echo "links lost: $(grep -c 'link down' "$work/router.log" || true); silent reports: $(grep -c 'no load report' "$work/router.log" || true); placeable now: $(metric bellows_router_placeable_workers)"
"$bin/bellows-bench" load --target "http://127.0.0.1:$port" --workload shared-prefix --tenants 200 --system-bytes 2000 \
    --connections "$connections" --requests "$requests" --warmup 200 --max-tokens 4 --prompt-format text 2>/dev/null |
    python3 -c "import json, sys; d = json.load(sys.stdin); print(f\"load: {d['requests_per_s']:.0f} req/s, {d['errors']} errors, cached {d['cached_tokens']} of {d['prompt_tokens']} prompt tokens\")"
curl -s "http://127.0.0.1:$port/metrics" | python3 -c '
import re, sys
buckets, count = [], None
for line in sys.stdin:
    m = re.match(r"bellows_router_placement_duration_seconds_bucket\{le=\"([^\"]+)\"\} (\S+)", line)
    if m:
        buckets.append((float(m.group(1)), float(m.group(2))))
    m = re.match(r"bellows_router_placement_duration_seconds_count (\S+)", line)
    if m:
        count = float(m.group(1))
    if line.startswith("bellows_router_prefix_index_entries "):
        print("prefix index entries:", line.split()[1])
print(f"placements: {count:.0f}; placement time (histogram buckets):", ", ".join(
    f"p{int(q * 100)} <= {next(le for le, n in buckets if n >= q * count) * 1e6:.0f} us" for q in (0.5, 0.9, 0.99)))
'
