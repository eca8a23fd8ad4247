#!/usr/bin/env python3
"""Summarizes part.py soak output (JSON lines on stdin): per kind, total size (table + its
partitions' indexes + the side table) per quarter, and size end / first quarter (the last
sample over the mean of the first quarter's samples, as BENCHMARKS.md section 5)."""
import json, sys
from collections import defaultdict

rows = defaultdict(list)
summ = {}
for line in sys.stdin:
    d = json.loads(line)
    if "summary" in d:
        summ[d["summary"]] = d
    else:
        rows[d["kind"]].append(d)
for k, rs in rows.items():
    T = rs[-1]["t"]
    q = [[r for r in rs if i * T / 4 < r["t"] <= (i + 1) * T / 4 + 1e-9] for i in range(4)]
    mean = lambda xs, f: sum(f(x) for x in xs) / len(xs)
    mb = lambda b: round(b / 1048576, 1)
    first = mean(q[0], lambda r: r["total_bytes"])
    firstt = mean(q[0], lambda r: r["table_bytes"])
    print(f"{k}: {len(rs)} samples over {T:.0f} s; appended {rs[-1]['appended']}, published {rs[-1]['published']}, "
          f"errors {rs[-1]['errors']}")
    print("  quarter means, MB total (table+indexes | side table), dead tuples, partitions, backlog max:")
    for i, xs in enumerate(q):
        print(f"   Q{i + 1}: {mb(mean(xs, lambda r: r['total_bytes']))} ({mb(mean(xs, lambda r: r['table_bytes']))} | "
              f"{mb(mean(xs, lambda r: r['side_bytes']))}), dead {int(mean(xs, lambda r: r['dead_tuples']))}, "
              f"leaves {round(mean(xs, lambda r: r['leaves']), 1)}, backlog max {max(r['backlog'] for r in xs)}")
    print(f"  end {mb(rs[-1]['total_bytes'])} MB; size end / first quarter = {rs[-1]['total_bytes'] / first:.2f} "
          f"(table alone {rs[-1]['table_bytes'] / firstt:.2f}); max {mb(max(r['total_bytes'] for r in rs))} MB; "
          f"holder xmin age at end {rs[-1]['holder_xmin_age']}; load {min(r['load'] for r in rs):.1f}-{max(r['load'] for r in rs):.1f}")
    qi = len(rs) // 4
    print(f"  as outbox-bench computes it (last sample / sample {qi} of {len(rs)}): "
          f"{rs[-1]['total_bytes'] / rs[qi]['total_bytes']:.2f}; quarter means Q4/Q1 = "
          f"{mean(q[3], lambda r: r['total_bytes']) / first:.2f}; quarter peaks Q4/Q1 = "
          f"{max(r['total_bytes'] for r in q[3]) / max(r['total_bytes'] for r in q[0]):.2f}")
    if k in summ:
        s = summ[k]
        print(f"  append batch ms p50 {s['append_batch_p50_ms']} p99 {s['append_batch_p99_ms']} max {s['append_batch_max_ms']}; "
              f"maintenance {json.dumps(s['maintenance'])}; errors {s['n_errors']} {s['errors'][:3]}")
