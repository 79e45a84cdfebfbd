#!/usr/bin/env bash
# Install what a fresh Debian/Ubuntu machine lacks to build and test Bellows: protoc (gRPC code
# generation), etcd (tests start their own), and the default model. Idempotent: does nothing that
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
"$(dirname "$0")/fetch-model.sh" >/dev/null
