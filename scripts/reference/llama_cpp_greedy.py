#!/usr/bin/env python3
"""Greedy token ids llama.cpp produces for a few prompts on a GGUF: the reference our forward pass
is checked against (crates/worker/tests/fixtures/greedy_reference.json).

    .venv/bin/python scripts/reference/llama_cpp_greedy.py \
        [--model ~/.cache/bellows/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--tokens 32] > FILE
"""
import argparse
import json
import os

from llama_cpp import Llama

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/bellows/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    llm = Llama(model_path=a.model, n_ctx=512, n_threads=2, verbose=False, seed=0)
    cases = []
    for p in PROMPTS:
        prompt = llm.tokenize(p.encode(), add_bos=False, special=True)
        llm.reset()
        out = []
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            out.append(tok)
            if len(out) == a.tokens:
                break
        cases.append({"prompt": p, "prompt_ids": prompt, "greedy_ids": out})
    print(json.dumps({"model": os.path.basename(a.model), "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
