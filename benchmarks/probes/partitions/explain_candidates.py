#!/usr/bin/env python3
"""EXPLAIN ANALYZE of today's claim candidates statement (../completion/cur.sql) on the
steady-state partitioned layout of drain_low.py (schema given as argv[1])."""
import sys, os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "completion"))
import drain as D  # noqa: E402
s = sys.argv[1]
sql = D.statements("cur", s)["candidates"].replace("$1", "1000")
with D.connect() as c:
    c.execute("BEGIN")
    c.execute("SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL jit = off; SET LOCAL enable_sort = off; SET LOCAL enable_bitmapscan = off")
    for (line,) in c.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + sql).fetchall():
        print(line)
    c.execute("ROLLBACK")
