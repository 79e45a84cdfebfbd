#!/usr/bin/env python3
"""A conversation continued through /v1/responses' previous_response_id, against the same
history sent whole to chat/completions.

Start a cluster first (scripts/run.sh), then:

    PYTHONPATH=~/.cache/bellows/py-openai python3 scripts/bench-responses.py [--base-url URL]

Each of `--repeat` rounds opens two conversations with the same long message (about 600
tokens), each tagged so that neither shares a cached prefix with the other or an earlier round:
one goes on through chat/completions, sending its whole history each turn, the other through
/v1/responses, sending only the new question and its previous response's id. Both stream, greedy,
24 tokens a turn, the arms alternating. Per turn, the time to the first streamed text token of
each, medians over the rounds, and responses' over chat's; one JSON line a turn.
"""
import argparse
import json
import statistics
import time

import openai

OPENING = (
    "The city council met on Tuesday to discuss the new library, the repair of the old bridge, "
    "the budget for the parks, and the plan to add bicycle lanes along the river. "
) * 15 + "Summarize the meeting in one sentence."
QUESTIONS = [
    "Which of these projects is likely to cost the most money, and why would the council care?",
    "If the council can only afford one project this year, which should it be? Give two reasons.",
    "How could the new bicycle lanes change the traffic in the city center next to the river?",
    "Write a short headline for a newspaper story about this meeting, then a critical one.",
]


def chat_turn(client, model, history):
    start = time.perf_counter()
    first, text, usage = None, [], None
    for chunk in client.chat.completions.create(
        model=model, messages=history, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or (time.perf_counter() - start) * 1000
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return first, "".join(text), usage.prompt_tokens_details.cached_tokens


def responses_turn(client, model, text, previous):
    start = time.perf_counter()
    first, done = None, None
    for event in client.responses.create(
        model=model, input=text, previous_response_id=previous, max_output_tokens=24, temperature=0, stream=True
    ):
        if event.type == "response.output_text.delta" and event.delta:
            first = first or (time.perf_counter() - start) * 1000
        if event.type in ("response.completed", "response.incomplete"):
            done = event.response
    return first, done.id, done.usage.input_tokens_details.cached_tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key="none")
    run = time.time_ns()
    turns = {t: {"chat": [], "responses": [], "cached_chat": [], "cached_responses": []} for t in range(2, 6)}
    for r in range(a.repeat):
        history = [{"role": "user", "content": f"[{run}-{r}-chat] " + OPENING}]
        _, reply, _ = chat_turn(client, a.model, history)
        history.append({"role": "assistant", "content": reply})
        _, previous, _ = responses_turn(client, a.model, f"[{run}-{r}-resp] " + OPENING, None)
        for t, q in enumerate(QUESTIONS, start=2):
            history.append({"role": "user", "content": q})
            ms, reply, cached = chat_turn(client, a.model, history)
            history.append({"role": "assistant", "content": reply})
            turns[t]["chat"].append(ms)
            turns[t]["cached_chat"].append(cached)
            ms, previous, cached = responses_turn(client, a.model, q, previous)
            turns[t]["responses"].append(ms)
            turns[t]["cached_responses"].append(cached)
    for t, v in turns.items():
        chat, resp = statistics.median(v["chat"]), statistics.median(v["responses"])
        print(json.dumps({
            "turn": t, "ttft_ms_chat_whole_history": round(chat, 1), "ttft_ms_responses_previous_id": round(resp, 1),
            "responses_over_chat": round(resp / chat, 3),
            "cached_tokens_median": {"chat": statistics.median(v["cached_chat"]), "responses": statistics.median(v["cached_responses"])},
            "runs_ms": {"chat": [round(x, 1) for x in v["chat"]], "responses": [round(x, 1) for x in v["responses"]]},
        }))


if __name__ == "__main__":
    main()
