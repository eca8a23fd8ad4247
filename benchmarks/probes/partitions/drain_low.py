#!/usr/bin/env python3
"""Issue 25 partition probe: the claim on a steady-state layout (most partitions finished and
waiting for retention, the backlog in the newest ones), with today's statements and with a
"low-water mark" added to the by-aggregate probes, so that finished partitions are pruned.

  drain_low.py setup --kind cur|part --schema S      100,000 events (10 partitions of 10,000 for
                                                     part), the first 80,000 published
  drain_low.py drain --kind cur|part|partlow --schema S [--explain-at K]

partlow: ../completion/cur.sql with `AND <row>.id >= (SELECT lo FROM S.outbox_events_low)` in the
follower probe (decide) and the promote probes (decide, complete). The mark is set here once,
to the lower bound of the oldest partition holding an unfinished row (a real store would keep it
in maintenance, see README). Prints drain.py's JSON line.
"""
import argparse, os, re, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "completion"))
import drain as D  # noqa: E402
import part as P  # noqa: E402

EVENTS, AGGS, DONE = 100_000, 20_000, 80_000


def setup(a):
    s = a.schema
    P.setup(s)
    if a.kind == "part":
        P.upgrade(s, 10_000, ahead=11, margin=10_000, uniq="check")  # ids from 10,000
    P.fill(s, 0, EVENTS, AGGS)
    with P.connect() as c:
        lo_id = c.execute(f"SELECT min(id) FROM {P.q(s)}").fetchone()[0]
        c.execute(f"UPDATE {P.q(s)} SET status = 'published', published_at = clock_timestamp(), "
                  f"finished_at = clock_timestamp(), ack_transport = 'kafka', ack_destination = 'bench', "
                  f"ack_partition = 0, ack_position = id WHERE id < %s", (lo_id + DONE,))
        # The published versions 1..4 of every aggregate, as completions would have left them.
        c.execute(f"INSERT INTO {P.q(s, 'outbox_events_aggregate')} (aggregate_key, aggregate_type, aggregate_id, last_version) "
                  f"SELECT hashtextextended('order' || chr(31) || 'order-' || g, 0), 'order', 'order-' || g, {DONE // AGGS} "
                  f"FROM generate_series(0, {AGGS - 1}) g")
        c.execute(f"CREATE TABLE {P.q(s, 'outbox_events_low')} (lo bigint NOT NULL)")
        c.execute(f"INSERT INTO {P.q(s, 'outbox_events_low')} SELECT (min(id) / 10000) * 10000 FROM {P.q(s)} "
                  f"WHERE status IN ('pending', 'parked')")
        c.execute(f"VACUUM ANALYZE {P.q(s)}")
        c.execute(f"VACUUM ANALYZE {P.q(s, 'outbox_events_aggregate')}")


def patched_sections(low):
    orig = D.sections

    def sections(path):
        s = orig(path)
        if path == "cur.sql" and low:
            m = "(SELECT lo FROM @SCHEMA@.\"outbox_events_low\")"
            n0 = s["decide"].count("AND u.aggregate_version > c.last")
            s["decide"] = s["decide"].replace("AND u.aggregate_version > c.last",
                                              f"AND u.id >= {m} AND u.aggregate_version > c.last")
            s["decide"] = s["decide"].replace("AND b.blocked AND b.aggregate_type = h.aggregate_type",
                                              f"AND b.id >= {m} AND b.blocked AND b.aggregate_type = h.aggregate_type")
            s["complete"] = s["complete"].replace("AND b.blocked AND b.aggregate_type = p.at",
                                                  f"AND b.id >= {m} AND b.blocked AND b.aggregate_type = p.at")
            assert n0 == 1 and s["decide"].count(m) == 2 and s["complete"].count(m) == 1
        return s
    return sections


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["setup", "drain", "check"])
    p.add_argument("--kind", required=True, choices=["cur", "part", "partlow"])
    p.add_argument("--schema", required=True)
    p.add_argument("--explain-at", type=int, default=0)
    a = p.parse_args()
    if a.cmd == "setup":
        setup(a)
        return
    D.sections = patched_sections(a.kind == "partlow")
    ns = argparse.Namespace(scheme="cur", schema=a.schema, batch=1000, explain_at=a.explain_at, hold_ms=0,
                            until_empty=False, log=None, events=EVENTS, aggs=AGGS)
    if a.cmd == "drain":
        D.drain(ns)
    else:
        D.check(ns)


if __name__ == "__main__":
    main()
