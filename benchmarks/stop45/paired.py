#!/usr/bin/env python3
"""Per-round ratios of bench contenders' txn/s to the reference (paired: same round).
Usage: paired.py REPORT.json [metric]"""
import json, statistics, sys
d = json.load(open(sys.argv[1]))
metric = sys.argv[2] if len(sys.argv) > 2 else "txn/s"
for r in d["reports"]:
    figs = [f for f in r["figures"] if f["metric"] == metric]
    ref = figs[0]
    print(f"reference: {ref['contender']}: {[round(s) for s in ref['samples']]}")
    for f in figs[1:]:
        cost = [a / b for a, b in zip(ref["samples"], f["samples"])]
        print(f"{f['contender']}: median {statistics.median(f['samples']):.0f}; cost per round "
              f"{' '.join(f'{c:.2f}' for c in cost)}; median {statistics.median(cost):.2f}")
