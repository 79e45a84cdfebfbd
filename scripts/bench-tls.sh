#!/usr/bin/env bash
# What mutual TLS between router and workers costs (docs/BENCHMARKS.md, "Mutual TLS"): the same
# router and simulated workers in plaintext and with mTLS, side by side, RUNS times alternating.
# Router CPU microseconds per request (utime+stime from /proc), latency at one connection and
# requests/s at 64, whole and streamed, token-id prompts (no tokenization). Certificates are made
# here with openssl into a temp dir. Raw JSON lines go to $OUT/results.jsonl (default
# target/bench-tls).
#   usage: scripts/bench-tls.sh        env: REQUESTS (per run, default 10000), RUNS (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
nice -n 19 cargo build --release -q --workspace --bins
out="${OUT:-$CARGO_TARGET_DIR/bench-tls}"
mkdir -p "$out/logs"
bin="$CARGO_TARGET_DIR/release"
results="$out/results.jsonl"
: >"$results"
requests="${REQUESTS:-10000}"
runs="${RUNS:-2}"
export RUST_LOG=warn
pki=$(mktemp -d)
pids=()
cleanup() {
    if ((${#pids[@]})); then kill "${pids[@]}" 2>/dev/null || true; fi
    wait 2>/dev/null || true
    pids=()
}
trap 'cleanup; rm -rf "$pki"' EXIT

# A CA, and certificates it signs for the workers (127.0.0.1: reached as --workers entries)
# and the router.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=bench-ca \
    -keyout "$pki/ca-key.pem" -out "$pki/ca.pem" 2>/dev/null
issue() { # NAME SAN
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" \
        -keyout "$pki/$1-key.pem" -out "$pki/$1.csr" 2>/dev/null
    openssl x509 -req -in "$pki/$1.csr" -CA "$pki/ca.pem" -CAkey "$pki/ca-key.pem" -CAcreateserial -days 1 \
        -extfile <(printf 'subjectAltName=%s\n' "$2") -out "$pki/$1.pem" 2>/dev/null
}
issue worker IP:127.0.0.1
issue router DNS:router
tls() { echo --tls-ca "$pki/ca.pem" --tls-cert "$pki/$1.pem" --tls-key "$pki/$1-key.pem"; }

free_ports() {
    python3 -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}
start() { # NAME COMMAND...: in the background, its pid in $last_pid
    "${@:2}" >"$out/logs/$1.log" 2>&1 &
    last_pid=$!
    pids+=("$last_pid")
}
wait_ready() {
    for _ in $(seq 300); do
        code=$(curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' \
            -d '{"model":"sim","prompt":[1,2,3],"max_tokens":1}' "$1/v1/completions" || true)
        [[ "$code" == 200 ]] && return 0
        sleep 0.1
    done
    echo "not ready: $1 (logs in $out/logs)" >&2
    return 1
}

# A fixed 2 ms step whatever the batch: latency is the same for every request, the router's
# cost shows.
sim='{"base_us":2000,"per_token_us":0,"per_sequence_us":0}'
common=(--max-tokens 8 --prompt-tokens 16)
for run in $(seq "$runs"); do
    for mode in plain mtls; do
        read -r w1 w2 r <<<"$(free_ports 3)"
        worker_tls=() router_tls=()
        if [[ $mode == mtls ]]; then
            read -r -a worker_tls <<<"$(tls worker)"
            read -r -a router_tls <<<"$(tls router)"
        fi
        for w in "$w1" "$w2"; do
            start "sim-$mode-$w" "$bin/bellows-worker" serve --engine sim --listen "127.0.0.1:$w" --sim-config "$sim" \
                --max-batch-tokens 2048 --metrics-listen 127.0.0.1:0 "${worker_tls[@]}"
        done
        start "router-$mode" "$bin/bellows-router" --listen "127.0.0.1:$r" --workers "127.0.0.1:$w1,127.0.0.1:$w2" \
            --policy round_robin "${router_tls[@]}"
        router=$last_pid
        wait_ready "http://127.0.0.1:$r"
        for stream in "" --stream; do
            kind=${stream:+stream}
            echo "== run $run $mode ${kind:-whole}" >&2
            "$bin/bellows-bench" load --label "tls|$run|$mode|64|${kind:-whole}" --target "http://127.0.0.1:$r" \
                "${common[@]}" --connections 64 --requests "$requests" --warmup 1000 $stream --cpu-pid "$router" \
                | tee -a "$results"
            "$bin/bellows-bench" load --label "tls|$run|$mode|1|${kind:-whole}" --target "http://127.0.0.1:$r" \
                "${common[@]}" --connections 1 --requests 300 --warmup 30 $stream | tee -a "$results"
        done
        cleanup
    done
done
