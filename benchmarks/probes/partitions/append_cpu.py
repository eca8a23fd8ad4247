#!/usr/bin/env python3
"""Append cost as backend CPU (robust on a shared machine): N single-row INSERT transactions
(autocommit, synchronous_commit = off, prepared) per variant on one connection; CPU of the
backend from /proc/<pid>/stat. Variants as the append_*.sql pgbench scripts; rotating order.
  python3 append_cpu.py [N] [ROUNDS] [PARTS]
Partitioned variants: PARTS partitions of 1,000,000 ids, each holding PREFILL rows (so the
other-partition probes of the check trigger descend real indexes)."""
import os, sys, time, uuid
import part as P  # noqa: E402
import drain as D

N = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
PARTS = int(sys.argv[3]) if len(sys.argv) > 3 else 6
PREFILL = int(os.environ.get("PREFILL", "20000"))
COLS = ("(event_id, aggregate_type, aggregate_id, aggregate_version, event_type, schema_version, "
        "content_type, payload, headers, created_at, inserted_at)")
VALS = ("VALUES (%s, 'order', 'order-' || %s, 1, 'order.changed', 1, 'application/json', "
        "convert_to(repeat('x', 207), 'UTF8'), '{}', now(), clock_timestamp())")
V = {
    "cur": ("probe_part25_ac_cur", f"INSERT INTO probe_part25_ac_cur.outbox_events {COLS} {VALS}"),
    "part_side": ("probe_part25_ac_side", f"INSERT INTO probe_part25_ac_side.outbox_events {COLS} {VALS}"),
    "part_cte": ("probe_part25_ac_cte", f"WITH e AS (INSERT INTO probe_part25_ac_cte.outbox_events {COLS} {VALS} "
                 f"RETURNING event_id, id) INSERT INTO probe_part25_ac_cte.outbox_events_ids SELECT event_id, id FROM e"),
    "part_bare": ("probe_part25_ac_cte", f"INSERT INTO probe_part25_ac_cte.outbox_events {COLS} {VALS}"),
    "part_check": ("probe_part25_ac_chk", f"INSERT INTO probe_part25_ac_chk.outbox_events {COLS} {VALS}"),
    "part_check_row": ("probe_part25_ac_chr", f"INSERT INTO probe_part25_ac_chr.outbox_events {COLS} {VALS}"),
    "part_check_nolock": ("probe_part25_ac_chn", f"INSERT INTO probe_part25_ac_chn.outbox_events {COLS} {VALS}"),
}


def prep():
    P.setup("probe_part25_ac_cur")
    P.fill("probe_part25_ac_cur", 10_000_000, PREFILL * PARTS, 4000)
    for s, kw in (("probe_part25_ac_side", {}), ("probe_part25_ac_cte", {"trigger": False}),
                  ("probe_part25_ac_chk", {"uniq": "check"}), ("probe_part25_ac_chr", {"uniq": "check"}),
                  ("probe_part25_ac_chn", {"uniq": "check"})):
        P.setup(s)
        P.upgrade(s, 1_000_000, ahead=PARTS, margin=1_000_000, **kw)
        with P.connect() as c:
            for k in range(PARTS - 1):  # PREFILL rows in each partition but the last
                c.execute(f"SELECT setval(pg_get_serial_sequence('{s}.outbox_events', 'id'), {1_000_000 * (k + 1)})")
                c.execute(P.fill_sql(s, 4000), (10_000_000 + k * PREFILL, 10_000_000 + (k + 1) * PREFILL - 1))
                if not kw:  # side table through its trigger
                    pass
                elif kw.get("trigger") is False:
                    c.execute(f"INSERT INTO {s}.outbox_events_ids SELECT event_id, id FROM {s}.outbox_events "
                              f"ON CONFLICT DO NOTHING")
            c.execute(f"SELECT setval(pg_get_serial_sequence('{s}.outbox_events', 'id'), {1_000_000 * PARTS})")
            if s.endswith("chr"):
                c.execute(P.CHECK_ROW_DDL.format(s=s, t=f"{s}.outbox_events"))
            if s.endswith("chn"):  # the statement trigger without its locks: what the locks cost
                ddl = P.CHECK_DDL.format(s=s, t=f"{s}.outbox_events")
                for f in ("pg_advisory_xact_lock_shared(25, b.c)", "pg_advisory_xact_lock(26, b.f)",
                          "pg_advisory_xact_lock(25, b.c)"):
                    ddl = ddl.replace(f, "0")
                c.execute(ddl)
    with P.connect() as c:
        for s in ("probe_part25_ac_cur", "probe_part25_ac_side", "probe_part25_ac_cte", "probe_part25_ac_chk",
                  "probe_part25_ac_chr", "probe_part25_ac_chn"):
            c.execute(f"VACUUM ANALYZE {s}.outbox_events")


def run(name):
    schema, sql = V[name]
    c = P.connect()
    c.execute("SET synchronous_commit = off")
    pid = c.info.backend_pid
    for i in range(200):  # warm-up (plan cache, relcache)
        c.execute(sql, (uuid.uuid4(), i), prepare=True)
    cpu0, t0 = D.cpu_of(pid), time.monotonic()
    for i in range(N):
        c.execute(sql, (uuid.uuid4(), i), prepare=True)
    cpu, wall = D.cpu_of(pid) - cpu0, time.monotonic() - t0
    c.close()
    return cpu * 1e6 / N, wall * 1e6 / N


if __name__ == "__main__":
    prep()
    names = list(V)
    res = {k: [] for k in names}
    for r in range(ROUNDS):
        for i in range(len(names)):
            k = names[(i + r) % len(names)]
            cpu, wall = run(k)
            res[k].append((cpu, wall))
            print(f"round {r + 1} {k}: backend CPU {cpu:.1f} us/append, wall {wall:.1f} us/append, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    base = sorted(x[0] for x in res["cur"])[len(res["cur"]) // 2]
    for k in names:
        m = sorted(x[0] for x in res[k])[len(res[k]) // 2]
        w = sorted(x[1] for x in res[k])[len(res[k]) // 2]
        print(f"median {k}: backend CPU {m:.1f} us/append ({m / base:.2f} x today), wall {w:.1f} us")
    with P.connect() as c:
        for s in ("probe_part25_ac_cur", "probe_part25_ac_side", "probe_part25_ac_cte", "probe_part25_ac_chk",
                  "probe_part25_ac_chr", "probe_part25_ac_chn"):
            c.execute(f"DROP SCHEMA {s} CASCADE")
