#!/usr/bin/env python3
"""Record llama.cpp's tokenization of tricky lines as the reference for Bellows' tokenizer.

llama.cpp is the reference implementation for GGUF models: our tokenizer must give the same ids
for the same text, or the model sees prompts it was never trained on (and nothing errors). This
script loads only the vocabulary of a GGUF with llama.cpp (through llama-cpp-python) and writes,
for each line in CASES, the ids of

    tokenize(text.encode(), add_bos=False, special=True)   -> "ids"
    tokenize(text.encode(), add_bos=True,  special=True)   -> "ids_add_special"
    detokenize(ids)  (control tokens print nothing)         -> "detokenized"

plus the vocabulary's BOS/EOS and its end-of-generation set. The Rust test
crates/worker/tests/tokenizer_matches_llama_cpp.rs checks our tokenizer against that file.

Regenerate (after changing CASES, or for another model):

    python3 -m venv .venv && .venv/bin/pip install llama-cpp-python==0.3.36   # builds ~10 min
    scripts/fetch-model.sh
    .venv/bin/python scripts/reference/llama_cpp_tokenize.py \
        [--model ~/.cache/bellows/models/SmolLM2-135M-Instruct.Q4_1.gguf] \
        [--out crates/worker/tests/fixtures/tokenizer_reference.json] [--metadata-only]

--metadata-only tokenizes a copy of the file without its tensor table: llama.cpp refuses a file
whose tensors run past its end, such as the head of a split model (fetch-model.sh qwen-vocab).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import tempfile
from pathlib import Path

import llama_cpp

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = Path.home() / ".cache/bellows/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = REPO / "crates/worker/tests/fixtures/tokenizer_reference.json"

# Each line exercises one way a tokenizer can be "almost right".
CASES = [
    "12345 and 3.14159",  # digits: one token per digit for smollm
    "你好，世界",  # CJK and a full-width comma: multi-byte characters across tokens
    "I ❤️ 🦀 and 👩‍👩‍👧",  # emoji, a variation selector, a ZWJ family
    "def f(x):\n\tif x:\n\t\treturn [i * 2 for i in range(10)]\n    pass\n",  # code, tabs, indentation
    "<|im_start|>user\nHi<|im_end|>\n",  # ChatML control tokens in text
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "word<|endoftext|>word",  # a control token glued to words
    "a   b\n\n\tc",  # whitespace runs
    "naïve café",  # accents (precomposed)
    "cafe\u0301",  # a combining accent: no normalization may merge it
    "don't I'll WE'RE",  # apostrophes, contractions in upper case
    " ",  # a lone space
    " hello",  # leading space
    "x=1+2;y=[3,4]",  # punctuation and digits mixed
    "trailing spaces   ",
    "line one\r\nline two\n\n\n",  # CRLF and a newline run at the end
    "Hello, world! How are you today?",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",  # Gemma's turn tokens
    "<table><tr><td>1</td></tr></table>",  # Gemma: HTML tags are user-defined tokens
    "\ue000 and \U0010fffd",  # private-use characters: SentencePiece falls back to bytes
    "    four spaces\tand tabs\t\t\n\n\n",  # runs of spaces, tabs and newlines
    "Ünïcödé ÀÉÎÕÜ ñ ß Ωμέγα Привет",  # accents, Greek, Cyrillic
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",  # Llama 3's header tokens
    "<｜User｜>2+2?<｜Assistant｜><think>\nfour</think>",  # DeepSeek-R1's full-width bars
    "[INST] Hi [/INST]",  # Mistral's instruction markers
]

SPECIAL_MARKERS = ("<|", "|>", "<start_of_turn>", "<end_of_turn>", "<｜")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def metadata_only_copy(src: Path, dir: Path) -> Path:
    """The GGUF's header and key-value section with a tensor count of 0, under the same name."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(src, "rb") as f:
        def rd(fmt: str):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def skip(t: int) -> None:
            if t == 8:  # string
                f.seek(rd("Q"), 1)
            elif t == 9:  # array
                at, n = rd("I"), rd("Q")
                if at in sizes:
                    f.seek(sizes[at] * n, 1)
                else:
                    for _ in range(n):
                        skip(at)
            else:
                f.seek(sizes[t], 1)

        magic, version, _, n_kv = f.read(4), rd("I"), rd("Q"), rd("Q")
        start = f.tell()
        for _ in range(n_kv):
            f.seek(rd("Q"), 1)
            skip(rd("I"))
        end = f.tell()
        f.seek(start)
        kv = f.read(end - start)
    out = dir / src.name
    out.write_bytes(magic + struct.pack("<IQQ", version, 0, n_kv) + kv)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path(os.environ.get("BELLOWS_MODEL", DEFAULT_MODEL)))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--metadata-only", action="store_true", help="tokenize a copy without tensors")
    args = ap.parse_args()
    if not args.model.is_file():
        sys.exit(f"model not found: {args.model} (run scripts/fetch-model.sh)")

    tmp = tempfile.TemporaryDirectory()
    path = metadata_only_copy(args.model, Path(tmp.name)) if args.metadata_only else args.model
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llm.n_vocab()
    eog_ids = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]

    cases = []
    for text in CASES:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        ids_add_special = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        detok = llm.detokenize(ids, special=False).decode("utf-8", errors="replace")
        cases.append(
            {
                "text": text,
                "has_special": any(m in text for m in SPECIAL_MARKERS),
                "ids": ids,
                "ids_add_special": ids_add_special,
                "detokenized": detok,
            }
        )

    header = {
        "generator": "scripts/reference/llama_cpp_tokenize.py",
        "llama_cpp_python": llama_cpp.__version__,
        "model": args.model.name,
        "model_sha256": sha256(args.model),
        "n_vocab": n_vocab,
        "bos_id": llm.token_bos(),
        "eos_id": llm.token_eos(),
        "eog_ids": eog_ids,
    }
    # One case per line keeps diffs of the fixture readable.
    lines = ["{"]
    for k, v in header.items():
        lines.append(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)},")
    lines.append('  "cases": [')
    lines.append(",\n".join("    " + json.dumps(c, ensure_ascii=False) for c in cases))
    lines.append("  ]")
    lines.append("}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
