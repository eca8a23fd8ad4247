#!/usr/bin/env python3
"""../completion/late_lower.py (a row with the same version and a lower id becomes visible while
another relay holds the aggregate) against a variant of this folder's claim:
  python3 late_lower.py VARIANT        (PROBE_BREAK=lease: the claim ignores live leases)"""
import os, runpy, sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import probe  # noqa: E402

probe.VARIANT = sys.argv[1]
probe.drain.statements = probe.decision_statements
print({"variant": probe.VARIANT, "break": os.environ.get("PROBE_BREAK"),
       "decide_chars": len(probe.decision_statements("cur", "x")["decide"])})
sys.argv = [os.path.join(HERE, "..", "completion", "late_lower.py"), "cur"]
runpy.run_path(sys.argv[0], run_name="__main__")
