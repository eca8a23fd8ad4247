#!/usr/bin/env python3
"""Issue 25 partition probe: today's outbox table vs the same table partitioned by id range.

  part.py setup   --schema S [--events N --aggs M]          today's schema (+ N events, as ../completion/drain.py)
  part.py upgrade --schema S --size K [--ahead A]           today's table -> partitioned, online (see README)
  part.py fill    --schema S --events N --aggs M            N more events, through the table's name
  part.py maintain --schema S --size K                      one maintenance step (create ahead, drop finished)
  part.py soak    --schemas cur,part --minutes T --rate R   the vacuum-horizon soak (see README)
  part.py uptest  --schema S --events N --size K            upgrade with data, appends and a relay running

The partitioned layout: "outbox_events" PARTITION BY RANGE (id), partitions "outbox_events_p<lo>"
of K ids each (the upgraded old table is "outbox_events_p0", FROM (MINVALUE)), and the event-id
uniqueness in "outbox_events_ids" (event_id PRIMARY KEY, id), filled by a statement-level AFTER
INSERT trigger with a transition table (or by the append statement itself: append_part_cte.sql).
"""
import argparse, json, os, re, sys, threading, time

import psycopg

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "completion"))
import drain as D  # noqa: E402  (the completion probe's setup and statements)

DSN = D.DSN


def connect():
    return psycopg.connect(DSN, autocommit=True)


def q(schema, t="outbox_events"):
    return f'"{schema}"."{t}"'


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# setup and fill

def setup(schema, events=0, aggs=20000):
    ns = argparse.Namespace(scheme="cur", schema=schema, events=events, aggs=aggs)
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            D.setup(ns)
        except ZeroDivisionError:  # its per-event figure, printed after the setup, for 0 events
            pass


def fill_sql(schema, aggs):
    return (f"INSERT INTO {q(schema)} (event_id, aggregate_type, aggregate_id, aggregate_version, "
            f"event_type, schema_version, content_type, payload, headers, created_at, inserted_at) "
            f"SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(i), 12, '0'))::uuid, 'order', "
            f"'order-' || (i %% {aggs}), i / {aggs} + 1, 'order.changed', 1, 'application/json', "
            f"convert_to({D.PAYLOAD.replace('%', '%%')}, 'UTF8'), '{{}}'::jsonb, now(), clock_timestamp() "
            f"FROM generate_series(%s::int8, %s::int8) i")


def fill(schema, start, events, aggs):
    with connect() as c:
        for lo in range(start, start + events, 5000):
            hi = min(start + events, lo + 5000) - 1
            c.execute(fill_sql(schema, aggs), (lo, hi))


# ---------------------------------------------------------------------------------------------
# the upgrade: today's table -> partitioned by id range, with appends and a relay running

IDS_DDL = """
CREATE TABLE IF NOT EXISTS {ids} (
    event_id uuid   NOT NULL,
    id       bigint NOT NULL,
    CONSTRAINT "outbox_events_ids_pkey" PRIMARY KEY (event_id)
) WITH (fillfactor = 100);
CREATE OR REPLACE FUNCTION {s}."outbox_events_ids_add"() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
    INSERT INTO {ids} (event_id, id) SELECT n.event_id, n.id FROM new_rows n;
    RETURN NULL;
END
$f$;
"""
CHECK_DDL = """
CREATE OR REPLACE FUNCTION {s}."outbox_events_id_check"() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
    -- The same event id in another partition (each partition's own UNIQUE (event_id) covers
    -- its own rows). Appenders of one event id are serialized by a transaction-level advisory
    -- lock on its hash bucket, taken after the insert and before the probe, so under READ
    -- COMMITTED the probe (a new snapshot) sees a concurrent append of the same id once it
    -- committed.
    -- Bounded lock count: a statement of up to 32 rows takes, per row, its coarse bucket
    -- (64) shared and its fine bucket (2^20) exclusive; a bigger statement takes its coarse
    -- buckets exclusive (at most 64 locks). Coarse buckets first, each level in order: no
    -- deadlock between appenders. The (int, int) key space is not the store's (bigint) one.
    IF (SELECT count(*) FROM new_rows) <= 32 THEN
        PERFORM pg_advisory_xact_lock_shared(25, b.c)
           FROM (SELECT DISTINCT (hashtextextended(event_id::text, 25) & 63)::int AS c FROM new_rows ORDER BY 1) b;
        PERFORM pg_advisory_xact_lock(26, b.f)
           FROM (SELECT DISTINCT (hashtextextended(event_id::text, 25) & 1048575)::int AS f FROM new_rows ORDER BY 1) b;
    ELSE
        PERFORM pg_advisory_xact_lock(25, b.c)
           FROM (SELECT DISTINCT (hashtextextended(event_id::text, 25) & 63)::int AS c FROM new_rows ORDER BY 1) b;
    END IF;
    IF EXISTS (SELECT 1 FROM new_rows n JOIN {t} e ON e.event_id = n.event_id AND e.id <> n.id) THEN
        RAISE EXCEPTION USING ERRCODE = '23505', CONSTRAINT = 'outbox_events_event_id_key',
            MESSAGE = 'duplicate key value violates unique constraint "outbox_events_event_id_key"';
    END IF;
    RETURN NULL;
END
$f$;
"""
# The same check as a row trigger (no transition table): one row's bucket locks and probe.
CHECK_ROW_DDL = """
CREATE OR REPLACE FUNCTION {s}."outbox_events_id_check_row"() RETURNS trigger LANGUAGE plpgsql AS $f$
DECLARE h bigint := hashtextextended(NEW.event_id::text, 25);
BEGIN
    PERFORM pg_advisory_xact_lock_shared(25, (h & 63)::int);
    PERFORM pg_advisory_xact_lock(26, (h & 1048575)::int);
    IF EXISTS (SELECT 1 FROM {t} e WHERE e.event_id = NEW.event_id AND e.id <> NEW.id) THEN
        RAISE EXCEPTION USING ERRCODE = '23505', CONSTRAINT = 'outbox_events_event_id_key',
            MESSAGE = 'duplicate key value violates unique constraint "outbox_events_event_id_key"';
    END IF;
    RETURN NULL;
END
$f$;
DROP TRIGGER IF EXISTS "outbox_events_id_check" ON {t};
CREATE TRIGGER "outbox_events_id_check_row" AFTER INSERT ON {t}
    FOR EACH ROW EXECUTE FUNCTION {s}."outbox_events_id_check_row"();
"""
CHECK_TRIGGER = ('CREATE TRIGGER "outbox_events_id_check" AFTER INSERT ON {t} REFERENCING NEW TABLE AS new_rows '
                 'FOR EACH STATEMENT EXECUTE FUNCTION {s}."outbox_events_id_check"()')
TRIGGER = ('CREATE TRIGGER "outbox_events_ids_add" AFTER INSERT ON {t} REFERENCING NEW TABLE AS new_rows '
           'FOR EACH STATEMENT EXECUTE FUNCTION {s}."outbox_events_ids_add"()')


def timed(c, sql, params=None, out=None, key=None):
    t0 = time.monotonic()
    c.execute(sql, params)
    dt = time.monotonic() - t0
    if out is not None:
        out[key] = round(out.get(key, 0) + dt, 4)
    return dt


def upgrade(schema, size, ahead=2, margin=None, trigger=True, swap_lock_timeout="2s", uniq="side"):
    """Returns a dict of step -> seconds. Phase A runs with appends going on; phase B is the one
    transaction that holds today's table's ACCESS EXCLUSIVE lock."""
    t, s, ids = q(schema), f'"{schema}"', q(schema, "outbox_events_ids")
    out = {}
    c = connect()
    # A1: the side table and its trigger on today's table. CREATE TRIGGER takes SHARE ROW
    # EXCLUSIVE: it waits for appends in flight, and rows committed before it are all visible
    # to the backfill below.
    if uniq == "check":
        trigger = False
    else:
        timed(c, IDS_DDL.format(s=s, ids=ids), out=out, key="A1_side_table")
    if trigger:
        c.execute("SET lock_timeout = '2s'")
        timed(c, TRIGGER.format(t=t, s=s), out=out, key="A1_trigger_on_old_table")
        c.execute("RESET lock_timeout")
    # A2: backfill the event ids already there, in bounded batches.
    top = c.execute(f"SELECT coalesce(max(id), 0) FROM {t}").fetchone()[0]
    t0 = time.monotonic()
    for lo in range(0, top + 1 if uniq == "side" else 0, 20000):
        c.execute(f"INSERT INTO {ids} (event_id, id) SELECT event_id, id FROM {t} "
                  f"WHERE id >= %s AND id < %s ON CONFLICT DO NOTHING", (lo, lo + 20000))
    out["A2_backfill_ids"] = round(time.monotonic() - t0, 3)
    out["A2_backfilled_upto_id"] = top
    # A3: the bound of the old table, NOT VALID then validated (SHARE UPDATE EXCLUSIVE: appends
    # and the relay go on during the scan).
    seq = c.execute("SELECT pg_get_serial_sequence(%s, 'id')", (t,)).fetchone()[0]
    last = c.execute(f"SELECT coalesce(pg_sequence_last_value(%s), 0)", (seq,)).fetchone()[0]
    b = last + (margin if margin is not None else size)
    out["bound"] = b
    c.execute("SET lock_timeout = '2s'")
    timed(c, f'ALTER TABLE {t} ADD CONSTRAINT "outbox_events_p0_bound" CHECK (id < {b}) NOT VALID',
          out=out, key="A3_add_check_not_valid")
    c.execute("RESET lock_timeout")
    timed(c, f'ALTER TABLE {t} VALIDATE CONSTRAINT "outbox_events_p0_bound"', out=out, key="A3_validate")
    # The old table's indexes, renamed in the swap so the parent's get today's names.
    idx = c.execute(
        "SELECT i.relname, pg_get_indexdef(x.indexrelid), x.indisprimary, x.indisunique, "
        "       (SELECT conname FROM pg_constraint WHERE conindid = x.indexrelid AND conrelid = x.indrelid) "
        "FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid WHERE x.indrelid = %s::regclass",
        (t,)).fetchall()
    # B: the swap, one transaction, retried on lock timeout (never queued behind a long claim
    # for long: the lock queue would stall appends).
    for attempt in range(1, 30):
        try:
            t0 = time.monotonic()
            c.execute("BEGIN")
            c.execute(f"SET LOCAL lock_timeout = '{swap_lock_timeout}'")
            c.execute(f"LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE")
            t_locked = time.monotonic()
            now_last = c.execute(f"SELECT coalesce(pg_sequence_last_value(%s), 0)", (seq,)).fetchone()[0]
            if now_last >= b:
                raise RuntimeError(f"appends passed the bound {b} before the swap; rerun")
            c.execute(f'ALTER TABLE {t} RENAME TO "outbox_events_p0"')
            p0 = q(schema, "outbox_events_p0")
            for name, _, _, _, con in idx:
                if con:
                    c.execute(f'ALTER TABLE {p0} RENAME CONSTRAINT "{con}" TO "{con}_p0"')
                else:
                    c.execute(f'ALTER INDEX {s}."{name}" RENAME TO "{name}_p0"')
            c.execute(f'DROP TRIGGER IF EXISTS "outbox_events_ids_add" ON {p0}')
            c.execute(f"CREATE TABLE {t} (LIKE {p0} INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
                      f"INCLUDING STORAGE INCLUDING COMMENTS) PARTITION BY RANGE (id)")
            c.execute(f'ALTER TABLE {t} DROP CONSTRAINT "outbox_events_p0_bound"')
            c.execute(f"ALTER TABLE {t} ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (START WITH {b})")
            c.execute(f"ALTER TABLE {t} ATTACH PARTITION {p0} FOR VALUES FROM (MINVALUE) TO ({b})")
            for name, d, prim, isuniq, con in idx:
                if prim:
                    c.execute(f'ALTER TABLE {t} ADD CONSTRAINT "{con}" PRIMARY KEY (id)')
                elif isuniq:
                    continue  # event_id: kept on p0 only (side table or check trigger for the rest)
                else:
                    # Same definition on the parent: matches the p0 index and attaches it (no build).
                    d = d.replace(f"INDEX {name} ON {schema}.outbox_events_p0",
                                  f'INDEX "{name}" ON {t}').replace(
                        f'INDEX {name} ON "{schema}".outbox_events_p0', f'INDEX "{name}" ON {t}')
                    d = re.sub(r" ON " + re.escape(schema) + r"\.outbox_events_p0 ", f" ON {t} ", d)
                    d = d.replace(f'CREATE INDEX {name}_p0', f'CREATE INDEX "{name}"')
                    c.execute(d)
            for k in range(ahead):
                lo, hi = b + k * size, b + (k + 1) * size
                c.execute(f'CREATE TABLE {q(schema, f"outbox_events_p{lo}")} PARTITION OF {t} '
                          f"FOR VALUES FROM ({lo}) TO ({hi}) WITH (fillfactor = 80)")
                if uniq == "check":
                    c.execute(f'ALTER TABLE {q(schema, f"outbox_events_p{lo}")} ADD CONSTRAINT '
                              f'"outbox_events_p{lo}_event_id_key" UNIQUE (event_id)')
            if trigger:
                c.execute(TRIGGER.format(t=t, s=s))
            if uniq == "check":
                c.execute(CHECK_DDL.format(s=s, t=t))
                c.execute(CHECK_TRIGGER.format(s=s, t=t))
            c.execute("COMMIT")
            out["B_swap_lock_held_s"] = round(time.monotonic() - t_locked, 4)
            out["B_swap_total_s"] = round(time.monotonic() - t0, 4)
            out["B_attempts"] = attempt
            break
        except psycopg.errors.LockNotAvailable:
            c.execute("ROLLBACK")
            out["B_lock_timeouts"] = out.get("B_lock_timeouts", 0) + 1
    c.close()
    return out


# ---------------------------------------------------------------------------------------------
# maintenance: create partitions ahead, drop finished ones (bounded steps)

BOUND = re.compile(r"FROM \((MINVALUE|'?(-?\d+)'?)\) TO \((MAXVALUE|'?(-?\d+)'?)\)")


def partitions(c, schema):
    rows = c.execute(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), i.inhdetachpending "
        "FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass",
        (q(schema),)).fetchall()
    out = []
    for name, expr, pending in rows:
        m = BOUND.search(expr)
        lo = -(1 << 63) if m.group(1) == "MINVALUE" else int(m.group(2))
        hi = (1 << 63) if m.group(3) == "MAXVALUE" else int(m.group(4))
        out.append((lo, hi, name, pending))
    return sorted(out)


def maintain(schema, size, ahead=2, retention_s=5.0, max_drop=2, archive=False, stats=None, uniq="side"):
    """One step. Returns what it did. Every DDL has a short lock_timeout: a step that cannot get
    its lock gives up and the next step tries again (appends never queue behind it)."""
    t, ids = q(schema), q(schema, "outbox_events_ids")
    st = stats if stats is not None else {}
    did = {"created": [], "dropped": [], "kept": None}
    c = connect()
    c.execute("SET lock_timeout = '1s'")
    try:
        seq = c.execute("SELECT pg_get_serial_sequence(%s, 'id')", (t,)).fetchone()[0]
        last = c.execute("SELECT coalesce(pg_sequence_last_value(%s), 0)", (seq,)).fetchone()[0]
        parts = partitions(c, schema)
        # 0. A detach interrupted in its second phase leaves the partition "detach pending".
        for lo, hi, name, pending in parts:
            if pending:
                timed(c, f'ALTER TABLE {t} DETACH PARTITION {q(schema, name)} FINALIZE', out=st, key="finalize_s")
        # 1. Ahead: partitions up to last + ahead * size, each created alone and attached
        #    (SHARE UPDATE EXCLUSIVE on the table: appends and claims go on).
        top = max(hi for lo, hi, _, _ in parts)
        while top < last + ahead * size:
            lo, hi = top, top + size
            p = q(schema, f"outbox_events_p{lo}")
            t0 = time.monotonic()
            c.execute(f"CREATE TABLE {p} (LIKE {t} INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
                      f"INCLUDING INDEXES INCLUDING STORAGE) WITH (fillfactor = 80)")
            c.execute(f'ALTER TABLE {p} ADD CONSTRAINT "outbox_events_p{lo}_bound" CHECK (id >= {lo} AND id < {hi})')
            if uniq == "check":
                c.execute(f'ALTER TABLE {p} ADD CONSTRAINT "outbox_events_p{lo}_event_id_key" UNIQUE (event_id)')
            c.execute(f"ALTER TABLE {t} ATTACH PARTITION {p} FOR VALUES FROM ({lo}) TO ({hi})")
            st.setdefault("create_s", []).append(round(time.monotonic() - t0, 4))
            did["created"].append(lo)
            top = hi
        # 2. Drop: oldest first, only partitions below the ids handed out whose rows are all
        #    finished before the retention; stop at the first one that is not.
        for lo, hi, name, pending in partitions(c, schema)[:max_drop]:
            if hi > last:
                break
            p = q(schema, name)
            busy = c.execute(
                f"SELECT EXISTS (SELECT 1 FROM {p} WHERE status IN ('pending', 'parked')) "
                f"OR coalesce((SELECT max(finished_at) FROM {p} WHERE status IN ('published', 'discarded')) "
                f"   >= clock_timestamp() - %s * interval '1 second', false)", (retention_s,)).fetchone()[0]
            if busy:
                did["kept"] = name
                break
            t0 = time.monotonic()
            # DETACH CONCURRENTLY: first transaction SHARE UPDATE EXCLUSIVE, then it waits for
            # every transaction that uses the table (appends, claims in flight) to end.
            c.execute(f"ALTER TABLE {t} DETACH PARTITION {p} CONCURRENTLY")
            st.setdefault("detach_s", []).append(round(time.monotonic() - t0, 4))
            # Re-check now that no writer of the partition is left: an append that had its id
            # before the check above and committed after it would otherwise be dropped unseen.
            late = c.execute(f"SELECT count(*) FROM {p} WHERE status IN ('pending', 'parked')").fetchone()[0]
            if late:
                c.execute(f"ALTER TABLE {t} ATTACH PARTITION {p} FOR VALUES FROM ({lo if lo > -(1 << 62) else 'MINVALUE'}) TO ({hi})")
                did["reattached"] = name
                break
            if archive:
                c.execute(f'INSERT INTO {q(schema, "outbox_events_archive")} SELECT * FROM {p}')
            t1 = time.monotonic()
            n = 0 if uniq == "check" else c.execute(f"WITH d AS (DELETE FROM {ids} WHERE event_id IN (SELECT event_id FROM {p}) RETURNING 1) "
                          f"SELECT count(*) FROM d").fetchone()[0]
            st.setdefault("ids_delete_s", []).append(round(time.monotonic() - t1, 4))
            t2 = time.monotonic()
            c.execute(f"DROP TABLE {p}")
            st.setdefault("drop_s", []).append(round(time.monotonic() - t2, 4))
            did["dropped"].append((name, n))
    except psycopg.errors.LockNotAvailable as e:
        did["lock_timeout"] = str(e).splitlines()[0]
        st["lock_timeouts"] = st.get("lock_timeouts", 0) + 1
    finally:
        c.close()
    return did


# ---------------------------------------------------------------------------------------------
# workload: appender, relay (claim + complete), cleanup, vacuum stand-in, sampler

class Work:
    def __init__(self, schema, kind, rate, aggs, size, stop, start_id=10_000_000):
        self.schema, self.kind, self.rate, self.aggs, self.size, self.stop = schema, kind, rate, aggs, size, stop
        self.appended = self.published = self.removed = 0
        self.errors = []
        self.lat = []  # append transaction latencies (s)
        self.next_i = start_id
        self.mstats = {}

    def appender(self):
        c = connect()
        c.execute("SET synchronous_commit = off")
        per = max(1, self.rate // 50)
        sql = fill_sql(self.schema, self.aggs)
        t_next = time.monotonic()
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                c.execute(sql, (self.next_i, self.next_i + per - 1))
                self.next_i += per
                self.appended += per
            except Exception as e:
                self.errors.append(f"append: {type(e).__name__}: {str(e).splitlines()[0]}")
            self.lat.append(time.monotonic() - t0)
            t_next += per / self.rate
            time.sleep(max(0, t_next - time.monotonic()))
        c.close()

    def relay(self):
        """The naive claim + completion (SKIP LOCKED, then the row rewrite to 'published'): the
        same row versions per event as today's completion (one non-HOT update)."""
        t = q(self.schema)
        c = connect()
        while not self.stop.is_set():
            try:
                with c.transaction():
                    ids = [r[0] for r in c.execute(
                        f"SELECT id FROM {t} WHERE status = 'pending' AND NOT blocked ORDER BY id "
                        f"LIMIT 500 FOR UPDATE SKIP LOCKED").fetchall()]
                    if ids:
                        c.execute(f"UPDATE {t} SET status = 'published', published_at = clock_timestamp(), "
                                  f"finished_at = clock_timestamp(), ack_transport = 'kafka', "
                                  f"ack_destination = 'bench', ack_partition = 0, ack_position = id "
                                  f"WHERE id = ANY(%s)", (ids,))
                self.published += len(ids)
                if len(ids) < 500:
                    time.sleep(0.05)
            except Exception as e:
                self.errors.append(f"relay: {type(e).__name__}: {str(e).splitlines()[0]}")
                time.sleep(0.2)
        c.close()

    def cleanup(self):
        """Every 5 s, retention 5 s: today's cleanup statement (sql.rs) in batches of 10,000,
        or one maintenance step of the partitioned table."""
        t = q(self.schema)
        c = connect()
        stmt = (f"WITH d AS (DELETE FROM {t} WHERE id IN (SELECT id FROM {t} "
                f"WHERE status IN ('published', 'discarded') AND finished_at < "
                f"(SELECT clock_timestamp() - %s::int8 * interval '1 microsecond') "
                f"ORDER BY finished_at LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING *) SELECT count(*) FROM d")
        while not self.stop.wait(5):
            try:
                if self.kind == "cur":
                    while True:
                        n = c.execute(stmt, (5_000_000, 10_000)).fetchone()[0]
                        self.removed += n
                        if n < 10_000:
                            break
                else:
                    did = maintain(self.schema, self.size, stats=self.mstats,
                                   uniq="check" if self.kind == "partchk" else "side")
                    self.removed += sum(1 for _ in did["dropped"])
            except Exception as e:
                self.errors.append(f"cleanup: {type(e).__name__}: {str(e).splitlines()[0]}")
        c.close()

    def vacuum(self):
        """Autovacuum stand-in: VACUUM every 60 s (the server runs with autovacuum = off)."""
        c = connect()
        while not self.stop.wait(60):
            try:
                c.execute(f"VACUUM {q(self.schema)}")
                if self.kind == "part":
                    c.execute(f"VACUUM {q(self.schema, 'outbox_events_ids')}")
            except Exception as e:
                self.errors.append(f"vacuum: {type(e).__name__}: {str(e).splitlines()[0]}")
        c.close()


def sizes(c, schema):
    r = c.execute(
        "SELECT coalesce(sum(pg_total_relation_size(relid)), 0), coalesce(sum(pg_relation_size(relid)), 0), count(*) "
        "FROM (SELECT relid FROM pg_partition_tree(%s) WHERE isleaf "
        "      UNION SELECT %s::regclass WHERE (SELECT relkind FROM pg_class WHERE oid = %s::regclass) = 'r') l",
        (q(schema), q(schema), q(schema))).fetchone()
    side = c.execute("SELECT coalesce(pg_total_relation_size(to_regclass(%s)), 0)",
                     (q(schema, "outbox_events_ids"),)).fetchone()[0]
    dead = c.execute("SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE schemaname = %s "
                     "AND relname LIKE 'outbox_events%%' AND relname <> 'outbox_events_aggregate'", (schema,)).fetchone()[0]
    backlog = c.execute(f"SELECT count(*) FROM {q(schema)} WHERE status = 'pending' AND NOT blocked").fetchone()[0]
    return {"total_bytes": int(r[0]) + int(side), "table_bytes": int(r[0]), "heap_bytes": int(r[1]),
            "side_bytes": int(side), "leaves": r[2], "dead_tuples": int(dead), "backlog": backlog}


def soak(a):
    kinds = a.schemas.split(",")
    stop = threading.Event()
    works = []
    for k in kinds:
        schema = f"probe_part25_soak_{k}"
        setup(schema)
        if k in ("part", "partchk"):
            log(k, "upgrade", upgrade(schema, a.size, ahead=2, uniq="check" if k == "partchk" else "side"))
        works.append(Work(schema, k, a.rate, a.aggs, a.size, stop, start_id=1))
    holder = None
    if a.hold:
        holder = connect()
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")
        hx = holder.execute("SELECT backend_xmin::text FROM pg_stat_activity WHERE pid = pg_backend_pid()").fetchone()[0]
        log("holder open, backend_xmin", hx)
    threads = []
    for w in works:
        for f in (w.appender, w.relay, w.cleanup, w.vacuum):
            th = threading.Thread(target=f, daemon=True)
            th.start()
            threads.append(th)
    mon = connect()
    t0 = time.monotonic()
    end = t0 + a.minutes * 60
    while time.monotonic() < end:
        time.sleep(a.sample)
        el = time.monotonic() - t0
        oldest = mon.execute("SELECT min(age(backend_xmin)) , (SELECT age(backend_xmin) FROM pg_stat_activity "
                             "WHERE pid = %s) FROM pg_stat_activity WHERE backend_xmin IS NOT NULL",
                             (holder.info.backend_pid if holder else 0,)).fetchone()
        for w in works:
            row = {"t": round(el, 1), "kind": w.kind, **sizes(mon, w.schema), "appended": w.appended,
                   "published": w.published, "errors": len(w.errors),
                   "holder_xmin_age": oldest[1], "load": os.getloadavg()[0]}
            print(json.dumps(row), flush=True)
    stop.set()
    for th in threads:
        th.join(timeout=30)
    if holder:
        holder.execute("ROLLBACK")
        holder.close()
    for w in works:
        lat = sorted(w.lat)
        print(json.dumps({"summary": w.kind, "appended": w.appended, "published": w.published,
                          "append_batch_p50_ms": round(lat[len(lat) // 2] * 1000, 2) if lat else None,
                          "append_batch_p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 2) if lat else None,
                          "append_batch_max_ms": round(lat[-1] * 1000, 2) if lat else None,
                          "maintenance": {k: (v if not isinstance(v, list) else
                                              {"n": len(v), "max": max(v), "median": sorted(v)[len(v) // 2]})
                                          for k, v in w.mstats.items()},
                          "errors": w.errors[:10], "n_errors": len(w.errors)}), flush=True)


def uptest(a):
    """Today's table with N events (half published), then the upgrade while an appender (rate
    R, batches of R/50) and the relay run; then the relay drains and maintenance runs until the
    old table (p0) is dropped."""
    schema = a.schema
    setup(schema, events=a.events, aggs=a.aggs)
    with connect() as c:
        c.execute(f"UPDATE {q(schema)} SET status = 'published', published_at = clock_timestamp(), "
                  f"finished_at = clock_timestamp(), ack_transport = 'kafka', ack_destination = 'bench', "
                  f"ack_partition = 0, ack_position = id WHERE id <= %s", (a.events // 2,))
        c.execute(f"VACUUM ANALYZE {q(schema)}")
        before = c.execute(f"SELECT count(*), count(DISTINCT event_id) FROM {q(schema)}").fetchone()
    stop = threading.Event()
    w = Work(schema, "part", a.rate, a.aggs, a.size, stop, start_id=a.events)
    ths = [threading.Thread(target=f, daemon=True) for f in (w.appender, w.relay)]
    for th in ths:
        th.start()
    time.sleep(5)
    n0 = len(w.lat)
    t0 = time.monotonic()
    res = upgrade(schema, a.size, ahead=2, margin=a.size, uniq=a.uniq)
    res["upgrade_wall_s"] = round(time.monotonic() - t0, 3)
    during = w.lat[n0:]
    res["append_batches_during_upgrade"] = len(during)
    res["append_batch_max_ms_during_upgrade"] = round(max(during) * 1000, 1) if during else None
    res["append_batch_p50_ms_during_upgrade"] = round(sorted(during)[len(during) // 2] * 1000, 2) if during else None
    # Right after the swap: a duplicate of an event of the old table (now p0), appended
    # through the partitioned table, must be refused.
    with connect() as c:
        eid = c.execute(f"SELECT event_id FROM {q(schema, 'outbox_events_p0')} ORDER BY id LIMIT 1").fetchone()[0]
        try:
            c.execute(f"INSERT INTO {q(schema)} (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, "
                      f"schema_version, content_type, payload, created_at) VALUES (%s, 'order', 'dup', 1, 'x', 1, "
                      f"'application/json', '\\x00', now())", (eid,))
            res["duplicate_of_old_table_event_after_swap"] = "ACCEPTED (wrong)"
        except psycopg.errors.UniqueViolation as e:
            res["duplicate_of_old_table_event_after_swap"] = f"rejected: SQLSTATE {e.sqlstate} {e.diag.constraint_name}"
    res["uptime"] = os.getloadavg()
    log("upgrade", json.dumps(res))
    # Run on: the relay drains the old table's backlog, maintenance creates ahead and drops p0.
    steps = []
    t1 = time.monotonic()
    while time.monotonic() - t1 < a.after:
        time.sleep(5)
        d = maintain(schema, a.size, retention_s=5, stats=w.mstats, uniq=a.uniq)
        if d["created"] or d["dropped"] or d.get("lock_timeout") or d.get("reattached"):
            steps.append({"t": round(time.monotonic() - t1, 1), **d})
        if any(n == "outbox_events_p0" for n, _ in d["dropped"]):
            time.sleep(5)  # and a little more with p0 gone
            break
    stop.set()
    for th in ths:
        th.join(timeout=30)
    # Checks: duplicate rejected, every event id of the store in the side table, no lost rows.
    with connect() as c:
        ids = q(schema, "outbox_events_ids")
        chk = {}
        chk["rows_in_store"], chk["distinct_event_ids"] = c.execute(
            f"SELECT count(*), count(DISTINCT event_id) FROM {q(schema)}").fetchone()
        if a.uniq == "side":
          chk["store_rows_missing_from_side_table"] = c.execute(
            f"SELECT count(*) FROM {q(schema)} e WHERE NOT EXISTS (SELECT 1 FROM {ids} i WHERE i.event_id = e.event_id)").fetchone()[0]
          chk["side_rows_without_store_row"] = c.execute(
            f"SELECT count(*) FROM {ids} i WHERE NOT EXISTS (SELECT 1 FROM {q(schema)} e WHERE e.id = i.id)").fetchone()[0]
        chk["duplicate_event_ids_in_store"] = chk["rows_in_store"] - chk["distinct_event_ids"]
        for label, order in (("newest", "DESC"), ("oldest", "ASC")):
          eid = c.execute(f"SELECT event_id FROM {q(schema)} ORDER BY id {order} LIMIT 1").fetchone()[0]
          try:
            c.execute(f"INSERT INTO {q(schema)} (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, "
                      f"schema_version, content_type, payload, created_at) VALUES (%s, 'order', 'dup', 1, 'x', 1, "
                      f"'application/json', '\\x00', now())", (eid,))
            chk[f"duplicate_of_{label}_append"] = "ACCEPTED (wrong)"
          except psycopg.errors.UniqueViolation as e:
            chk[f"duplicate_of_{label}_append"] = f"rejected: SQLSTATE {e.sqlstate} {e.diag.constraint_name}"
        chk["appended_during_test"] = w.appended
        chk["published_during_test"] = w.published
        chk["partitions"] = [p[2] for p in partitions(c, schema)]
        chk["rows_before"] = before[0]
    print(json.dumps({"upgrade": res, "maintenance_steps": steps, "checks": chk,
                      "maintenance_timings": {k: (v if not isinstance(v, list) else
                                                  {"n": len(v), "max": max(v), "median": sorted(v)[len(v) // 2]})
                                              for k, v in w.mstats.items()},
                      "errors": w.errors[:10], "n_errors": len(w.errors)}, default=str), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["setup", "upgrade", "fill", "maintain", "soak", "uptest"])
    p.add_argument("--schema")
    p.add_argument("--schemas", default="cur,part")
    p.add_argument("--events", type=int, default=0)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--aggs", type=int, default=4000)
    p.add_argument("--size", type=int, default=15000)
    p.add_argument("--ahead", type=int, default=2)
    p.add_argument("--no-trigger", action="store_true")
    p.add_argument("--uniq", choices=["side", "check"], default="side")
    p.add_argument("--minutes", type=float, default=8)
    p.add_argument("--rate", type=int, default=500)
    p.add_argument("--sample", type=float, default=10)
    p.add_argument("--hold", action="store_true")
    p.add_argument("--after", type=float, default=120)
    a = p.parse_args()
    if a.cmd == "setup":
        setup(a.schema, a.events, a.aggs)
    elif a.cmd == "upgrade":
        print(json.dumps(upgrade(a.schema, a.size, a.ahead, trigger=not a.no_trigger, uniq=a.uniq)))
    elif a.cmd == "fill":
        fill(a.schema, a.start, a.events, a.aggs)
    elif a.cmd == "maintain":
        print(json.dumps(maintain(a.schema, a.size, a.ahead, uniq=a.uniq)))
    elif a.cmd == "soak":
        soak(a)
    elif a.cmd == "uptest":
        uptest(a)


if __name__ == "__main__":
    main()
