#!/usr/bin/env bash
# The GPU worker's device check (issue 18), run ON a GPU machine in one call of under 10 minutes:
#   1. the worker's device-attention unit tests on the GPU (the path's outputs against the host
#      kernel's, within 1e-5 of their largest value);
#   2. greedy output on the GPU against the CPU build's, on the fixture prompts;
#   3. the benchmark rows as JSON: single-stream decode, aggregate decode at 1/16/64/256 streams,
#      TTFT cold and with a cached prefix on a 4,096-token prompt;
#   4. a 7B-shaped model (Llama 2 7B's shapes, Q8_0, random weights, made there by
#      `bellows-worker synth-model`): single-stream decode against the bandwidth bound (weight
#      bytes / 4.8 TB/s) and 64 streams against one;
#   5. the same rows from the same models in eager PyTorch (scripts/bench/torch_llama.py: a
#      Hugging Face-style llama in plain torch ops, fp16; transformers is not known to be there), and
#      ours over theirs.
# Each step's time is capped, and all of them by BELLOWS_GPU_CHECK_BUDGET (default 540 s), so the
# report is written within one call; every step's raw output is in $OUT too.
# UNVERIFIED ON A GPU: no GPU has run this script yet. BELLOWS_GPU_CHECK_QUICK=1 runs every step
# with small sizes, which is how it was checked end to end on a CPU, with a CPU build packed in its
# place (the "GPU" and CPU runs are then the same device).
#
# What it needs in the working tree, all made here by `scripts/build-cuda.sh --pack` in target-gpu/
# (ignored by git; at most 64 MiB travels per device call, so the model goes in parts):
#   target-gpu/bin/bellows-worker.zst, target-gpu/bin/worker-lib-tests.zst   (22 MiB measured)
#   target-gpu/model/part-aa..ac   the default model in 40 MiB parts, joined and checksummed here
# A sequence of device calls that fits: carry target-gpu/bin and target-gpu/model/part-aa (62 MiB)
# with `true` as the command, then at once (the machine stays warm briefly) carry part-ab and
# part-ac (54 MiB) with `scripts/gpu-check.sh` as the command. The report is $OUT/gpu-check.json.
#
# Libraries: the driver's libcuda.so.1 from the machine; cudart, cublas(Lt), curand and nvrtc
# from the nvidia-* wheels of its Python environment (found under site-packages).
set -uo pipefail
cd "$(dirname "$0")/.."

pack="${BELLOWS_GPU_PACK:-target-gpu}"
out="${OUT:-$pack/out}"
run="$pack/run"
mkdir -p "$out" "$run"
log() { printf '[gpu-check] %s\n' "$*" >&2; }
fail() {
    log "$*"
    exit 2
}
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PY="${PYTHON:-python3}"
deadline=$((SECONDS + ${BELLOWS_GPU_CHECK_BUDGET:-540}))
# `capped N CMD...`: run CMD for at most N seconds, or what is left of the budget (skipped under 10).
capped() {
    local cap=$1 left=$((deadline - SECONDS))
    shift
    ((left < cap)) && cap=$left
    if ((cap < 10)); then
        log "skipped (budget spent): $*"
        return 124
    fi
    timeout "$cap" "$@"
}
# Sizes: the device's, or small ones for checking the script on a CPU.
if [[ -n "${BELLOWS_GPU_CHECK_QUICK:-}" ]]; then
    streams=1,4 ttft_tokens=256 repeat=1 decode_tokens=16
    synth_shape=(--layers 2 --hidden 512 --ffn 1024 --heads 8 --kv-heads 8)
else
    streams=1,16,64,256 ttft_tokens=4096 repeat=3 decode_tokens=128
    synth_shape=()
fi

# The device every "GPU" row must run on: cuda, so that a broken CUDA fails the row instead of
# serving it on the CPU. BELLOWS_GPU_CHECK_DEVICE=auto is for rehearsing on a CPU build, where the
# report then refuses the rows (exit 3) because they did not run on CUDA.
gpu_device="${BELLOWS_GPU_CHECK_DEVICE:-cuda}"

# 1. Binaries and libraries.
for f in bellows-worker worker-lib-tests; do
    [[ -f "$pack/bin/$f.zst" ]] || fail "missing $pack/bin/$f.zst: run scripts/build-cuda.sh --pack here and carry $pack/bin"
    zstd -d -q -f "$pack/bin/$f.zst" -o "$run/$f" || fail "cannot unpack $f.zst"
    chmod +x "$run/$f"
done
libs="$("$PY" - <<'EOF'
import glob, os, site
dirs = set()
for sp in site.getsitepackages() + [site.getusersitepackages()]:
    for lib in glob.glob(os.path.join(sp, "nvidia", "**", "lib", "*.so*"), recursive=True):
        dirs.add(os.path.dirname(lib))
print(":".join(sorted(dirs)))
EOF
)"
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv,noheader >"$out/gpu.txt" 2>&1 \
    || log "nvidia-smi failed: $(cat "$out/gpu.txt")"

# 2. The model, from its parts.
model="$run/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ ! -f "$model" ]] || ! echo "$MODEL_SHA256  $model" | sha256sum -c --quiet - 2>/dev/null; then
    compgen -G "$pack/model/part-*" >/dev/null || fail "no model parts in $pack/model (scripts/build-cuda.sh --pack)"
    cat "$pack"/model/part-* >"$model"
    echo "$MODEL_SHA256  $model" | sha256sum -c --quiet - || fail "the joined model's checksum is wrong: a part is missing"
fi
export BELLOWS_MODEL="$model" BELLOWS_MODEL_DIR="$run"

# 3. Unit tests on the device (a CUDA build's device tests run on CUDA or fail, never on the CPU).
log "device-attention unit tests"
capped 60 "$run/worker-lib-tests" device_attention cuda_asked_for >"$out/unit-tests.txt" 2>&1
unit_rc=$?

# 4. Greedy text, GPU against CPU (no visible device: the same binary on the CPU).
log "greedy output, GPU against CPU"
prompts=("Once upon a time" "The capital of France is" "def fibonacci(n):")
for i in "${!prompts[@]}"; do
    capped 30 "$run/bellows-worker" generate --device "$gpu_device" --prompt "${prompts[$i]}" --max-tokens 32 \
        >"$out/gpu-$i.txt" 2>"$out/gpu-$i.err"
    capped 30 "$run/bellows-worker" generate --device cpu --prompt "${prompts[$i]}" --max-tokens 32 \
        >"$out/cpu-$i.txt" 2>"$out/cpu-$i.err"
done

# 5. Benchmarks on the device.
log "benchmarks"
capped 180 "$run/bellows-worker" bench --device "$gpu_device" --suite decode,batch,ttft --concurrency "$streams" \
    --ttft-prompt-tokens "$ttft_tokens" --repeat "$repeat" --decode-tokens "$decode_tokens" \
    >"$out/bench.json" 2>"$out/bench.err"
bench_rc=$?

# 6. The 7B-shaped model, made here (about 7 GB, under a minute).
log "7B-shaped model"
synth="$run/synth-7b.gguf"
capped 90 "$run/bellows-worker" synth-model --like "$model" --out "$synth" "${synth_shape[@]}" >"$out/synth.txt" 2>&1 \
    && capped 90 "$run/bellows-worker" bench --device "$gpu_device" --model "$synth" --suite decode,batch --concurrency 1,64 --repeat 1 \
        --decode-tokens "$decode_tokens" >"$out/bench-7b.json" 2>"$out/bench-7b.err"

# 7. The PyTorch baseline on both models.
log "PyTorch baseline"
capped 90 "$PY" scripts/bench/torch_llama.py "$model" --streams "$streams" --prompt-tokens "$ttft_tokens" \
    --decode-tokens "$decode_tokens" >"$out/torch.json" 2>"$out/torch.err"
capped 90 "$PY" scripts/bench/torch_llama.py "$synth" --streams 1,64 --prompt-tokens "$ttft_tokens" \
    --decode-tokens "$decode_tokens" >"$out/torch-7b.json" 2>"$out/torch-7b.err"
rm -f "$synth"

# The report.
"$PY" - "$out" "$unit_rc" "$bench_rc" "${#prompts[@]}" <<'EOF' | tee "$out/gpu-check.json"
import json, os, sys
out, unit_rc, bench_rc, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
read = lambda f: open(os.path.join(out, f), errors="replace").read() if os.path.exists(os.path.join(out, f)) else ""
greedy = []
for i in range(n):
    gpu, cpu = read(f"gpu-{i}.txt"), read(f"cpu-{i}.txt")
    same = next((k for k, (a, b) in enumerate(zip(gpu, cpu)) if a != b), min(len(gpu), len(cpu)))
    greedy.append({"gpu": gpu, "cpu": cpu, "same_chars": same, "identical": gpu == cpu and gpu != "",
                   "gpu_stats": read(f"gpu-{i}.err").strip().splitlines()[-1:]})
def bench_of(name):
    try:
        return json.loads(read(f"{name}.json"))
    except ValueError:
        return {"error": read(f"{name}.err")[-2000:]}
bench, bench_7b = bench_of("bench"), bench_of("bench-7b")
torch_rows, torch_7b = bench_of("torch"), bench_of("torch-7b")

def ours_over_torch(ours, theirs):
    """Ours / PyTorch's for each row both have (rates: above 1 is ours faster; times: below 1)."""
    if "error" in ours or "error" in theirs:
        return None
    r = {}
    if "single_stream" in ours and "single_stream_tok_s" in theirs:
        r["single_stream_decode"] = ours["single_stream"]["decode_tok_s"] / theirs["single_stream_tok_s"]
    mine = {row["streams"]: row["aggregate_tok_s"] for row in ours.get("aggregate", [])}
    for row in theirs.get("aggregate", []):
        if row["streams"] in mine:
            r[f"aggregate_{row['streams']}_streams"] = mine[row["streams"]] / row["aggregate_tok_s"]
    if "ttft" in ours and "ttft_cold_ms" in theirs:
        r["ttft_cold_time"] = ours["ttft"]["cold_ms"] / theirs["ttft_cold_ms"]
        r["ttft_cached_time"] = ours["ttft"]["cached_ms"] / theirs["ttft_cached_ms"]
    return r
synth = read("synth.txt").split(": ")[-1].split(" ")[0]
if synth.isdigit() and "single_stream" in bench_7b:
    bound = 4.8e12 / int(synth)
    bench_7b["weight_bytes"], bench_7b["bandwidth_bound_tok_s"] = int(synth), bound
    bench_7b["of_bound"] = bench_7b["single_stream"]["decode_tok_s"] / bound
# Every GPU row must say it ran on CUDA: generate's stats line names the device, the bench JSON has it.
not_cuda = [f"greedy {i}" for i in range(n) if "[device cuda |" not in read(f"gpu-{i}.err")]
not_cuda += [name for name, rows in (("bench", bench), ("bench_7b", bench_7b)) if rows.get("device") != "cuda"]
print(json.dumps({
    "gpu": read("gpu.txt").strip(),
    "rows_not_on_cuda": not_cuda,
    "unit_tests": {"rc": unit_rc, "tail": read("unit-tests.txt")[-1500:]},
    "greedy_gpu_vs_cpu": greedy,
    "bench_rc": bench_rc, "bench": bench, "bench_7b_shaped": bench_7b,
    "torch": torch_rows, "torch_7b_shaped": torch_7b,
    "ours_over_torch": ours_over_torch(bench, torch_rows),
    "ours_over_torch_7b_shaped": ours_over_torch(bench_7b, torch_7b),
}, indent=1))
sys.exit(3 if not_cuda else 0)
EOF
report_rc=${PIPESTATUS[0]}
if ((report_rc != 0)); then
    log "refused: some GPU rows did not run on CUDA (rows_not_on_cuda in the report)"
    exit "$report_rc"
fi
