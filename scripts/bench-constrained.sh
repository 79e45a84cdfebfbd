#!/usr/bin/env bash
# Structured-output decode of docs/BENCHMARKS.md: Bellows under a JSON Schema against
# unconstrained, at 1 and 16 streams, with the mask time per token; then llama.cpp's
# grammar-constrained decode on the same schema, prompt and model, alternating with Bellows'
# single stream. Run on a quiet machine. Prints JSON lines.
#   usage: scripts/bench-constrained.sh [RUNS]      (default 3)
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"
source scripts/bench-setup.sh
ours="$("$bin" bench --model "$model" --suite constrained --concurrency 1,16 --repeat "$runs" 2>/dev/null)"
echo "$ours" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["constrained"]))'
schema="$(echo "$ours" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["constrained"]["schema"]))')"
# Single stream side by side, alternating: llama.cpp's run, then Bellows' (1 stream) again.
ref=(); again=()
for _ in $(seq "$runs"); do
    ref+=("$(.venv/bin/python scripts/reference/llama_cpp_constrained.py --model "$model" --schema "$schema" --runs 1)")
    again+=("$("$bin" bench --model "$model" --suite constrained --concurrency 1 --repeat 1 2>/dev/null)")
done
python3 - "$(printf '%s\n' "${ref[@]}")" "$(printf '%s\n' "${again[@]}" | python3 -c 'import json,sys
d=sys.stdin.read(); dec=json.JSONDecoder(); i=0; out=[]
while i < len(d):
    if d[i].isspace(): i+=1; continue
    v,i=dec.raw_decode(d,i); out.append(v)
print(json.dumps(out))')" <<'PY'
import json, statistics, sys
ref = [json.loads(l) for l in sys.argv[1].splitlines() if l.strip()]
ours = json.loads(sys.argv[2])
r_c = [x for r in ref for x in r["constrained_tok_s"]]; r_u = [x for r in ref for x in r["unconstrained_tok_s"]]
o_c = [o["constrained"]["rows"][0]["constrained_tok_s"] for o in ours]
o_u = [o["constrained"]["rows"][0]["unconstrained_tok_s"] for o in ours]
m = statistics.median
print(json.dumps({"single_stream_constrained_tok_s": {
    "bellows_median": m(o_c), "llama_cpp_median": m(r_c), "bellows_over_llama_cpp": m(o_c) / m(r_c),
    "bellows_constrained_over_unconstrained": m(o_c) / m(o_u),
    "llama_cpp_constrained_over_unconstrained": m(r_c) / m(r_u),
    "bellows_runs": o_c, "llama_cpp_runs": r_c, "bellows_unconstrained": o_u, "llama_cpp_unconstrained": r_u,
    "llama_cpp_text": ref[-1]["text"]}}))
PY
