#!/usr/bin/env bash
# The engine benchmarks of docs/BENCHMARKS.md, side by side with llama.cpp in one run.
# Run on a quiet machine (scripts/quiet.sh pauses background process groups you name). Prints JSON lines.
#   usage: scripts/bench-engine.sh [RUNS]      (default 5 alternating single-stream runs each)
# Environment: BELLOWS_BENCH_MODEL=gemma3 for Gemma 3 270M instead of the default model;
# BELLOWS_BENCH_SUITES (default batch,ttft,itl) for the rest, ours only.
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-5}"
source scripts/bench-setup.sh
# Single stream, alternating so both see the same machine: greedy, "Once upon a time", 128 tokens.
ours=(); ref=()
for _ in $(seq "$runs"); do
    ref+=("$(.venv/bin/python scripts/reference/llama_cpp_bench.py --model "$model" --threads 2 --ignore-eos \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["decode_tok_s"])')")
    ours+=("$("$bin" bench --model "$model" --suite decode --repeat 1 2>/dev/null \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["single_stream"]["decode_tok_s"])')")
done
python3 - "${ours[*]}" "${ref[*]}" <<'PY'
import json, statistics, sys
ours = [float(x) for x in sys.argv[1].split()]; ref = [float(x) for x in sys.argv[2].split()]
print(json.dumps({"single_stream_decode_tok_s": {"bellows_median": statistics.median(ours),
    "llama_cpp_median": statistics.median(ref), "ratio": statistics.median(ours) / statistics.median(ref),
    "bellows_runs": ours, "llama_cpp_runs": ref}}))
PY
# llama.cpp's prompt evaluation of about 1,000 tokens, against our cold 1,000-token TTFT (suite ttft).
long="$(python3 -c 'print("The quick brown fox jumps over the lazy dog while the old man watches from the porch. " * 60, end="")')"
.venv/bin/python scripts/reference/llama_cpp_bench.py --model "$model" --threads 2 --prompt "$long" --max-tokens 1 \
    | python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"llama_cpp_prompt_eval": {k: d[k] for k in ("prompt_tokens", "prompt_eval_tok_s", "wall_s")}}))'
"$bin" bench --model "$model" --suite "${BELLOWS_BENCH_SUITES:-batch,ttft,itl}" 2>/dev/null | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))'
