#!/usr/bin/env bash
# Build `bellows-worker --features cuda` on a machine with no GPU and no CUDA installed, to prove
# the CUDA build compiles and links (and to make a binary to carry to a GPU machine).
# UNVERIFIED ON A GPU: the binary has only been linked and started here, never run on a device.
#
# candle 0.11.1's `cuda` feature forces cudarc 0.19.10 with `dynamic-linking` and
# `cuda-version-from-build-system`, so the build needs nvcc, the CUDA headers, and libcuda,
# libnvrtc, libcurand, libcublas, libcublasLt and libcudart to link against. This script:
#   1. installs the CUDA 13.0 PyPI wheels (no deps, --target, never into the system) into
#      ${BELLOWS_CUDA_DIR:-~/.cache/bellows/cuda}/wheels, skipped when already there;
#   2. makes a CUDA_HOME tree ($BELLOWS_CUDA_DIR/home) of links into the wheels' nvidia/cu13, with
#      `libX.so -> libX.so.N` links, and a link-time-only stub libcuda.so (soname libcuda.so.1) in
#      lib/stubs that defines every driver API name cudarc's bindings declare (every call returns
#      CUDA_ERROR_NO_DEVICE); the real driver's libcuda.so.1 replaces it on a GPU machine;
#   3. builds with CUDA_COMPUTE_CAP (default 90: Hopper, sm_90a) under `nice -n 19` into
#      ${CARGO_TARGET_DIR:-~/.cache/bellows/target-cuda}, then prints the binary and its NEEDED libs;
#   4. with --pack: also builds the worker's unit-test binary and writes the kit scripts/gpu-check.sh
#      runs on a GPU machine, target-gpu/gpu-kit.tar.xz (ignored by git; xz, written and read by
#      Python's tarfile, since that machine may lack zstd): bin/bellows-worker and bin/worker-lib-tests
#      (stripped), vocab.gguf (the default model's vocabulary alone, `synth-model --vocab-only`:
#      the models are made there from it, no weights travel) and kit.json (build, commit,
#      sha256s); then scripts/check-carry-size.sh holds kit + tree to the 64 MiB a device call
#      carries.
#   --pack --cpu: the same kit from a CPU build (no wheels, no CUDA: steps 1-3 skipped), built as
#      scripts/test.sh builds (--workspace, into ${CARGO_TARGET_DIR:-~/.cache/bellows/target}), so
#      after test.sh's own build it compiles nothing new; scripts/rehearse-gpu-check.sh runs
#      gpu-check on it here.
# Idempotent. A clean CUDA build takes ~9 minutes on 2 cores (most of it nvcc on candle-kernels).
#
# To run the result:   LD_LIBRARY_PATH=$BELLOWS_CUDA_DIR/home/lib  (cudart, cublas, curand, nvrtc)
#   plus the NVIDIA driver's libcuda.so.1 (driver >= 580 for CUDA 13.0 PTX). On a machine without a
#   driver, adding $BELLOWS_CUDA_DIR/home/lib/stubs lets the binary start (CUDA then reports no
#   device and the worker stays on the CPU); never put lib/stubs on the path on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
pack=false cpu=false
for arg in "$@"; do
    case "$arg" in
    --pack) pack=true ;;
    --cpu) cpu=true ;;
    *)
        echo "usage: $0 [--pack [--cpu]]" >&2
        exit 2
        ;;
    esac
done
if $cpu && ! $pack; then
    echo "--cpu makes a CPU kit: give --pack too (a CPU build alone is plain cargo build)" >&2
    exit 2
fi
PY="${PYTHON:-python3}"
log() { printf '[build-cuda] %s\n' "$*" >&2; }

# Step 4, from binaries already built: $1 the worker, $2 its unit-test binary, $3 the build's name,
# $4 the LD_LIBRARY_PATH that lets the worker start here, $5 the xz preset (9 for what travels: its
# 64 MiB window spans both binaries, which share most of their code: 6.8 MiB for the CPU kit
# against 9.2 at preset 6; 0 for a CPU kit, which is only unpacked here, in seconds).
make_kit() {
    local worker=$1 tests=$2 build=$3 libs=$4 level=$5 out=target-gpu source
    source="$(scripts/fetch-model.sh)"
    stage="$(mktemp -d)"
    trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage/bin" "$out"
    strip -o "$stage/bin/bellows-worker" "$worker"
    strip -o "$stage/bin/worker-lib-tests" "$tests"
    LD_LIBRARY_PATH="$libs" "$stage/bin/bellows-worker" synth-model --vocab-only --like "$source" \
        --out "$stage/vocab.gguf" >&2
    # The manifest and the archive, with Python's tarfile and lzma (no xz binary needed here either).
    nice -n 19 "$PY" - "$stage" "$build" "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)" "$source" \
        "$level" "$out/gpu-kit.tar.xz.tmp" <<'EOF'
import hashlib, json, os, sys, tarfile
stage, build, commit, source, level, archive = sys.argv[1:]
files = ["bin/bellows-worker", "bin/worker-lib-tests", "vocab.gguf"]
sha = {f: hashlib.sha256(open(os.path.join(stage, f), "rb").read()).hexdigest() for f in files}
json.dump({"build": build, "commit": commit, "vocab_of": os.path.basename(source), "sha256": sha},
          open(os.path.join(stage, "kit.json"), "w"), indent=1)
def owned_by_root(info):
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info
with tarfile.open(archive, "w:xz", preset=int(level)) as t:
    for f in ["kit.json"] + files:
        t.add(os.path.join(stage, f), arcname=f, filter=owned_by_root)
EOF
    mv "$out/gpu-kit.tar.xz.tmp" "$out/gpu-kit.tar.xz"
    log "packed for scripts/gpu-check.sh ($build build): $out/gpu-kit.tar.xz, of"
    (cd "$stage" && du -b kit.json vocab.gguf bin/*) | awk '{printf "[build-cuda]   %7.2f MiB  %s\n", $1 / 1048576, $2}' >&2
    scripts/check-carry-size.sh "$out/gpu-kit.tar.xz"
}

# The executable of bellows-worker's library unit tests, from cargo's JSON messages on stdin.
lib_tests() {
    "$PY" -c 'import json, sys
for m in map(json.loads, sys.stdin):
    if (m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]
            and m["target"]["name"] == "bellows_worker" and "lib" in m["target"]["kind"]):
        print(m["executable"])'
}

if $cpu; then
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bellows/target}"
    nice -n 19 cargo build --release --workspace --bins
    tests="$(nice -n 19 cargo test --release --workspace --lib --no-run --message-format=json | lib_tests)"
    [[ -n "$tests" ]] || { log "no unit-test binary was built"; exit 1; }
    make_kit "$CARGO_TARGET_DIR/release/bellows-worker" "$tests" cpu "" 0
    exit 0
fi

CUDA_DIR="${BELLOWS_CUDA_DIR:-$HOME/.cache/bellows/cuda}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bellows/target-cuda}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
# Stay on 13.0.x: newer nvcc emits PTX that driver 580 may reject.
WHEELS=(
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvrtc==13.0.88
    nvidia-cuda-cccl==13.0.85 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
    nvidia-curand==10.4.0.35 nvidia-cublas==13.0.2.14
)

# 1. Wheels. The stamp records the exact list, so changing a version reinstalls.
wheels_dir="$CUDA_DIR/wheels"
stamp="$CUDA_DIR/wheels.stamp"
if [[ -f "$stamp" && "$(cat "$stamp")" == "${WHEELS[*]}" && -x "$wheels_dir/nvidia/cu13/bin/nvcc" ]]; then
    log "wheels present in $wheels_dir"
else
    log "installing CUDA wheels into $wheels_dir (~650 MB download)"
    rm -rf "$wheels_dir" "$stamp"
    mkdir -p "$CUDA_DIR"
    nice -n 19 "$PY" -m pip install --quiet --no-deps --no-cache-dir --target "$wheels_dir.tmp" "${WHEELS[@]}"
    mv "$wheels_dir.tmp" "$wheels_dir"
    printf '%s' "${WHEELS[*]}" >"$stamp"
fi
cu="$wheels_dir/nvidia/cu13"
[[ -x "$cu/bin/nvcc" ]] || { log "no nvcc at $cu/bin/nvcc"; exit 1; }

# 2. CUDA_HOME: links into the wheel tree (rebuilt every run; cheap).
home="$CUDA_DIR/home"
rm -rf "$home"
mkdir -p "$home/lib/stubs"
for d in bin include nvvm; do ln -s "$cu/$d" "$home/$d"; done
for f in "$cu"/lib/*.so*; do ln -s "$f" "$home/lib/"; done
# libX.so -> libX.so.N for every versioned library (the wheels ship only the .so.N names).
for f in "$cu"/lib/lib*.so.[0-9]*; do
    base="$(basename "$f")"
    dev="${base%%.so.*}.so"
    [[ -e "$home/lib/$dev" ]] || ln -s "$base" "$home/lib/$dev"
done
for lib in cudart nvrtc curand cublas cublasLt; do
    [[ -e "$home/lib/lib$lib.so" ]] || { log "missing lib$lib.so in the wheels"; exit 1; }
done

# The libcuda stub: every driver function cudarc's bindings declare (a superset of what it binds
# for any CUDA version), taken from the cudarc sources the lock file pins.
cudarc_ver="$(awk '/^name = "cudarc"$/ {getline; gsub(/[^0-9.]/, ""); print; exit}' Cargo.lock)"
[[ -n "$cudarc_ver" ]] || { log "cudarc not in Cargo.lock"; exit 1; }
nice -n 19 cargo fetch --quiet
bindings=""
for f in "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"cudarc-$cudarc_ver"/src/driver/sys/mod.rs; do
    [[ -f "$f" ]] && bindings="$f"
done
[[ -n "$bindings" ]] || { log "cudarc-$cudarc_ver sources not found under ${CARGO_HOME:-$HOME/.cargo}/registry/src"; exit 1; }
stub_c="$CUDA_DIR/libcuda_stub.c"
{
    echo '/* Link-time stub of the CUDA driver API, generated by scripts/build-cuda.sh from'
    echo "   $bindings. Every call fails with CUDA_ERROR_NO_DEVICE (100). */"
    echo 'static const char msg[] = "libcuda stub: no CUDA driver";'
    echo 'int cuGetErrorString(int e, const char **s) { (void)e; *s = msg; return 0; }'
    echo 'int cuGetErrorName(int e, const char **s) { (void)e; *s = "CUDA_ERROR_NO_DEVICE"; return 0; }'
    grep -oE '^pub unsafe fn cu[A-Za-z0-9_]+' "$bindings" | sed 's/^pub unsafe fn //' | sort -u \
        | grep -vxE 'cuGetErrorString|cuGetErrorName' \
        | sed 's/.*/int &(void) { return 100; }/'
} >"$stub_c"
nice -n 19 gcc -shared -fPIC -O0 -Wl,-soname,libcuda.so.1 -o "$home/lib/stubs/libcuda.so" "$stub_c"
ln -s libcuda.so "$home/lib/stubs/libcuda.so.1"
log "stub libcuda: $(grep -c '^int cu' "$stub_c") driver functions"

# 3. Build.
export CUDA_HOME="$home" CUDA_PATH="$home"
export NVCC="$home/bin/nvcc"
export PATH="$home/bin:$PATH" # cudarc's build script runs plain `nvcc --version`
export LIBRARY_PATH="$home/lib:$home/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
log "$("$NVCC" --version | tail -2 | head -1)"
log "cargo build --release -p bellows-worker --features cuda (CARGO_TARGET_DIR=$CARGO_TARGET_DIR, CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP)"
start=$SECONDS
nice -n 19 cargo build --release -p bellows-worker --features cuda
log "build took $((SECONDS - start)) s"

bin="$CARGO_TARGET_DIR/release/bellows-worker"
echo "binary: $bin ($(du -h "$bin" | cut -f1))"
echo "NEEDED (readelf -d):"
readelf -d "$bin" | awk '/NEEDED/ {print "  " $NF}' | tr -d '[]'
echo "ldd (LD_LIBRARY_PATH=$home/lib:$home/lib/stubs):"
LD_LIBRARY_PATH="$home/lib:$home/lib/stubs" ldd "$bin" | sed 's/^\s*/  /'


# 4. The GPU machine's kit.
if $pack; then
    tests="$(nice -n 19 cargo test --release -p bellows-worker --features cuda --lib --no-run --message-format=json \
        | lib_tests)"
    [[ -n "$tests" ]] || { log "no unit-test binary was built"; exit 1; }
    make_kit "$bin" "$tests" "cuda sm_$CUDA_COMPUTE_CAP" "$home/lib:$home/lib/stubs" 9
fi
