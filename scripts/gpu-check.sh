#!/usr/bin/env bash
# The GPU worker's device check (issue 18), run ON a GPU machine as one command, in steps whose
# time caps add up to at most 480 s (8 minutes), so one call of 10 minutes holds it and a rerun
# still fits in 15 minutes of device time:
#   unpack    the kit (target-gpu/gpu-kit.tar.xz) with Python's tarfile, checksums checked;
#   synth     the default model's shapes (SmolLM2-135M: 30 layers, 576 wide, 9 heads of 64, 3 KV
#             heads, MLP 1536, rope base 100000, context 8192) in Q8_0 random weights with the real
#             vocabulary from the kit, made here by `bellows-worker synth-model`: no weights travel;
#   warmup    a short benchmark on the device, untimed: the driver compiles candle's PTX on first use
#             and keeps the result in its cache (CUDA_CACHE_PATH), so no timed row pays for it;
#   unit      the worker's device-attention unit tests on the GPU (the device path's outputs against
#             the host kernel's, within 1e-5 of their largest value; --device cuda never the CPU);
#   greedy    greedy text on the GPU against the CPU, the same binary and the same synthesized file,
#             on the fixture prompts;
#   bench     the benchmark rows as JSON: single-stream decode, aggregate decode at 1/16/64/256
#             streams, TTFT cold and with a cached prefix on a 4,096-token prompt;
#   synth_7b, bench_7b   a 7B-shaped model (Llama 2 7B's shapes, Q8_0, random weights, the same
#             vocabulary, about 7 GB made here): single-stream decode against the bandwidth bound
#             (weight bytes / 4.8 TB/s) and 64 streams against one;
#   torch, torch_7b      the same rows from the same files in eager PyTorch
#             (scripts/bench/torch_llama.py, fp16), and ours over theirs;
#   report    $OUT/gpu-check.json: every step's status, rc, seconds and cap, the kit's manifest,
#             the rows. Every step's raw output is in $OUT too.
# Exit: 0 every step passed and every GPU row ran on CUDA; 2 the kit is missing or broken (nothing
# ran) or no report could be written; 3 every step passed but some rows did not run on CUDA (rows_not_on_cuda: a CPU kit, or a
# rehearsal); 4 a step failed or ran out of time (steps in the report).
#
# On the GPU machine: build the kit here with `scripts/build-cuda.sh --pack` (it writes
# target-gpu/gpu-kit.tar.xz, ignored by git, and checks kit + tree against the 64 MiB a call
# carries: scripts/check-carry-size.sh), then make ONE device call that carries
# target-gpu/gpu-kit.tar.xz and runs `scripts/gpu-check.sh`, with a limit of 500 s or more (the
# check stops itself within 480); the report is $OUT/gpu-check.json.
# The machine needs only what a stock system has: Python 3 (tarfile, lzma), coreutils' timeout,
# sha256sum; no zstd, no package registry. Libraries: the driver's libcuda.so.1 from the machine;
# cudart, cublas(Lt), curand and nvrtc from the nvidia-* wheels of its Python environment.
#
# UNVERIFIED ON A GPU: no GPU has run this script yet. It is rehearsed on every test run
# (scripts/rehearse-gpu-check.sh, from scripts/test.sh): a CPU build of the same kit
# (`build-cuda.sh --pack --cpu`) unpacked in a temporary copy of the tree and run with
# BELLOWS_GPU_CHECK_QUICK=1 (small sizes for the timed rows and the 7B shape),
# BELLOWS_GPU_CHECK_DEVICE=auto (the "GPU" rows then run on the CPU and are refused: exit 3) and
# BELLOWS_GPU_CHECK_NO_TORCH=1 (no PyTorch there: its two steps are skipped, not failed).
set -uo pipefail
cd "$(dirname "$0")/.."

pack="${BELLOWS_GPU_PACK:-target-gpu}"
kit="$pack/gpu-kit.tar.xz"
out="${OUT:-$pack/out}"
run="$pack/run"
mkdir -p "$out"
exec 3>&2 # the log, whatever a step's stderr is sent to
log() { printf '[gpu-check] %s\n' "$*" >&3; }
fail() {
    log "$*"
    exit 2
}
PY="${PYTHON:-python3}"

# Each step's cap in seconds, in the order they run. The whole check never runs longer than
# their sum, and the sum may not pass 480; BELLOWS_GPU_CHECK_BUDGET may hold it shorter still (a
# rerun after a long first call). The widest are the 7B's: synth-model made random quants at
# about 100 MB/s on 2 busy cores here (7 GB in about 70 s; a quiet server core is faster), and
# the warm-up, whose PTX compile no machine here has timed.
STEPS=(unpack:10 synth:10 warmup:50 unit:20 greedy:35 bench:90 synth_7b:90 bench_7b:60 torch:40 torch_7b:60 report:10)
declare -A CAP RC SECS NOTE
total=0
for s in "${STEPS[@]}"; do
    CAP[${s%%:*}]=${s##*:}
    total=$((total + ${s##*:}))
done
((total <= 480)) || fail "the steps' caps add up to $total s, over 480"
budget=$((${BELLOWS_GPU_CHECK_BUDGET:-$total} < total ? ${BELLOWS_GPU_CHECK_BUDGET:-$total} : total))
deadline=$((SECONDS + budget))

# `step NAME CMD...`: run CMD for at most NAME's cap, or what is left of the budget (skipped under
# 5 s), the cap including 3 s for a process that ignores SIGTERM; records its rc and seconds.
step() {
    local name=$1 cap=${CAP[$1]} left=$((deadline - SECONDS)) t0=$SECONDS rc
    shift
    ((left < cap)) && cap=$left
    if ((cap < 5)); then
        log "$name: skipped (budget spent)"
        RC[$name]=124 SECS[$name]=0 NOTE[$name]="budget spent"
        return 124
    fi
    log "$name (cap $cap s)"
    timeout -k 3 $((cap - 3)) "$@"
    rc=$?
    RC[$name]=$rc SECS[$name]=$((SECONDS - t0))
    ((rc == 0)) || log "$name: rc $rc after ${SECS[$name]} s"
    return $rc
}
skip() {
    RC[$1]=0 SECS[$1]=0 NOTE[$1]="skipped: $2"
    log "$1: skipped ($2)"
}

# Sizes: the device's, or small ones for rehearsing on a CPU. The default model's shapes are the
# same either way (they are that model's).
if [[ -n "${BELLOWS_GPU_CHECK_QUICK:-}" ]]; then
    streams=1,4 ttft_tokens=256 repeat=1 decode_tokens=16 greedy_tokens=16
    warm=(--concurrency 1,2 --ttft-prompt-tokens 64 --decode-tokens 4)
    shape_7b=(--layers 2 --hidden 512 --ffn 1024 --heads 8 --kv-heads 8)
else
    streams=1,16,64,256 ttft_tokens=4096 repeat=3 decode_tokens=128 greedy_tokens=32
    warm=(--concurrency 1,16 --ttft-prompt-tokens 512 --decode-tokens 8)
    shape_7b=() # synth-model's defaults: Llama 2 7B
fi
shape_default=(--layers 30 --hidden 576 --ffn 1536 --heads 9 --kv-heads 3 --context 8192 --rope-base 100000)

# The device every "GPU" row must run on: cuda, so that a broken CUDA fails the row instead of
# serving it on the CPU. BELLOWS_GPU_CHECK_DEVICE=auto is for rehearsing on a CPU build, where the
# report then refuses the rows (exit 3) because they did not run on CUDA.
gpu_device="${BELLOWS_GPU_CHECK_DEVICE:-cuda}"

# unpack: the kit, with Python's tarfile (xz through its lzma module), or tar where Python has no lzma.
[[ -f "$kit" ]] || fail "missing $kit: run scripts/build-cuda.sh --pack here and carry $kit"
rm -rf "$run" && mkdir -p "$run"
step unpack "$PY" - "$kit" "$run" >"$out/kit.json" 2>"$out/unpack.err" <<'EOF'
import hashlib, json, os, sys, tarfile
kit, dest = sys.argv[1:]
try:
    import lzma  # noqa: F401
except ImportError:
    import subprocess
    subprocess.run(["tar", "-xJf", kit, "-C", dest], check=True)
else:
    with tarfile.open(kit, "r:xz") as t:
        for m in t.getmembers():
            if not (m.isfile() or m.isdir()) or m.name.startswith(("/", "..")) or "/../" in m.name:
                sys.exit(f"unexpected member {m.name!r} in {kit}")
        t.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
manifest = json.load(open(os.path.join(dest, "kit.json")))
for name, digest in manifest["sha256"].items():
    h = hashlib.sha256()
    with open(os.path.join(dest, name), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != digest:
        sys.exit(f"{name}: sha256 {h.hexdigest()}, the manifest says {digest}")
print(json.dumps(manifest))
EOF
((RC[unpack] == 0)) || fail "cannot unpack $kit: $(tail -3 "$out/unpack.err")"
chmod +x "$run/bin/"*
worker="$run/bin/bellows-worker"

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
# The driver's cache of PTX compiled for this GPU: filled by the warm-up, read by every later step
# (and kept beside the kit, so a rerun on the same machine compiles nothing).
export CUDA_CACHE_PATH="${CUDA_CACHE_PATH:-$(cd "$pack" && pwd)/cuda-cache}"
export CUDA_CACHE_MAXSIZE="${CUDA_CACHE_MAXSIZE:-4294967296}"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv,noheader >"$out/gpu.txt" 2>&1 \
        || log "nvidia-smi failed: $(cat "$out/gpu.txt")"
else
    echo "no nvidia-smi" >"$out/gpu.txt"
fi

# synth: the default model's shapes with the kit's vocabulary. Everything after reads it through
# BELLOWS_MODEL; BELLOWS_MODEL_DIR keeps any lookup away from a home directory's models.
model="$run/default-shape.gguf"
export BELLOWS_MODEL="$model" BELLOWS_MODEL_DIR="$run"
step synth "$worker" synth-model --like "$run/vocab.gguf" --out "$model" "${shape_default[@]}" >"$out/synth-default.txt" 2>&1

step warmup "$worker" bench --device "$gpu_device" --suite decode,batch,ttft --repeat 1 "${warm[@]}" \
    >"$out/warmup.json" 2>"$out/warmup.err"

# unit: a CUDA build's device tests run on CUDA or fail, never on the CPU.
step unit "$run/bin/worker-lib-tests" device_attention cuda_asked_for >"$out/unit-tests.txt" 2>&1

# greedy: the same binary, the same file, the GPU and then the CPU (--device cpu).
prompts=("Once upon a time" "The capital of France is" "def fibonacci(n):")
greedy() {
    local prompts=("$@") i rc=0
    for i in "${!prompts[@]}"; do
        "$worker" generate --device "$gpu_device" --prompt "${prompts[$i]}" --max-tokens "$greedy_tokens" \
            >"$out/gpu-$i.txt" 2>"$out/gpu-$i.err" || rc=1
        "$worker" generate --device cpu --prompt "${prompts[$i]}" --max-tokens "$greedy_tokens" \
            >"$out/cpu-$i.txt" 2>"$out/cpu-$i.err" || rc=1
    done
    return $rc
}
export -f greedy
export worker gpu_device greedy_tokens out
step greedy bash -c 'greedy "$@"' greedy "${prompts[@]}"

step bench "$worker" bench --device "$gpu_device" --suite decode,batch,ttft --concurrency "$streams" \
    --ttft-prompt-tokens "$ttft_tokens" --repeat "$repeat" --decode-tokens "$decode_tokens" \
    >"$out/bench.json" 2>"$out/bench.err"

synth="$run/synth-7b.gguf"
if step synth_7b "$worker" synth-model --like "$run/vocab.gguf" --out "$synth" "${shape_7b[@]}" >"$out/synth.txt" 2>&1; then
    step bench_7b "$worker" bench --device "$gpu_device" --model "$synth" --suite decode,batch --concurrency 1,64 \
        --repeat 1 --decode-tokens "$decode_tokens" >"$out/bench-7b.json" 2>"$out/bench-7b.err"
else
    RC[bench_7b]=1 SECS[bench_7b]=0 NOTE[bench_7b]="no 7B-shaped model (synth_7b failed)"
fi

if [[ -n "${BELLOWS_GPU_CHECK_NO_TORCH:-}" ]]; then
    skip torch BELLOWS_GPU_CHECK_NO_TORCH
    skip torch_7b BELLOWS_GPU_CHECK_NO_TORCH
else
    step torch "$PY" scripts/bench/torch_llama.py "$model" --streams "$streams" --prompt-tokens "$ttft_tokens" \
        --decode-tokens "$decode_tokens" >"$out/torch.json" 2>"$out/torch.err"
    step torch_7b "$PY" scripts/bench/torch_llama.py "$synth" --streams 1,64 --prompt-tokens "$ttft_tokens" \
        --decode-tokens "$decode_tokens" >"$out/torch-7b.json" 2>"$out/torch-7b.err"
fi
rm -f "$synth"

# The report. Each step's rc, seconds and cap go in as "name rc seconds cap note" lines.
for s in "${STEPS[@]}"; do
    n=${s%%:*}
    [[ $n == report ]] || printf '%s %s %s %s %s\n' "$n" "${RC[$n]:-1}" "${SECS[$n]:-0}" "${CAP[$n]}" "${NOTE[$n]:-}"
done >"$out/steps.txt"
step report "$PY" - "$out" "${#prompts[@]}" "$total" "$SECONDS" <<'EOF' >"$out/gpu-check.json.tmp"
import json, os, re, sys
out, n, caps_total, wall = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
read = lambda f: open(os.path.join(out, f), errors="replace").read() if os.path.exists(os.path.join(out, f)) else ""
steps = {}
for line in read("steps.txt").splitlines():
    name, rc, secs, cap, note = (line.split(" ", 4) + [""])[:5]
    steps[name] = {"rc": int(rc), "seconds": int(secs), "cap_s": int(cap), "note": note,
                   "status": "ok" if rc == "0" else ("timed out" if rc in ("124", "137") else "failed")}
    if note.startswith("skipped"):
        steps[name]["status"] = "skipped"
def demote(name, why):
    if steps[name]["status"] == "ok":
        steps[name]["status"], steps[name]["note"] = "failed", why
def json_of(name):
    try:
        return json.loads(read(f"{name}.json"))
    except ValueError:
        return {"error": read(f"{name}.err")[-2000:]}
greedy = []
for i in range(n):
    gpu, cpu = read(f"gpu-{i}.txt"), read(f"cpu-{i}.txt")
    same = next((k for k, (a, b) in enumerate(zip(gpu, cpu)) if a != b), min(len(gpu), len(cpu)))
    greedy.append({"gpu": gpu, "cpu": cpu, "same_chars": same, "identical": gpu == cpu and gpu != "",
                   "gpu_stats": read(f"gpu-{i}.err").strip().splitlines()[-1:]})
if any(not g["gpu"].strip() or not g["cpu"].strip() for g in greedy):
    demote("greedy", "an empty completion")
unit = read("unit-tests.txt")
ran = sum(int(w) for w in re.findall(r"test result: ok\. (\d+) passed", unit))
if ran < 4:
    demote("unit", f"{ran} tests passed: the filters matched too few")
rows = {name: json_of(name) for name in ("bench", "bench-7b", "torch", "torch-7b")}
wanted = {"bench": ["single_stream", "aggregate", "ttft"], "bench-7b": ["single_stream", "aggregate"],
          "torch": ["single_stream_tok_s", "aggregate", "ttft_cold_ms"], "torch-7b": ["single_stream_tok_s", "aggregate"]}
for step, name in (("bench", "bench"), ("bench_7b", "bench-7b"), ("torch", "torch"), ("torch_7b", "torch-7b")):
    missing = [k for k in wanted[name] if k not in rows[name]]
    if missing and steps[step]["status"] != "skipped":
        demote(step, f"its JSON lacks {missing}")
bench, bench_7b, torch_rows, torch_7b = rows["bench"], rows["bench-7b"], rows["torch"], rows["torch-7b"]

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
failed = [name for name, s in steps.items() if s["status"] not in ("ok", "skipped")]
try:
    kit = json.loads(read("kit.json"))
except ValueError:
    kit = None
print(json.dumps({
    "exit": 4 if failed else (3 if not_cuda else 0),
    "gpu": read("gpu.txt").strip(),
    "kit": kit,
    "steps": steps, "failed_steps": failed,
    "caps_total_s": caps_total, "wall_s": wall,
    "rows_not_on_cuda": not_cuda,
    "unit_tests": {"passed": ran, "tail": unit[-1500:]},
    "greedy_gpu_vs_cpu": greedy,
    "bench": bench, "bench_7b_shaped": bench_7b,
    "torch": torch_rows, "torch_7b_shaped": torch_7b,
    "ours_over_torch": ours_over_torch(bench, torch_rows),
    "ours_over_torch_7b_shaped": ours_over_torch(bench_7b, torch_7b),
}, indent=1))
EOF
((RC[report] == 0)) || fail "the report failed: $(tail -5 "$out/gpu-check.json.tmp")"
mv "$out/gpu-check.json.tmp" "$out/gpu-check.json"
cat "$out/gpu-check.json"
rc="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["exit"])' "$out/gpu-check.json")"
case "$rc" in
0) log "passed in $SECONDS s" ;;
3) log "refused in $SECONDS s: some GPU rows did not run on CUDA (rows_not_on_cuda in the report)" ;;
*) log "failed in $SECONDS s: steps $("$PY" -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1]))["failed_steps"]))' "$out/gpu-check.json")" ;;
esac
exit "$rc"
