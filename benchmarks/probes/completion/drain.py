#!/usr/bin/env python3
"""Drain probe for issue 25: today's lease-mode claim + completion, the naive SKIP LOCKED drain,
and the two completion schemes of this folder, on tables of the same shape.

  drain.py setup  --scheme cur|naive|queue|batchack --schema S --events N --aggs M
  drain.py drain  --scheme ... --schema S --batch B [--explain-at K]
  drain.py check  --scheme ... --schema S --events N --aggs M

The driver plays the relay: it claims (lease mode: claim transaction committed synchronously),
builds one `published` outcome per claimed row (Kafka ack: topic 'bench', partition, offset), and
completes (blocking aggregate locks, then the completion, committed asynchronously), batch after
batch, one connection, no prefetch (the "SQL ceiling" contender of BENCHMARKS.md section 1).
Prints one JSON line: events/s, backend CPU per event (/proc of the backend), client CPU per
event, WAL bytes (pg_current_wal_lsn, server-wide) per event, per-statement wall time.
--explain-at K: the K-th cycle runs each statement under EXPLAIN (ANALYZE, BUFFERS, WAL) and
reports its buffers and WAL per event (exact, not shared with other sessions).
"""
import argparse, json, os, re, sys, time, uuid

import psycopg

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
DSN = os.environ.get("PROBE_DSN", "host=127.0.0.1 user=postgres dbname=test")
TICK = os.sysconf("SC_CLK_TCK")

CLAIM_BEGIN = ("BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL plan_cache_mode = force_custom_plan; "
               "SET LOCAL jit = off; SET LOCAL enable_sort = off; SET LOCAL enable_bitmapscan = off; "
               "SET LOCAL synchronous_commit = on; SELECT pg_advisory_xact_lock_shared(25)")
COMPLETE_BEGIN = ("BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL plan_cache_mode = force_custom_plan; "
                  "SET LOCAL jit = off; SET LOCAL synchronous_commit = off")


def seed(schema, table):
    h = 0xcbf29ce484222325
    for b in (schema + "." + table).encode():
        h ^= b
        h = (h * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h - (1 << 64) if h >= (1 << 63) else h


def sections(path):
    out, name, buf = {}, None, []
    for line in open(os.path.join(HERE, path)):
        m = re.match(r"-- name: (\w+)", line)
        if m:
            if name:
                out[name] = "".join(buf).strip()
            name, buf = m.group(1), []
        elif name and not line.startswith("--"):
            buf.append(line)
    if name:
        out[name] = "".join(buf).strip()
    return out


def names(schema):
    q = lambda t: f'"{schema}"."{t}"'
    return {"@SCHEMA@": f'"{schema}"', "@T@": q("outbox_events"), "@S@": q("outbox_events_aggregate"),
            "@Q@": q("outbox_events_queue"), "@A@": q("outbox_events_ack"),
            "@AB@": q("outbox_events_ackb"), "@SEED@": str(seed(schema, "outbox_events"))}


def subst(sql, schema):
    for k, v in names(schema).items():
        sql = sql.replace(k, v)
    return sql


def break_leases(s):
    """PROBE_BREAK=lease (rowlease only): the claim ignores live leases, to see the two-relay
    check fail."""
    s["candidates"] = s["candidates"].replace("AND NOT COALESCE((SELECT u.lease_until", "AND NOT COALESCE((SELECT false AND u.lease_until")
    s["decide"] = s["decide"].replace("COALESCE(q.lease_until > clock_timestamp(), false) AS leased", "false AS leased")
    s["decide"] = s["decide"].replace("AND u.lease_until > clock_timestamp()) THEN 'wait'", "AND false) THEN 'wait'")
    s["decide"] = s["decide"].replace("AND (l.lease_until IS NULL OR l.lease_until <= clock_timestamp())", "")
    return s


def statements(scheme, schema):
    if scheme in ("cur", "naive"):
        s = sections("cur.sql")
    else:
        s = sections("queue.sql")
        b = sections("batchack.sql")
        if scheme.startswith("rowlease"):
            r = sections("rowlease.sql")
            s.update({k: r[k] for k in ("candidates", "decide", "complete")})
            s["ddl"] = s["ddl"] + "\n" + r["ddl"]
        ack = b["ack_per_batch"] if scheme.endswith("batchack") else s["ack_per_event"]
        s["complete"] = s["complete"].replace("@ACK_INSERT@", ack)
        if scheme.endswith("batchack"):
            s["ddl"] = s["ddl"] + "\n" + b["ddl"]
    if os.environ.get("PROBE_COMPLETE") and scheme == "cur":
        # Another text of today's lease-mode completion (e.g. ../complete-lease-plan/new.sql).
        s["complete"] = sections(os.path.abspath(os.environ["PROBE_COMPLETE"]))["complete"]
    if os.environ.get("PROBE_BREAK") == "lease" and scheme.startswith("rowlease"):
        s = break_leases(s)
    return {k: subst(v, schema) for k, v in s.items()}


SCHEMES = ["naive", "cur", "queue", "batchack", "rowlease", "rowlease_batchack"]


def connect():
    return psycopg.connect(DSN, autocommit=True, cursor_factory=psycopg.RawCursor)


PAYLOAD = ("'{\"currency\":\"EUR\",\"customer\":\"customer-' || lpad((i % 100000)::text, 6, '0') || "
           "'\",\"items\":[{\"qty\":2,\"sku\":\"SKU-0001\"},{\"qty\":1,\"sku\":\"SKU-0042\"}],"
           "\"note\":\"benchmark payload, about two hundred bytes\",\"order\":\"order-' || "
           "lpad(i::text, 8, '0') || '\",\"total_cents\":' || (1999 + i % 1000) || '}'")


def setup(a):
    st = statements(a.scheme, a.schema)
    ddl = open(os.path.join(ROOT, "outbox-postgres/sql/outbox.sql")).read()
    ddl = ddl.replace('"outbox".', f'"{a.schema}".').replace(
        'CREATE SCHEMA IF NOT EXISTS "outbox"', f'CREATE SCHEMA IF NOT EXISTS "{a.schema}"').replace("table_schema = 'outbox'", f"table_schema = '{a.schema}'")
    with connect() as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{a.schema}" CASCADE')
        c.execute(ddl)
        if a.scheme not in ("cur", "naive"):
            c.execute(st["ddl"])
        n = names(a.schema)
        t0 = time.monotonic()
        # Events i = 0..N-1, round-robin over M aggregates (version = the round), as
        # outbox-bench's env::event; event ids ordered like v7 uuids.
        fill = (f"INSERT INTO {n['@T@']} (event_id, aggregate_type, aggregate_id, aggregate_version, "
                f"event_type, schema_version, content_type, payload, headers, created_at, inserted_at) "
                f"SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(i), 12, '0'))::uuid, 'order', "
                f"'order-' || (i % {a.aggs}), i / {a.aggs} + 1, 'order.changed', 1, 'application/json', "
                f"convert_to({PAYLOAD}, 'UTF8'), '{{}}'::jsonb, now(), clock_timestamp() "
                f"FROM generate_series($1::int8, $2::int8) i")
        qfill = (f"INSERT INTO {n['@Q@']} (id, k, aggregate_type, aggregate_id, aggregate_version, inserted_at) "
                 f"SELECT id, hashtextextended(aggregate_type || chr(31) || aggregate_id, 0), aggregate_type, "
                 f"aggregate_id, aggregate_version, inserted_at FROM {n['@T@']} WHERE id BETWEEN $1 AND $2")
        for lo in range(0, a.events, 5000):
            hi = min(a.events, lo + 5000) - 1
            c.execute("BEGIN")
            c.execute(fill, (lo, hi))
            if a.scheme not in ("cur", "naive"):
                c.execute(qfill, (lo + 1, hi + 1))  # identity ids start at 1
            c.execute("COMMIT")
        took = time.monotonic() - t0
        for t in ("@T@", "@S@", "@Q@", "@A@", "@AB@"):
            if c.execute("SELECT to_regclass($1)", (n[t],)).fetchone()[0]:
                c.execute(f"VACUUM ANALYZE {n[t]}")
        # No CHECKPOINT here: the drain then logs no full-page images (every page it touches was
        # written after the last checkpoint), unless a timed checkpoint falls inside the run
        # ("checkpoints_during_run" in the drain's output).
        print(json.dumps({"scheme": a.scheme, "schema": a.schema, "fill_s": round(took, 3),
                          "fill_us_per_event": round(took * 1e6 / a.events, 1)}))


def cpu_of(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def lsn(c):
    return int(c.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()[0])


EXPLAIN = "EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) "


def plan_totals(rows):
    p = rows[0][0][0]
    if os.environ.get("PROBE_PLANS"):
        with open(os.environ["PROBE_PLANS"], "a") as f:
            f.write(json.dumps(p, indent=1) + "\n")
    pl = p["Plan"]
    return {"ms": p["Execution Time"], "hit": pl.get("Shared Hit Blocks", 0),
            "read": pl.get("Shared Read Blocks", 0), "dirtied": pl.get("Shared Dirtied Blocks", 0),
            "wal_bytes": pl.get("WAL Bytes", 0), "wal_records": pl.get("WAL Records", 0),
            "wal_fpi": pl.get("WAL FPI", 0)}


def drain(a):
    st = statements(a.scheme, a.schema)
    sd = seed(a.schema, "outbox_events")
    n = names(a.schema)
    c, mon = connect(), connect()
    pid = c.execute("SELECT pg_backend_pid()").fetchone()[0]
    bg0 = lsn(mon)
    time.sleep(2)
    bg = (lsn(mon) - bg0) / 2.0  # background WAL bytes/s (other sessions) just before the run
    naive_sel = (f"SELECT id, event_id, aggregate_type, aggregate_id, aggregate_version, event_type, "
                 f"schema_version, content_type, payload, headers, created_at FROM {n['@T@']} "
                 f"WHERE status = 'pending' AND NOT blocked ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED")
    naive_upd = (f"UPDATE {n['@T@']} x SET status = 'published', published_at = clock_timestamp(), "
                 f"finished_at = clock_timestamp(), ack_transport = 'kafka', ack_destination = 'bench', "
                 f"ack_partition = u.p, ack_position = u.o "
                 f"FROM UNNEST($1::int8[], $2::int4[], $3::int8[]) AS u(id, p, o) WHERE x.id = u.id")
    stmt_s = {}
    explained = {}

    stmt_wal = {}
    ins_lsn = "SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn"

    def timed(name, sql, params=None, explain=False):
        """Runs one statement; its wall time, and the WAL inserted meanwhile (read from this
        session before and after: other sessions' WAL in that window is counted too)."""
        w = int(c.execute(ins_lsn).fetchone()[0])
        t = time.monotonic()
        if explain:
            explained[name] = plan_totals(c.execute(EXPLAIN + sql, params).fetchall())
            out = None
        else:
            cur = c.execute(sql, params)
            out = cur.fetchall() if cur.description else None
        stmt_s[name] = stmt_s.get(name, 0.0) + time.monotonic() - t
        stmt_wal[name] = stmt_wal.get(name, 0) + int(c.execute(ins_lsn).fetchone()[0]) - w
        return out

    total, offset, cycles, refused = 0, 0, 0, 0
    ckpt = "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"
    k0 = mon.execute(ckpt).fetchone()[0]
    cpu0, ccpu0, w0, t0 = cpu_of(pid), time.process_time(), lsn(mon), time.monotonic()
    while True:
        cycles += 1
        ex = a.explain_at == cycles
        if a.scheme == "naive":
            c.execute("BEGIN")
            if ex:
                rows = timed("select", naive_sel, (a.batch,))  # rows needed: not explained
            else:
                rows = timed("select", naive_sel, (a.batch,))
            if not rows:
                c.execute("COMMIT")
                break
            ids, parts, offs = [], [], []
            for r in rows:
                _payload, _headers = r[8], r[9]
                offset += 1
                ids.append(r[0]); parts.append(offset % 12); offs.append(offset)
            timed("update", naive_upd, (ids, parts, offs), explain=ex)
            if ex:
                explained["update"]["events"] = len(ids)
            timed("commit", "COMMIT")
            total += len(ids)
            continue
        token = uuid.uuid4()
        c.execute(CLAIM_BEGIN)
        ids = [r[0] for r in timed("candidates", st["candidates"], (a.batch,))]
        if not ids:
            c.execute("COMMIT")
            if a.until_empty and c.execute(
                    f"SELECT EXISTS (SELECT 1 FROM {n['@T@']} WHERE status = 'pending')" if a.scheme == "cur"
                    else f"SELECT EXISTS (SELECT 1 FROM {n['@Q@']})").fetchone()[0]:
                time.sleep(0.005)  # another relay holds what is left
                continue
            break
        dparams = (ids, "probe25", token, 30_000_000, 300_000_000, 1_000_000)
        if ex:
            timed("decide", st["decide"], dparams, explain=True)
            leases = (f"SELECT q.id AS lease_row, q.k AS aggregate_key, NULL::int8 AS last_version "
                      f"FROM {n['@Q@']} q WHERE q.lease_token = $1" if a.scheme.startswith("rowlease")
                      else f"SELECT * FROM {n['@S@']} WHERE lease_token = $1")
            rows = c.execute(
                f"SELECT e.id, 'claim', e.event_id, e.aggregate_type, e.aggregate_id, e.aggregate_version, "
                f"e.event_type, e.schema_version, e.content_type, e.payload, e.headers, e.created_at, "
                f"e.attempts, a.aggregate_key, a.last_version, false, 0, true FROM ({leases}) a "
                f"JOIN {n['@T@']} e ON e.id = a.lease_row", (token,)).fetchall()
        else:
            rows = timed("decide", st["decide"], dparams)
        timed("claim_commit", "COMMIT")
        claimed_at = time.time()
        if a.hold_ms:
            time.sleep(a.hold_ms / 1000)  # the batch is "at the broker"
        claimed = [r for r in rows if r[1] == "claim" and r[17]]
        if len(claimed) != len(rows):
            sys.exit(f"unexpected actions: {[(r[0], r[1], r[17]) for r in rows if r not in claimed][:5]}")
        claimed.sort(key=lambda r: r[0])
        o = {k: [] for k in ("id", "k", "at", "ai", "v", "kind", "dest", "part", "pos", "delay",
                             "ecl", "ek", "em", "pk", "unc", "tr", "route", "dup")}
        for r in claimed:
            _payload, _headers = r[9], r[10]
            offset += 1
            for key, val in (("id", r[0]), ("k", r[13]), ("at", r[3]), ("ai", r[4]), ("v", r[5]),
                             ("kind", "published"), ("dest", "bench"), ("part", offset % 12),
                             ("pos", offset), ("delay", None), ("ecl", None), ("ek", None),
                             ("em", None), ("pk", None), ("unc", False), ("tr", "kafka"),
                             ("route", None), ("dup", None)):
                o[key].append(val)
        completing_at = time.time()
        c.execute(COMPLETE_BEGIN)
        timed("lock_keys", st["lock_keys"], ([k ^ sd for k in o["k"]],))
        params = tuple(o.values()) + (token,)
        if ex:
            timed("complete", st["complete"], params, explain=True)
            explained["events"] = len(claimed)
        else:
            applied = timed("complete", st["complete"], params)[0][0]
            if len(applied) != len(claimed):
                if not a.log:
                    sys.exit(f"applied {len(applied)} of {len(claimed)}")
                refused += len(claimed) - len(applied)
        timed("complete_commit", "COMMIT")
        if a.log:
            # Certainly in flight between the claim's commit and the completion's BEGIN.
            with open(a.log, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "from": claimed_at, "to": completing_at,
                                    "keys": [[r[3], r[4], r[5]] for r in claimed]}) + "\n")
        total += len(claimed)
    took = time.monotonic() - t0
    cpu, ccpu, wal = cpu_of(pid) - cpu0, time.process_time() - ccpu0, lsn(mon) - w0
    ev = max(total, 1)
    res = {"scheme": a.scheme, "schema": a.schema, "events": total, "refused": refused, "cycles": cycles, "seconds": round(took, 3),
           "events_per_s": round(total / took), "backend_cpu_us_per_event": round(cpu * 1e6 / ev, 1),
           "client_cpu_us_per_event": round(ccpu * 1e6 / ev, 1),
           "wal_bytes_per_event_lsn": round(wal / ev), "background_wal_bytes_per_s": round(bg),
           "wal_bytes_per_event_lsn_minus_background": round((wal - bg * took) / ev),
           "statement_us_per_event": {k: round(v * 1e6 / ev, 1) for k, v in stmt_s.items()},
           "statement_wal_bytes_per_event": {k: round(v / ev) for k, v in stmt_wal.items()},
           "statement_wal_bytes_per_event_total": round(sum(stmt_wal.values()) / ev),
           "checkpoints_during_run": mon.execute(ckpt).fetchone()[0] - k0,
           "loadavg": open("/proc/loadavg").read().split()[:3]}
    if explained:
        k = explained.pop("events", None) or explained.get("update", {}).pop("events", 1)
        res["explained_cycle"] = {"events": k, **{s: {m: round(v / k, 2) for m, v in r.items()}
                                                   for s, r in explained.items()}}
    print(json.dumps(res))


def check(a):
    n = names(a.schema)
    with connect() as c:
        q = lambda sql: c.execute(sql).fetchone()[0]
        if a.scheme in ("cur", "naive"):
            pub = q(f"SELECT count(*) FROM {n['@T@']} WHERE status = 'published'")
            left = q(f"SELECT count(*) FROM {n['@T@']} WHERE status <> 'published'")
        else:
            left = q(f"SELECT count(*) FROM {n['@Q@']}")
            pub = (q(f"SELECT count(*) FROM {n['@A@']}") if not a.scheme.endswith("batchack")
                   else q(f"SELECT coalesce(sum(cardinality(ids)), 0) FROM {n['@AB@']}"))
        out = {"scheme": a.scheme, "published": pub, "unfinished": left}
        if a.scheme != "naive":
            out["last_version_ok"] = q(
                f"SELECT count(*) = {a.aggs} AND bool_and(last_version = {a.events // a.aggs}) "
                f"FROM {n['@S@']}")
        sizes = {}
        for t in ("@T@", "@S@", "@Q@", "@A@", "@AB@"):
            if c.execute("SELECT to_regclass($1)", (n[t],)).fetchone()[0]:
                sizes[t.strip("@")] = q(f"SELECT pg_total_relation_size('{n[t]}')")
        out["bytes"] = sizes
        print(json.dumps(out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["setup", "drain", "check"])
    p.add_argument("--scheme", required=True, choices=SCHEMES)
    p.add_argument("--schema", required=True)
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--aggs", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=1_000)
    p.add_argument("--explain-at", type=int, default=0)
    p.add_argument("--hold-ms", type=int, default=0, help="sleep between claim and completion")
    p.add_argument("--until-empty", action="store_true",
                   help="when nothing is claimable, wait until the backlog is empty (several relays)")
    p.add_argument("--log", help="append each batch's in-flight interval and aggregates here")
    a = p.parse_args()
    {"setup": setup, "drain": drain, "check": check}[a.cmd](a)


if __name__ == "__main__":
    main()
