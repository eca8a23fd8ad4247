#!/usr/bin/env python3
"""Same decisions, same writes: today's decision text and a variant decide on the same rows, one
of every action (claim, claim as a re-send (lease that still names the row; maybe_delivered),
claim of an aggregate without state, follower, stale with a blocked row to promote, gap_hold,
gap_park, bad_key, wait under a live lease, wait not due), each in a savepoint of one
transaction that is rolled back; the returned rows and the resulting event and state tables
must be equal (times compared to the second, relative to the transaction's start).
  python3 equiv.py VARIANT [VARIANT ...]      (PROBE_BREAK=lease: a variant that must differ)"""
import json, sys, uuid

import probe

drain = probe.drain
SCHEMA = "probe25d_equiv"


class A:
    pass


def main():
    a = A(); a.scheme, a.schema, a.events, a.aggs = "cur", SCHEMA, 1, 1
    drain.statements = probe.decision_statements
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()):
        drain.setup(a)
    n = drain.names(SCHEMA)
    T, S = n["@T@"], n["@S@"]
    c = drain.connect()
    c.execute(f"DELETE FROM {T}")  # setup's one backlog row
    long_id = "x" * 1100
    # (aggregate_id, version, extra columns) per row; ids in this order from 1.
    rows = [
        ("fresh", 1, {}),                                     # 1 claim, no state row
        ("two", 1, {}), ("two", 2, {}),                       # 2 claim, 3 follower
        ("stale", 3, {}), ("stale", 4, {"blocked": True}),    # 4 stale (last 3), 5 promoted
        ("hold", 3, {}),                                      # 6 gap_hold (last 1)
        ("park", 3, {"held_since": "now() - interval '1 hour'"}),  # 7 gap_park (last 1)
        (long_id, 1, {}),                                     # 8 bad_key
        ("leased", 1, {}),                                    # 9 wait (live lease)
        ("later", 1, {"next_attempt_at": "now() + interval '1 hour'"}),  # 10 wait (not due)
        ("resend", 2, {}),                                    # 11 claim, lease names it (expired)
        ("maybe", 1, {"maybe_delivered": True}),              # 12 claim, maybe_delivered
        ("known", 4, {}),                                     # 13 claim (last 3, lease released)
    ]
    for i, (agg, v, extra) in enumerate(rows, 1):
        cols = ", ".join(extra)
        vals = ", ".join(str(x) if not isinstance(x, bool) else ("true" if x else "false") for x in extra.values())
        c.execute(f"INSERT INTO {T} (id, event_id, aggregate_type, aggregate_id, aggregate_version, event_type, "
                  f"schema_version, content_type, payload, headers, created_at, inserted_at{', ' + cols if cols else ''}) "
                  f"OVERRIDING SYSTEM VALUE VALUES ({i}, '{uuid.UUID(int=i)}', 'order', $1, {v}, 'order.changed', 1, "
                  f"'application/json', '\\x7b7d', '{{}}', now(), clock_timestamp(){', ' + vals if vals else ''})", (agg,))
    state = [("two", None, None, None), ("stale", 3, None, None), ("hold", 1, None, None), ("park", 1, None, None),
             ("leased", None, "now() + interval '1 hour'", 99), ("resend", 1, "now() - interval '1 second'", 11),
             ("known", 3, "now() - interval '1 hour'", None)]
    for agg, last, until, row in state:
        c.execute(f"INSERT INTO {S} (aggregate_key, aggregate_type, aggregate_id, last_version, lease_owner, "
                  f"lease_token, lease_until, lease_row) VALUES (hashtextextended('order' || chr(31) || $1, 0), "
                  f"'order', $1, $2, $3, {'gen_random_uuid()' if until else 'NULL'}, {until or 'NULL'}, $4)",
                  (agg, last, "other" if until else None, row))
    ids = list(range(1, len(rows) + 1))
    rel = lambda col: (f"CASE WHEN isfinite({col}) THEN round(extract(epoch FROM {col} - now()))::text "
                       f"ELSE {col}::text END")
    dump_t = (f"SELECT id, status, blocked, attempts, maybe_delivered, park_kind, last_error_class, last_error_kind, "
              f"last_error_message, parked_at IS NOT NULL, {rel('held_since')}, {rel('next_attempt_at')} "
              f"FROM {T} ORDER BY id")
    dump_s = (f"SELECT aggregate_id, last_version, lease_owner, lease_token, {rel('lease_until')}, lease_row "
              f"FROM {S} ORDER BY aggregate_id")
    token = uuid.uuid4()
    texts = ["cur"] + sys.argv[1:]
    out = {}
    c.execute("BEGIN")
    for v in texts:
        brk = probe.os.environ.pop("PROBE_BREAK", None) if v == "cur" else None  # today's text unbroken
        decide = probe.decision_statements("cur", SCHEMA, v)["decide"]
        if brk:
            probe.os.environ["PROBE_BREAK"] = brk
        c.execute("SAVEPOINT s")
        got = c.execute(decide, (ids, "probe25", token, 30_000_000, 300_000_000, 1_000_000)).fetchall()
        got = sorted([list(r[:16]) + [None if r[16] is None else round(r[16] / 1e6), r[17]] for r in got], key=lambda r: r[0])
        out[v] = {"returned": got, "events": c.execute(dump_t).fetchall(), "state": c.execute(dump_s).fetchall()}
        c.execute("ROLLBACK TO SAVEPOINT s")
    c.execute("ROLLBACK")
    c.execute(f'DROP SCHEMA "{SCHEMA}" CASCADE')
    actions = sorted({(r[0], r[1], r[17]) for r in out["cur"]["returned"]})
    res = {"break": probe.os.environ.get("PROBE_BREAK"), "returned_by_today": actions,
           "resend_by_today": [r[0] for r in out["cur"]["returned"] if r[15]],
           "maybe_delivered_after_today": [r[0] for r in out["cur"]["events"] if r[4]],
           "blocked_by_today": [r[0] for r in out["cur"]["events"] if r[2]],
           "parked_by_today": [(r[0], r[5]) for r in out["cur"]["events"] if r[1] == "parked"]}
    ok = True
    for v in texts[1:]:
        same = {k: out[v][k] == out["cur"][k] for k in ("returned", "events", "state")}
        res[v] = same
        ok = ok and all(same.values())
    res["ok"] = ok
    print(json.dumps(res, default=str))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
