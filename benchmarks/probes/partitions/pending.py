#!/usr/bin/env python3
"""After DETACH PARTITION CONCURRENTLY gives up (lock_timeout while it waits for a transaction
that uses the table), in which state is the partition, do appends and reads go on, and does
FINALIZE complete it once that transaction ended? Schema probe_part25_locks (dropped)."""
import locks as L

L.reset()
S = L.S
holder = L.conn()
holder.execute("BEGIN")
holder.execute(f"INSERT INTO {S}.t (v) VALUES ('open')")  # an append in flight (RowExclusive on t)
m = L.conn()
m.execute("SET lock_timeout = '2s'")
try:
    m.execute(f"ALTER TABLE {S}.t DETACH PARTITION {S}.t_p0 CONCURRENTLY")
    print("detach finished")
except Exception as e:
    print("detach:", type(e).__name__, str(e).splitlines()[0])
print("pg_inherits.inhdetachpending:", m.execute(
    f"SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = '{S}.t_p0'::regclass").fetchone()[0])
o = L.conn()
o.execute("SET lock_timeout = '2s'")
o.execute(f"INSERT INTO {S}.t (v) VALUES ('during')")
print("append while pending: ok; rows visible through t:", o.execute(f"SELECT count(*) FROM {S}.t").fetchone()[0],
      "(t_p0 holds", o.execute(f"SELECT count(*) FROM {S}.t_p0").fetchone()[0], ")")
try:
    o.execute(f"ALTER TABLE {S}.t DETACH PARTITION {S}.t_p1 CONCURRENTLY")
    print("a second detach while one is pending: finished")
except Exception as e:
    print("a second detach while one is pending:", type(e).__name__, str(e).splitlines()[0])
holder.execute("COMMIT")
import threading, time
mpid = m.info.backend_pid
m.execute("SET lock_timeout = '8s'")
res = {}


def fin():
    t0 = time.monotonic()
    try:
        m.execute(f"ALTER TABLE {S}.t DETACH PARTITION {S}.t_p0 FINALIZE")
        res["r"] = f"finished in {time.monotonic() - t0:.2f}s"
    except Exception as e:
        res["r"] = f"{type(e).__name__} after {time.monotonic() - t0:.1f}s"


th = threading.Thread(target=fin)
th.start()
time.sleep(2)
w = o.execute("SELECT wait_event_type, wait_event, pg_blocking_pids(pid) FROM pg_stat_activity WHERE pid = %s", (mpid,)).fetchone()
blockers = [o.execute("SELECT state, backend_xmin::text, left(query, 60), now() - xact_start FROM pg_stat_activity WHERE pid = %s", (p,)).fetchone()
            for p in (w[2] or [])]
print("finalize after the append ended, at 2 s: waiting on", w[0], w[1], "blocked by", blockers)
th.join()
print("finalize:", res["r"])
o.execute(f"DROP SCHEMA {S} CASCADE")
