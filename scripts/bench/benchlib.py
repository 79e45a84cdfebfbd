"""What the Python benchmark scripts share: free ports, waiting for a router, percentiles."""
import socket
import subprocess
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_placeable(url, workers):
    """Until the router at `url` has `workers` placeable workers (its /metrics says so)."""
    for _ in range(300):
        try:
            text = urllib.request.urlopen(url + "/metrics", timeout=1).read().decode()
            if f"bellows_router_placeable_workers {workers}" in text:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} not ready: fewer than {workers} placeable workers")


def pct(xs, q):
    """The q-quantile of xs (nearest rank); NaN when empty."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def first_data_after(response, start):
    """Seconds from `start` (a time.monotonic()) to the first SSE data chunk of `response`, which
    is read to its end; None if it had none."""
    first = None
    for line in response:
        if first is None and line.startswith(b"data: {"):
            first = time.monotonic() - start
    return first


def start_sim_workers(bin_dir, n, sim_config, extra, procs):
    """Start `n` simulated workers (`extra` flags each) on free ports, adding them to `procs`;
    their host:port addresses."""
    addresses = []
    for _ in range(n):
        port = free_port()
        procs.append(subprocess.Popen(
            [f"{bin_dir}/bellows-worker", "serve", "--engine", "sim", "--sim-config", sim_config,
             "--listen", f"127.0.0.1:{port}", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        addresses.append(f"127.0.0.1:{port}")
    return addresses
