#!/usr/bin/env python3
"""Markdown tables from the JSON lines of scripts/bench-router.sh.

Labels are `part|router|policy|prompt|connections|mode[|run]`. Overhead: one row per router,
policy, prompt format and mode at 64 connections, with the latency added at 1 connection against
the same backend called directly. Placement: one row per router and policy (medians over runs),
throughput relative to bellows round_robin of the same run.
"""
import json
import statistics
import sys
from collections import defaultdict


def fmt(x, digits=0):
    return "-" if x is None else f"{x:,.{digits}f}"


def pct(s, key, digits=1):
    return "-" if not s else f"{s['p50']:.{digits}f} / {s[key]:.{digits}f}"


def main(path):
    lines = [json.loads(l) for l in open(path) if l.strip()]
    meta, runs = lines[0], lines[1:]
    print(f"date {meta['date']}, {meta['cpu']}, {meta['cores']} cores, quickack={meta['quickack']}\n")
    by = {}
    for r in runs:
        by[tuple(r["label"].split("|"))] = r
    overhead = {k: v for k, v in by.items() if k[0] == "overhead"}
    if overhead:
        print_overhead(overhead)
    placement = {k: v for k, v in by.items() if k[0] == "placement"}
    if placement:
        print_placement(placement)


def print_overhead(rows):
    def direct(router, mode):
        if router == "bellows":
            return rows.get(("overhead", "direct-sim", "-", "tokens", "1", "stream"))
        return rows.get(("overhead", "direct-fake", "-", "text", "1", mode))

    print("| router | policy | prompt | response | req/s @64 | latency p50 / p99 @64 (ms) | TTFT p50 / p99 @64 (ms) "
          "| router CPU us/req (user + sys) | p50 @1 (ms) | added @1 vs direct (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, r in rows.items():
        _, router, policy, prompt, conns, mode = key[:6]
        if conns != "64":
            continue
        one = rows.get(key[:4] + ("1", mode))
        # Streams are compared on the first token, whole answers on the whole latency.
        metric = "ttft_ms" if mode == "stream" else "latency_ms"
        base = direct(router, mode) if not router.startswith("direct") else None
        at1 = one[metric]["p50"] if one and one[metric] else None
        added = at1 - base[metric]["p50"] if at1 is not None and base else None
        cpu = r["cpu"]
        cpu_s = (f"{cpu['us_per_request']:.0f} ({cpu['user_us_per_request']:.0f} + {cpu['system_us_per_request']:.0f})"
                 if cpu else "-")
        if router == "direct-sim" and cpu:
            cpu_s += " (router idle, watching)"
        if router == "direct-fake" and cpu:
            cpu_s += " (the fake itself)"
        print(f"| {router} | {policy} | {prompt} | {mode} | {fmt(r['requests_per_s'])} | {pct(r['latency_ms'], 'p99')} "
              f"| {pct(r['ttft_ms'], 'p99')} | {cpu_s} | {fmt(at1, 1)} | {fmt(added, 1)} |")
    print()


def print_placement(rows):
    groups = defaultdict(list)
    baseline = {}
    for key, r in rows.items():
        _, router, policy = key[:3]
        run = key[6] if len(key) > 6 else "1"
        groups[(router, policy)].append((run, r))
        if (router, policy) == ("bellows", "round_robin"):
            baseline[run] = r["requests_per_s"]
    med = statistics.median
    first = next(iter(rows.values()))
    print(f"achievable cached tokens (run 1): {first.get('achievable_cached_tokens')} of {first['shareable_tokens']} "
          f"shareable; {first['requests']} requests, hot tenant {first['hot_tenant']['requests']}\n")
    print("| router | policy | req/s | vs bellows round_robin | cached of achievable | cached of shareable: hot / others "
          "| TTFT p50 / p99 (ms) | router CPU us/req | per-worker decode tok/s | per-worker blocks evicted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (router, policy), rs in groups.items():
        rps = med(r["requests_per_s"] for _, r in rs)
        rel = med(r["requests_per_s"] / baseline[run] for run, r in rs if run in baseline) if baseline else None
        ach = med(r["cached_of_achievable"] for _, r in rs)
        hot = med(r["hot_tenant"]["cached_of_shareable"] for _, r in rs)
        cold = med(r["other_tenants"]["cached_of_shareable"] for _, r in rs)
        ttft50 = med(r["ttft_ms"]["p50"] for _, r in rs)
        ttft99 = med(r["ttft_ms"]["p99"] for _, r in rs)
        cpu = med(r["cpu"]["us_per_request"] for _, r in rs)
        last = rs[-1][1]["workers"]
        decode = ", ".join(f"{w['decode_tokens_per_s']:.0f}" for w in last)
        evicted = ", ".join(f"{w['blocks_evicted']}" for w in last)
        runs = f" ({len(rs)} runs)" if len(rs) > 1 else ""
        print(f"| {router} | {policy}{runs} | {rps:.0f} | {fmt(rel, 2)}x | {ach:.0%} | {hot:.0%} / {cold:.0%} "
              f"| {ttft50:.0f} / {ttft99:.0f} | {cpu:.0f} | {decode} | {evicted} |")
    print()


if __name__ == "__main__":
    main(sys.argv[1])
