#!/usr/bin/env python3
"""Summarise inferno-collapse-perf --pid output: samples per process group, and the top frames
(self = leaf samples; total = samples with the frame anywhere on the stack) of a group.

fold-summary.py ALL.folded RELAY.folded POSTGRES.folded [N]"""
import collections, sys

def load(path):
    rows = []
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if stack:
            rows.append((stack.split(";"), int(n)))
    return rows

def tops(rows, n):
    self_, total = collections.Counter(), collections.Counter()
    for frames, c in rows:
        self_[frames[-1]] += c
        for f in set(frames[1:]):
            total[f] += c
    return self_.most_common(n), total.most_common(n)

all_, relay, pg = (load(p) for p in sys.argv[1:4])
n = int(sys.argv[4]) if len(sys.argv) > 4 else 15
s = lambda rows: sum(c for _, c in rows)
t_all, t_relay, t_pg = s(all_), s(relay), s(pg)
other_pg = sum(c for f, c in all_ if f[0].startswith("postgres-")) - t_pg
print(f"samples on the machine while the drain ran: {t_all}")
print(f"  relay process:                     {t_relay:6d} ({100*t_relay/t_all:4.1f}%)")
print(f"  the run's PostgreSQL backends:     {t_pg:6d} ({100*t_pg/t_all:4.1f}%)")
print(f"  other PostgreSQL processes:        {other_pg:6d} ({100*other_pg/t_all:4.1f}%)")
rest = t_all - t_relay - t_pg - other_pg
print(f"  everything else (other sessions):  {rest:6d} ({100*rest/t_all:4.1f}%)")
if t_relay + t_pg:
    print(f"relay : its backends = {t_relay/(t_relay+t_pg):.2f} : {t_pg/(t_relay+t_pg):.2f}")
for name, rows, tot in (("relay process", relay, t_relay), ("PostgreSQL backends", pg, t_pg)):
    self_, total = tops(rows, n)
    print(f"\n== {name}: top {n} frames by self samples (of {tot})")
    for f, c in self_:
        print(f"{c:6d} {100*c/tot:5.1f}%  {f[:150]}")
    print(f"== {name}: top {n} frames by total (inclusive) samples")
    for f, c in total:
        print(f"{c:6d} {100*c/tot:5.1f}%  {f[:150]}")
