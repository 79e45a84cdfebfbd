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
cargo test --release --workspace --no-fail-fast
