#!/usr/bin/env python3
"""llama.cpp's grammar-constrained decode against its unconstrained decode, in one process: the
reference for Bellows' structured-output benchmark (scripts/bench-constrained.sh).

Greedy, one stream, the same prompt both ways; the constrained run uses llama.cpp's own JSON
Schema to GBNF conversion (LlamaGrammar.from_json_schema, what llama-cpp-python's
response_format uses). Rates are wall-clock tokens per second after the first token, since the
grammar's cost is in sampling, which llama.cpp's eval counters leave out. Prints one JSON object:

    {"engine": "llama.cpp", "constrained_tok_s": [...], "unconstrained_tok_s": [...], "text": "..."}

    .venv/bin/python scripts/reference/llama_cpp_constrained.py --schema '{"type": "object", ...}' \
        [--model ...gguf] [--threads 2] [--prompt ...] [--max-tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import llama_cpp

DEFAULT_MODEL = Path.home() / ".cache/bellows/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def stream_rate(llm, prompt_ids, max_tokens, grammar):
    stamps, ids = [], []
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, grammar=grammar):
        stamps.append(time.perf_counter())
        ids.append(token)
        if len(ids) >= max_tokens:
            break
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None
    return rate, llm.detokenize(ids).decode("utf-8", errors="replace")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path(os.environ.get("BELLOWS_MODEL", DEFAULT_MODEL)))
    ap.add_argument("--schema", required=True, help="the JSON Schema, as JSON text")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", default="Write report 0 about the river station, as JSON.")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    llm = llama_cpp.Llama(
        model_path=str(args.model), n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048, verbose=False
    )
    grammar = llama_cpp.LlamaGrammar.from_json_schema(args.schema, verbose=False)
    prompt_ids = llm.tokenize(args.prompt.encode("utf-8"), add_bos=False, special=True)
    free, constrained, text = [], [], ""
    for _ in range(args.runs):
        free.append(stream_rate(llm, prompt_ids, args.max_tokens, None)[0])
        rate, text = stream_rate(llm, prompt_ids, args.max_tokens, grammar)
        constrained.append(rate)
    print(json.dumps({"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "n_threads": args.threads,
                      "max_tokens": args.max_tokens, "constrained_tok_s": constrained, "unconstrained_tok_s": free,
                      "text": text}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
