#!/usr/bin/env bash
# llama.cpp's greedy tokens on a synthetic model of a family whose weights no reachable registry
# holds (Qwen3) or whose real file is too large for CI (Qwen2): the fixture
# crates/worker/tests/fixtures/greedy_reference_synth_<arch>.json. The test makes the same file
# again from the arguments recorded in the fixture and checks its hash before comparing tokens.
#   usage: scripts/reference/synth_greedy.sh qwen3|qwen2   (needs .venv from scripts/bench-setup.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
arch="${1:?usage: $0 qwen3|qwen2}"
# Grouped-query attention, four layers; Qwen3's heads are wider than hidden / heads (llama.cpp's
# qwen2 takes only hidden / heads).
args=(--arch "$arch" --layers 4 --hidden 256 --ffn 768 --heads 4 --kv-heads 2 --context 2048 --seed 3)
if [[ "$arch" == qwen3 ]]; then args+=(--head-dim 128); fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bellows/target}"
cargo build --release -q --workspace --bins
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
"$CARGO_TARGET_DIR/release/bellows-worker" synth-model "${args[@]}" --out "$dir/model.gguf" >&2
.venv/bin/pip install -q xxhash
.venv/bin/python scripts/reference/llama_cpp_greedy.py --model "$dir/model.gguf" --synth "${args[*]}" \
    >"crates/worker/tests/fixtures/greedy_reference_synth_$arch.json"
