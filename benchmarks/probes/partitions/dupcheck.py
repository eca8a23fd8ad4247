#!/usr/bin/env python3
"""Issue 25 partition probe: does the "check" design (per-partition UNIQUE (event_id) plus the
statement trigger probing the other partitions under an advisory lock) reject duplicate event
ids, concurrent ones included, and under which isolation levels?

Two sessions append the same event id into two different partitions (ids forced with
OVERRIDING SYSTEM VALUE), the second while the first is still open, then the first commits.
PROBE_BREAK=lock drops the advisory lock from the trigger (the check must then fail).
Schema probe_part25_dup (dropped at the end). Prints one line per case.
"""
import os, threading, time, uuid
import psycopg
import part as P

S = "probe_part25_dup"


def ins(c, eid, id_):
    c.execute(f"INSERT INTO {P.q(S)} (id, event_id, aggregate_type, aggregate_id, aggregate_version, event_type, "
              f"schema_version, content_type, payload, created_at) OVERRIDING SYSTEM VALUE "
              f"VALUES (%s, %s, 'order', 'o', 1, 'x', 1, 'application/json', '\\x00', now())", (id_, eid))


K = [0]


def case(name, iso2, same_partition, snapshot_first):
    eid = uuid.uuid4()
    K[0] += 10
    a, b = P.connect(), P.connect()
    id_a, id_b = 1_000_001 + K[0], (1_000_002 + K[0] if same_partition else 2_000_001 + K[0])
    res = {}
    b.execute(f"BEGIN ISOLATION LEVEL {iso2}")
    if snapshot_first:
        b.execute("SELECT 1")  # b's snapshot predates a's commit
    a.execute("BEGIN")
    ins(a, eid, id_a)

    def second():
        try:
            ins(b, eid, id_b)
            b.execute("COMMIT")
            res["b"] = "ACCEPTED"
        except psycopg.Error as e:
            res["b"] = f"rejected {e.sqlstate} ({type(e).__name__})"
            b.execute("ROLLBACK")
    if snapshot_first == "late":
        a.execute("COMMIT")
        second()
    else:
        th = threading.Thread(target=second)
        th.start()
        time.sleep(0.5)
        a.execute("COMMIT")
        th.join()
    n = a.execute(f"SELECT count(*) FROM {P.q(S)} WHERE event_id = %s", (eid,)).fetchone()[0]
    ok = (n == 1)
    print(f"{name}: second append {res['b']}; rows with the id: {n} -> {'OK' if ok else 'DUPLICATE STORED'}", flush=True)
    a.close(); b.close()
    return ok


if __name__ == "__main__":
    P.setup(S)
    P.upgrade(S, 1_000_000, ahead=2, margin=1_000_000, uniq="check")  # partitions [1M, 2M), [2M, 3M)
    if os.environ.get("PROBE_BREAK") == "lock":
        with P.connect() as c:
            ddl = P.CHECK_DDL.format(s=f'"{S}"', t=P.q(S))
            for f in ("pg_advisory_xact_lock_shared(25, b.c)", "pg_advisory_xact_lock(26, b.f)",
                      "pg_advisory_xact_lock(25, b.c)"):
                assert f in ddl
                ddl = ddl.replace(f, "0")
            c.execute(ddl)
    print("break:", os.environ.get("PROBE_BREAK", "none"))
    case("READ COMMITTED, same partition, concurrent", "READ COMMITTED", True, False)
    case("READ COMMITTED, other partition, concurrent", "READ COMMITTED", False, False)
    case("READ COMMITTED, other partition, after commit", "READ COMMITTED", False, "late")
    case("REPEATABLE READ, same partition, concurrent", "REPEATABLE READ", True, False)
    case("REPEATABLE READ, other partition, concurrent (snapshot at first insert)", "REPEATABLE READ", False, False)
    case("REPEATABLE READ, other partition, snapshot taken before the first append committed", "REPEATABLE READ", False, "late")
    case("SERIALIZABLE, other partition, snapshot taken before the first append committed", "SERIALIZABLE", False, "late")
    with P.connect() as c:
        c.execute(f"DROP SCHEMA {S} CASCADE")
