#!/usr/bin/env bash
# The GPU check rehearsed on this machine, as the GPU machine would run it: the kit that
# `scripts/build-cuda.sh --pack --cpu` wrote (a CPU build of the same kit) beside a copy of the
# working tree as a device call carries it, in a temporary directory, with a home directory of its
# own (no cached models), zstd and xz hidden from PATH (that machine may lack them), and
#   BELLOWS_GPU_CHECK_QUICK=1     small timed rows and a small "7B" shape,
#   BELLOWS_GPU_CHECK_DEVICE=auto the "GPU" rows run on the CPU, so the check must refuse them,
#   BELLOWS_GPU_CHECK_NO_TORCH=1  no PyTorch here: its two steps are skipped (the script is only
#                                 compiled).
# Passes only when gpu-check exits 3 (rows not on CUDA) with every other step passed, the kit holds
# binaries and a vocabulary and no weights, the model made there has the default model's shapes
# and vocabulary, greedy "GPU" and CPU text agree (one device), and a broken kit is refused (exit 2).
#   usage: scripts/rehearse-gpu-check.sh [KIT]   (default target-gpu/gpu-kit.tar.xz)
set -euo pipefail
cd "$(dirname "$0")/.."
kit="${1:-target-gpu/gpu-kit.tar.xz}"
PY="${PYTHON:-python3}"
log() { printf '[rehearse] %s\n' "$*" >&2; }
[[ -f "$kit" ]] || {
    log "no kit at $kit: run scripts/build-cuda.sh --pack --cpu"
    exit 1
}
start=$SECONDS
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# The kit: binaries, the vocabulary, the manifest; nothing else, and the vocabulary has no tensors.
"$PY" - "$kit" <<'EOF'
import io, struct, sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    names = sorted(m.name for m in t.getmembers() if m.isfile())
    want = ["bin/bellows-worker", "bin/worker-lib-tests", "kit.json", "vocab.gguf"]
    if names != want:
        sys.exit(f"the kit holds {names}, not {want}")
    head = t.extractfile("vocab.gguf").read(24)
magic, _version, tensors, entries = struct.unpack("<IIQQ", head)
if magic != 0x46554747 or tensors != 0:
    sys.exit(f"vocab.gguf: magic {magic:#x}, {tensors} tensors: it must be a vocabulary alone")
EOF

# The tree as a device call carries it (tracked and untracked-but-not-ignored files), plus the kit.
tree="$tmp/tree"
mkdir -p "$tree/target-gpu" "$tmp/home" "$tmp/shims"
git ls-files -z --cached --others --exclude-standard \
    | "$PY" -c 'import os, sys; sys.stdout.buffer.write(b"".join(p + b"\0" for p in sys.stdin.buffer.read().split(b"\0") if p and os.path.lexists(p)))' \
    | tar --null -T - -cf - | tar -C "$tree" -xf -
cp "$kit" "$tree/target-gpu/gpu-kit.tar.xz"
for tool in zstd unzstd zstdcat xz unxz xzcat; do
    printf '#!/bin/sh\necho "%s: not on the GPU machine" >&2\nexit 127\n' "$tool" >"$tmp/shims/$tool"
    chmod +x "$tmp/shims/$tool"
done
on_device() {
    env -u BELLOWS_MODEL -u BELLOWS_MODEL_DIR -u BELLOWS_GPU_PACK -u CARGO_TARGET_DIR \
        HOME="$tmp/home" PATH="$tmp/shims:$PATH" \
        BELLOWS_GPU_CHECK_QUICK=1 BELLOWS_GPU_CHECK_DEVICE=auto BELLOWS_GPU_CHECK_NO_TORCH=1 "$@"
}

# A kit cut short is refused before anything runs.
mkdir -p "$tmp/bad"
head -c 100000 "$kit" >"$tmp/bad/gpu-kit.tar.xz"
rc=0
(cd "$tree" && on_device OUT="$tmp/bad-out" BELLOWS_GPU_PACK="$tmp/bad" scripts/gpu-check.sh) >/dev/null 2>"$tmp/bad.err" || rc=$?
((rc == 2)) || {
    cat "$tmp/bad.err" >&2
    log "FAILED: gpu-check on a truncated kit exited $rc, not 2"
    exit 1
}

log "gpu-check, quick, on the CPU kit"
rc=0
(cd "$tree" && on_device OUT="$tmp/out" scripts/gpu-check.sh) >"$tmp/stdout" 2>"$tmp/stderr" || rc=$?
grep '^\[gpu-check\]' "$tmp/stderr" >&2 || true
mkdir -p target-gpu/rehearsal # kept for reading (ignored by git)
cp "$tmp/stderr" target-gpu/rehearsal/gpu-check.stderr
cp "$tmp/out/gpu-check.json" target-gpu/rehearsal/ 2>/dev/null || true
"$PY" -m py_compile "$tree/scripts/bench/torch_llama.py"

real="$(scripts/fetch-model.sh)"
if ! "$PY" - "$tmp/out/gpu-check.json" "$rc" "$tree/target-gpu/run/default-shape.gguf" "$real" <<'EOF'; then
import json, struct, sys
report_path, rc, made, real = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
problems = []
try:
    r = json.load(open(report_path))
except (OSError, ValueError) as e:
    sys.exit(f"[rehearse] FAILED: no report ({e}); gpu-check exited {rc}")
if rc != 3 or r["exit"] != 3:
    problems.append(f"gpu-check exited {rc} (report: {r['exit']}), not 3")
for name, s in r["steps"].items():
    want = "skipped" if name in ("torch", "torch_7b") else "ok"
    if s["status"] != want:
        problems.append(f"step {name}: {s['status']} (rc {s['rc']}, {s['note']}), not {want}")
want_refused = [f"greedy {i}" for i in range(len(r["greedy_gpu_vs_cpu"]))] + ["bench", "bench_7b"]
if r["rows_not_on_cuda"] != want_refused:
    problems.append(f"rows_not_on_cuda {r['rows_not_on_cuda']}, not {want_refused}")
for i, g in enumerate(r["greedy_gpu_vs_cpu"]):
    if not g["identical"]:
        problems.append(f"greedy {i}: the two runs on one device differ: {g['gpu']!r} / {g['cpu']!r}")
if (r["kit"] or {}).get("build") != "cpu":
    problems.append(f"the kit's build is {(r['kit'] or {}).get('build')!r}, not cpu")
if r["caps_total_s"] > 480 or r["wall_s"] > r["caps_total_s"]:
    problems.append(f"caps {r['caps_total_s']} s, wall {r['wall_s']} s: over 480 or over the caps")

def header(path):
    """A GGUF's metadata (arrays as their length) and tensor count."""
    f = open(path, "rb")
    take = lambda fmt: struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]
    scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    def value(kind):
        if kind == 8:
            return f.read(take("Q")).decode("utf-8", "replace")
        if kind == 9:
            inner, n = take("I"), take("Q")
            return [value(inner) for _ in range(n)]
        return take(scalars[kind])
    assert take("I") == 0x46554747, path
    take("I")
    tensors, n = take("Q"), take("Q")
    meta = {}
    for _ in range(n):
        key = f.read(take("Q")).decode()
        meta[key] = value(take("I"))
    return meta, tensors

made_meta, _ = header(made)
real_meta, _ = header(real)
for k in ["block_count", "embedding_length", "feed_forward_length", "attention.head_count",
          "attention.head_count_kv", "context_length", "rope.freq_base", "attention.layer_norm_rms_epsilon"]:
    a, b = made_meta.get(f"llama.{k}"), real_meta.get(f"llama.{k}")
    if a != b:
        problems.append(f"the default-shape model's llama.{k} is {a}, the default model's {b}")
tok = lambda m: {k: v for k, v in m.items() if k.startswith("tokenizer.")}
if tok(made_meta) != tok(real_meta):
    problems.append("the default-shape model's vocabulary is not the default model's")

steps = ", ".join(f"{n} {s['seconds']}s" + ("" if s["status"] == "ok" else f" ({s['status']})")
                  for n, s in r["steps"].items())
print(f"[rehearse] gpu-check exit {rc}: {steps}; {r['wall_s']} s of {r['caps_total_s']} s of caps;"
      f" rows refused as not on CUDA: {len(r['rows_not_on_cuda'])}", file=sys.stderr)
if problems:
    sys.exit("[rehearse] FAILED:\n  " + "\n  ".join(problems))
EOF
    log "gpu-check's stderr, last lines:"
    tail -30 "$tmp/stderr" >&2
    exit 1
fi
log "passed in $((SECONDS - start)) s (gpu-check exit 3, as a CPU kit must; the rest passed)"
