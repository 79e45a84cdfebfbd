#!/usr/bin/env python3
"""Greedy token ids llama.cpp produces for a few prompts on a GGUF: the reference our forward pass
is checked against (crates/worker/tests/fixtures/greedy_reference.json).

    .venv/bin/python scripts/reference/llama_cpp_greedy.py \
        [--model ~/.cache/bellows/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--tokens 32] [--gemma] \
        [--synth "ARGS"] > FILE

Prompts are tokenized as the model's vocabulary says (BOS where it asks for one). --gemma swaps
the ChatML prompt for Gemma's turn markers and adds a prompt of over 512 tokens, so the output
depends on Gemma 3's sliding-window layers. --synth records the `bellows-worker synth-model`
arguments that made the model, the file's xxh3 (scripts/reference/synth_greedy.sh), and at each
greedy step the top logits llama.cpp chose from: a random model's logits have near-ties
everywhere, so its tests compare logits along llama.cpp's sequence, not free-running tokens.
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


# Logits recorded per greedy step of a synthetic model.
TOP = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/bellows/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--gemma", action="store_true")
    ap.add_argument("--synth", help="the synth-model arguments that made --model")
    a = ap.parse_args()
    llm = Llama(model_path=a.model, n_ctx=2048 if a.gemma else 512, n_threads=2, verbose=False, seed=0,
                logits_all=bool(a.synth))
    cases = []
    for p in GEMMA_PROMPTS if a.gemma else PROMPTS:
        prompt = llm.tokenize(p.encode(), add_bos=True, special=True)
        llm.reset()
        out = []
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            out.append(tok)
            if len(out) == a.tokens:
                break
        case = {"prompt": p, "prompt_ids": prompt, "greedy_ids": out}
        if a.synth:
            # Row len(prompt) - 1 + i holds the logits greedy token i was chosen from.
            rows = llm.scores[len(prompt) - 1:len(prompt) - 1 + len(out)]
            case["top_logits"] = [
                [[int(t), round(float(r[t]), 5)] for t in r.argsort()[::-1][:TOP]] for r in rows
            ]
        cases.append(case)
    result = {"model": os.path.basename(a.model), "cases": cases}
    if a.synth:
        import xxhash

        with open(a.model, "rb") as f:
            result["synth"] = {"args": a.synth.split(), "file_xxh3": f"{xxhash.xxh3_64_intdigest(f.read()):016x}"}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
