#!/usr/bin/env python3
"""Greedy single-stream decode speed of llama.cpp on a GGUF: the number Bellows is compared to.

Runs one greedy completion (temperature 0, top_k 1) with llama.cpp through llama-cpp-python and
prints one JSON object:

    {"engine": "llama.cpp", "n_threads": 2, "prompt_tokens": 4, "completion_tokens": 128,
     "decode_tok_s": ..., "prompt_eval_tok_s": ..., "text": "..."}

decode_tok_s excludes prompt evaluation: it comes from llama.cpp's own perf counters
(t_eval_ms / n_eval, reset just before the run); the wall-clock rate of the token stream after
the first token is printed as stream_tok_s for a cross-check. Generation stops at an
end-of-generation token unless --ignore-eos. Benchmark on a quiet machine: on
2 cores, anything else running (a cargo build) changes the numbers a lot.

    .venv/bin/python scripts/reference/llama_cpp_bench.py \
        [--model ~/.cache/bellows/models/SmolLM2-135M-Instruct.Q4_1.gguf] \
        [--threads 2] [--prompt "Once upon a time"] [--max-tokens 128] [--ignore-eos]

Install: python3 -m venv .venv && .venv/bin/pip install llama-cpp-python==0.3.36 (builds ~10 min).
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path(os.environ.get("BELLOWS_MODEL", DEFAULT_MODEL)))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="never stop at an end-of-generation token, so exactly --max-tokens are decoded",
    )
    args = ap.parse_args()
    if not args.model.is_file():
        sys.exit(f"model not found: {args.model} (run scripts/fetch-model.sh)")

    llm = llama_cpp.Llama(
        model_path=str(args.model),
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=args.n_ctx,
        verbose=False,
    )
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    logits_processor = None
    if args.ignore_eos:
        eog = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]

        def no_eog(_ids, scores):
            scores[eog] = -float("inf")
            return scores

        logits_processor = llama_cpp.LogitsProcessorList([no_eog])

    prompt_ids = llm.tokenize(args.prompt.encode("utf-8"), add_bos=True, special=True)
    llama_cpp.llama_perf_context_reset(llm.ctx)
    out_ids = []
    stamps = []
    t0 = time.perf_counter()
    # generate() evaluates the prompt, then yields each sampled token and evaluates it before
    # sampling the next: one yield per generated token, exact counts.
    for token in llm.generate(
        prompt_ids,
        temp=0.0,
        top_k=1,
        top_p=1.0,
        min_p=0.0,
        repeat_penalty=1.0,
        logits_processor=logits_processor,
    ):
        stamps.append(time.perf_counter())
        if not args.ignore_eos and llama_cpp.llama_vocab_is_eog(vocab, token):
            break
        out_ids.append(token)
        if len(out_ids) >= args.max_tokens:
            break
    wall_s = time.perf_counter() - t0
    perf = llama_cpp.llama_perf_context(llm.ctx)

    # llama.cpp counts the prompt batch in n_p_eval and each single-token decode in n_eval.
    decode_tok_s = perf.n_eval / (perf.t_eval_ms / 1000.0) if perf.t_eval_ms > 0 else None
    prompt_eval_tok_s = perf.n_p_eval / (perf.t_p_eval_ms / 1000.0) if perf.t_p_eval_ms > 0 else None
    stream_tok_s = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None
    text = llm.detokenize(out_ids).decode("utf-8", errors="replace")
    prompt_tokens = len(prompt_ids)
    completion_tokens = len(out_ids)

    print(
        json.dumps(
            {
                "engine": "llama.cpp",
                "llama_cpp_python": llama_cpp.__version__,
                "model": args.model.name,
                "n_threads": args.threads,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "n_eval": perf.n_eval,
                "n_p_eval": perf.n_p_eval,
                "decode_tok_s": round(decode_tok_s, 2) if decode_tok_s else None,
                "prompt_eval_tok_s": round(prompt_eval_tok_s, 2) if prompt_eval_tok_s else None,
                "stream_tok_s": round(stream_tok_s, 2) if stream_tok_s else None,
                "wall_s": round(wall_s, 3),
                "text": text,
            },
            ensure_ascii=False,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
