#!/usr/bin/env bash
# Everything CI checks, on a fresh machine: install what is missing (protoc, etcd, the default
# model), then formatting, lints, docs and every test of the workspace, in release mode (the model is
# tens of times slower unoptimized).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/check-deploy.sh
# A target dir that outlives the checkout: a clean clone rebuilds only what changed.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bellows/target}"
cargo fmt --all --check
cargo clippy --release --workspace --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps --workspace --quiet
# The whole-cluster tests start the binaries themselves: build them first.
cargo build --release --workspace --bins
# The GPU check, rehearsed: a CPU build of the GPU machine's kit (the same commands as these builds
# and the tests below: nothing compiled twice), held to what one device call carries
# (scripts/check-carry-size.sh, run by the pack), and scripts/gpu-check.sh run on it as that machine
# would (expected: exit 3, its rows refused as not on CUDA, every other step passed).
scripts/build-cuda.sh --pack --cpu
scripts/rehearse-gpu-check.sh
cargo test --release --workspace --no-fail-fast
