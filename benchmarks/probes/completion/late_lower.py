#!/usr/bin/env python3
"""The corner the `busy` probe of rowlease.sql exists for: while relay A holds version 1 of an
aggregate (row id 1), a row with the same version and a LOWER id (a transaction that got its id
earlier and committed later, emulated with OVERRIDING SYSTEM VALUE) becomes visible. Relay B's
claim must not hand it out while A's lease is live; after A's completion it is parked as out of
order. Runs for `cur` (today's aggregate lease) and `rowlease`; PROBE_BREAK=busy removes the
busy probe to see the check fail.
  python3 late_lower.py cur|rowlease"""
import os, sys, uuid
import drain

scheme = sys.argv[1]
schema = f"probe25_late_{scheme}"
st = drain.statements(scheme, schema)
if os.environ.get("PROBE_BREAK") == "busy":
    st["decide"] = st["decide"].replace("AND u.lease_until > clock_timestamp()) THEN 'wait'",
                                        "AND false) THEN 'wait'")
n = drain.names(schema)


class A:
    pass


a = A(); a.scheme, a.schema, a.events, a.aggs = scheme, schema, 1, 1
drain.setup(a)
c = drain.connect()


def claim(owner):
    token = uuid.uuid4()
    c.execute(drain.CLAIM_BEGIN)
    ids = [r[0] for r in c.execute(st["candidates"], (10,)).fetchall()]
    rows = c.execute(st["decide"], (ids, owner, token, 30_000_000, 300_000_000, 1_000_000)).fetchall() if ids else []
    c.execute("COMMIT")
    return token, [(r[0], r[1], r[17]) for r in rows]


def complete(token, rows):
    sd = drain.seed(schema, "outbox_events")
    full = c.execute(f"SELECT id, hashtextextended(aggregate_type || chr(31) || aggregate_id, 0), aggregate_type, "
                     f"aggregate_id, aggregate_version FROM {n['@T@']} WHERE id = ANY($1)",
                     ([r[0] for r in rows],)).fetchall()
    c.execute(drain.COMPLETE_BEGIN)
    c.execute(st["lock_keys"], ([f[1] ^ sd for f in full],))
    m = len(full)
    applied = c.execute(st["complete"], ([f[0] for f in full], [f[1] for f in full], [f[2] for f in full],
                                         [f[3] for f in full], [f[4] for f in full], ["published"] * m,
                                         ["bench"] * m, [0] * m, [1] * m, [None] * m, [None] * m, [None] * m,
                                         [None] * m, [None] * m, [False] * m, ["kafka"] * m, [None] * m,
                                         [None] * m, token)).fetchone()[0]
    c.execute("COMMIT")
    return applied


ta, ra = claim("relay-a")
c.execute(f"INSERT INTO {n['@T@']} (id, event_id, aggregate_type, aggregate_id, aggregate_version, event_type, "
          f"schema_version, content_type, payload, headers, created_at, inserted_at) OVERRIDING SYSTEM VALUE "
          f"VALUES (0, gen_random_uuid(), 'order', 'order-0', 1, 'order.changed', 1, 'application/json', "
          f"'\\x7b7d', '{{}}', now(), clock_timestamp())")
if scheme != "cur":
    c.execute(f"INSERT INTO {n['@Q@']} (id, k, aggregate_type, aggregate_id, aggregate_version, inserted_at) "
              f"VALUES (0, hashtextextended('order' || chr(31) || 'order-0', 0), 'order', 'order-0', 1, clock_timestamp())")
tb, rb = claim("relay-b")
applied = complete(ta, [r for r in ra if r[1] == "claim" and r[2]])
tc, rc = claim("relay-c")
parked = c.execute(f"SELECT status, park_kind FROM {n['@T@']} WHERE id = 0").fetchone()
ok = (ra == [(1, "claim", True)] and not any(r[1] == "claim" and r[2] for r in rb)
      and applied == [1] and parked == ("parked", "out_of_order"))
print({"scheme": scheme, "break": os.environ.get("PROBE_BREAK"), "relay_a": ra, "relay_b_while_a_holds": rb,
       "a_applied": applied, "after_a": rc, "row_0": parked, "ok": ok})
c.execute(f'DROP SCHEMA "{schema}" CASCADE')
sys.exit(0 if ok else 1)
