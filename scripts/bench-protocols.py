#!/usr/bin/env python3
"""Router CPU per request for each protocol: chat/completions, /v1/responses, /v1/messages.

The same request in each protocol's shape (a 16-word user message, 8 tokens out, greedy), whole
and streamed, against one router in front of two simulated workers (2 ms a step), from
`--connections` keep-alive connections; the router's CPU time (user + system, from /proc) over
the requests. Protocols alternate within each round, so drift on a noisy host falls on all of
them alike. Prints one JSON line per protocol and mode: each round's microseconds per request,
the median, and the ratio to chat's median.

    python3 scripts/bench-protocols.py [--requests 4000] [--rounds 3] [--connections 16]

Builds nothing: run it after `cargo build --release` (binaries from $CARGO_TARGET_DIR/release,
default ~/.cache/bellows/target/release).
"""
import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import tempfile
import threading
import time

QUESTION = "Tell me one short fact about the river that runs through the old town, in plain words."
SIM = '{"base_us":2000,"per_token_us":0,"per_sequence_us":0}'


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bodies(stream):
    return {
        "chat": ("/v1/chat/completions",
                 {"model": "sim", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8,
                  "temperature": 0, "stream": stream}),
        "responses": ("/v1/responses",
                      {"model": "sim", "input": QUESTION, "max_output_tokens": 8, "temperature": 0,
                       "store": False, "stream": stream}),
        "messages": ("/v1/messages",
                     {"model": "sim", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8,
                      "temperature": 0, "stream": stream}),
    }


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(port, path, body, n, connections):
    """Send `n` requests over `connections` keep-alive connections; every answer must be a 200."""
    payload = json.dumps(body).encode()
    left = [n]
    lock = threading.Lock()
    errors = []

    def worker():
        c = http.client.HTTPConnection("127.0.0.1", port)
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            c.request("POST", path, payload, {"content-type": "application/json"})
            r = c.getresponse()
            data = r.read()
            if r.status != 200:
                errors.append(data[:200])
                return

    threads = [threading.Thread(target=worker) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"{path}: {errors[0]!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=16)
    a = ap.parse_args()
    bins = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.expanduser("~/.cache/bellows/target")), "release")
    logs = tempfile.mkdtemp(prefix="bench-protocols-")
    procs, workers = [], []
    try:
        for _ in range(2):
            port = free_port()
            log = open(os.path.join(logs, f"worker-{port}.log"), "w")
            procs.append(subprocess.Popen(
                [f"{bins}/bellows-worker", "serve", "--engine", "sim", "--listen", f"127.0.0.1:{port}",
                 "--metrics-listen", f"127.0.0.1:{free_port()}", "--sim-config", SIM, "--max-batch-tokens", "2048"],
                stdout=log, stderr=log))
            workers.append(f"127.0.0.1:{port}")
        port = free_port()
        log = open(os.path.join(logs, "router.log"), "w")
        router = subprocess.Popen(
            [f"{bins}/bellows-router", "--listen", f"127.0.0.1:{port}", "--workers", ",".join(workers),
             "--policy", "round_robin"], stdout=log, stderr=log, env={**os.environ, "RUST_LOG": "warn"})
        procs.append(router)
        for _ in range(300):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port)
                c.request("GET", "/ready")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        results = {}
        for rnd in range(a.rounds):
            for stream in (False, True):
                for name, (path, body) in bodies(stream).items():
                    drive(port, path, body, max(a.requests // 10, 50), a.connections)  # warm-up
                    before = cpu_seconds(router.pid)
                    drive(port, path, body, a.requests, a.connections)
                    us = (cpu_seconds(router.pid) - before) / a.requests * 1e6
                    results.setdefault((name, stream), []).append(round(us, 1))
        for stream in (False, True):
            chat = statistics.median(results[("chat", stream)])
            for name in ("chat", "responses", "messages"):
                runs = results[(name, stream)]
                med = statistics.median(runs)
                print(json.dumps({"protocol": name, "mode": "stream" if stream else "whole", "us_per_request": runs,
                                  "median": med, "vs_chat": round(med / chat, 3)}))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


if __name__ == "__main__":
    main()
