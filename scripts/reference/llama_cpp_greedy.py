#!/usr/bin/env python3
"""Greedy token ids llama.cpp produces for a few prompts on a GGUF: the reference our forward pass
is checked against (crates/worker/tests/fixtures/greedy_reference.json).

    .venv/bin/python scripts/reference/llama_cpp_greedy.py \
        [--model ~/.cache/bellows/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--tokens 32] [--gemma] > FILE

Prompts are tokenized as the model's vocabulary says (BOS where it asks for one). --gemma swaps
the ChatML prompt for Gemma's turn markers and adds a prompt of over 512 tokens, so the output
depends on Gemma 3's sliding-window layers.
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

CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Tokyo", "Quito", "Accra", "Hanoi", "Dakar", "Perth"]
# Over 512 tokens: the key fact is at the start, beyond a local layer's window at the end.
LONG = (
    "Remember this: the secret word is 'lantern'.\n"
    + "".join(f"Note {i}: the train from {CITIES[i % 10]} leaves at {i % 12 + 1} o'clock on platform {i % 7 + 2}.\n"
              for i in range(40))
    + "Question: what is the secret word? Answer: the secret word is"
)

GEMMA_PROMPTS = PROMPTS[:3] + [
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    LONG,
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/bellows/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--gemma", action="store_true")
    a = ap.parse_args()
    llm = Llama(model_path=a.model, n_ctx=2048 if a.gemma else 512, n_threads=2, verbose=False, seed=0)
    cases = []
    for p in GEMMA_PROMPTS if a.gemma else PROMPTS:
        prompt = llm.tokenize(p.encode(), add_bos=True, special=True)
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
