#!/usr/bin/env python3
"""Two relays on one backlog (two_relays.sh): checks the batches logged by drain.py --log.
* no event claimed twice: with a 30 s lease and no release, a second claim of a row can only
  happen while the first relay still holds it (a completion deletes or finishes the row), so
  any row in two batches was in flight in two relays at once;
* no aggregate certainly in flight in two relays at once (claim commit .. completion BEGIN);
* per aggregate, versions published in order (by publication time) and each exactly once."""
import json, sys
from collections import defaultdict
import psycopg

log, scheme, schema = sys.argv[1], sys.argv[2], sys.argv[3]
spans = defaultdict(list)
for line in open(log):
    b = json.loads(line)
    for t, i, v in b["keys"]:
        spans[(t, i)].append((b["from"], b["to"], b["pid"], v))
seen = defaultdict(int)
for line in open(log):
    for t, i, v in json.loads(line)["keys"]:
        seen[(t, i, v)] += 1
claimed_twice = sum(1 for n in seen.values() if n > 1)
overlaps = 0
for k, ss in spans.items():
    ss.sort()
    for x, y in zip(ss, ss[1:]):
        if y[0] < x[1] and y[2] != x[2]:
            overlaps += 1
pids = {p for ss in spans.values() for (_, _, p, _) in ss}
c = psycopg.connect("host=127.0.0.1 user=postgres dbname=test")
T = f'"{schema}".outbox_events'
if scheme == "cur":
    q = f"SELECT aggregate_id, aggregate_version, published_at FROM {T} WHERE status = 'published'"
elif scheme.endswith("batchack"):
    q = (f"SELECT e.aggregate_id, e.aggregate_version, b.finished_at FROM \"{schema}\".outbox_events_ackb b "
         f"CROSS JOIN LATERAL unnest(b.ids) WITH ORDINALITY u(id, n) JOIN {T} e ON e.id = u.id")
else:
    q = f"SELECT e.aggregate_id, e.aggregate_version, a.finished_at FROM \"{schema}\".outbox_events_ack a JOIN {T} e ON e.id = a.id"
rows = c.execute(q).fetchall()
by = defaultdict(list)
for agg, v, t in rows:
    by[agg].append((t, v))
out_of_order = sum(1 for l in by.values() if [v for _, v in sorted(l)] != sorted(v for _, v in l))
dups = sum(len(l) - len({v for _, v in l}) for l in by.values())
print(json.dumps({"scheme": scheme, "relays": len(pids), "batches_logged": sum(1 for _ in open(log)),
                  "published": len(rows), "aggregates": len(by), "claimed_twice": claimed_twice, "overlapping_in_flight": overlaps,
                  "aggregates_out_of_order": out_of_order, "duplicate_versions": dups}))
