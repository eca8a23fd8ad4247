#!/usr/bin/env python3
"""Medians per scheme of run.sh's JSON lines (stdin): events/s and its ratio to the naive drain,
backend CPU per event and its ratio, WAL bytes per event (own statements; server-wide LSN),
per-statement time and WAL, fill time; every round's events/s in brackets."""
import json, statistics as st, sys
from collections import defaultdict

drains, fills, checks = defaultdict(list), defaultdict(list), defaultdict(list)
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    d = json.loads(line)
    {"drain": drains, "setup": fills, "check": checks}[d["kind"]][d["scheme"]].append(d)
med = lambda xs: st.median(xs) if xs else float("nan")
base = drains.get("naive")
b_eps = med([d["events_per_s"] for d in base]) if base else None
b_cpu = med([d["backend_cpu_us_per_event"] for d in base]) if base else None
print("| scheme | events/s (rounds) | ratio to naive | backend CPU µs/event | CPU ratio | client CPU µs/event | WAL B/event (statements) | WAL B/event (LSN, server-wide) | fill µs/event | checks |")
print("|---|---|---|---|---|---|---|---|---|---|")
for s, ds in drains.items():
    eps = med([d["events_per_s"] for d in ds]); cpu = med([d["backend_cpu_us_per_event"] for d in ds])
    ok = all(c["published"] == c["unfinished"] + c["published"] and c["unfinished"] == 0
             and c.get("last_version_ok", True) for c in checks[s])
    rounds = ", ".join(format(d["events_per_s"], ",") for d in ds)
    print(f"| {s} | {eps:,.0f} ({rounds}) | "
          f"{eps / b_eps:.2f} | {cpu:.1f} | {cpu / b_cpu:.2f} | "
          f"{med([d['client_cpu_us_per_event'] for d in ds]):.1f} | "
          f"{med([d['statement_wal_bytes_per_event_total'] for d in ds]):.0f} | "
          f"{med([d['wal_bytes_per_event_lsn'] for d in ds]):.0f} | "
          f"{med([f['fill_us_per_event'] for f in fills[s]]):.1f} | {'ok' if ok else 'FAILED'} |")
print()
print("Per statement, median µs/event (wall, client-measured) and WAL bytes/event:")
print()
for s, ds in drains.items():
    keys = ds[0]["statement_us_per_event"].keys()
    parts = [f"{k} {med([d['statement_us_per_event'][k] for d in ds]):.1f} µs / "
             f"{med([d['statement_wal_bytes_per_event'][k] for d in ds]):.0f} B" for k in keys]
    print(f"* {s}: " + "; ".join(parts))
print()
print("Load average (1 min) during the drains:",
      ", ".join(f"{s} {min(float(d['loadavg'][0]) for d in ds)}–{max(float(d['loadavg'][0]) for d in ds)}"
                for s, ds in drains.items()))
print("Checkpoints during drains:", sum(d["checkpoints_during_run"] for ds in drains.values() for d in ds))
