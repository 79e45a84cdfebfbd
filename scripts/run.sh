#!/usr/bin/env bash
# Run Bellows locally on the default model (SmolLM2-135M-Instruct, fetched on first use).
# Today this is one worker node (gRPC on 127.0.0.1:50051, no etcd); the OpenAI-compatible HTTP
# router that fronts it is the next milestone (see the README).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bellows/target}"
cargo build --release -p bellows-worker
exec "$CARGO_TARGET_DIR/release/bellows-worker" serve --engine gguf --listen 127.0.0.1:50051 "$@"
