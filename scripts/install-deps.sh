#!/usr/bin/env bash
# Install what a fresh Debian/Ubuntu machine lacks to build and test Bellows: protoc (gRPC code
# generation), etcd and PostgreSQL (tests start their own servers; PostgreSQL is the shared
# response store), Prometheus and promtool (tests/integration's prometheus test runs its own
# server and lints the scrapes), the models and vocabularies (the default model, and those the
# family, tokenizer and template tests hold to llama.cpp and Hugging Face: see
# scripts/fetch-model.sh), and the OpenAI and Anthropic Python clients. Idempotent: does nothing
# that is already done.
set -euo pipefail
need=()
command -v protoc >/dev/null || need+=(protobuf-compiler)
command -v etcd >/dev/null || need+=(etcd-server)
command -v etcdctl >/dev/null || need+=(etcd-client)
compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null || need+=(postgresql)
# Without its recommended node exporter: the test needs only the server and promtool.
lean=()
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || lean+=(prometheus)
if ((${#need[@]} + ${#lean[@]})); then
    sudo=""; [[ $(id -u) -eq 0 ]] || sudo="sudo"
    $sudo apt-get update -qq
    if ((${#need[@]})); then
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
    fi
    if ((${#lean[@]})); then
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${lean[@]}" >/dev/null
    fi
fi
"$(dirname "$0")/fetch-model.sh" --all >/dev/null
# The official OpenAI and Anthropic Python clients, for the API conformance tests (each in its own
# folder, not the system's).
install_client() { # <folder> <module> <requirement>
    if ! PYTHONPATH="$1" python3 -c "import $2" 2>/dev/null; then
        python3 -m pip install --quiet --disable-pip-version-check --no-warn-conflicts --target "$1" "$3" 2>&1 |
            grep -v "Running pip as the 'root' user" || true
    fi
}
install_client "${BELLOWS_PY_OPENAI:-$HOME/.cache/bellows/py-openai}" openai "openai==1.109.1"
install_client "${BELLOWS_PY_ANTHROPIC:-$HOME/.cache/bellows/py-anthropic}" anthropic "anthropic==2.17.0"
