#!/usr/bin/env bash
# Shared set-up of the engine benchmarks that compare against llama.cpp (sourced, not run): builds
# the worker, installs llama-cpp-python into .venv if missing, sets $model and $bin, and prints
# the machine line that heads each result. BELLOWS_BENCH_MODEL=gemma3 benchmarks Gemma 3 270M
# instead of the default model.
model="$(scripts/fetch-model.sh "${BELLOWS_BENCH_MODEL:-smollm2}")"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bellows/target}"
cargo build --release -q -p bellows-worker
bin="$CARGO_TARGET_DIR/release/bellows-worker"
if [[ ! -x .venv/bin/python ]] || ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
    python3 -m venv .venv
    .venv/bin/pip install -q llama-cpp-python==0.3.36   # builds llama.cpp from source (~10 min)
fi
echo "{\"date\": \"$(date -u +%FT%TZ)\", \"cpu\": \"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)\", \"cores\": $(nproc)}"
