#!/usr/bin/env python3
"""Markdown tables from the JSON lines of scripts/bench-router.sh.

Labels are `part|run|router|policy|prompt|connections|mode`; every number shown is the median
over runs. Overhead: one row per router, policy, prompt format and response mode at 64
connections, with the latency at 1 connection and what it adds to the same backend called
directly. Placement: one row per router and policy, throughput relative to bellows round_robin
of the same run.
"""
import json
import statistics
import sys
from collections import defaultdict


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def get(r, *path):
    for p in path:
        if r is None:
            return None
        r = r.get(p)
    return r


def fmt(x, digits=0, suffix=""):
    return "-" if x is None else f"{x:,.{digits}f}{suffix}"


def pair(a, b, digits=1):
    return f"{fmt(a, digits)} / {fmt(b, digits)}"


def main(path):
    lines = [json.loads(l) for l in open(path) if l.strip()]
    meta, results = lines[0], lines[1:]
    print(f"{meta['date']}, {meta['cpu']}, {meta['cores']} cores, quickack={meta['quickack']}\n")
    groups = defaultdict(list)  # label without the run -> [(run, result)]
    router_metrics = [r for r in results if "router_metrics_of" in r]
    for r in results:
        if "label" not in r:
            continue
        part, run, *rest = r["label"].split("|")
        groups[(part, *rest)].append((run, r))
    overhead = {k[1:]: v for k, v in groups.items() if k[0] == "overhead"}
    if overhead:
        print_overhead(overhead)
    placement = {k[1:3]: v for k, v in groups.items() if k[0] == "placement"}
    if placement:
        print_placement(placement)
    for r in router_metrics:
        print(f"{r['router_metrics_of']}: bellows-router placed {r['prompt_tokens']:,.0f} prompt tokens, expecting "
              f"{r['predicted_cached_tokens']:,.0f} cached; the workers reported {r['cached_tokens']:,.0f} cached")


def print_overhead(groups):
    def m(key, *path):
        return med(get(r, *path) for _, r in groups.get(key, []))

    print("| router | policy | prompt | response | req/s @64 | latency p50 / p99 @64 (ms) | TTFT p50 / p99 @64 (ms) "
          "| router CPU us/req: total (user + sys) | @1: latency / TTFT p50 (ms) | added @1: latency / TTFT (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, rs in groups.items():
        router, policy, prompt, conns, mode = key
        if conns != "64":
            continue
        one = (router, policy, prompt, "1", mode)
        direct = (("direct-sim", "-", "tokens", "1", "stream") if router in ("bellows", "direct-sim")
                  else ("direct-fake", "-", "text", "1", mode))
        lat1, ttft1 = m(one, "latency_ms", "p50"), m(one, "ttft_ms", "p50")
        added = "-"
        if not router.startswith("direct") and one in groups:
            d_lat, d_ttft = m(direct, "latency_ms", "p50"), m(direct, "ttft_ms", "p50")
            added = pair(lat1 - d_lat if lat1 is not None else None,
                         ttft1 - d_ttft if ttft1 is not None and d_ttft is not None else None)
        cpu = m(key, "cpu", "us_per_request")
        cpu_s = "-" if cpu is None else \
            f"{cpu:.0f} ({m(key, 'cpu', 'user_us_per_request'):.0f} + {m(key, 'cpu', 'system_us_per_request'):.0f})"
        if router == "direct-sim" and cpu is not None:
            cpu_s += ", router idle but watching"
        if router == "direct-fake" and cpu is not None:
            cpu_s += ", of the fake itself"
        runs = f" ({len(rs)} runs)" if len(rs) > 1 else ""
        print(f"| {router}{runs} | {policy} | {prompt} | {mode} | {fmt(m(key, 'requests_per_s'))} "
              f"| {pair(m(key, 'latency_ms', 'p50'), m(key, 'latency_ms', 'p99'))} "
              f"| {pair(m(key, 'ttft_ms', 'p50'), m(key, 'ttft_ms', 'p99'))} | {cpu_s} "
              f"| {pair(lat1, ttft1) if one in groups else '-'} | {added} |")
    # What the transports cost with nothing in between: the fake is a bare hyper server, and the
    # load generator is an HTTP/1.1 client of it or a gRPC client of the simulated workers.
    floors = [("direct-fake", "-", "text", "64", "whole"), ("direct-fake", "-", "text", "64", "stream"),
              ("direct-sim", "-", "tokens", "64", "stream")]
    if any(k in groups for k in floors):
        print("\n| transport, no router | response | server CPU us/req | client CPU us/req (the load generator) |")
        print("|---|---|---|---|")
        for key in floors:
            if key not in groups:
                continue
            server = fmt(m(key, "cpu", "us_per_request")) if key[0] == "direct-fake" else "-"
            transport = "HTTP/1.1 (hyper)" if key[0] == "direct-fake" else "gRPC (tonic), one message per token"
            print(f"| {transport} | {key[4]} | {server} | {fmt(m(key, 'client_cpu', 'us_per_request'))} |")
    # At 1 connection the benchmark itself keeps the machine under 20% busy: more means other
    # work shared the machine during that run.
    shared = [f"{'|'.join(k)} run {run} ({r['machine_cpu_busy']:.0%})" for k, rs in groups.items() if k[3] == "1"
              for run, r in rs if r["machine_cpu_busy"] > 0.3]
    print(f"\nRuns at 1 connection that shared the machine with other work: {', '.join(shared) or 'none'}\n")


def print_placement(groups):
    baseline = {run: r["requests_per_s"] for run, r in groups.get(("bellows", "round_robin"), [])}
    first = next(iter(groups.values()))[0][1]
    print(f"run 1 of bellows round_robin: {first['requests']} requests ({first['hot_tenant']['requests']} from the hot "
          f"tenant), {first['shareable_tokens']:,} shareable prompt tokens, "
          f"{first.get('achievable_cached_tokens', 0):,} achievable cached tokens\n")
    print("| router | policy | req/s | vs bellows round_robin | cached tokens | of achievable "
          "| of shareable: hot / other tenants | TTFT p50 / p99 (ms) | router CPU us/req "
          "| per worker (last run): decode tok/s; waiting; blocks evicted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (router, policy), rs in groups.items():
        def m(*path):
            return med(get(r, *path) for _, r in rs)
        rel = med(r["requests_per_s"] / baseline[run] for run, r in rs if run in baseline)
        workers = rs[-1][1]["workers"]
        per_worker = "; ".join([
            ", ".join(f"{w['decode_tokens_per_s']:.0f}" for w in workers),
            ", ".join(f"{w['waiting_requests']:.1f}" for w in workers),
            ", ".join(f"{w['blocks_evicted']}" for w in workers),
        ])
        runs = f" ({len(rs)} runs)" if len(rs) > 1 else ""
        print(f"| {router} | {policy}{runs} | {fmt(m('requests_per_s'))} | {fmt(rel, 2, 'x')} "
              f"| {fmt(m('cached_tokens'))} | {fmt(100 * m('cached_of_achievable'), 0, '%')} "
              f"| {fmt(100 * m('hot_tenant', 'cached_of_shareable'), 0, '%')} / "
              f"{fmt(100 * m('other_tenants', 'cached_of_shareable'), 0, '%')} "
              f"| {pair(m('ttft_ms', 'p50'), m('ttft_ms', 'p99'), 0)} | {fmt(m('cpu', 'us_per_request'))} "
              f"| {per_worker} |")
    print()


if __name__ == "__main__":
    main(sys.argv[1])
