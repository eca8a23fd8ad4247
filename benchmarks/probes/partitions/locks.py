#!/usr/bin/env python3
"""Issue 25 partition probe: which locks partition maintenance takes, and who it waits for.

Each case opens the sessions it names, runs one maintenance statement in another session with
a 4-second lock_timeout, and reports whether it finished, how long it took and the lock modes it
held on the parent (read from pg_locks while its transaction is still open, where it can be).
Schema probe_part25_locks (dropped at the end). Prints one JSON line per case.
"""
import json, os, threading, time
import psycopg

DSN = os.environ.get("PROBE_DSN", "host=127.0.0.1 user=postgres dbname=test")
S = "probe_part25_locks"


def conn():
    return psycopg.connect(DSN, autocommit=True)


def reset():
    with conn() as c:
        c.execute(f"DROP SCHEMA IF EXISTS {S} CASCADE")
        c.execute(f"CREATE SCHEMA {S}")
        c.execute(f"CREATE TABLE {S}.t (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                  f"v text, status text NOT NULL DEFAULT 'pending') PARTITION BY RANGE (id)")
        for i in range(3):
            c.execute(f"CREATE TABLE {S}.t_p{i} PARTITION OF {S}.t FOR VALUES FROM ({i * 1000 + 1}) TO ({(i + 1) * 1000 + 1})")
        c.execute(f"CREATE INDEX ON {S}.t (id) WHERE status = 'pending'")
        c.execute(f"INSERT INTO {S}.t (v) SELECT 'x' FROM generate_series(1, 1500)")


def locks_of(c, pid):
    return c.execute(
        "SELECT c.relname, l.mode, l.granted FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
        "WHERE l.pid = %s AND c.relnamespace = %s::regnamespace AND c.relkind IN ('p','r') ORDER BY 1, 2",
        (pid, S)).fetchall()


def run(name, holder_sql, stmts, in_tx=True, probe_insert=False):
    """holder_sql: statements of the session left open (None: none). stmts: the maintenance."""
    reset()
    holder = conn()
    if holder_sql:
        for s in holder_sql:
            holder.execute(s)
    m, mon = conn(), conn()
    mpid = m.execute("SELECT pg_backend_pid()").fetchone()[0]
    m.execute("SET lock_timeout = '4s'")
    out = {"case": name, "holder": holder_sql, "maintenance": stmts}
    t0 = time.monotonic()
    try:
        if in_tx:
            m.execute("BEGIN")
        for s in stmts:
            m.execute(s)
        out["finished"] = True
        if in_tx:
            out["locks_held"] = [f"{r[0]}:{r[1]}" for r in locks_of(mon, mpid)]
            if probe_insert:
                # Does an append go on while this maintenance transaction is open?
                a = conn()
                a.execute("SET lock_timeout = '2s'")
                t1 = time.monotonic()
                try:
                    a.execute(f"INSERT INTO {S}.t (v) VALUES ('y')")
                    out["concurrent_insert"] = f"ok in {time.monotonic() - t1:.3f}s"
                except Exception as e:
                    out["concurrent_insert"] = f"blocked: {type(e).__name__} after {time.monotonic() - t1:.1f}s"
                a.close()
            m.execute("COMMIT")
    except Exception as e:
        out["finished"] = False
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        if in_tx:
            m.execute("ROLLBACK")
    out["seconds"] = round(time.monotonic() - t0, 3)
    holder.close(); m.close(); mon.close()
    print(json.dumps(out), flush=True)


RR1 = ["BEGIN ISOLATION LEVEL REPEATABLE READ", "SELECT 1"]
RR_READ = ["BEGIN ISOLATION LEVEL REPEATABLE READ", f"SELECT count(*) FROM {S}.t"]
APPEND_OPEN = ["BEGIN", f"INSERT INTO {S}.t (v) VALUES ('open')"]
NEW = f"CREATE TABLE {S}.t_p3 PARTITION OF {S}.t FOR VALUES FROM (3001) TO (4001)"
LIKE = [f"CREATE TABLE {S}.t_p3 (LIKE {S}.t INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)",
        f"ALTER TABLE {S}.t_p3 ADD CONSTRAINT t_p3_bound CHECK (id >= 3001 AND id < 4001)"]
ATTACH = f"ALTER TABLE {S}.t ATTACH PARTITION {S}.t_p3 FOR VALUES FROM (3001) TO (4001)"
DETACH_C = f"ALTER TABLE {S}.t DETACH PARTITION {S}.t_p0 CONCURRENTLY"
DETACH = f"ALTER TABLE {S}.t DETACH PARTITION {S}.t_p0"

if __name__ == "__main__":
    run("create partition of: locks", None, [NEW], probe_insert=True)
    run("create partition of, an append open", APPEND_OPEN, [NEW])
    run("create partition of, RR holder that read the table", RR_READ, [NEW])
    run("like + check + attach: locks", None, LIKE + [ATTACH], probe_insert=True)
    run("like + check + attach, an append open", APPEND_OPEN, LIKE + [ATTACH])
    run("like + check + attach, RR holder that read the table", RR_READ, LIKE + [ATTACH])
    run("detach (plain): locks", None, [DETACH], probe_insert=True)
    run("detach (plain), an append open", APPEND_OPEN, [DETACH])
    run("detach concurrently, no holder", None, [DETACH_C], in_tx=False)
    run("detach concurrently, RR holder SELECT 1", RR1, [DETACH_C], in_tx=False)
    run("detach concurrently, RR holder that read the table", RR_READ, [DETACH_C], in_tx=False)
    run("detach concurrently, an append open", APPEND_OPEN, [DETACH_C], in_tx=False)
    run("detach concurrently + drop, RR holder SELECT 1", RR1, [DETACH_C, f"DROP TABLE {S}.t_p0"], in_tx=False)
    run("drop partition directly: locks", None, [f"DROP TABLE {S}.t_p0"], probe_insert=True)
    # The holder that read the table before the detach keeps its lock on the partition.
    run("detach concurrently (no holder) then drop, RR holder that read the table opened before",
        RR_READ, [f"SET lock_timeout = '20s'", DETACH_C], in_tx=False)
    with conn() as c:
        c.execute(f"DROP SCHEMA IF EXISTS {S} CASCADE")
