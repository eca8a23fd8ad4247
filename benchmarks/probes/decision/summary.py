#!/usr/bin/env python3
"""Summaries of this probe's JSON lines (stdin; any mix of run.sh, ab.sh and shadow.sh output).
* drains (run.sh): per variant, medians of the backend CPU per event of claim + completion
  (schedstat, every statement of the relay's connection), of the decision, candidates and
  completion statements, events/s; every round in brackets; drain.py's check.
* ab (ab.sh): the decision's backend CPU per row it returned, per text, in the same drains.
* shadow (shadow.sh): the decision's cost with one part removed (ablations), per row."""
import json, statistics as st, sys
from collections import defaultdict

drains, checks, abs_, shadows = defaultdict(list), defaultdict(list), [], []
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    d = json.loads(line)
    if d["kind"] == "drain":
        drains[d["scheme"]].append(d)
    elif d["kind"] == "check":
        checks[d["scheme"]].append(d)
    elif d["kind"] == "ab":
        abs_.append(d)
    elif d["kind"] == "shadow":
        shadows.append(d)
med = st.median
if drains:
    base = med([d["backend_cpu_ns_us_per_event"] for d in drains["cur"]])
    print("| variant | backend CPU µs/event, claim + completion (rounds) | vs today | decision | candidates | completion | events/s (rounds) | check |")
    print("|---|---|---|---|---|---|---|---|")
    for v, ds in drains.items():
        cpu = med([d["backend_cpu_ns_us_per_event"] for d in ds])
        s = lambda k: med([d["statement_cpu_us_per_event"].get(k, 0) for d in ds])
        ok = len(checks[v]) >= len(ds) and all(c["unfinished"] == 0 and c["last_version_ok"] for c in checks[v])
        print(f"| {v} | {cpu:.1f} ({', '.join(format(d['backend_cpu_ns_us_per_event'], '.1f') for d in ds)}) | "
              f"{(cpu / base - 1) * 100:+.1f}% | {s('decide'):.1f} | {s('candidates'):.1f} | {s('complete'):.1f} | "
              f"{med([d['events_per_s'] for d in ds]):,.0f} ({', '.join(format(d['events_per_s'], ',') for d in ds)}) | "
              f"{'ok' if ok else 'FAILED'} |")
    print()
    print("Load average (1 min) during the drains:",
          ", ".join(f"{v} {min(float(d['loadavg'][0]) for d in ds)}–{max(float(d['loadavg'][0]) for d in ds)}"
                    for v, ds in drains.items()))
    print("Checkpoints during drains:", sum(d["checkpoints_during_run"] for ds in drains.values() for d in ds))
if abs_:
    names = list(abs_[0]["ab_decide_us_per_row"])
    print("\n| decision text (A/B in the same drains) | backend CPU µs per row returned (rounds) | vs today |")
    print("|---|---|---|")
    base = [d["ab_decide_us_per_row"]["cur"] for d in abs_]
    for n in names:
        xs = [d["ab_decide_us_per_row"][n] for d in abs_]
        rel = [x / b - 1 for x, b in zip(xs, base)]
        print(f"| {n} | {med(xs):.2f} ({', '.join(format(x, '.2f') for x in xs)}) | "
              f"{', '.join(format(r * 100, '+.1f') + '%' for r in rel)} |")
    print("A/B drains' load (1 min):", ", ".join(d["loadavg"][0] for d in abs_))
for d in shadows:
    print("\n| shadow text (rolled back, same ids) | backend CPU µs per claimed row |")
    print("|---|---|")
    for k, v in d["shadow_us_per_row"].items():
        print(f"| {k} | {v:.2f} |")
    print(f"| (the real decision after them) | {d['decide_us_per_row']:.2f} |")
    print("load (1 min):", d["loadavg"][0])
