#!/usr/bin/env python3
"""Soak samples of an `outbox-bench scale` JSON report, per window of WINDOW seconds: outbox
table total size (heap + indexes), heap, indexes, aggregate-state table, live and dead tuples,
backlog and the probe claim's latency (median and max in the window).

soak-summary.py REPORT.json [WINDOW]"""
import json, statistics, sys

rep = json.load(open(sys.argv[1]))["reports"][0]
window = int(sys.argv[2]) if len(sys.argv) > 2 else 300
s = rep["details"]["soak_samples"]
mb = lambda b: b / 1048576
print("window_s   total_MB heap_MB index_MB state_MB  live   dead  vacuums  backlog_max  claim_ms_p50 claim_ms_max")
start = 0
while start < s[-1]["t_s"]:
    w = [x for x in s if start < x["t_s"] <= start + window]
    start += window
    if not w:
        continue
    last = w[-1]
    c = [x["probe_claim_ms"] for x in w]
    print(f"{start - window:>4}-{start:<5} {mb(last['total_bytes']):8.1f} {mb(last['heap_bytes']):7.1f} "
          f"{mb(last['index_bytes']):8.1f} {mb(last.get('state_total_bytes', 0)):8.1f} "
          f"{last['live_tuples']:5d} {last['dead_tuples']:6d} {last.get('vacuums', 0):8d} "
          f"{max(x['backlog'] for x in w):12d} {statistics.median(c):13.1f} {max(c):12.1f}")
