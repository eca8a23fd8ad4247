#!/usr/bin/env python3
"""Prints the JSON plans that drain.py --explain-at appended to $PROBE_PLANS as indented text:
node, relation/index, actual rows x loops, total ms, shared hit, WAL bytes."""
import json, sys

def walk(n, d=0):
    rel = n.get("Relation Name") or n.get("Index Name") or n.get("CTE Name") or ""
    if n.get("Index Name") and n.get("Relation Name"):
        rel = n["Relation Name"] + "/" + n["Index Name"]
    print(f"{'  ' * d}{n['Node Type']:<18} {rel:<40} rows={n.get('Actual Rows')}x{n.get('Actual Loops')} est={n.get('Plan Rows')} "
          f"ms={n.get('Actual Total Time', 0) * n.get('Actual Loops', 1):.1f} hit={n.get('Shared Hit Blocks', 0)} "
          f"wal={n.get('WAL Bytes', 0)} {n.get('Subplan Name', '') or n.get('Parent Relationship', '')}")
    for c in n.get("Plans", []):
        walk(c, d + 1)

dec = json.JSONDecoder()
s = open(sys.argv[1]).read()
i = 0
while i < len(s):
    while i < len(s) and s[i].isspace():
        i += 1
    if i >= len(s):
        break
    p, i = dec.raw_decode(s, i)
    print(f"==== execution {p['Execution Time']:.1f} ms")
    walk(p["Plan"])
