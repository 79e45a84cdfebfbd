#!/usr/bin/env bash
# The engine benchmarks of docs/BENCHMARKS.md, side by side with llama.cpp in one run.
# Run on a quiet machine (scripts/quiet.sh pauses background process groups you name). Prints JSON lines.
#   usage: scripts/bench-engine.sh [RUNS]      (default 5 alternating single-stream runs each)
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
"$bin" bench --model "$model" --suite batch,ttft,itl 2>/dev/null | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))'
