#!/usr/bin/env bash
# Router CPU per request of two bellows-router binaries, alternating, in front of the same two
# simulated workers (2 ms step, 16-token prompts, 8-token answers, 64 connections, as the
# "overhead" part of scripts/bench-router.sh): for changes too small for the whole table to show.
#   usage: scripts/bench/router-ab.sh ROUTER_A ROUTER_B [RUNS]     (default 3 runs of each)
#   env:   REQUESTS (per run, default 10000), POLICY (default round_robin), OUT (default
#          $CARGO_TARGET_DIR/router-ab); JSON lines in $OUT/results.jsonl, medians printed.
set -euo pipefail
cd "$(dirname "$0")/../.."
a="$(realpath "$1")" b="$(realpath "$2")" runs="${3:-3}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bellows/target}"
cargo build --release -q -p bellows-worker -p bellows-bench
bin="$CARGO_TARGET_DIR/release"
out="${OUT:-$CARGO_TARGET_DIR/router-ab}"
mkdir -p "$out"
: >"$out/results.jsonl"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
read -r w1 w2 r <<<"$(python3 -c 'import socket
s = [socket.socket() for _ in range(3)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))')"
sim='{"base_us":2000,"per_token_us":0,"per_sequence_us":0}'
for w in "$w1" "$w2"; do
    "$bin/bellows-worker" serve --engine sim --listen "127.0.0.1:$w" --sim-config "$sim" --max-batch-tokens 2048 \
        >"$out/worker-$w.log" 2>&1 &
    pids+=($!)
done
for run in $(seq "$runs"); do
    for v in a b; do
        router="$a"; [[ $v == b ]] && router="$b"
        RUST_LOG=warn "$router" --listen "127.0.0.1:$r" --workers "127.0.0.1:$w1,127.0.0.1:$w2" \
            --policy "${POLICY:-round_robin}" >"$out/router-$v.log" 2>&1 &
        rp=$!
        pids+=("$rp")
        for _ in $(seq 300); do
            curl -sf -o /dev/null -H 'content-type: application/json' -d '{"model":"sim","prompt":[1,2],"max_tokens":1}' \
                "http://127.0.0.1:$r/v1/completions" && break
            sleep 0.1
        done
        for mode in whole stream; do
            stream=(); [[ $mode == stream ]] && stream=(--stream)
            "$bin/bellows-bench" load --label "$v|$mode|$run" --target "http://127.0.0.1:$r" --max-tokens 8 \
                --prompt-tokens 16 --connections 64 --requests "${REQUESTS:-10000}" --warmup 1000 "${stream[@]}" \
                --cpu-pid "$rp" >>"$out/results.jsonl"
        done
        kill "$rp"; wait "$rp" 2>/dev/null || true
    done
done
python3 - "$out/results.jsonl" "$a" "$b" <<'PY'
import collections, json, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    v, mode, _ = r["label"].split("|")
    runs[(v, mode)].append(r["cpu"]["us_per_request"])
for v, path in (("a", sys.argv[2]), ("b", sys.argv[3])):
    for mode in ("whole", "stream"):
        us = runs[(v, mode)]
        print(json.dumps({"router": v, "binary": path, "response": mode, "cpu_us_per_request_median": statistics.median(us), "runs": us}))
PY
