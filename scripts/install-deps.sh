#!/usr/bin/env bash
# Install what a fresh Debian/Ubuntu machine lacks to build and test Bellows: protoc (gRPC code
# generation), etcd (tests start their own), the models and vocabularies (the default model, and
# those the family, tokenizer and template tests hold to llama.cpp and Hugging Face: see
# scripts/fetch-model.sh), and the OpenAI Python client. Idempotent: does nothing that
# is already done.
set -euo pipefail
need=()
command -v protoc >/dev/null || need+=(protobuf-compiler)
command -v etcd >/dev/null || need+=(etcd-server)
command -v etcdctl >/dev/null || need+=(etcd-client)
if ((${#need[@]})); then
    sudo=""; [[ $(id -u) -eq 0 ]] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
"$(dirname "$0")/fetch-model.sh" --all >/dev/null
# The official OpenAI Python client, for the API conformance test (its own folder, not the system's).
openai_dir="${BELLOWS_PY_OPENAI:-$HOME/.cache/bellows/py-openai}"
if ! PYTHONPATH="$openai_dir" python3 -c 'import openai' 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-conflicts --target "$openai_dir" "openai==1.109.1" 2>&1 |
        grep -v "Running pip as the 'root' user" || true
fi
