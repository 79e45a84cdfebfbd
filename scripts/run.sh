#!/usr/bin/env bash
# Run a local Bellows cluster: the router (OpenAI API on http://127.0.0.1:8080) in front of two
# workers serving the default model (SmolLM2-135M-Instruct, fetched on first use). Static
# discovery, no etcd. Ctrl-C stops everything.
#
# Environment: BELLOWS_PORT (router port, default 8080), BELLOWS_WORKER_PORTS (default
# "50051 50052"), BELLOWS_MODEL (another GGUF, e.g. from `scripts/fetch-model.sh gemma3`),
# BELLOWS_MODEL_ID (served name, default SmolLM2-135M-Instruct); the workers read their own
# flags' variables too (e.g. BELLOWS_KV_CACHE_DTYPE=f16, `bellows-worker serve --help`). Extra
# arguments go to the router (e.g. --policy round_robin).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bellows/target}"
# The same build as scripts/test.sh: -p and --workspace builds unify features differently, and
# a different set would rebuild the dependencies.
cargo build --release --workspace --bins
bin="$CARGO_TARGET_DIR/release"
port="${BELLOWS_PORT:-8080}"
model="${BELLOWS_MODEL_ID:-SmolLM2-135M-Instruct}"
logs="$(mktemp -d)"

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

workers=()
for p in ${BELLOWS_WORKER_PORTS:-50051 50052}; do
    "$bin/bellows-worker" serve --engine gguf --model-id "$model" --listen "127.0.0.1:$p" \
        --metrics-listen "127.0.0.1:$((p + 1000))" >"$logs/worker-$p.log" 2>&1 &
    pids+=($!)
    workers+=("127.0.0.1:$p")
done
"$bin/bellows-router" --listen "127.0.0.1:$port" --workers "$(IFS=,; echo "${workers[*]}")" "$@" \
    > >(tee "$logs/router.log") 2>&1 &
pids+=($!)

for _ in $(seq 600); do
    curl -fs "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && break
    sleep 0.2
done
curl -fs "http://127.0.0.1:$port/ready" >/dev/null || { echo "the cluster did not become ready; logs in $logs" >&2; exit 1; }
cat <<MSG

Bellows is up: OpenAI API at http://127.0.0.1:$port/v1 (model "$model", ${#workers[@]} workers; logs in $logs)

  curl http://127.0.0.1:$port/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$model", "messages": [{"role": "user", "content": "Tell me a short story."}], "max_tokens": 64}'

  PYTHONPATH="${BELLOWS_PY_OPENAI:-$HOME/.cache/bellows/py-openai}" python3 -c 'import openai; c = openai.OpenAI(base_url="http://127.0.0.1:$port/v1", api_key="none"); print(c.chat.completions.create(model="$model", messages=[{"role": "user", "content": "Hi!"}]).choices[0].message.content)'

  Structured output (JSON matching a schema; tools, logprobs: docs/structured-outputs.md):
  curl http://127.0.0.1:$port/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$model", "messages": [{"role": "user", "content": "Describe Paris as JSON."}], "max_tokens": 100,
         "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object",
           "properties": {"name": {"type": "string", "maxLength": 40}, "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
           "required": ["name", "population"], "additionalProperties": false}}}}'

Metrics: http://127.0.0.1:$port/metrics (router), each worker on its gRPC port + 1000. Ctrl-C stops the cluster.
MSG
wait "${pids[@]}"
