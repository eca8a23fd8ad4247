//! The SQL text of one outbox store, built once from validated identifiers.
//!
//! Every statement that changes an aggregate's delivery state runs after the aggregate's
//! advisory lock was taken by its transaction, and decides in a snapshot taken after that
//! (READ COMMITTED: each statement gets a new snapshot). See `docs/claims.md`.

use crate::schema::qualified;

/// Envelope columns, in the order [`crate::outbox::rows::envelope_from_row`] reads them.
pub(crate) const ENVELOPE_COLS: &str = "event_id, aggregate_type, aggregate_id, \
    aggregate_version, event_type, schema_version, content_type, payload, headers, created_at";

/// Columns of a parked row as [`crate::outbox::rows::parked_from_row`] reads them.
const PARKED_COLS: &str = "attempts, park_kind, last_error_class, last_error_kind, \
    last_error_message, parked_at, maybe_delivered";

#[derive(Debug)]
pub(crate) struct OutboxSql {
    pub table: String,
    pub append: String,
    /// The append of a single event: the same row as `append` writes, from scalars (`$1`..`$10`
    /// in `append`'s order; `$11`..`$13` as there; never blocked).
    pub append_one: String,
    /// Claim step 1: candidates in id order, their aggregates try-locked. `$1` limit.
    pub claim_candidates: String,
    /// Claim step 2 (lease mode), in a snapshot taken after the locks. `$1` ids, `$2` owner,
    /// `$3` token, `$4` lease µs, `$5` gap timeout µs, `$6` gap re-check µs.
    pub claim_decide_lease: String,
    /// Claim step 2 (locked mode). `$1` ids, `$2` gap timeout µs, `$3` gap re-check µs.
    pub claim_decide_locked: String,
    /// `claim_decide_lease` with runs: `$7` run length, `$8` limit.
    pub claim_decide_lease_runs: String,
    /// `claim_decide_locked` with runs: `$4` run length, `$5` limit.
    pub claim_decide_locked_runs: String,
    /// Clears the expired leases a locked claim took over. `$1` aggregate keys, `$2` types,
    /// `$3` ids.
    pub unlease_locked: String,
    /// Parks claimed rows that fail to decode. `$1` ids, `$2` reasons, `$3` claim token, `$4`
    /// aggregate keys.
    pub park_undecodable: String,
    /// Blocking advisory locks of the given lock keys, in key order. `$1` keys.
    pub lock_keys: String,
    pub complete_lease: String,
    pub complete_locked: String,
    pub release_lease: String,
    pub lease_rows: String,
    pub owner_leases: String,
    pub release_owner_lease: String,
    pub event_state: String,
    pub retry_parked: String,
    pub discard_parked: String,
    pub reissue_parked: String,
    pub list_parked: String,
    pub parked_event: String,
    pub audit_trail: String,
    pub audit: String,
    pub cleanup: String,
    pub stats: String,
    pub table_stats: String,
}

/// A stable 64-bit seed per table, so two outbox tables never share advisory lock keys.
pub(crate) fn seed(schema: &str, table: &str) -> i64 {
    // FNV-1a: deterministic across processes and versions (unlike std's hasher).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in schema.bytes().chain([b'.']).chain(table.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h as i64
}

/// Aggregate key of row alias `a`: the expression of the unfinished and blocked indexes
/// (migration 2), written the same way so that the planner matches them.
fn agg(a: &str) -> String {
    format!("hashtextextended({a}.aggregate_type || chr(31) || {a}.aggregate_id, 0)")
}

/// The aggregate-state row of event alias `e` (its primary key).
fn state_of(s: &str, e: &str) -> String {
    format!(
        "{s}.aggregate_key = {} AND {s}.aggregate_type = {e}.aggregate_type \
         AND {s}.aggregate_id = {e}.aggregate_id",
        agg(e)
    )
}

/// `interval` of `$n` microseconds.
fn micros(n: u8) -> String {
    format!("${n}::int8 * interval '1 microsecond'")
}

impl OutboxSql {
    pub(crate) fn new(schema: &str, table: &str, accept_first_version: bool) -> Self {
        let t = qualified(schema, table);
        let audit = qualified(schema, &format!("{table}_audit"));
        let archive = qualified(schema, &format!("{table}_archive"));
        let state = qualified(schema, &format!("{table}_aggregate"));
        let seed = seed(schema, table);

        // What an append returns: rows written, notifications sent (`$11` the channel; with
        // the wake-up gate `$12`, `$13`, only when its shared lock is refused: `wake_gate.rs`).
        let appended = "SELECT (SELECT count(*) FROM ins) AS n, \
                    (SELECT count(*) FROM (SELECT pg_notify($11::text, '') \
                                           WHERE $11::text IS NOT NULL \
                                             AND ($12::int4 IS NULL \
                                                  OR NOT pg_try_advisory_xact_lock_shared( \
                                                           $12::int4, $13::int4))) nn) \
                    AS notified";

        // `inserted_at` (what the stats age events from) is the statement's clock, not the
        // column default `now()`, the start of the business transaction: an event appended
        // at the end of a long transaction must not look that old at its commit, before the
        // relay can even see it (it would turn the backpressure gate on by age).
        // `blocked` (`$14`, NULL when no row of the statement is blocked: then every element
        // is NULL) is set at insert on the rows of an aggregate above the statement's lowest
        // version of that aggregate (see `blocked_at_insert` in `outbox/append.rs` for why the
        // claims stay correct): a batch of one aggregate's versions goes into the blocked
        // index from birth, instead of being moved there by the first claim that meets it.
        let append = format!(
            "WITH ins AS ( \
               INSERT INTO {t} ({ENVELOPE_COLS}, inserted_at, blocked) \
               SELECT e, at, ai, av, et, sv, ct, p, h::jsonb, ca, clock_timestamp(), \
                      COALESCE(bl, false) \
               FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::int8[], $5::text[], \
                           $6::int4[], $7::text[], $8::bytea[], $9::text[], $10::timestamptz[], \
                           $14::bool[]) \
                    AS u(e, at, ai, av, et, sv, ct, p, h, ca, bl) \
               RETURNING 1) \
             {appended}"
        );

        // One event (most business transactions): `VALUES` instead of `UNNEST` over ten
        // one-element arrays; the row, the notification and the gate are `append`'s.
        let append_one = format!(
            "WITH ins AS ( \
               INSERT INTO {t} ({ENVELOPE_COLS}, inserted_at) \
               VALUES ($1::uuid, $2::text, $3::text, $4::int8, $5::text, $6::int4, $7::text, \
                       $8::bytea, $9::text::jsonb, $10::timestamptz, clock_timestamp()) \
               RETURNING 1) \
             {appended}"
        );

        // Step 1: the first candidates (pending, unblocked, due) in insertion order whose
        // aggregate shows no live lease here and which this transaction can lock. The CASE keeps
        // the lease probe and the lock attempt behind the cheap filters. Nothing is decided on
        // this snapshot, which predates the locks: a view that is stale only costs a lock.
        let claim_candidates = format!(
            "SELECT c.id FROM {t} c \
             WHERE c.status = 'pending' AND NOT c.blocked \
               AND CASE WHEN c.next_attempt_at <= now() \
                         AND NOT EXISTS (SELECT 1 FROM {state} a \
                                         WHERE {sc} AND a.lease_until > clock_timestamp()) \
                        THEN pg_try_advisory_xact_lock({kc} # ({seed})) ELSE false END \
             ORDER BY c.id LIMIT $1",
            sc = state_of("a", "c"),
            kc = agg("c"),
        );

        // Step 2, in a snapshot taken after the locks: every writer of these aggregates' state
        // takes the same locks first, so what this statement reads stays true until commit.
        // Each candidate gets one action:
        //   bad_key   its aggregate type or id is longer than MAX_AGGREGATE_NAME_BYTES (a row
        //             written by other means, or by a version without the bound): its state
        //             row could not be indexed, and writing it would fail the whole claim;
        //             parked as a permanent error
        //   stale     version <= last: would go out after a later version; parked out of order
        //   follower  an unfinished row of the aggregate above `last` precedes it, unblocked
        //             or of the same version (a blocked earlier copy of its version is the
        //             head, not it: counting only unblocked rows let a second copy that
        //             arrived unblocked go out first once a stale row before the first copy
        //             was parked and promoted it in the same claim): blocked,
        //             and with it every pending row of its aggregate after it in (version,
        //             id), in the window or not (each has the same row before it): otherwise
        //             one aggregate's backlog fills every claim's window one batch at a time,
        //             and an event of another aggregate appended after it waits (issue 25:
        //             10,000 versions of one aggregate kept it out of about 100 claims);
        //             an append of several versions of an aggregate writes all but its
        //             lowest version blocked already (`blocked_at_insert`, outbox/append.rs),
        //             and `blk` does not write those rows again (but for the
        //             `maybe_delivered` mark)
        //   gap_park  the head skips a version for longer than the gap timeout: parked
        //   gap_hold  the head skips a version: held, re-checked after a short delay
        //   wait      the head is under a live lease (a mixed-mode relay) or not due
        //   claim     the head, version last + 1, due: claimed (lease mode: the lease)
        // Runs (`$run` above 1, issue 25): `run0` reads, after each claimed head, the next rows
        // of its aggregate through the unfinished index (at most `$run`, and no more than the
        // limit leaves after the heads, `nh`; one more than kept, to see a duplicate of the
        // last version) and keeps them while each is exactly the next version, pending, due,
        // and alone at its version; `run` keeps the first of them, in head order, up to the
        // limit, and reads their envelopes. With `$run` 1 both are empty (a one-time filter).
        // A lease that ended without outcome or release (`sent_upto`: the last version of its
        // run) may have sent every row of its run: they are marked `maybe_delivered`, by
        // `blk` where it writes them anyway, else by `mark_run`: one write per row per
        // statement (PostgreSQL applies only one of two updates of a row in one statement).
        // `mark_run` also unblocks (promotes), per aggregate whose head it parks (`stale`,
        // `bad_key`), the aggregate's lowest blocked row, unless `blk` blocks it (at or after
        // the aggregate's first follower): a separate `promote` lost the mark of a run row it
        // unblocked, which went out later unflagged (adversary_unknown47). Both read their
        // aggregates from `ag` (one row per aggregate of the window: its claimed head with a
        // lease that ended, its first follower, whether a head is parked), never a CTE per
        // row of another.
        // The last version of an aggregate without state (no row, or a row whose
        // `last_version` is still NULL: nothing published or discarded, migration 6), and the
        // source of `c`: each candidate with its aggregate's state row (`a`).
        // With `accept_first_version` that last version is read from the aggregate's
        // unfinished rows, so `c` reads the candidates grouped by aggregate: the state row and
        // that read once per aggregate (the subquery `a`, kept apart by `OFFSET 0`), then its
        // candidates by id. Read per candidate, a window of 33 versions of one aggregate of
        // 1,500 unfinished versions read 49,500 index rows (stop 46); joined to a CTE of
        // the aggregates' last versions, the planner chose a nested loop over that CTE (300
        // candidates x 60 aggregates compared) on estimates it cannot have.
        let (c_source, c_last) = if accept_first_version {
            (
                format!(
                    "(SELECT g.k, g.ids, COALESCE(s.last_version, {unknown_g}) AS last, \
                            s.last_version, s.lease_until, s.lease_row, s.lease_upto, \
                            s.lease_token \
                     FROM (SELECT {kr} AS k, r.aggregate_type, r.aggregate_id, \
                                  array_agg(x.id) AS ids \
                           FROM UNNEST($1::int8[]) AS x(id) \
                           CROSS JOIN LATERAL (SELECT r.aggregate_type, r.aggregate_id \
                                               FROM {t} r \
                                               WHERE r.id = x.id AND r.status = 'pending' \
                                                 AND NOT r.blocked OFFSET 0) r \
                           GROUP BY 1, 2, 3) g \
                     LEFT JOIN LATERAL (SELECT s.last_version, s.lease_until, s.lease_row, \
                                               s.lease_upto, s.lease_token \
                                        FROM {state} s WHERE s.aggregate_key = g.k \
                                          AND s.aggregate_type = g.aggregate_type \
                                          AND s.aggregate_id = g.aggregate_id LIMIT 1) s \
                       ON true \
                     OFFSET 0) a \
                   CROSS JOIN LATERAL UNNEST(a.ids) AS x(id) \
                   CROSS JOIN LATERAL (SELECT * FROM {t} r \
                                       WHERE r.id = x.id AND r.status = 'pending' \
                                         AND NOT r.blocked OFFSET 0) r",
                    unknown_g = unknown_last(&t, &state, "g", true),
                    kr = agg("r"),
                ),
                "a.last",
            )
        } else {
            (
                format!(
                    "UNNEST($1::int8[]) AS x(id) \
                   CROSS JOIN LATERAL (SELECT * FROM {t} r \
                                       WHERE r.id = x.id AND r.status = 'pending' \
                                         AND NOT r.blocked OFFSET 0) r \
                   LEFT JOIN LATERAL (SELECT a.last_version, a.lease_until, a.lease_row, \
                                             a.lease_upto, a.lease_token \
                                      FROM {state} a WHERE {sr} LIMIT 1) a ON true",
                    sr = state_of("a", "r"),
                ),
                "COALESCE(a.last_version, 0)",
            )
        };
        // Runs (`$run` and `$limit` bound): `nh`, `run0` and `run`, after `mark_run`. A claim
        // of heads only (`run` 1, the default) uses statements without them: planning is about
        // a third of the decision's server time on a claim of a few hundred heads, and these
        // CTEs were a fifth of the plan (EXPLAIN's planning time, BENCHMARKS.md).
        let runs_ctes = |run: u8, limit: u8| {
            let (run, limit) = (format!("${run}::int8"), format!("${limit}::int8"));
            format!(
                "nh AS MATERIALIZED ( \
                   SELECT {limit} - count(*) AS budget FROM h WHERE h.action = 'claim'), \
                 run0 AS MATERIALIZED ( \
                   SELECT h.id AS head, h.k, h.last, h.sent_upto, q.* \
                   FROM h CROSS JOIN LATERAL ( \
                     SELECT q.*, bool_and(q.ok) OVER (ORDER BY q.pos) AS all_ok \
                     FROM (SELECT q.*, q.aggregate_version = h.aggregate_version + q.pos \
                                       AND q.status = 'pending' AND q.due \
                                       AND q.next_v IS DISTINCT FROM q.aggregate_version AS ok \
                           FROM (SELECT q.*, \
                                        row_number() OVER (ORDER BY q.aggregate_version, q.id) \
                                          AS pos, \
                                        lead(q.aggregate_version) \
                                          OVER (ORDER BY q.aggregate_version, q.id) AS next_v \
                                 FROM (SELECT r.id, r.aggregate_version, r.attempts, r.status, \
                                              r.maybe_delivered, r.next_attempt_at <= now() AS due \
                                       FROM {t} r \
                                       WHERE {kr} = h.k AND r.status IN ('pending', 'parked') \
                                         AND (r.aggregate_version, r.id) \
                                             > (h.aggregate_version, h.id) \
                                         AND r.aggregate_type = h.aggregate_type \
                                         AND r.aggregate_id = h.aggregate_id \
                                       ORDER BY r.aggregate_version, r.id \
                                       LIMIT (SELECT CASE WHEN n.budget > 0 \
                                                          THEN LEAST({run}, n.budget + 1) \
                                                          ELSE 0 END \
                                              FROM nh n)) q) q) q) q \
                   WHERE h.action = 'claim' AND {run} > 1), \
                 run AS MATERIALIZED ( \
                   SELECT r.head, r.k, r.last, r.sent_upto, r.id, r.attempts, r.maybe_delivered, \
                          r.pos, {cols_e} \
                   FROM (SELECT r.*, row_number() OVER (ORDER BY r.head, r.pos) AS nth \
                         FROM run0 r WHERE r.all_ok AND r.pos < {run}) r \
                   JOIN {t} e ON e.id = r.id \
                   WHERE r.nth <= (SELECT n.budget FROM nh n))",
                kr = agg("r"),
                cols_e = prefixed("e", ENVELOPE_COLS),
            )
        };
        let decide = |gap: u8, recheck: u8, runs: Option<String>| {
            let runs = runs.map(|r| format!("{r}, ")).unwrap_or_default();
            format!(
                "c AS MATERIALIZED ( \
                   SELECT r.id, {cols}, r.attempts, r.held_since, {kr} AS k, \
                          r.next_attempt_at <= now() AS due, \
                          {c_last} AS last, \
                          (a.last_version IS NOT NULL) AS known, \
                          COALESCE(a.lease_until > clock_timestamp(), false) AS leased, \
                          (a.lease_token IS NOT NULL) AS lease_left, \
                          (COALESCE(a.lease_row = r.id \
                                    OR a.lease_row IS NOT NULL \
                                       AND r.aggregate_version <= a.lease_upto, false) \
                           OR r.maybe_delivered) AS resend, \
                          CASE WHEN a.lease_row IS NOT NULL \
                                AND NOT COALESCE(a.lease_until > clock_timestamp(), false) \
                               THEN a.lease_upto END AS sent_upto \
                   FROM {c_source}), \
                 h AS MATERIALIZED ( \
                   SELECT c.*, CASE \
                     WHEN octet_length(c.aggregate_type) > {max_name} \
                       OR octet_length(c.aggregate_id) > {max_name} THEN 'bad_key' \
                     WHEN c.leased THEN 'wait' \
                     WHEN c.aggregate_version <= c.last THEN 'stale' \
                     WHEN EXISTS (SELECT 1 FROM {t} u \
                                  WHERE {ku} = c.k AND u.status IN ('pending', 'parked') \
                                    AND u.aggregate_version > c.last \
                                    AND (u.aggregate_version, u.id) < (c.aggregate_version, c.id) \
                                    AND u.aggregate_type = c.aggregate_type \
                                    AND u.aggregate_id = c.aggregate_id \
                                    AND (NOT u.blocked \
                                         OR u.aggregate_version = c.aggregate_version)) \
                     THEN 'follower' \
                     WHEN c.aggregate_version > c.last + 1 THEN \
                       CASE WHEN c.held_since <= clock_timestamp() - {gap_i} THEN 'gap_park' \
                            ELSE 'gap_hold' END \
                     WHEN NOT c.due THEN 'wait' \
                     ELSE 'claim' END AS action \
                   FROM c), \
                 fol AS MATERIALIZED ( \
                   SELECT DISTINCT ON (h.k, h.aggregate_type, h.aggregate_id) \
                          h.k, h.aggregate_type, h.aggregate_id, \
                          h.aggregate_version AS v, h.id, h.sent_upto \
                   FROM h WHERE h.action = 'follower' \
                   ORDER BY h.k, h.aggregate_type, h.aggregate_id, h.aggregate_version, h.id), \
                 blk AS ( \
                   UPDATE {t} b SET blocked = true, \
                          maybe_delivered = b.maybe_delivered \
                                            OR COALESCE(b.aggregate_version <= f.sent_upto, false) \
                   FROM fol f \
                   WHERE {kb} = f.k AND b.status IN ('pending', 'parked') \
                     AND b.status = 'pending' \
                     AND (NOT b.blocked OR NOT b.maybe_delivered \
                                           AND b.aggregate_version <= f.sent_upto) \
                     AND (b.aggregate_version, b.id) >= (f.v, f.id) \
                     AND b.aggregate_type = f.aggregate_type \
                     AND b.aggregate_id = f.aggregate_id \
                   RETURNING 1), \
                 ag AS MATERIALIZED ( \
                   SELECT h.k, h.aggregate_type, h.aggregate_id, \
                          bool_or(h.action IN ('stale', 'bad_key')) AS promote, \
                          min(h.aggregate_version) FILTER (WHERE h.action = 'claim' \
                            AND h.sent_upto > h.aggregate_version) AS v, \
                          min(h.id) FILTER (WHERE h.action = 'claim' \
                            AND h.sent_upto > h.aggregate_version) AS id, \
                          max(h.sent_upto) FILTER (WHERE h.action = 'claim' \
                            AND h.sent_upto > h.aggregate_version) AS sent_upto, \
                          min(ARRAY[h.aggregate_version, h.id]) \
                            FILTER (WHERE h.action = 'follower') AS fol \
                   FROM h WHERE h.action IN ('stale', 'bad_key', 'claim', 'follower') \
                   GROUP BY h.k, h.aggregate_type, h.aggregate_id), \
                 mark_run AS ( \
                   UPDATE {t} m SET maybe_delivered = m.maybe_delivered OR u.mark, \
                          blocked = m.blocked AND NOT u.unblock \
                   FROM (SELECT w.id, bool_or(w.mark) AS mark, bool_or(w.unblock) AS unblock \
                         FROM (SELECT r.id, true AS mark, false AS unblock \
                               FROM ag x CROSS JOIN LATERAL ( \
                                 SELECT m.id FROM {t} m \
                                 WHERE {km} = x.k AND m.status IN ('pending', 'parked') \
                                   AND m.status = 'pending' AND NOT m.maybe_delivered \
                                   AND (m.aggregate_version, m.id) > (x.v, x.id) \
                                   AND m.aggregate_version <= x.sent_upto \
                                   AND (x.fol IS NULL \
                                        OR (m.aggregate_version, m.id) < (x.fol[1], x.fol[2])) \
                                   AND m.aggregate_type = x.aggregate_type \
                                   AND m.aggregate_id = x.aggregate_id OFFSET 0) r \
                               WHERE x.v IS NOT NULL \
                               UNION ALL \
                               SELECT p.id, false, true \
                               FROM ag x CROSS JOIN LATERAL ( \
                                 SELECT b.id, b.aggregate_version AS v FROM {t} b \
                                 WHERE {kb} = x.k AND b.status IN ('pending', 'parked') \
                                   AND b.blocked AND b.aggregate_type = x.aggregate_type \
                                   AND b.aggregate_id = x.aggregate_id \
                                 ORDER BY b.aggregate_version, b.id LIMIT 1) p \
                               WHERE x.promote \
                                 AND (x.fol IS NULL OR (p.v, p.id) < (x.fol[1], x.fol[2]))) w \
                         GROUP BY w.id) u \
                   WHERE m.id = u.id AND (u.mark OR m.blocked) RETURNING 1), \
                 {runs}\
                 prk AS ( \
                   UPDATE {t} p SET status = 'parked', parked_at = clock_timestamp(), \
                          park_kind = x.kind, last_error_class = 'permanent', \
                          last_error_kind = CASE x.kind WHEN 'permanent_error' \
                                                THEN 'invalid_record' ELSE x.kind END, \
                          last_error_message = x.msg \
                   FROM (SELECT h.id, \
                                CASE h.action WHEN 'stale' THEN 'out_of_order' \
                                              WHEN 'bad_key' THEN 'permanent_error' \
                                              ELSE 'version_gap' END AS kind, \
                                CASE h.action \
                                  WHEN 'stale' THEN CASE WHEN h.known THEN format('version %s \
is at or below %s, the last version published or discarded for its aggregate', \
                                    h.aggregate_version, h.last) ELSE format('version %s is below \
%s, the first version of its aggregate (nothing of it published or discarded yet), which may \
have reached the broker already', h.aggregate_version, h.last + 1) END \
                                  WHEN 'bad_key' THEN format('aggregate_type (%s bytes) or \
aggregate_id (%s bytes) is longer than {max_name} bytes, the most a store can key an aggregate \
by: discard it and append the event again under shorter names', \
                                    octet_length(h.aggregate_type), octet_length(h.aggregate_id)) \
                                  ELSE format('version %s follows %s: the versions between did \
not arrive within %s', h.aggregate_version, h.last, {gap_i}) END AS msg \
                         FROM h WHERE h.action IN ('stale', 'gap_park', 'bad_key')) x \
                   WHERE p.id = x.id RETURNING 1), \
                 hold AS ( \
                   UPDATE {t} g SET \
                          held_since = COALESCE(h.held_since, clock_timestamp()), \
                          next_attempt_at = LEAST( \
                            COALESCE(h.held_since, clock_timestamp()) + {gap_i}, \
                            clock_timestamp() + {recheck_i}), \
                          last_error_class = 'transient', last_error_kind = 'version_gap', \
                          last_error_message = format('waiting for version %s of the aggregate \
(the last published or discarded is %s)', h.last + 1, h.last) \
                   FROM h WHERE g.id = h.id AND h.action = 'gap_hold' RETURNING 1)",
                cols = prefixed("r", ENVELOPE_COLS),
                kr = agg("r"),
                ku = agg("u"),
                kb = agg("b"),
                km = agg("m"),
                c_source = c_source,
                c_last = c_last,
                gap_i = micros(gap),
                recheck_i = micros(recheck),
                max_name = outbox_core::MAX_AGGREGATE_NAME_BYTES,
            )
        };
        let outcome_cols = format!(
            "h.id, h.action, {}, h.attempts, h.k, h.last, h.resend, h.id AS head, 0::int8 AS pos",
            prefixed("h", ENVELOPE_COLS)
        );
        // A run's rows (`run`, after their claimed head): the same columns.
        let run_cols = format!(
            "r.id, 'run'::text, {}, r.attempts, r.k, r.last, \
             r.maybe_delivered OR COALESCE(r.aggregate_version <= r.sent_upto, false), \
             r.head, r.pos",
            prefixed("r", ENVELOPE_COLS)
        );
        // Lease mode: the claimed heads get their leases in the aggregate-state row (created
        // at the aggregate's first claim, with `last_version` left NULL: a claim publishes
        // nothing, so the aggregate still has no last version until its completion or an
        // operator sets one). A released or expired lease is taken over in place.
        // A lease that still names the row (`resend`: its claim ended without outcome or
        // release) may have sent it: the row keeps that as `maybe_delivered`, so a later claim
        // still counts its publication as a re-send.
        // With runs, a lease covers its head's run: `lease_upto` is the run's last version
        // (a grouped union: a join per head of the heads and the run rows was a nested loop
        // over two CTE scans), and the run rows go out unjoined: the store keeps those whose
        // head's lease was written (`claimed` NULL: as their head).
        let lease_decision = |runs: bool| {
            let (with_runs, lease_src, run_rows) = if runs {
                (
                    Some(runs_ctes(7, 8)),
                    format!(
                        "SELECT x.k, x.aggregate_type, x.aggregate_id, $2, $3, \
                            clock_timestamp() + {lease_i}, x.head, \
                            max(x.v) \
                     FROM (SELECT h.id AS head, h.k, h.aggregate_type, h.aggregate_id, \
                                  h.aggregate_version AS v \
                           FROM h WHERE h.action = 'claim' \
                           UNION ALL \
                           SELECT r.head, r.k, r.aggregate_type, r.aggregate_id, \
                                  r.aggregate_version \
                           FROM run r) x \
                     GROUP BY x.head, x.k, x.aggregate_type, x.aggregate_id",
                        lease_i = micros(4),
                    ),
                    format!("UNION ALL SELECT {run_cols}, NULL::int8, NULL::bool FROM run r"),
                )
            } else {
                (
                    None,
                    format!(
                        "SELECT h.k, h.aggregate_type, h.aggregate_id, $2, $3, \
                            clock_timestamp() + {lease_i}, h.id, \
                            h.aggregate_version \
                     FROM h WHERE h.action = 'claim'",
                        lease_i = micros(4),
                    ),
                    String::new(),
                )
            };
            format!(
                "WITH {}, \
                 ins AS ( \
                   INSERT INTO {state} AS a (aggregate_key, aggregate_type, aggregate_id, \
                                             lease_owner, lease_token, lease_until, lease_row, \
                                             lease_upto) \
                   {lease_src} \
                   ON CONFLICT (aggregate_key, aggregate_type, aggregate_id) DO UPDATE \
                     SET lease_owner = EXCLUDED.lease_owner, \
                         lease_token = EXCLUDED.lease_token, \
                         lease_until = EXCLUDED.lease_until, lease_row = EXCLUDED.lease_row, \
                         lease_upto = EXCLUDED.lease_upto, updated_at = clock_timestamp() \
                     WHERE a.lease_until IS NULL OR a.lease_until <= clock_timestamp() \
                   RETURNING a.lease_row AS id, \
                     (extract(epoch FROM a.lease_until - clock_timestamp()) * 1000000)::int8 \
                       AS remaining_us), \
                 mark AS ( \
                   UPDATE {t} m SET maybe_delivered = true FROM h \
                   WHERE m.id = h.id AND h.action = 'claim' AND h.resend \
                     AND NOT m.maybe_delivered \
                   RETURNING 1) \
                 SELECT {outcome_cols}, i.remaining_us, (i.id IS NOT NULL) AS claimed \
                 FROM h LEFT JOIN ins i ON i.id = h.id \
                 WHERE h.action IN ('claim', 'stale', 'gap_park', 'gap_hold', 'bad_key') \
                 {run_rows}",
                decide(5, 6, with_runs),
            )
        };
        let claim_decide_lease = lease_decision(false);
        let claim_decide_lease_runs = lease_decision(true);
        // Locked mode: the aggregate locks, held until the completion commits, are the claim.
        // A claimed head whose aggregate carries an expired lease (a lease-mode relay on the
        // same table whose claim ended without outcome or release: a live lease makes the
        // head wait) takes the aggregate over as a lease claim does: the lease is cleared, so
        // that relay's late completion no longer passes its token fence (it was applied after
        // this claim had published the version: the version recorded twice, and with a lower
        // copy the first copy and the later one both marked published; adversary_claim45),
        // and the head keeps what the lease said about it as `maybe_delivered` (`unlease_mark`;
        // the run and follower rows up to the lease's end are marked by `mark_run` and `blk`).
        // The lease is cleared by `unlease_locked`, not here: the claim runs it in the
        // transaction it keeps (`lease_left` names the heads), so that a claim ending without
        // completion rolls it back and the lease is as it was. A decision that parked rows
        // commits before the claim decides again (`claim_inner`): a cleared lease committed
        // with it stayed cleared after a release, and its holder's late completion was refused
        // though no takeover stood (adversary_takeover45). The marks may commit early: a row
        // marked possibly sent that its lease holder then publishes loses nothing.
        let locked_decision = |runs: bool| {
            format!(
                "WITH {}, \
                 unlease_mark AS ( \
                   UPDATE {t} m SET maybe_delivered = true FROM h \
                   WHERE m.id = h.id AND h.action = 'claim' AND h.resend \
                     AND NOT m.maybe_delivered \
                   RETURNING 1) \
                 SELECT {outcome_cols}, NULL::int8 AS remaining_us, \
                        (h.action = 'claim') AS claimed, h.lease_left \
                 FROM h WHERE h.action IN ('claim', 'stale', 'gap_park', 'gap_hold', 'bad_key') \
                 {}",
                decide(2, 3, runs.then(|| runs_ctes(4, 5))),
                if runs {
                    format!("UNION ALL SELECT {run_cols}, NULL::int8, true, false FROM run r")
                } else {
                    String::new()
                },
            )
        };
        let claim_decide_locked = locked_decision(false);
        let claim_decide_locked_runs = locked_decision(true);
        // A locked claim's takeover of expired leases (`lease_left` heads), in the claim's
        // transaction, under its aggregate locks. `$1` keys, `$2` types, `$3` ids.
        let unlease_locked = format!(
            "UPDATE {state} a SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
                    lease_row = NULL, lease_upto = NULL, updated_at = clock_timestamp() \
             FROM UNNEST($1::int8[], $2::text[], $3::text[]) AS u(k, at, ai) \
             WHERE a.aggregate_key = u.k AND a.aggregate_type = u.at \
               AND a.aggregate_id = u.ai AND a.lease_token IS NOT NULL"
        );

        // Claimed rows that no longer decode are parked, alone: a parked head's lease is
        // released; a run cut at a parked row keeps its lease up to the version before it
        // (`lease_upto`: what stats count in flight and what a claim after the lease's expiry
        // counts as possibly sent; the rows after the cut were never handed out).
        // A locked claim writes no lease: the lease it acts on is the expired one of the
        // lease-mode claim it took over (`lease_until` past: a live lease makes the head wait,
        // and the claim holds the aggregate's lock). The park commits, and with it that
        // lease's release or cut: kept as it was, the holder's late completion published the
        // versions after the parked one (its run's prefix skips rows it cannot write;
        // adversary_takeover46).
        let park_undecodable = format!(
            "WITH p AS ( \
               UPDATE {t} t SET status = 'parked', park_kind = 'permanent_error', \
                      parked_at = clock_timestamp(), last_error_class = 'permanent', \
                      last_error_kind = 'invalid_record', \
                      last_error_message = 'stored event does not decode: ' || x.why \
               FROM UNNEST($1::int8[], $2::text[]) AS x(id, why) \
               WHERE t.id = x.id AND t.status = 'pending' \
               RETURNING t.id, t.aggregate_type AS at, t.aggregate_id AS ai, \
                         t.aggregate_version AS v), \
             cut AS ( \
               UPDATE {state} a SET lease_upto = m.v - 1, updated_at = clock_timestamp() \
               FROM (SELECT p.at, p.ai, min(p.v) AS v FROM p GROUP BY p.at, p.ai) m \
               WHERE a.aggregate_key = ANY($4::int8[]) \
                 AND (a.lease_token = $3 OR a.lease_until <= clock_timestamp()) \
                 AND a.aggregate_type = m.at AND a.aggregate_id = m.ai \
                 AND a.lease_row NOT IN (SELECT id FROM p) AND a.lease_upto >= m.v \
               RETURNING 1) \
             UPDATE {state} SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
                    lease_row = NULL, lease_upto = NULL, updated_at = clock_timestamp() \
             WHERE aggregate_key = ANY($4::int8[]) \
               AND (lease_token = $3 OR lease_until <= clock_timestamp()) \
               AND lease_row IN (SELECT id FROM p)"
        );
        let lock_keys = "SELECT pg_advisory_xact_lock(s.k) FROM ( \
               SELECT DISTINCT k FROM UNNEST($1::int8[]) AS k ORDER BY 1) s"
            .to_owned();

        // The aggregate's first blocked row becomes a candidate again (the claim re-checks it).
        let promote_after = |src: &str| {
            format!(
                "promote AS ( \
                   UPDATE {t} s SET blocked = false \
                   FROM (SELECT (SELECT b.id FROM {t} b \
                                 WHERE {kb} = p.k AND b.status IN ('pending', 'parked') \
                                   AND b.blocked AND b.aggregate_type = p.at \
                                   AND b.aggregate_id = p.ai AND b.id <> p.id \
                                 ORDER BY b.aggregate_version, b.id LIMIT 1) AS id \
                         FROM {src} p) nx \
                   WHERE s.id = nx.id AND s.blocked RETURNING 1)",
                kb = agg("b"),
            )
        };

        // The completion: one row per claimed event, in `OutcomeArrays` order ($1..$18);
        // `release` marks a claimed row without outcome (its claim just ends).
        // `ts`: the one time of an outcome (a published row's `published_at` and `finished_at`
        // are equal, so the publication-time queries use `finished_idx`; migration 5). A
        // retry's delay is counted from the row's own `clock_timestamp()` instead: evaluated
        // again after a wait on a concurrent update of the row (EvalPlanQual), it does not
        // count that wait as part of the delay, as `ts` (read before any wait) would.
        // `extra`: more columns of `o` (the lease mode's token, below).
        let outcomes = |extra: &str| {
            format!(
                "o AS MATERIALIZED (SELECT *, clock_timestamp() AS ts{extra} FROM UNNEST( \
                   $1::int8[], $2::int8[], $3::text[], $4::text[], $5::int8[], $6::text[], \
                   $7::text[], $8::int4[], $9::int8[], $10::int8[], $11::text[], $12::text[], \
                   $13::text[], $14::text[], $15::bool[], $16::text[], $17::text[], $18::bool[]) \
                 AS o(id, k, at, ai, v, kind, dest, part, pos, delay_us, eclass, ekind, emsg, \
                      pkind, uncertain, transport, route, dup))"
            )
        };
        let set = "status = CASE o.kind WHEN 'published' THEN 'published' \
                                WHEN 'park' THEN 'parked' ELSE 'pending' END, \
             attempts = CASE WHEN o.kind IN ('retry', 'park') THEN t.attempts + 1 \
                             ELSE t.attempts END, \
             next_attempt_at = CASE WHEN o.kind IN ('retry', 'defer') \
                 THEN clock_timestamp() + o.delay_us * interval '1 microsecond' \
                 ELSE t.next_attempt_at END, \
             published_at = CASE WHEN o.kind = 'published' THEN o.ts END, \
             finished_at = CASE WHEN o.kind = 'published' THEN o.ts END, \
             ack_transport = o.transport, ack_destination = o.dest, ack_partition = o.part, \
             ack_position = o.pos, ack_route = o.route, ack_duplicate = o.dup, \
             last_error_class = CASE WHEN o.kind = 'published' THEN t.last_error_class \
                                     ELSE o.eclass END, \
             last_error_kind = CASE WHEN o.kind = 'published' THEN t.last_error_kind \
                                    ELSE o.ekind END, \
             last_error_message = CASE WHEN o.kind = 'published' THEN t.last_error_message \
                                       ELSE o.emsg END, \
             park_kind = CASE WHEN o.kind = 'park' THEN o.pkind END, \
             parked_at = CASE WHEN o.kind = 'park' THEN o.ts END, \
             maybe_delivered = t.maybe_delivered OR COALESCE(o.uncertain, false), \
             blocked = false";
        // Lease mode: only rows whose aggregate's lease still carries this claim's token
        // (`$19`) get their outcome (fencing); every such lease is released, and a publication
        // advances the aggregate's last version in the same write.
        // The token is compared as a column of `o` (`tok`, always `$19`), not as the constant:
        // a constant is a filter of the state table that the planner estimates from the
        // column's statistics (tokens are nearly all NULL: about one row), so with few
        // aggregates it scanned the whole state table first and read `f` again for every row
        // it found (batch x batch). As a join condition it leaves the state table at its full
        // size, and `f` drives keyed lookups through the primary key at every table size.
        // The prefix rule of a completion (`outbox_core::store`, *Runs*), over the outcomes of
        // `src` (one row per claimed row): per aggregate, a publication is applied only when
        // every version from the claim's lowest (its head, the aggregate's `last + 1`) up to it
        // is published in this completion; another outcome only for the version right after
        // that prefix; rows without outcome (`release`) are left as they are. `gap` is the
        // row's version minus the head's minus the publications up to it (inclusive): -1 for a
        // publication inside the prefix, 0 for the one row after it. A claim without runs has
        // one row per aggregate, its head: always accepted, as before runs.
        let prefix = |src: &str| {
            format!(
                "g AS MATERIALIZED ( \
                   SELECT * FROM ( \
                     SELECT p.*, p.v - min(p.v) OVER w \
                                 - count(*) FILTER (WHERE p.kind = 'published') \
                                     OVER (w ORDER BY p.v, p.id) AS gap \
                     FROM {src} p WINDOW w AS (PARTITION BY p.k, p.at, p.ai)) p \
                   WHERE p.kind = 'published' AND p.gap = -1 \
                      OR p.kind NOT IN ('published', 'release') AND p.gap = 0)"
            )
        };
        // After a publication the aggregate's first blocked row becomes a candidate again (the
        // claim re-checks it), unless the completion gave the row after its prefix an outcome
        // (that row, unblocked by `upd`, is the head). Rows this completion wrote are skipped:
        // a run's published rows were blocked followers in this statement's snapshot.
        // The tests against `upd` are uncorrelated `NOT IN`s (hashed once per statement; ids,
        // keys and names are never NULL), not correlated `NOT EXISTS`: the planner estimates a
        // CTE at about one row, and a correlated probe of `upd` became a rescan of it per row
        // (batch x batch: 1,000 x 1,000 comparisons per completion of 1,000).
        let promote_run = format!(
            "pv AS MATERIALIZED ( \
               SELECT u.k, u.at, u.ai, max(u.v) AS v FROM upd u \
               WHERE u.kind = 'published' GROUP BY u.k, u.at, u.ai), \
             promote AS ( \
               UPDATE {t} s SET blocked = false \
               FROM (SELECT (SELECT b.id FROM {t} b \
                             WHERE {kb} = p.k AND b.status IN ('pending', 'parked') \
                               AND b.blocked AND b.aggregate_type = p.at \
                               AND b.aggregate_id = p.ai \
                               AND b.id NOT IN (SELECT u.id FROM upd u) \
                             ORDER BY b.aggregate_version, b.id LIMIT 1) AS id \
                     FROM pv p \
                     WHERE (p.k, p.at, p.ai) NOT IN (SELECT u.k, u.at, u.ai FROM upd u \
                                                     WHERE u.kind <> 'published')) nx \
               WHERE s.id = nx.id AND s.blocked RETURNING 1)",
            kb = agg("b"),
        );
        // Lease mode: only rows whose aggregate's lease still carries this claim's token
        // (`$19`) and that are rows of its run get their outcome (fencing), under the prefix
        // rule; every such lease is released, and a publication advances the aggregate's last
        // version to the prefix's end in the same write.
        // The token is compared as a column of `o` (`tok`, always `$19`), not as the constant:
        // a constant is a filter of the state table that the planner estimates from the
        // column's statistics (tokens are nearly all NULL: about one row), so with few
        // aggregates it scanned the whole state table first and read `f` again for every row
        // it found (batch x batch). As a join condition it leaves the state table at its full
        // size, and `f` drives keyed lookups through the primary key at every table size.
        // For the same reason `rel` reads each aggregate's published prefix end from `pv`
        // through one map built once (a JSON object keyed by the aggregate), not by a join of
        // `f` and `pv`: both CTEs are estimated at one row, and the join ran as a nested loop
        // (1,000 x 1,000 rows compared, ~0.4-0.9 s per completion of 1,000 under load).
        let complete_lease = format!(
            "WITH {}, \
             f AS MATERIALIZED ( \
               SELECT o.* FROM o \
               WHERE EXISTS (SELECT 1 FROM {state} a \
                             WHERE a.aggregate_key = o.k AND a.aggregate_type = o.at \
                               AND a.aggregate_id = o.ai AND a.lease_token = o.tok \
                               AND (a.lease_row = o.id OR o.v <= a.lease_upto))), \
             {}, \
             upd AS ( \
               UPDATE {t} t SET {set} FROM g o \
               WHERE t.id = o.id AND t.status = 'pending' AND o.kind <> 'release' \
               RETURNING t.id, o.kind, o.k, o.at, o.ai, o.v), \
             {promote_run}, \
             rel AS ( \
               UPDATE {state} a SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
                      lease_row = NULL, lease_upto = NULL, \
                      last_version = GREATEST(a.last_version, \
                        ((SELECT jsonb_object_agg(jsonb_build_array(pv.k, pv.at, pv.ai)::text, \
                                                  pv.v) FROM pv) \
                          ->> jsonb_build_array(f.k, f.at, f.ai)::text)::int8), \
                      updated_at = clock_timestamp() \
               FROM f \
               WHERE a.aggregate_key = f.k AND a.aggregate_type = f.at \
                 AND a.aggregate_id = f.ai AND a.lease_token = f.tok AND a.lease_row = f.id \
               RETURNING 1) \
             SELECT ARRAY(SELECT id FROM upd) AS applied",
            outcomes(", $19::uuid AS tok"),
            prefix("f"),
        );
        // Locked mode: the claim's transaction still holds the aggregate locks; a publication
        // advances (or creates) the aggregate's state, to the prefix's end.
        let complete_locked = format!(
            "WITH {}, \
             {}, \
             upd AS ( \
               UPDATE {t} t SET {set} FROM g o \
               WHERE t.id = o.id AND t.status = 'pending' AND o.kind <> 'release' \
               RETURNING t.id, o.kind, o.k, o.at, o.ai, o.v), \
             {promote_run}, \
             st AS ( \
               INSERT INTO {state} AS a (aggregate_key, aggregate_type, aggregate_id, \
                                         last_version) \
               SELECT p.k, p.at, p.ai, p.v FROM pv p \
               ON CONFLICT (aggregate_key, aggregate_type, aggregate_id) DO UPDATE \
                 SET last_version = GREATEST(a.last_version, EXCLUDED.last_version), \
                     updated_at = clock_timestamp() \
               RETURNING 1) \
             SELECT ARRAY(SELECT id FROM upd) AS applied",
            outcomes(""),
            prefix("o"),
        );
        let release_lease = format!(
            "UPDATE {state} SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
                    lease_row = NULL, lease_upto = NULL, updated_at = clock_timestamp() \
             WHERE aggregate_key = ANY($2::int8[]) AND lease_token = $1"
        );
        // Pending rows, through the two partial indexes (candidates and blocked rows), so the
        // walk covers what is in flight or queued, never the published history.
        let pending = format!(
            "(SELECT id, event_id, aggregate_type, aggregate_id, aggregate_version FROM {t} \
               WHERE status = 'pending' AND NOT blocked \
             UNION ALL \
             SELECT id, event_id, aggregate_type, aggregate_id, aggregate_version FROM {t} \
               WHERE status IN ('pending', 'parked') AND blocked AND status = 'pending')"
        );
        // The rows of a lease's run after its head (`hd`: id, k, aggregate_type, aggregate_id,
        // aggregate_version, lease_upto): the pending rows of the aggregate above the head's
        // version up to `lease_upto` (the last version of its run), through the unfinished
        // index. A claim without runs has `lease_upto` equal to its head's version (or NULL, a
        // lease of a version before runs): nothing.
        let run_rows = |cols: &str| {
            format!(
                "SELECT {cols} FROM hd CROSS JOIN LATERAL ( \
                   SELECT r.id, r.event_id, r.aggregate_type, r.aggregate_id, r.aggregate_version \
                   FROM {t} r \
                   WHERE {kr} = hd.k AND r.status IN ('pending', 'parked') \
                     AND r.status = 'pending' AND r.aggregate_version > hd.aggregate_version \
                     AND r.aggregate_version <= hd.lease_upto \
                     AND r.aggregate_type = hd.aggregate_type \
                     AND r.aggregate_id = hd.aggregate_id OFFSET 0) r \
                 WHERE hd.lease_upto > hd.aggregate_version",
                kr = agg("r"),
            )
        };
        // Rows of a lease claim made by another store instance (no rows in memory): the heads,
        // then their runs.
        let lease_rows = format!(
            "WITH hd AS MATERIALIZED ( \
               SELECT e.id, e.event_id, {ke} AS k, e.aggregate_type, e.aggregate_id, \
                      e.aggregate_version, a.lease_upto \
               FROM {pending} e JOIN LATERAL (SELECT a.lease_token, a.lease_upto FROM {state} a \
                                        WHERE {se} AND a.lease_row = e.id LIMIT 1) a ON true \
               WHERE a.lease_token = $1) \
             SELECT id, event_id, k, aggregate_type, aggregate_id, aggregate_version FROM hd \
             UNION ALL {}",
            run_rows(
                "r.id, r.event_id, hd.k, r.aggregate_type, r.aggregate_id, r.aggregate_version"
            ),
            ke = agg("e"),
            se = state_of("a", "e"),
        );
        // The live leases of one owner (operator action on a relay that is gone): one row per
        // claimed row, heads and their runs.
        let owner_leases = format!(
            "WITH hd AS MATERIALIZED ( \
               SELECT e.id, e.event_id, {ke} AS k, e.aggregate_type, e.aggregate_id, \
                      e.aggregate_version, a.lease_upto \
               FROM {pending} e JOIN LATERAL (SELECT a.lease_owner, a.lease_until, a.lease_upto \
                                        FROM {state} a \
                                        WHERE {se} AND a.lease_row = e.id LIMIT 1) a ON true \
               WHERE a.lease_owner = $1 AND a.lease_until > clock_timestamp()) \
             SELECT id, event_id, k, aggregate_type, aggregate_id FROM hd \
             UNION ALL {}",
            run_rows("r.id, r.event_id, hd.k, r.aggregate_type, r.aggregate_id"),
            ke = agg("e"),
            se = state_of("a", "e"),
        );
        // Ends one live lease of an owner (`$1..$3` aggregate key, type, id; `$4` owner) and
        // marks every row of its run as possibly delivered (the gone relay may have sent any
        // of them: their next publication counts as a re-publication). Returns the event ids
        // of those rows (none: there was no such lease).
        let release_owner_lease = format!(
            "WITH l AS MATERIALIZED ( \
               SELECT a.lease_row, a.lease_upto FROM {state} a \
               WHERE aggregate_key = $1 AND aggregate_type = $2 AND aggregate_id = $3 \
                 AND lease_owner = $4 AND lease_until > clock_timestamp()), \
             rel AS ( \
               UPDATE {state} a SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
                      lease_row = NULL, lease_upto = NULL, updated_at = clock_timestamp() \
               WHERE aggregate_key = $1 AND aggregate_type = $2 AND aggregate_id = $3 \
                 AND lease_owner = $4 AND lease_until > clock_timestamp() RETURNING 1), \
             hd AS MATERIALIZED ( \
               SELECT e.id, e.aggregate_version AS v, \
                      GREATEST(e.aggregate_version, l.lease_upto) AS upto \
               FROM l JOIN {t} e ON e.id = l.lease_row), \
             mk AS ( \
               UPDATE {t} m SET maybe_delivered = true FROM hd \
               WHERE {km} = $1 AND m.status IN ('pending', 'parked') AND m.status = 'pending' \
                 AND m.aggregate_version >= hd.v AND m.aggregate_version <= hd.upto \
                 AND m.aggregate_type = $2 AND m.aggregate_id = $3 \
               RETURNING m.event_id, m.aggregate_version, m.id = hd.id AS head) \
             SELECT (SELECT count(*) FROM rel) AS released, \
                    ARRAY(SELECT event_id FROM mk ORDER BY NOT head, aggregate_version) AS events",
            km = agg("m"),
        );

        // Operator actions: the event's aggregate and state, read again after its lock. `last`
        // is the one the claims count from (for an aggregate without state, what
        // `unknown_last` says), so an operator accepts or refuses what a claim would.
        let event_state = format!(
            "SELECT e.status, e.aggregate_type, e.aggregate_id, e.aggregate_version, \
                    {ke} AS k, l.last, \
                    (SELECT count(*) FROM {t} u \
                      WHERE {ku} = {ke} AND u.status IN ('pending', 'parked') \
                        AND u.aggregate_type = e.aggregate_type \
                        AND u.aggregate_id = e.aggregate_id AND u.id <> e.id \
                        AND u.aggregate_version > l.last \
                        AND u.aggregate_version < e.aggregate_version) AS waiting_below \
             FROM {t} e LEFT JOIN LATERAL (SELECT a.last_version FROM {state} a \
                                           WHERE {se} LIMIT 1) a ON true \
             CROSS JOIN LATERAL (SELECT COALESCE(a.last_version, {unknown_e}) AS last) l \
             WHERE e.event_id = $1",
            ke = agg("e"),
            ku = agg("u"),
            se = state_of("a", "e"),
            unknown_e = unknown_last(&t, &state, "e", accept_first_version),
        );
        let max_name = outbox_core::MAX_AGGREGATE_NAME_BYTES;
        // Raises the aggregate's last version to at least `$5` ($2..$4 key, type, id). An
        // aggregate whose names are too long to key has no state (its events are parked as
        // they are met; a discard must still work).
        let raise_last = format!(
            "st AS ( \
               INSERT INTO {state} AS a (aggregate_key, aggregate_type, aggregate_id, \
                                         last_version) \
               SELECT $2, $3, $4, $5 \
               WHERE octet_length($3::text) <= {max_name} AND octet_length($4::text) <= {max_name} \
               ON CONFLICT (aggregate_key, aggregate_type, aggregate_id) DO UPDATE \
                 SET last_version = GREATEST(a.last_version, EXCLUDED.last_version), \
                     updated_at = clock_timestamp() \
               RETURNING 1)"
        );
        let retry_parked = format!(
            "WITH {raise_last}, \
             u AS ( \
               UPDATE {t} SET status = 'pending', attempts = 0, next_attempt_at = '-infinity', \
                      park_kind = NULL, parked_at = NULL, blocked = false \
               WHERE event_id = $1 AND status = 'parked' RETURNING event_id) \
             SELECT count(*) FROM u"
        );
        let discard_parked = format!(
            "WITH {raise_last}, \
             u AS ( \
               UPDATE {t} SET status = 'discarded', finished_at = clock_timestamp(), \
                      discard_reason = $6, blocked = false \
               WHERE event_id = $1 AND status = 'parked' \
               RETURNING id, event_id, $2::int8 AS k, $3::text AS at, $4::text AS ai), \
             {} \
             SELECT count(*) FROM u",
            promote_after("u"),
        );
        // The copy keeps the original's id in a header (the first original's, when the parked
        // event is itself a copy), so inboxes deduplicate the two as one event.
        let reissue_parked = format!(
            "WITH {raise_last}, \
             o AS ( \
               UPDATE {t} SET status = 'discarded', finished_at = clock_timestamp(), \
                      discard_reason = $6, blocked = false \
               WHERE event_id = $1 AND status = 'parked' \
               RETURNING {ENVELOPE_COLS}), \
             ins AS ( \
               INSERT INTO {t} ({ENVELOPE_COLS}) \
               SELECT $7, aggregate_type, aggregate_id, aggregate_version, event_type, \
                      schema_version, content_type, payload, \
                      headers || jsonb_build_object($8::text, \
                                   COALESCE(headers ->> $8::text, event_id::text)), \
                      created_at FROM o \
               RETURNING event_id), \
             {} \
             SELECT count(*) FROM ins",
            // The aggregate's first blocked row becomes a candidate again, as after a discard:
            // a row of the same version appended while the original was parked (a duplicate)
            // precedes the copy and is now the head; the claim re-checks whatever it unblocks.
            promote_after(
                "(SELECT 0::int8 AS id, $2::int8 AS k, $3::text AS at, $4::text AS ai FROM o)"
            ),
        );
        let audit_insert = format!(
            "INSERT INTO {audit} (event_id, action, actor, reason, new_event_id) \
             VALUES ($1, $2, $3, $4, $5)"
        );
        let list_parked = format!(
            "SELECT id, {ENVELOPE_COLS}, {PARKED_COLS} \
             FROM {t} WHERE status = 'parked' ORDER BY parked_at, id LIMIT $1"
        );
        let parked_event = format!(
            "SELECT id, {ENVELOPE_COLS}, {PARKED_COLS} \
             FROM {t} WHERE event_id = $1 AND status = 'parked'"
        );
        let audit_trail = format!(
            "SELECT event_id, action, actor, reason, new_event_id, at FROM {audit} \
             WHERE $1::uuid IS NULL OR event_id = $1 ORDER BY id"
        );
        let cleanup = format!(
            "WITH d AS ( \
               DELETE FROM {t} WHERE id IN ( \
                 SELECT id FROM {t} \
                 WHERE status IN ('published', 'discarded') \
                   AND finished_at < \
                     (SELECT clock_timestamp() - $1::int8 * interval '1 microsecond') \
                 ORDER BY finished_at LIMIT $2 FOR UPDATE SKIP LOCKED) \
               RETURNING *), \
             ar AS (INSERT INTO {archive} SELECT * FROM d WHERE $3::bool RETURNING 1) \
             SELECT (SELECT count(*) FROM d) AS removed, (SELECT count(*) FROM ar) AS archived"
        );
        let stats = stats_sql(&t, &state, seed, accept_first_version);
        let table_stats = "SELECT pg_total_relation_size(c.oid)::float8 AS total_bytes, \
                    pg_relation_size(c.oid)::float8 AS table_bytes, \
                    pg_indexes_size(c.oid)::float8 AS index_bytes, \
                    s.n_live_tup::float8 AS live_tuples, s.n_dead_tup::float8 AS dead_tuples, \
                    extract(epoch FROM now() - s.last_autovacuum)::float8 AS autovacuum_age, \
                    extract(epoch FROM now() - s.last_autoanalyze)::float8 AS autoanalyze_age, \
                    extract(epoch FROM now() - GREATEST(s.last_vacuum, s.last_autovacuum))::float8 \
                      AS vacuum_age \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid \
             WHERE n.nspname = $1 AND c.relname = $2"
            .to_owned();

        Self {
            table: t,
            append,
            append_one,
            claim_candidates,
            claim_decide_lease,
            claim_decide_lease_runs,
            claim_decide_locked,
            claim_decide_locked_runs,
            unlease_locked,
            park_undecodable,
            lock_keys,
            complete_lease,
            complete_locked,
            release_lease,
            lease_rows,
            owner_leases,
            release_owner_lease,
            event_state,
            retry_parked,
            discard_parked,
            reissue_parked,
            list_parked,
            parked_event,
            audit_trail,
            audit: audit_insert,
            cleanup,
            stats,
            table_stats,
        }
    }
}

/// Published rows the stats count exactly; above this many, an estimate (see [`stats_sql`]).
pub(crate) const PUBLISHED_EXACT_UP_TO: u64 = 10_000;

/// Claimable events, in `id` order, the stats take the oldest age over (see [`stats_sql`]).
pub(crate) const OLDEST_CLAIMABLE_SCAN: u64 = 1_000;

/// The monitoring snapshot (`OutboxStats`): counts, and where each pending event stands.
///
/// Blocked: a parked event of its aggregate above the last version comes before it (`lp`, the
/// first such parked event per aggregate, few by nature; the events after it, one range of the
/// unfinished index each). Gap-held: its aggregate's head is held as a version gap (`gh`: a
/// pending event a claim held, `held_since`, still above `last + 1`, with no unfinished event
/// above the last version before it) and it is that head or after it, before the aggregate's
/// first parked event (after it, blocked). The oldest claimable age is taken over the other
/// pending events. Ages count from `inserted_at` (the append statement's clock), never from the
/// producer's `created_at`. The ranges are read through the unfinished index per aggregate
/// (`OFFSET 0` keeps the planner from hashing every pending row instead), so the cost beyond
/// the counts grows with the parked and held aggregates, not with the backlog.
///
/// Nothing in it reads the published history, so its cost does not grow with the retained
/// rows (issue 25: 1.2 s at 100k rows before, a scan of the whole table for the published
/// count and of every pending row for the leases, the held heads and the oldest age):
/// * the backlog is counted exactly, through the claim index (candidates) and the blocked
///   index (`queued`): the cost grows with the backlog only;
/// * leases from the aggregate-state rows whose lease is live, each joined to its event row
///   (one row per aggregate: no index on the lease time, so that a claim's lease update
///   stays HOT), and a lease's run (migration 11: `lease_upto` above its head's version) by
///   one range of the unfinished index: every row of a run is in flight;
/// * held heads through `held_idx` (migration 10: pending rows with `held_since`, normally
///   none);
/// * locked aggregates from the granted advisory locks, each probing the unfinished index;
/// * the published rows exactly while the finished (published and discarded) rows are no
///   more than [`PUBLISHED_EXACT_UP_TO`] (`published_upto`): the finished index is counted
///   alone up to one more than that (an index-only scan: the status test of the published
///   rows read a heap row per entry, 31 ms of the statement's 123 ms at 10M rows, issue 25
///   third pass), and only a finished index that small is read for the status; above that
///   (`published_upto` then one more than the bound) the caller estimates them from
///   `live_rows`: the rows per
///   page of the last vacuum or analyze times the table's pages now (the planner's own
///   estimate; the live-tuple counter when the table was never vacuumed or analyzed: it
///   double counts inserts whose statistics arrive after an `ANALYZE`);
/// * the oldest claimable age over the first [`OLDEST_CLAIMABLE_SCAN`] claimable events by
///   `id` of the claim index and of the blocked index. `id` and `inserted_at` are both taken
///   by the append statement, so id order is insertion order up to appends that run at the
///   same moment: an event further on is older only if its append statement started before
///   an earlier id's and took longer to get its id.
fn stats_sql(t: &str, state: &str, seed: i64, accept_first_version: bool) -> String {
    let last_of = |a: &str| {
        format!(
            "COALESCE((SELECT s.last_version FROM {state} s WHERE {}), {})",
            state_of("s", a),
            unknown_last(t, state, a, accept_first_version)
        )
    };
    let age = "extract(epoch FROM clock_timestamp() - min(inserted_at))::float8";
    format!(
        "WITH lp AS MATERIALIZED ( \
           SELECT DISTINCT ON ({kp}, p.aggregate_type, p.aggregate_id) \
                  {kp} AS k, p.aggregate_type, p.aggregate_id, p.aggregate_version AS v, p.id \
           FROM {t} p \
           WHERE p.status = 'parked' AND p.aggregate_version > {last_p} \
           ORDER BY {kp}, p.aggregate_type, p.aggregate_id, p.aggregate_version, p.id), \
         blk AS MATERIALIZED ( \
           SELECT r.id, r.inserted_at FROM lp CROSS JOIN LATERAL ( \
             SELECT r.id, r.inserted_at FROM {t} r \
             WHERE {kr} = lp.k AND r.status = 'pending' \
               AND (r.aggregate_version, r.id) > (lp.v, lp.id) \
               AND r.aggregate_type = lp.aggregate_type \
               AND r.aggregate_id = lp.aggregate_id OFFSET 0) r), \
         gh AS MATERIALIZED ( \
           SELECT g.id, g.k, g.aggregate_type, g.aggregate_id, g.aggregate_version AS v \
           FROM (SELECT g.id, {kg} AS k, g.aggregate_type, g.aggregate_id, \
                        g.aggregate_version, {last_g} AS l \
                 FROM {t} g WHERE g.status = 'pending' AND g.held_since IS NOT NULL \
                 OFFSET 0) g \
           WHERE g.aggregate_version > g.l + 1 \
             AND (SELECT count(*) FROM (SELECT FROM {t} u \
                    WHERE {ku} = g.k AND u.status IN ('pending', 'parked') \
                      AND u.aggregate_version > g.l \
                      AND (u.aggregate_version, u.id) < (g.aggregate_version, g.id) \
                      AND u.aggregate_type = g.aggregate_type \
                      AND u.aggregate_id = g.aggregate_id LIMIT 1) x) = 0), \
         gap AS MATERIALIZED ( \
           SELECT r.id FROM gh \
           LEFT JOIN lp ON lp.k = gh.k AND lp.aggregate_type = gh.aggregate_type \
                       AND lp.aggregate_id = gh.aggregate_id \
           CROSS JOIN LATERAL ( \
             SELECT r.id FROM {t} r \
             WHERE {kr} = gh.k AND r.status = 'pending' \
               AND (r.aggregate_version, r.id) >= (gh.v, gh.id) \
               AND (lp.v IS NULL OR (r.aggregate_version, r.id) < (lp.v, lp.id)) \
               AND r.aggregate_type = gh.aggregate_type \
               AND r.aggregate_id = gh.aggregate_id OFFSET 0) r) \
         SELECT \
           (SELECT count(*) FROM {t} WHERE status = 'pending' AND NOT blocked) AS candidates, \
           (SELECT (count(*) + COALESCE(sum(CASE WHEN a.lease_upto > e.aggregate_version THEN \
                     (SELECT count(*) FROM {t} q \
                       WHERE {kq} = a.aggregate_key AND q.status IN ('pending', 'parked') \
                         AND q.status = 'pending' AND q.aggregate_version > e.aggregate_version \
                         AND q.aggregate_version <= a.lease_upto \
                         AND q.aggregate_type = a.aggregate_type \
                         AND q.aggregate_id = a.aggregate_id) END), 0))::int8 \
              FROM {state} a JOIN {t} e ON e.id = a.lease_row \
              WHERE a.lease_until > clock_timestamp() AND {se} \
                AND e.status = 'pending' AND NOT e.blocked) AS leased, \
           (SELECT count(*) FROM {t} WHERE status = 'parked') AS parked, \
           (SELECT CASE WHEN f.n < {cap} \
                     THEN (SELECT count(*) FROM {t} \
                           WHERE status IN ('published', 'discarded') \
                             AND status = 'published') \
                     ELSE f.n END \
              FROM (SELECT count(*) AS n FROM (SELECT FROM {t} \
                      WHERE status IN ('published', 'discarded') \
                      ORDER BY finished_at LIMIT {cap}) x) f) AS published_upto, \
           (SELECT CASE WHEN c.relpages > 0 AND c.reltuples >= 0 \
                     THEN (c.reltuples::float8 / c.relpages \
                           * (pg_relation_size(c.oid) / current_setting('block_size')::int8)) \
                          ::int8 \
                     ELSE GREATEST(pg_stat_get_live_tuples(c.oid), 0) END \
              FROM pg_class c WHERE c.oid = '{t}'::regclass) AS live_rows, \
           (SELECT count(*) FROM {t} WHERE status = 'pending' AND blocked) AS queued, \
           (SELECT count(*) FROM blk) AS blocked, \
           (SELECT count(*) FROM gap) AS gap_held, \
           (SELECT count(*) FROM gh) AS gaps_held, \
           (SELECT count(DISTINCT l.k) \
              FROM (SELECT DISTINCT (l.classid::int8 << 32) | l.objid::int8 AS k \
                    FROM pg_locks l \
                    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
                      AND l.database = (SELECT oid FROM pg_database \
                                        WHERE datname = current_database())) l \
              JOIN {t} e ON {ke} = (l.k # ({seed})) \
              WHERE e.status = 'pending' AND NOT e.blocked \
                AND e.next_attempt_at <= now()) AS locked, \
           (SELECT {age} FROM ( \
              (SELECT e.inserted_at FROM {t} e WHERE e.status = 'pending' AND NOT e.blocked \
                 AND NOT EXISTS (SELECT 1 FROM blk b WHERE b.id = e.id) \
                 AND NOT EXISTS (SELECT 1 FROM gap x WHERE x.id = e.id) \
               ORDER BY e.id LIMIT {first}) \
              UNION ALL \
              (SELECT e.inserted_at FROM {t} e WHERE e.status = 'pending' AND e.blocked \
                 AND NOT EXISTS (SELECT 1 FROM blk b WHERE b.id = e.id) \
                 AND NOT EXISTS (SELECT 1 FROM gap x WHERE x.id = e.id) \
               ORDER BY e.id LIMIT {first})) c) AS oldest_claimable, \
           (SELECT {age} FROM blk) AS oldest_blocked, \
           (SELECT {age} FROM {t} WHERE status = 'parked') AS oldest_parked",
        kp = agg("p"),
        kq = agg("q"),
        kr = agg("r"),
        kg = agg("g"),
        ku = agg("u"),
        ke = agg("e"),
        se = state_of("a", "e"),
        last_p = last_of("p"),
        last_g = last_of("g"),
        cap = PUBLISHED_EXACT_UP_TO + 1,
        first = OLDEST_CLAIMABLE_SCAN,
    )
}

/// The last version of row alias `r`'s aggregate when it has no state: 0 (its first event must
/// be version 1), or, with `accept_first_version`, one below its first version: its lowest
/// unfinished version that may have been sent already (`maybe_delivered`, or the row of a
/// lease that ended without an outcome or a release: a relay that crashed after sending, a
/// timeout), or else its lowest unfinished version. A version that may be at the broker is
/// the first for good: a lower one that commits later would reach consumers after it, so it
/// is out of order (issue 20, item 1: without this, a claim that ended so let a late lower
/// version go out after it).
fn unknown_last(t: &str, state: &str, r: &str, accept_first_version: bool) -> String {
    if accept_first_version {
        format!(
            "(SELECT COALESCE(min(u.aggregate_version) FILTER ( \
                                WHERE u.maybe_delivered \
                                   OR u.id = (SELECT s.lease_row FROM {state} s WHERE {sr})), \
                              min(u.aggregate_version)) - 1 \
              FROM {t} u \
              WHERE {ku} = {kr} AND u.status IN ('pending', 'parked') \
                AND u.aggregate_type = {r}.aggregate_type AND u.aggregate_id = {r}.aggregate_id)",
            ku = agg("u"),
            kr = agg(r),
            sr = state_of("s", r),
        )
    } else {
        "0".to_owned()
    }
}

fn prefixed(alias: &str, cols: &str) -> String {
    cols.split(", ")
        .map(|c| format!("{alias}.{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ")
}
