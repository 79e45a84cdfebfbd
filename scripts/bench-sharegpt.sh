#!/usr/bin/env bash
# ShareGPT conversations replayed as multi-turn chats (scripts/bench/sharegpt.py), through
# bellows-router and through the reference routers (sglang-router, vllm-router) on the same
# simulated workers, then optionally through Bellows on the real model (docs/BENCHMARKS.md,
# "ShareGPT multi-turn"). Later turns carry the earlier ones, so they hit the prefix cache only
# if placement sends a conversation back to the worker that holds it.
#   usage: scripts/bench-sharegpt.sh
#   env:   CONVERSATIONS (default 400), CLIENTS (16), MAX_TOKENS (32),
#          ROUTERS (default "bellows:cache_aware bellows:round_robin sglang:cache_aware
#          sglang:round_robin vllm:cache_aware vllm:round_robin"),
#          REAL=1 also replays REAL_CONVERSATIONS (default 24) on the default model through
#          scripts/run.sh's cluster (2 workers; needs the model: scripts/fetch-model.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
conversations="${CONVERSATIONS:-400}"
routers="${ROUTERS:-bellows:cache_aware bellows:round_robin sglang:cache_aware sglang:round_robin vllm:cache_aware vllm:round_robin}"
venv="$HOME/.cache/bellows/bench-venv"
cargo build --release -q --workspace --bins
if [[ "$routers" == *sglang* || "$routers" == *vllm* ]] && ! "$venv/bin/python" -c "import sglang_router, vllm_router" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q sglang-router==0.3.2 vllm-router==0.1.17
fi
bin="$CARGO_TARGET_DIR/release"
work=$(mktemp -d)
pgids=()
stop_all() {
    for p in "${pgids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    pgids=()
}
trap stop_all EXIT
start() { # LOG COMMAND...: in its own process group
    setsid "${@:2}" >"$work/$1.log" 2>&1 &
    pgids+=($!)
}
free_ports() {
    python3 -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}
wait_ready() { # URL MODEL
    for _ in $(seq 1200); do
        curl -sf -o /dev/null -H 'content-type: application/json' \
            -d "{\"model\":\"$2\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1}" \
            "$1/v1/chat/completions" && return 0
        sleep 0.1
    done
    echo "not ready: $1 (logs in $work)" >&2
    return 1
}

python3 scripts/bench/sharegpt.py prepare "$work/conversations.jsonl" "$conversations" >&2

# 4 workers, 8 sequences each, KV for 16k tokens each: the active conversations fit in the
# cluster's caches only if each stays on one worker. Prefill costs 50 us a token.
sim='{"base_us":2000,"per_token_us":50,"per_sequence_us":20}'
for spec in $routers; do
    name=${spec%%:*} policy=${spec#*:}
    read -r -a ports <<<"$(free_ports 9)"
    workers=() urls=() maps=()
    for i in 0 1 2 3; do
        start "sim-$i" "$bin/bellows-worker" serve --engine sim --listen "127.0.0.1:${ports[$i]}" --sim-config "$sim" \
            --max-running 8 --kv-cache-mb 16 --metrics-listen 127.0.0.1:0
        workers+=("127.0.0.1:${ports[$i]}")
        urls+=("http://127.0.0.1:${ports[$((i + 4))]}")
        maps+=(--map "127.0.0.1:${ports[$((i + 4))]}=127.0.0.1:${ports[$i]}")
    done
    r=${ports[8]}
    if [[ $name == bellows ]]; then
        start router env RUST_LOG=warn "$bin/bellows-router" --listen "127.0.0.1:$r" --workers "$(IFS=,; echo "${workers[*]}")" \
            --policy "$policy"
    else
        start shim "$bin/bellows-bench" sim-openai "${maps[@]}"
        wait_ready "${urls[0]}" sim
        module=sglang_router level=warn
        [[ $name == vllm ]] && module=vllm_router level=warning
        start router "$venv/bin/python" -m "$module.launch_router" --host 127.0.0.1 --port "$r" --policy "$policy" \
            --prometheus-port "$(free_ports 1)" --log-level "$level" --worker-urls "${urls[@]}"
    fi
    wait_ready "http://127.0.0.1:$r" sim
    LABEL="$name $policy (sim)" python3 scripts/bench/sharegpt.py replay "http://127.0.0.1:$r" "$work/conversations.jsonl"
    stop_all
done

if [[ "${REAL:-0}" == 1 ]]; then
    head -n "${REAL_CONVERSATIONS:-24}" "$work/conversations.jsonl" >"$work/real.jsonl"
    start run scripts/run.sh
    for _ in $(seq 1800); do grep -q "Bellows is up" "$work/run.log" && break; sleep 1; done
    model=$(curl -s http://127.0.0.1:8080/v1/models | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
    MODEL="$model" CLIENTS="${REAL_CLIENTS:-4}" LABEL="bellows cache_aware (real model, 2 workers)" \
        python3 scripts/bench/sharegpt.py replay http://127.0.0.1:8080 "$work/real.jsonl"
    stop_all
fi
