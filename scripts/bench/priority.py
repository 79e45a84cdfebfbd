"""Priority classes: interactive requests' TTFT under a batch flood at 20x their rate.

Two simulated workers (20 ms a step, as a GPU's decode step barely depends on the batch; 16
running sequences each) behind one router (--max-waiting 32, no tenants: the request names its
class). Open-loop Poisson arrivals: interactive at RATE requests/s (16 tokens, streamed,
`service_tier: priority`), batch at 20x that (128 tokens, `service_tier: flex`), more than the
workers can serve, so the router refuses batch past its cap. Reported per run: interactive TTFT
p50/p99 (a 503 is retried after 50 ms and counts toward the TTFT), batch requests completed and
refused. Runs: interactive alone; with the batch flood; with the same flood sent without a class
(everyone standard: first come, first served); and with tenants (so the fair-share queue holds
what is over the cap): the flood from a tenant whose default class is batch, sending no class.

Usage: [RATE=1] [DURATION=60] python3 scripts/bench/priority.py [BIN_DIR] (default target/release)."""
import hashlib
import json
import os
import tempfile
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from benchlib import first_data_after, free_port, pct, start_sim_workers, wait_placeable

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release"
RATE = float(os.environ.get("RATE", "1"))
SECONDS = int(os.environ.get("DURATION", "60"))
BATCH_FACTOR = 20


TENANTS = ("tenants:\n"
           f"- name: app\n  key_sha256: [{hashlib.sha256(b'app').hexdigest()}]\n"
           f"- name: evals\n  key_sha256: [{hashlib.sha256(b'evals').hexdigest()}]\n  priority: batch\n")


def send(url, body, deadline, retry, key=None):
    """(status, seconds to the first streamed token or None); retries 503s while `retry`."""
    data = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    start = time.monotonic()
    while True:
        req = urllib.request.Request(url + "/v1/completions", data, headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return 200, first_data_after(r, start)
        except urllib.error.HTTPError as e:
            e.read()
            if not (retry and e.code == 503 and time.monotonic() < deadline):
                return e.code, None
            time.sleep(0.05)
        except OSError:
            return 0, None


def arrivals(rate, seconds, fire):
    """Call `fire` in a thread at Poisson arrival times for `seconds`; returns the threads."""
    rng, threads, t = random.Random(rate), [], time.monotonic()
    end = t + seconds
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return threads
        time.sleep(max(0.0, t - time.monotonic()))
        th = threading.Thread(target=fire)
        th.start()
        threads.append(th)


def run(batch, batch_tier, tenants=False):
    procs = []
    auth = []
    if tenants:
        path = os.path.join(tempfile.mkdtemp(), "tenants.yaml")
        open(path, "w").write(TENANTS)
        auth = ["--tenants-file", path]
    try:
        workers = start_sim_workers(BIN, 2, '{"base_us": 20000}',
                                    ["--max-running", "16", "--metrics-listen", "127.0.0.1:0"], procs)
        port = free_port()
        procs.append(subprocess.Popen(
            [f"{BIN}/bellows-router", "--listen", f"127.0.0.1:{port}", "--workers", ",".join(workers),
             "--max-waiting", "32", *auth], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}"
        wait_placeable(url, 2)
        deadline = time.monotonic() + SECONDS + 30
        ttfts, batch_status, lock = [], [], threading.Lock()

        def interactive():
            body = {"model": "sim", "prompt": "a b c d e f g h", "max_tokens": 16, "stream": True,
                    "service_tier": "priority"}
            status, first = send(url, body, deadline, retry=True, key="app" if tenants else None)
            with lock:
                ttfts.append(first if status == 200 else None)

        def batch_request():
            body = {"model": "sim", "prompt": "z y x w v u t s", "max_tokens": 128, "stream": True}
            if batch_tier:
                body["service_tier"] = batch_tier
            status, _ = send(url, body, deadline, retry=False, key="evals" if tenants else None)
            with lock:
                batch_status.append(status)

        threads = []
        if batch:
            flood = threading.Thread(target=lambda: threads.extend(
                arrivals(RATE * BATCH_FACTOR, SECONDS, batch_request)))
            flood.start()
            time.sleep(3)  # the workers are full of batch work before the first interactive request
        threads += arrivals(RATE, SECONDS - 3 if batch else SECONDS, interactive)
        if batch:
            flood.join()
        for th in threads:
            th.join()
        return ttfts, batch_status
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    os.chdir(os.path.join(os.path.dirname(__file__), "..", ".."))
    print(f"interactive {RATE}/s, batch {RATE * BATCH_FACTOR}/s, {SECONDS} s a run")
    alone = None
    runs = [("interactive alone", False, None, False), ("batch flood, service_tier flex", True, "flex", False),
            ("batch flood, no class (all standard)", True, None, False),
            ("batch flood from a batch tenant, fair-share queue", True, None, True)]
    for name, batch, tier, tenants in runs:
        ttfts, statuses = run(batch, tier, tenants)
        ok = [v for v in ttfts if v is not None]
        p50, p99 = pct(ok, 0.5), pct(ok, 0.99)
        alone = alone or p99
        line = (f"{name}: interactive TTFT p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms "
                f"({p99 / alone:.2f}x alone), {len(ok)} of {len(ttfts)} served")
        if batch:
            line += (f"; batch completed {statuses.count(200)}, refused {statuses.count(503)}, "
                     f"other {len(statuses) - statuses.count(200) - statuses.count(503)}")
        print(line, flush=True)
