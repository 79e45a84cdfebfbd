#!/usr/bin/env bash
# The router benchmarks of docs/BENCHMARKS.md ("Router"), with the reference routers from PyPI
# (sglang-router, vllm-router) side by side in one run:
#   overhead   router CPU microseconds per request (utime+stime from /proc, token-id prompts so
#              no tokenization), latency added against calling the workers directly, requests/s
#              at 64 connections, streaming and not. bellows-router fronts simulated workers; the
#              reference routers front fake-openai workers with similar timing (they speak HTTP).
#   placement  a skewed shared-prefix workload (50 tenants with ~2 KB system prompts, one sending
#              half the traffic) on 4 simulated workers with scarce slots and KV cache: throughput,
#              prefix-cache hits against the achievable maximum, TTFT. The reference routers reach
#              the same simulated workers through `bellows-bench sim-openai`.
# Builds what it needs, installs the reference routers into a cached venv, then runs everything on
# free loopback ports under scripts/quiet.sh. Raw JSON lines go to $OUT/results.jsonl (default
# target/bench-router), a table is printed at the end.
#   usage: scripts/bench-router.sh [overhead|placement|all]
#   env:   REQUESTS (overhead, per run, default 10000), PLACEMENT_REQUESTS (default 4000),
#          PLACEMENT_CONNECTIONS (default 64: the workers' queues stay full),
#          RUNS (repeats of each part, default 1; the table shows medians),
#          PLACEMENT_ROUTERS (default "bellows sglang vllm"), PLACEMENT_POLICIES (default: all four
#          of bellows, round_robin and cache_aware of the references),
#          QUICKACK=1 (run in a private network namespace whose loopback acknowledges at once: see
#          "Delayed ACKs" in docs/BENCHMARKS.md; needs root)
set -euo pipefail
cd "$(dirname "$0")/.."
part="${1:-all}"
case "$part" in overhead | placement | all) ;; *) echo "usage: $0 [overhead|placement|all]" >&2; exit 2 ;; esac
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
venv="$HOME/.cache/bellows/bench-venv"
out="${OUT:-$CARGO_TARGET_DIR/bench-router}"
# The binaries are copied here first, so a build running meanwhile cannot swap them mid-run.
bin="$out/bin"

if [[ -z "${BENCH_ROUTER_INNER:-}" ]]; then
    # Build and install before quiet.sh: it pauses the process groups named to it, and a paused
    # build could hold the cargo lock this build waits for.
    nice -n 19 cargo build --release -q --workspace --bins
    if ! "$venv/bin/python" -c "import sglang_router, vllm_router" 2>/dev/null; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q sglang-router==0.3.2 vllm-router==0.1.17
    fi
    mkdir -p "$out/logs" "$bin"
    cp "$CARGO_TARGET_DIR"/release/bellows-{worker,router,bench} "$bin/"
    export BENCH_ROUTER_INNER=1
    if [[ "${QUICKACK:-0}" == 1 ]]; then
        ns="bellows-bench-$$"
        ip netns add "$ns"
        trap 'ip netns delete "$ns"' EXIT
        ip netns exec "$ns" ip link set lo up
        for dst in 127.0.0.0/8 127.0.0.1; do
            ip netns exec "$ns" ip route replace local "$dst" dev lo scope host src 127.0.0.1 table local quickack 1
        done
        scripts/quiet.sh ip netns exec "$ns" "$0" "$@"
        exit
    fi
    exec scripts/quiet.sh "$0" "$@"
fi

results="$out/results.jsonl"
: >"$results"
requests="${REQUESTS:-10000}"
placement_requests="${PLACEMENT_REQUESTS:-4000}"
placement_connections="${PLACEMENT_CONNECTIONS:-64}"
runs="${RUNS:-1}"
export RUST_LOG=warn
pids=()
cleanup() {
    if ((${#pids[@]})); then kill "${pids[@]}" 2>/dev/null || true; fi
    wait 2>/dev/null || true
    pids=()
}
trap cleanup EXIT

free_ports() {
    python3 -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

# start NAME COMMAND...: run in the background, log to $out/logs/NAME.log; its pid in $last_pid.
start() {
    "${@:2}" >"$out/logs/$1.log" 2>&1 &
    last_pid=$!
    pids+=("$last_pid")
}

stop() {
    kill "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
    local keep=() p
    for p in "${pids[@]}"; do [[ $p == "$1" ]] || keep+=("$p"); done
    pids=("${keep[@]}")
}

# Until a one-token completion through URL succeeds.
wait_ready() {
    for _ in $(seq 300); do
        code=$(curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' \
            -d '{"model":"sim","prompt":"t1 t2 t3","max_tokens":1}' "$1/v1/completions" || true)
        [[ "$code" == 200 ]] && { sleep 1; return 0; }
        sleep 0.1
    done
    echo "not ready: $1 (logs in $out/logs)" >&2
    return 1
}

# Processes quiet.sh was not told to pause (another benchmark, a test's workers) keep running:
# wait, up to 2 minutes, until the machine has been nearly idle for a second before measuring.
# Each result also records the machine's busy share during its run.
wait_idle() {
    local busy
    for _ in $(seq 120); do
        busy=$(python3 -c 'import time
def t():
    v = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    return sum(v) - v[3] - v[4], sum(v)
b0, t0 = t(); time.sleep(1); b1, t1 = t()
print(round(100 * (b1 - b0) / max(1, t1 - t0)))')
        ((busy < 15)) && return 0
    done
    echo "warning: the machine is still ${busy}% busy with other work" >&2
}

# load LABEL ARGS...: one measured run, its JSON line kept and shown.
load() {
    echo "== $1" >&2
    wait_idle
    "$bin/bellows-bench" load --label "$1" "${@:2}" | tee -a "$results"
}

sim_worker() { # NAME PORT SIM_CONFIG FLAGS...
    start "$1" "$bin/bellows-worker" serve --engine sim --listen "127.0.0.1:$2" --sim-config "$3" "${@:4}"
}

reference_router() { # NAME(sglang|vllm) PORT POLICY WORKER_URL...
    local module=sglang_router level=warn
    [[ "$1" == vllm ]] && module=vllm_router level=warning
    local metrics_port
    metrics_port=$(free_ports 1)
    start "$1-$3" "$venv/bin/python" -m "$module.launch_router" --host 127.0.0.1 --port "$2" --policy "$3" \
        --prometheus-port "$metrics_port" --log-level "$level" --worker-urls "${@:4}"
}

overhead() { # RUN
    # Simulated workers: a fixed 2 ms step, whatever the batch (no per-token cost), so latency
    # is the same for every request and a router's cost shows. fake-openai: 2 ms to the first
    # token, then 500 tokens/s, the same timing.
    local sim='{"base_us":2000,"per_token_us":0,"per_sequence_us":0}'
    local common=(--max-tokens 8 --prompt-tokens 16)
    local many=(--connections 64 --requests "$requests" --warmup 1000)
    local one=(--connections 1 --requests 200 --warmup 20)
    local w1 w2 w3 w4 f1 f2 r
    read -r w1 w2 w3 w4 f1 f2 <<<"$(free_ports 6)"
    local direct="grpc://127.0.0.1:$w1,127.0.0.1:$w2"
    sim_worker sim-a "$w1" "$sim" --max-batch-tokens 2048
    sim_worker sim-b "$w2" "$sim" --max-batch-tokens 2048
    # The same workers speaking protocol 1 (a Generate call per request, no Session stream).
    sim_worker sim-c "$w3" "$sim" --max-batch-tokens 2048 --protocol-version 1
    sim_worker sim-d "$w4" "$sim" --max-batch-tokens 2048 --protocol-version 1
    # "+1t": the same router on one async thread (--threads 1); "+v1": in front of sim-c, sim-d.
    for policy in round_robin cache_aware round_robin+1t cache_aware+1t round_robin+v1; do
        r=$(free_ports 1)
        local threads=() workers="127.0.0.1:$w1,127.0.0.1:$w2"
        [[ $policy == *+1t ]] && threads=(--threads 1)
        [[ $policy == *+v1 ]] && workers="127.0.0.1:$w3,127.0.0.1:$w4"
        start "bellows-$policy" "$bin/bellows-router" --listen "127.0.0.1:$r" --workers "$workers" \
            --policy "${policy%+*}" "${threads[@]}"
        local router=$last_pid
        wait_ready "http://127.0.0.1:$r"
        if [[ $policy == round_robin ]]; then
            # The router is up and following both workers' load reports, but carries nothing:
            # its CPU here is what watching busy workers costs.
            load "overhead|$1|direct-sim|-|tokens|64|stream" --target "$direct" "${common[@]}" "${many[@]}" --cpu-pid "$router"
            load "overhead|$1|direct-sim|-|tokens|1|stream" --target "$direct" "${common[@]}" "${one[@]}"
        fi
        for stream in "" --stream; do
            local mode=${stream:+stream}
            load "overhead|$1|bellows|$policy|tokens|64|${mode:-whole}" --target "http://127.0.0.1:$r" "${common[@]}" \
                "${many[@]}" $stream --cpu-pid "$router"
            load "overhead|$1|bellows|$policy|tokens|1|${mode:-whole}" --target "http://127.0.0.1:$r" "${common[@]}" \
                "${one[@]}" $stream --cpu-pid "$router"
        done
        # With tokenization (text prompts, as the reference routers get them).
        load "overhead|$1|bellows|$policy|text|64|stream" --target "http://127.0.0.1:$r" "${common[@]}" "${many[@]}" \
            --stream --prompt-format text --cpu-pid "$router"
        stop "$router"
    done
    cleanup

    start fake "$bin/bellows-bench" fake-openai --listen "127.0.0.1:$f1" --listen "127.0.0.1:$f2" --ttft-ms 2 \
        --tokens-per-s 500
    local fake=$last_pid
    wait_ready "http://127.0.0.1:$f1"
    for stream in "" --stream; do
        local mode=${stream:+stream}
        load "overhead|$1|direct-fake|-|text|64|${mode:-whole}" --target "http://127.0.0.1:$f1" "${common[@]}" \
            "${many[@]}" $stream --prompt-format text --cpu-pid "$fake"
        load "overhead|$1|direct-fake|-|text|1|${mode:-whole}" --target "http://127.0.0.1:$f1" "${common[@]}" \
            "${one[@]}" $stream --prompt-format text
    done
    for name in sglang vllm; do
        for policy in round_robin cache_aware; do
            r=$(free_ports 1)
            reference_router "$name" "$r" "$policy" "http://127.0.0.1:$f1" "http://127.0.0.1:$f2"
            local router=$last_pid
            wait_ready "http://127.0.0.1:$r"
            for stream in "" --stream; do
                local mode=${stream:+stream}
                load "overhead|$1|$name|$policy|text|64|${mode:-whole}" --target "http://127.0.0.1:$r" "${common[@]}" \
                    "${many[@]}" $stream --prompt-format text --cpu-pid "$router"
                load "overhead|$1|$name|$policy|text|1|${mode:-whole}" --target "http://127.0.0.1:$r" "${common[@]}" \
                    "${one[@]}" $stream --prompt-format text --cpu-pid "$router"
            done
            stop "$router"
        done
    done
    cleanup
}

placement_run() { # ROUTER POLICY RUN
    # 4 workers, 8 sequences running each, KV for 768 blocks of 16 tokens: enough for each worker's
    # share of the 50 system prompts (about 23 blocks each) when each tenant stays on its workers,
    # far too little for every prompt on every worker. Prefill costs 50 us a token, so a cache hit
    # saves most of a request's work.
    local sim='{"base_us":2000,"per_token_us":50,"per_sequence_us":20}'
    local ports workers=() urls=() maps=()
    read -r -a ports <<<"$(free_ports 9)"
    for i in 0 1 2 3; do
        sim_worker "placement-sim-$i" "${ports[$i]}" "$sim" --max-running 8 --kv-cache-mb 12 --max-batch-tokens 256
        workers+=("127.0.0.1:${ports[$i]}")
        urls+=("http://127.0.0.1:${ports[$((i + 4))]}")
        maps+=(--map "127.0.0.1:${ports[$((i + 4))]}=127.0.0.1:${ports[$i]}")
    done
    local r=${ports[8]} list
    list=$(IFS=,; echo "${workers[*]}")
    if [[ $1 == bellows ]]; then
        start "placement-bellows-$2" "$bin/bellows-router" --listen "127.0.0.1:$r" --workers "$list" --policy "$2"
    else
        start placement-shim "$bin/bellows-bench" sim-openai "${maps[@]}"
        wait_ready "${urls[0]}"
        reference_router "$1" "$r" "$2" "${urls[@]}"
    fi
    local router=$last_pid
    wait_ready "http://127.0.0.1:$r"
    load "placement|$3|$1|$2|text|$placement_connections|stream" --target "http://127.0.0.1:$r" \
        --workload shared-prefix --prompt-format text --stream --connections "$placement_connections" \
        --requests "$placement_requests" --max-tokens 32 \
        --watch "$list" --cpu-pid "$router"
    if [[ $1 == bellows ]]; then
        # What placement expected to be cached, next to what the workers reported.
        curl -s "http://127.0.0.1:$r/metrics" | python3 -c 'import json, sys
m = {l.split()[0].removeprefix("bellows_router_").removesuffix("_total"): float(l.split()[1])
     for l in sys.stdin if l.startswith("bellows_router_") and "tokens" in l}
print(json.dumps({"router_metrics_of": sys.argv[1], **m}))' "placement|$3|$1|$2" | tee -a "$results"
    fi
    cleanup
}

placement() {
    local name policy policies
    for run in $(seq "$runs"); do
        for name in ${PLACEMENT_ROUTERS:-bellows sglang vllm}; do
            if [[ $name == bellows ]]; then
                policies=${PLACEMENT_POLICIES:-round_robin least_load power_of_two cache_aware}
            else
                policies=${PLACEMENT_POLICIES:-round_robin cache_aware}
            fi
            for policy in $policies; do
                placement_run "$name" "$policy" "$run"
            done
        done
    done
}

echo "{\"date\": \"$(date -u +%FT%TZ)\", \"cpu\": \"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)\", \"cores\": $(nproc), \"quickack\": ${QUICKACK:-0}}" | tee -a "$results"
if [[ $part != placement ]]; then
    for run in $(seq "$runs"); do overhead "$run"; done
fi
[[ $part == overhead ]] || placement
python3 scripts/bench-router-table.py "$results"
