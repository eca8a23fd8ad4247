#!/usr/bin/env python3
"""Issue 25 decision probe: today's lease-mode claim (cur.sql) against rewrites of its decision
(variants/*.sql), driven by ../completion/drain.py (same backlog, same relay loop, same checks).

  probe.py setup|drain|check --variant cur|<file in variants/ without .sql> --schema S [drain.py options]

A variant file holds `-- name: <statement>` sections that replace cur.sql's (usually `decide`,
sometimes `candidates`); every other statement stays today's. The drain is drain.py's with the
scheme `cur` (its setup, relay loop and `check` are those of today's tables); this wrapper adds
the backend CPU of every statement, read from /proc/<backend pid>/schedstat (nanoseconds of CPU
time; the backend is idle between statements), and prints drain.py's JSON line with the variant
name and `backend_cpu_ns_us_per_event` (schedstat total) and `statement_cpu_us_per_event`.
"""
import contextlib, io, json, os, sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "completion"))
import drain  # noqa: E402

VARIANT = "cur"
AB = []
SHADOWS = []


def decision_statements(scheme, schema, variant=None):
    variant = variant or VARIANT
    s = drain.sections(os.path.join(HERE, "cur.sql"))
    if variant != "cur":
        s.update(drain.sections(os.path.join(HERE, "variants", variant + ".sql")))
    if os.environ.get("PROBE_BREAK") == "lease":
        s = break_leases(s)
    return {k: drain.subst(v, schema) for k, v in s.items()}


def break_leases(s):
    """PROBE_BREAK=lease: the claim ignores live leases (candidates, decision and lease write),
    to see two_relays.sh and late_lower.sh fail."""
    def rep(text, a, b):
        assert a in text, a
        return text.replace(a, b)
    s["candidates"] = rep(s["candidates"], "AND a.lease_until > clock_timestamp())", "AND false)")
    s["decide"] = rep(s["decide"], "WHEN c.leased THEN 'wait'", "WHEN false THEN 'wait'")
    s["decide"] = rep(s["decide"], "WHERE a.lease_until IS NULL OR a.lease_until <= clock_timestamp()", "WHERE true")
    if "AND (a.lease_until IS NULL OR a.lease_until <= clock_timestamp())" in s["decide"]:
        s["decide"] = s["decide"].replace("AND (a.lease_until IS NULL OR a.lease_until <= clock_timestamp())", "")
    return s


def schedstat(pid):
    return int(open(f"/proc/{pid}/schedstat").read().split()[0])


class Timed:
    """A connection whose execute() adds the backend's CPU time to the statement's label."""

    def __init__(self, conn, labels, acc, alt=None):
        self._c, self._labels, self._acc, self._alt = conn, labels, acc, alt
        self._decides = 0
        self.pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        self._last = None

    def execute(self, sql, params=None):
        label = self._labels.get(sql)
        if label is None:
            if sql == "COMMIT":
                label = {"decide": "claim_commit", "complete": "complete_commit"}.get(self._last, "commit_other")
            elif sql == drain.CLAIM_BEGIN:
                label = "claim_begin"
            elif sql == drain.COMPLETE_BEGIN:
                label = "complete_begin"
            else:
                label = "harness"  # WAL position reads, checks
        if label == "decide" and self._alt:
            # A/B: the claims decide with today's text and each alternative in turn, in the
            # same drain (same backlog, same moment, same load).
            self._decides += 1
            k = self._decides % (len(self._alt) + 1)
            if k:
                label, sql = "decide_" + self._alt[k - 1][0], self._alt[k - 1][1]
        if label == "decide" and SHADOWS:
            # Cost attribution: each shadow text decides on the same ids, in a savepoint rolled
            # back before the real decision (shadows in a rotating order).
            self._decides += 1
            order = SHADOWS[self._decides % len(SHADOWS):] + SHADOWS[:self._decides % len(SHADOWS)]
            for name in order:
                self._c.execute("SAVEPOINT shadow")
                t = schedstat(self.pid)
                n = self._c.execute(self._shadow[name], params).rowcount
                self._acc["shadow_" + name] = self._acc.get("shadow_" + name, 0) + schedstat(self.pid) - t
                self._acc["rows_shadow_" + name] = self._acc.get("rows_shadow_" + name, 0) + max(n, 0)
                self._c.execute("ROLLBACK TO SAVEPOINT shadow")
        t = schedstat(self.pid)
        cur = self._c.execute(sql, params)
        self._acc[label] = self._acc.get(label, 0) + schedstat(self.pid) - t
        if label.startswith("decide"):
            self._acc["rows_" + label] = self._acc.get("rows_" + label, 0) + max(cur.rowcount, 0)
        if label.startswith("decide") or label == "complete":
            self._last = "decide" if label.startswith("decide") else label
        return cur

    def __getattr__(self, k):
        return getattr(self._c, k)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self._c.close()


def main():
    global VARIANT, AB, SHADOWS
    args = sys.argv[1:]
    i = args.index("--variant")
    VARIANT = args[i + 1]
    del args[i:i + 2]
    if "--ab" in args:
        i = args.index("--ab")
        AB = args[i + 1].split(",")
        del args[i:i + 2]
    if "--shadows" in args:
        i = args.index("--shadows")
        SHADOWS = args[i + 1].split(",")
        del args[i:i + 2]
    drain.statements = decision_statements
    sys.argv = [sys.argv[0]] + args + ["--scheme", "cur"]
    if args[0] != "drain":
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            drain.main()
        if args[0] == "setup":
            extra = decision_statements("cur", args[args.index("--schema") + 1]).get("setup_extra")
            if extra:  # a variant's storage change (not a statement of the claim)
                with drain.connect() as c:
                    c.execute(extra)
        for line in out.getvalue().splitlines():
            d = json.loads(line)
            d["scheme"] = VARIANT
            print(json.dumps(d))
        return
    acc = {}
    raw_connect = drain.connect
    made = []

    def connect():
        c = raw_connect()
        if not made:  # the first connection is the relay's, the second the monitor
            schema = args[args.index("--schema") + 1]
            st = decision_statements("cur", schema)
            alt = []
            for name in AB:
                s = drain.sections(os.path.join(HERE, "cur.sql"))
                s.update(drain.sections(os.path.join(HERE, "variants", name + ".sql")))
                alt.append((name, decision_statements("cur", schema, name)["decide"]))
            c = Timed(c, {v: k for k, v in st.items()}, acc, alt)
            c._shadow = {}
            for name in SHADOWS:
                s = drain.sections(os.path.join(HERE, "cur.sql"))
                if name != "cur":
                    s.update(drain.sections(os.path.join(HERE, "variants", name + ".sql")))
                c._shadow[name] = drain.subst(s["decide"], schema)
        made.append(c)
        return c

    drain.connect = connect
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        drain.main()
    d = json.loads(out.getvalue().strip().splitlines()[-1])
    ev = max(d["events"], 1)
    d["scheme"] = VARIANT
    rows = {k: acc.pop(k) for k in list(acc) if k.startswith("rows_")}
    d["statement_cpu_us_per_event"] = {k: round(v / 1e3 / ev, 2) for k, v in sorted(acc.items())}
    d["backend_cpu_ns_us_per_event"] = round(sum(v for k, v in acc.items() if k != "harness") / 1e3 / ev, 2)
    if SHADOWS:
        d["shadow_us_per_row"] = {k: round(acc.get("shadow_" + k, 0) / 1e3 / max(rows.get("rows_decide", 0), 1), 2) for k in SHADOWS}
        d["shadow_rows"] = {k: rows.get("rows_shadow_" + k, 0) for k in SHADOWS}
        d["decide_us_per_row"] = round(acc.get("decide", 0) / 1e3 / max(rows.get("rows_decide", 0), 1), 2)
    if AB:
        # Per row the decision returned, each text on its own half of the claims.
        d["ab_decide_us_per_row"] = {k: round(acc.get("decide" + s, 0) / 1e3 / max(rows.get("rows_decide" + s, 0), 1), 2)
                                     for k, s in [(VARIANT, "")] + [(n, "_" + n) for n in AB]}
        d["ab_rows"] = rows
    d["claim_cpu_us_per_event"] = round(sum(acc.get(k, 0) for k in ("claim_begin", "candidates", "decide", "claim_commit")) / 1e3 / ev, 2)
    print(json.dumps(d))


if __name__ == "__main__":
    main()
