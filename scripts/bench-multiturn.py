#!/usr/bin/env python3
"""A conversation's next turns through the router, against each turn's new message alone.

Start a cluster first (scripts/run.sh; set BELLOWS_KV_CACHE_DTYPE to compare cache types), then:

    PYTHONPATH=~/.cache/bellows/py-openai python3 scripts/bench-multiturn.py [--base-url URL]

Each of `--repeat` conversations opens with a long message (about 1,200 tokens, tagged so no two
conversations share a cached prefix); each later turn adds a question of about 40 tokens to the
conversation and its answers (24 tokens, greedy). Per turn, the time to the first streamed token of
the whole conversation (its earlier turns cached) and of the question alone in a fresh conversation
(tagged too, so nothing is cached), medians over the conversations, one JSON line a turn. The engine's own measurement of the same ratio, without
HTTP, is `bellows-worker bench --suite multiturn`.
"""
import argparse
import json
import statistics
import time

import openai

OPENING = (
    "The city council met on Tuesday to discuss the new library, the repair of the old bridge, "
    "the budget for the parks, and the plan to add bicycle lanes along the river. "
) * 30 + "Summarize the meeting in one sentence."
QUESTIONS = [
    "Of the library, the bridge, the parks and the bicycle lanes, which project is likely to cost "
    "the most money, and why would the members of the council care about that before they vote?",
    "If the council can only afford one project this year, should it be the repair of the old "
    "bridge or the new library? Give two reasons for your choice and one reason against it.",
    "How could the new bicycle lanes along the river change the traffic in the city center, and "
    "what might the shop owners on the river road say about them at the next council meeting?",
    "Write a short headline for a newspaper story about this meeting, then a second headline that "
    "a newspaper critical of the council might print about the very same meeting instead.",
]


def first_token_ms(client, model, messages, max_tokens):
    """Milliseconds to the first streamed content token, the reply's text, and the usage."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    first, usage, text = None, None, []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            if first is None:
                first = (time.perf_counter() - start) * 1000
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return first, "".join(text), usage


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--repeat", type=int, default=5, help="conversations, each measured once a turn")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key="none")
    run = time.time_ns()
    # Conversations side by side, each opened by its own tag: no two share a cached prefix, so a
    # turn's question is new to each; each question alone is tagged too, so never cached.
    tag = lambda *ids: f"[{run}-{'-'.join(map(str, ids))}] "
    talks = [[{"role": "user", "content": tag(i) + OPENING}] for i in range(a.repeat)]
    for turn, question in enumerate([None] + QUESTIONS, start=1):
        turns, alone, usage = [], [], None
        for i, history in enumerate(talks):
            if question is not None:
                history.append({"role": "user", "content": question})
            ms, reply, usage = first_token_ms(client, a.model, history, 24)
            history.append({"role": "assistant", "content": reply})
            turns.append(ms)
            if question is not None:
                lone = [{"role": "user", "content": tag(turn, i) + question}]
                ms, _, _ = first_token_ms(client, a.model, lone, 1)
                alone.append(ms)
        if question is None:
            continue  # the opening: cold, not a turn
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None
        t, s = statistics.median(turns), statistics.median(alone)
        print(json.dumps({"turn": turn, "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached,
                          "ttft_ms": round(t, 1), "message_alone_ms": round(s, 1), "ratio": round(t / s, 2)}),
              flush=True)


if __name__ == "__main__":
    main()
