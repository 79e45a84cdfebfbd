#!/usr/bin/env bash
# A public serving benchmark client against a Bellows cluster, beside our own load generator on
# the same cluster (docs/BENCHMARKS.md, "GuideLLM against Bellows"). GuideLLM (PyPI, pinned) drives
# /v1/chat/completions with streaming at a fixed concurrency; then `bellows-bench load` drives
# /v1/completions at the same concurrency and length. Both report TTFT, request throughput and
# output tokens/s; GuideLLM also ITL (ours gives it as (latency - TTFT) / (tokens - 1)).
# The cluster: one bellows-router over WORKERS simulated workers (real scheduler and KV cache).
#   usage: scripts/bench-guidellm.sh
#   env:   CONCURRENCY (default "8 32"), REQUESTS (default 300 per level), TOKENS (default 32),
#          WORKERS (default 2)
# GuideLLM is installed into ~/.cache/bellows/guidellm-venv on first use; it pulls PyTorch, about
# 6 GB, which is why this is a script and not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
levels="${CONCURRENCY:-8 32}"
requests="${REQUESTS:-300}"
tokens="${TOKENS:-32}"
workers="${WORKERS:-2}"
venv="$HOME/.cache/bellows/guidellm-venv"
guidellm_version=0.8.1
if ! "$venv/bin/guidellm" --version 2>/dev/null | grep -q "$guidellm_version"; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "guidellm==$guidellm_version"
fi
cargo build --release -q --workspace --bins
bin="$CARGO_TARGET_DIR/release"
work=$(mktemp -d)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pgids=()
trap 'for p in "${pgids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done; wait 2>/dev/null || true' EXIT

addresses=()
for i in $(seq "$workers"); do
    port=$(free_port)
    setsid "$bin/bellows-worker" serve --engine sim --listen "127.0.0.1:$port" --metrics-listen "127.0.0.1:0" \
        >"$work/worker-$i.log" 2>&1 &
    pgids+=($!)
    addresses+=("127.0.0.1:$port")
done
port=$(free_port)
target="http://127.0.0.1:$port"
RUST_LOG=warn setsid "$bin/bellows-router" --listen "127.0.0.1:$port" --workers "$(IFS=,; echo "${addresses[*]}")" \
    >"$work/router.log" 2>&1 &
pgids+=($!)
for _ in $(seq 300); do
    curl -sf -o /dev/null -H 'content-type: application/json' -d '{"model":"sim","prompt":"t1","max_tokens":1}' \
        "$target/v1/completions" && break
    sleep 0.1
done

# GuideLLM's prompts: 64 words of text each (10 tenants' openings, then words of their own).
python3 - "$work/prompts.jsonl" "$tokens" <<'EOF'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(4000):
        words = " ".join(f"w{(i * 7 + j) % 500}" for j in range(60))
        f.write(json.dumps({"prompt": f"tenant {i % 10} asks: {words}", "output_tokens_count": int(sys.argv[2])}) + "\n")
EOF

printf '| client | concurrency | requests/s | output tokens/s | TTFT p50 / mean (ms) | ITL p50 (ms) | errors |\n|---|---|---|---|---|---|---|\n'
for c in $levels; do
    "$venv/bin/guidellm" run --backend "kind=openai_http,target=$target,model=sim" \
        --profile "kind=concurrent,streams=$c" --constraint "kind=max_requests,count=$requests" \
        --data "kind=json_file,path=$work/prompts.jsonl" --output "kind=json,path=$work/guidellm-$c.json" \
        --disable-console >"$work/guidellm-$c.log" 2>&1
    python3 - "$work/guidellm-$c.json" "$c" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))["benchmarks"][0]["metrics"]
ok = lambda k: m[k]["successful"]
errors = m["request_totals"]["errored"]
print(f"| GuideLLM {sys.argv[2]} streams (chat) | {sys.argv[2]} (mean {ok('request_concurrency')['mean']:.1f}) | "
      f"{ok('requests_per_second')['mean']:.1f} | {ok('output_tokens_per_second')['mean']:.0f} | "
      f"{ok('time_to_first_token_ms')['median']:.1f} / {ok('time_to_first_token_ms')['mean']:.1f} | "
      f"{ok('inter_token_latency_ms')['median']:.2f} | {errors} |")
EOF
    "$bin/bellows-bench" load --target "$target" --stream --max-tokens "$tokens" --connections "$c" \
        --requests "$requests" --warmup 20 --prompt-tokens 64 --prompt-format text >"$work/ours-$c.json"
    python3 - "$work/ours-$c.json" "$c" "$tokens" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
tokens = int(sys.argv[3])
itl = (d["latency_ms"]["p50"] - d["ttft_ms"]["p50"]) / (tokens - 1)
print(f"| bellows-bench load (completions) | {sys.argv[2]} | {d['requests_per_s']:.1f} | {d['requests_per_s'] * tokens:.0f} | "
      f"{d['ttft_ms']['p50']:.1f} / {d['ttft_ms']['mean']:.1f} | {itl:.2f} (derived) | {d['errors']} |")
EOF
done
