#!/usr/bin/env bash
# Shared set-up of the engine benchmarks that compare against llama.cpp (sourced, not run): builds
# the worker, installs llama-cpp-python into .venv if missing, sets $model and $bin, and prints
# the machine line that heads each result. BELLOWS_BENCH_MODEL=gemma3 benchmarks Gemma 3 270M
# instead of the default model.
model="$(scripts/fetch-model.sh "${BELLOWS_BENCH_MODEL:-smollm2}")"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bellows/target}"
cargo build --release -q --workspace --bins
bin="$CARGO_TARGET_DIR/release/bellows-worker"
if [[ ! -x .venv/bin/python ]] || ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
    # llama.cpp's native build enables every instruction set the CPU advertises, AMX too, whose
    # instructions fault (SIGILL) in some VMs that advertise it: build for the CPU's AVX levels
    # only, AMX off.
    flags="$(grep -m1 '^flags' /proc/cpuinfo)"
    has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
    export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)
        -DGGML_F16C=$(has f16c) -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi)
        -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)
        -DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    python3 -m venv .venv
    .venv/bin/pip install -q llama-cpp-python==0.3.36   # builds llama.cpp from source (~10 min)
fi
echo "{\"date\": \"$(date -u +%FT%TZ)\", \"cpu\": \"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)\", \"cores\": $(nproc)}"
