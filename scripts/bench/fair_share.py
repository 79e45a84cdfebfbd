"""Fair sharing at the global cap: one tenant sends 20x the traffic of each of nine others.

One router (tenants file with 10 equal-weight tenants, --max-waiting CAP) in front of two
simulated workers that run a few sequences each, so the cap is reached. Closed-loop clients:
the noisy tenant runs 20 connections, each quiet tenant 1, each sending streamed completions
back to back. Reported per run: each quiet tenant's TTFT p50/p99 (from the first attempt; a 503
is retried after 50 ms and counts toward the TTFT of the request it delays), and the share of
completed requests per tenant. Runs: quiet tenants alone (their unloaded TTFT), then with the
noisy tenant, fair sharing on (per-tenant queues, deficit round robin) and off (--fair-queue-timeout
0: refusal at the cap, first come first served).

Usage: python3 scripts/bench/fair_share.py [BIN_DIR] (default target/release)."""
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from benchlib import first_data_after, free_port, pct, start_sim_workers, wait_placeable

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release"
CAP = int(os.environ.get("CAP", "8"))
SECONDS, NOISY_CONNS = 20, 20
TENANTS = [f"t{i}" for i in range(10)]  # t0 is the noisy one


def ttft(url, key, deadline):
    """Seconds to the first streamed token of one request, retrying 503s; None if out of time."""
    body = json.dumps({"model": "sim", "prompt": "a b c d e f g h", "max_tokens": 16, "stream": True}).encode()
    start = time.monotonic()
    while time.monotonic() < deadline:
        req = urllib.request.Request(url + "/v1/completions", body,
                                     {"content-type": "application/json", "authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return first_data_after(r, start)
        except urllib.error.HTTPError as e:
            e.read()
            time.sleep(0.05)
    return None


def run(fair, with_noisy):
    tmp = tempfile.mkdtemp()
    tenants = "tenants:\n" + "".join(
        f"- name: {t}\n  key_sha256: [{hashlib.sha256(t.encode()).hexdigest()}]\n" for t in TENANTS)
    path = os.path.join(tmp, "tenants.yaml")
    open(path, "w").write(tenants)
    procs = []
    try:
        workers = start_sim_workers(BIN, 2, '{"base_us": 20000}', ["--max-running", "2"], procs)
        port = free_port()
        args = [f"{BIN}/bellows-router", "--listen", f"127.0.0.1:{port}", "--workers", ",".join(workers),
                "--max-waiting", str(CAP), "--tenants-file", path, "--fair-queue-timeout", "30s" if fair else "0"]
        procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}"
        wait_placeable(url, 2)
        results = {t: [] for t in TENANTS}
        deadline = time.monotonic() + SECONDS

        def client(t):
            while time.monotonic() < deadline:
                v = ttft(url, t, deadline)
                if v is not None:
                    results[t].append(v)

        threads = [threading.Thread(target=client, args=(t,)) for t in TENANTS[1:]]
        if with_noisy:
            threads += [threading.Thread(target=client, args=(TENANTS[0],)) for _ in range(NOISY_CONNS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return results
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    os.chdir(os.path.join(os.path.dirname(__file__), "..", ".."))
    for name, fair, noisy in [("quiet tenants alone", True, False), ("noisy 20x, fair sharing on", True, True),
                              ("noisy 20x, fair sharing off", False, True)]:
        r = run(fair, noisy)
        quiet = [v for t in TENANTS[1:] for v in r[t]]
        total = sum(len(v) for v in r.values())
        print(f"{name}: quiet TTFT p50 {pct(quiet, 0.5) * 1000:.0f} ms, p99 {pct(quiet, 0.99) * 1000:.0f} ms "
              f"(per-tenant p99 max {max(pct(r[t], 0.99) for t in TENANTS[1:]) * 1000:.0f} ms); "
              f"completed: noisy {len(r[TENANTS[0]])}, quiet {len(quiet)} "
              f"(noisy share {len(r[TENANTS[0]]) / max(total, 1):.0%}, fair share 10%)")
