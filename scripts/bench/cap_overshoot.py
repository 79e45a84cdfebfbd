"""How far several routers, sharing no state, can overshoot the global queue cap.

Starts one simulated worker that runs one sequence at a time (so every admitted request but one
waits), N routers with --max-waiting CAP in front of it, and fires a burst of requests at all
routers at once, several times. A router counts the requests it is admitting and those the
worker reports waiting; what it cannot see is what the *other* routers admitted since the
worker's last load report. So a simultaneous burst is the worst case: each router may admit up
to CAP. Prints admitted requests per trial for 1 router and for N routers.

Usage: python3 scripts/bench/cap_overshoot.py [BIN_DIR] (default target/release)."""
import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.request

from benchlib import free_port, wait_placeable

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release"
CAP, BURST, TRIALS = 4, 40, 5


def post(url):
    body = json.dumps({"model": "sim", "prompt": "a b c", "max_tokens": 25}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def run(routers):
    procs = []
    try:
        wport = free_port()
        procs.append(subprocess.Popen(
            [f"{BIN}/bellows-worker", "serve", "--engine", "sim", "--sim-config", '{"base_us": 20000}',
             "--max-running", "1", "--max-waiting", "1000", "--listen", f"127.0.0.1:{wport}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls = []
        for _ in range(routers):
            port = free_port()
            procs.append(subprocess.Popen(
                [f"{BIN}/bellows-router", "--listen", f"127.0.0.1:{port}", "--workers", f"127.0.0.1:{wport}",
                 "--max-waiting", str(CAP)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            wait_placeable(u, 1)
        admitted = []
        with concurrent.futures.ThreadPoolExecutor(BURST * routers) as pool:
            for _ in range(TRIALS):
                statuses = list(pool.map(post, [u for u in urls for _ in range(BURST)]))
                admitted.append(sum(s == 200 for s in statuses))
                time.sleep(0.5)
        return admitted
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    os.chdir(os.path.join(os.path.dirname(__file__), "..", ".."))
    for n in (1, 2, 3):
        a = run(n)
        print(f"routers={n} cap={CAP} burst={BURST}/router: admitted per trial {a} "
              f"(max overshoot {max(a) - CAP})")
