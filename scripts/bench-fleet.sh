#!/usr/bin/env bash
# One router over fleets of simulated workers in one process (docs/BENCHMARKS.md, "One router
# over a 1,000-node fleet"). For each fleet size: how long until every link is up; what
# following the fleet costs the router while idle (CPU, memory, links lost); a shared-prefix
# workload (router CPU per request, prefix hits, KV events ingested, the placement histogram
# from /metrics); then the placement decision alone (`bellows-bench placement`). Once: the KV-event
# ingestion of one thread (`bellows-bench kv-ingest`), and STREAMS concurrent streams through
# one router over the largest fleet.
#   usage: scripts/bench-fleet.sh
#   env:   SIZES (default "100 300 1000"), CONNECTIONS (32), REQUESTS (6000), FOLLOW_S (10),
#          ROUTER_FLAGS (extra router flags for the per-size runs, e.g. "--threads 1"),
#          STREAMS (10000; 0 skips the phase), STREAM_TOKENS (20, at 500 ms a step)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
sizes="${SIZES:-100 300 1000}"
connections="${CONNECTIONS:-32}"
requests="${REQUESTS:-6000}"
follow_s="${FOLLOW_S:-10}"
streams="${STREAMS:-10000}"
stream_tokens="${STREAM_TOKENS:-20}"
cargo build --release -q --workspace --bins
bin="$CARGO_TARGET_DIR/release"
work=$(mktemp -d)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cpu_ms() { awk -v hz="$(getconf CLK_TCK)" '{print int(($14 + $15) * 1000 / hz)}' "/proc/$1/stat"; }
rss_kb() { awk '/VmRSS/{print $2}' "/proc/$1/status"; }
metric() { curl -s "http://127.0.0.1:$port/metrics" | awk -v m="$1" '$1 == m {print $2}'; }
fleet=""
router=""
stop() { # stop the process groups this script started
    for pid in $router $fleet; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    fleet=""
    router=""
}
trap stop EXIT
export RUST_LOG=info

# start_fleet NODES [SIM_CONFIG]: a fleet in its own process group; waits for its address list.
start_fleet() {
    rm -f "$work/addresses"
    setsid "$bin/bellows-worker" fleet --nodes "$1" --engine sim ${2:+--sim-config "$2"} \
        --addresses-file "$work/addresses" >"$work/fleet.log" 2>&1 &
    fleet=$!
    for _ in $(seq 600); do [[ -s "$work/addresses" ]] && break; sleep 0.1; done
}

# start_router NODES [FLAGS...]: a router over the fleet; prints how long until every link is up.
start_router() {
    local nodes=$1
    shift
    port=$(free_port)
    local started
    started=$(date +%s.%N)
    setsid "$bin/bellows-router" --listen "127.0.0.1:$port" --workers "$(cat "$work/addresses")" "$@" \
        >"$work/router.log" 2>&1 &
    router=$!
    for _ in $(seq 600); do
        if [[ "$(metric bellows_router_placeable_workers)" == "$nodes" ]]; then
            python3 -c "print(f'every link placeable after {$(date +%s.%N) - $started:.2f} s')"
            return
        fi
        sleep 0.1
    done
    echo "links not all up after 60 s: $(metric bellows_router_placeable_workers) of $nodes"
}

histogram() { # percentiles of the router's placement histogram
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
print(f"placement histogram ({count:.0f} placements):", ", ".join(
    f"p{int(q * 100)} <= {next(le for le, n in buckets if n >= q * count) * 1e6:.0f} us" for q in (0.5, 0.99)))
'
}

for nodes in $sizes; do
    echo "== $nodes nodes"
    start_fleet "$nodes"
    start_router "$nodes" ${ROUTER_FLAGS:-}
    r0=$(cpu_ms "$router"); f0=$(cpu_ms "$fleet")
    sleep "$follow_s"
    r1=$(cpu_ms "$router"); f1=$(cpu_ms "$fleet")
    echo "idle for $follow_s s: router $(((r1 - r0) * 100 / (follow_s * 1000))).$(((r1 - r0) * 1000 / (follow_s * 1000) % 10))% of a core, $(rss_kb "$router") kB; fleet $((f1 - f0)) ms CPU, $(rss_kb "$fleet") kB"
    echo "links lost: $(grep -c 'link down' "$work/router.log" || true); silent reports: $(grep -c 'no load report' "$work/router.log" || true)"
    e0=$(metric bellows_router_kv_events_total)
    "$bin/bellows-bench" load --target "http://127.0.0.1:$port" --workload shared-prefix --tenants 200 --system-bytes 2000 \
        --connections "$connections" --requests "$requests" --warmup 200 --max-tokens 4 --prompt-format text \
        --cpu-pid "$router" 2>/dev/null >"$work/load.json"
    e1=$(metric bellows_router_kv_events_total)
    python3 - "$work/load.json" "$e0" "$e1" "$(rss_kb "$router")" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
events = float(sys.argv[3]) - float(sys.argv[2])
print(f"load: {d['requests_per_s']:.0f} req/s, {d['errors']} errors; router {d['cpu']['us_per_request']:.0f} us CPU a request, "
      f"{sys.argv[4]} kB; cached {100 * d['cached_tokens'] / d['prompt_tokens']:.0f}% of prompt tokens; "
      f"KV events ingested: {events / d['elapsed_s']:.0f}/s")
EOF
    histogram
    echo "prefix index entries: $(metric bellows_router_prefix_index_entries); links lost under load: $(grep -c 'link down' "$work/router.log" || true)"
    kill -TERM -- "-$router"; wait "$router" 2>/dev/null || true; router=""
    echo "placement alone: $("$bin/bellows-bench" placement --addresses-file "$work/addresses")"
    stop
done

echo "== KV-event ingestion, one thread: $("$bin/bellows-bench" kv-ingest)"

if [[ "$streams" -gt 0 ]]; then
    largest=${sizes##* }
    echo "== $streams concurrent streams over $largest nodes ($stream_tokens tokens each, 500 ms a step)"
    start_fleet "$largest" '{"base_us": 500000}'
    start_router "$largest" --max-waiting $((streams * 2))
    r0=$(cpu_ms "$router")
    "$bin/bellows-bench" load --target "http://127.0.0.1:$port" --connections "$streams" --requests "$streams" \
        --stream --max-tokens "$stream_tokens" --timeout-s 300 2>"$work/streams.err" >"$work/streams.json" || true
    r1=$(cpu_ms "$router")
    python3 - "$work/streams.json" "$((r1 - r0))" "$(rss_kb "$router")" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (ValueError, OSError):
    sys.exit("the load generator gave no result")
lat = d["latency_ms"] or {}
print(f"{d['requests']} streams completed, {d['errors']} errors (first: {d['first_error']}); all done in {d['elapsed_s']:.1f} s, "
      f"each {lat.get('p50', 0) / 1000:.1f} s (p50) to {lat.get('max', 0) / 1000:.1f} s; TTFT p50 {(d['ttft_ms'] or {}).get('p50')} ms; "
      f"router {int(sys.argv[2]) / 1000:.1f} s CPU, {sys.argv[3]} kB at the end")
EOF
    echo "links lost: $(grep -c 'link down' "$work/router.log" || true)"
    stop
fi
