// Verbatim copy of `outbox-postgres/src/sql.rs` at commit c799720a74d4 (`git show 96643ee^:outbox-postgres/src/sql.rs`),
// the SQL of an older relay for the rolling-upgrade tests (adversary_upgrade_block.rs). Changed: this
// header, the allow attribute below, and `use crate::schema::qualified` -> `use super::qualified`.
// Check with: diff <(git show 96643ee^:outbox-postgres/src/sql.rs) <(tail -n +6 <this file> | sed 's/use super::qualified;/use crate::schema::qualified;/')
#![allow(dead_code, unreachable_pub, clippy::all, clippy::pedantic)]
//! The SQL text of one outbox store, built once from validated identifiers.
//!
//! Every statement that changes an aggregate's delivery state runs after the aggregate's
//! advisory lock was taken by its transaction, and decides in a snapshot taken after that
//! (READ COMMITTED: each statement gets a new snapshot). See `docs/claims.md`.

use super::qualified;

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
    /// Claim step 1: candidates in id order, their aggregates try-locked. `$1` limit.
    pub claim_candidates: String,
    /// Claim step 2 (lease mode), in a snapshot taken after the locks. `$1` ids, `$2` owner,
    /// `$3` token, `$4` lease µs, `$5` gap timeout µs, `$6` gap re-check µs.
    pub claim_decide_lease: String,
    /// Claim step 2 (locked mode). `$1` ids, `$2` gap timeout µs, `$3` gap re-check µs.
    pub claim_decide_locked: String,
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

        let append = format!(
            "WITH ins AS ( \
               INSERT INTO {t} ({ENVELOPE_COLS}) \
               SELECT e, at, ai, av, et, sv, ct, p, h::jsonb, ca \
               FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::int8[], $5::text[], \
                           $6::int4[], $7::text[], $8::bytea[], $9::text[], $10::timestamptz[]) \
                    AS u(e, at, ai, av, et, sv, ct, p, h, ca) \
               RETURNING 1) \
             SELECT (SELECT count(*) FROM ins) AS n, \
                    (SELECT count(*) FROM (SELECT pg_notify($11::text, '') \
                                           WHERE $11::text IS NOT NULL \
                                             AND ($12::int4 IS NULL \
                                                  OR NOT pg_try_advisory_xact_lock_shared( \
                                                           $12::int4, $13::int4))) nn) \
                    AS notified"
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
        //   stale     version <= last: would go out after a later version; parked out of order
        //   follower  an unfinished row of the aggregate above `last` precedes it: blocked
        //   gap_park  the head skips a version for longer than the gap timeout: parked
        //   gap_hold  the head skips a version: held, re-checked after a short delay
        //   wait      the head is under a live lease (a mixed-mode relay) or not due
        //   claim     the head, version last + 1, due: claimed (lease mode: the lease)
        // The last version of an aggregate without state: 0 (its first event must be version
        // 1), or, with `accept_first_version`, one below its lowest unfinished version.
        let unknown_last = if accept_first_version {
            format!(
                "(SELECT min(u.aggregate_version) - 1 FROM {t} u \
                  WHERE {ku} = {kr} AND u.status IN ('pending', 'parked') \
                    AND u.aggregate_type = r.aggregate_type AND u.aggregate_id = r.aggregate_id)",
                ku = agg("u"),
                kr = agg("r"),
            )
        } else {
            "0".to_owned()
        };
        let decide = |gap: u8, recheck: u8| {
            format!(
                "c AS MATERIALIZED ( \
                   SELECT r.id, {cols}, r.attempts, r.held_since, {kr} AS k, \
                          r.next_attempt_at <= now() AS due, \
                          COALESCE(a.last_version, {unknown_last}) AS last, \
                          COALESCE(a.lease_until > clock_timestamp(), false) AS leased, \
                          (COALESCE(a.lease_row = r.id, false) OR r.maybe_delivered) AS resend \
                   FROM UNNEST($1::int8[]) AS x(id) \
                   CROSS JOIN LATERAL (SELECT * FROM {t} r \
                                       WHERE r.id = x.id AND r.status = 'pending' \
                                         AND NOT r.blocked OFFSET 0) r \
                   LEFT JOIN LATERAL (SELECT a.last_version, a.lease_until, a.lease_row \
                                      FROM {state} a WHERE {sr} LIMIT 1) a ON true), \
                 h AS MATERIALIZED ( \
                   SELECT c.*, CASE \
                     WHEN c.leased THEN 'wait' \
                     WHEN c.aggregate_version <= c.last THEN 'stale' \
                     WHEN EXISTS (SELECT 1 FROM {t} u \
                                  WHERE {ku} = c.k AND u.status IN ('pending', 'parked') \
                                    AND u.aggregate_version > c.last \
                                    AND (u.aggregate_version, u.id) < (c.aggregate_version, c.id) \
                                    AND u.aggregate_type = c.aggregate_type \
                                    AND u.aggregate_id = c.aggregate_id \
                                    AND NOT u.blocked) THEN 'follower' \
                     WHEN c.aggregate_version > c.last + 1 THEN \
                       CASE WHEN c.held_since <= clock_timestamp() - {gap_i} THEN 'gap_park' \
                            ELSE 'gap_hold' END \
                     WHEN NOT c.due THEN 'wait' \
                     ELSE 'claim' END AS action \
                   FROM c), \
                 blk AS ( \
                   UPDATE {t} b SET blocked = true \
                   WHERE b.id = ANY(ARRAY(SELECT h.id FROM h WHERE h.action = 'follower')) \
                   RETURNING 1), \
                 prk AS ( \
                   UPDATE {t} p SET status = 'parked', parked_at = clock_timestamp(), \
                          park_kind = x.kind, last_error_class = 'permanent', \
                          last_error_kind = x.kind, last_error_message = x.msg \
                   FROM (SELECT h.id, \
                                CASE h.action WHEN 'stale' THEN 'out_of_order' \
                                              ELSE 'version_gap' END AS kind, \
                                CASE h.action \
                                  WHEN 'stale' THEN format('version %s is at or below %s, the \
last version published or discarded for its aggregate', h.aggregate_version, h.last) \
                                  ELSE format('version %s follows %s: the versions between did \
not arrive within %s', h.aggregate_version, h.last, {gap_i}) END AS msg \
                         FROM h WHERE h.action IN ('stale', 'gap_park')) x \
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
                   FROM h WHERE g.id = h.id AND h.action = 'gap_hold' RETURNING 1), \
                 promote AS ( \
                   UPDATE {t} s SET blocked = false \
                   FROM (SELECT (SELECT b.id FROM {t} b \
                                 WHERE {kb} = h.k AND b.status IN ('pending', 'parked') \
                                   AND b.blocked AND b.aggregate_type = h.aggregate_type \
                                   AND b.aggregate_id = h.aggregate_id AND b.id <> h.id \
                                 ORDER BY b.aggregate_version, b.id LIMIT 1) AS id \
                         FROM h WHERE h.action = 'stale') nx \
                   WHERE s.id = nx.id AND s.blocked RETURNING 1)",
                cols = prefixed("r", ENVELOPE_COLS),
                kr = agg("r"),
                ku = agg("u"),
                kb = agg("b"),
                sr = state_of("a", "r"),
                unknown_last = unknown_last,
                gap_i = micros(gap),
                recheck_i = micros(recheck),
            )
        };
        let outcome_cols = format!(
            "h.id, h.action, {}, h.attempts, h.k, h.last, h.resend",
            prefixed("h", ENVELOPE_COLS)
        );
        // Lease mode: the claimed heads get their leases in the aggregate-state row (created
        // at the aggregate's first claim). A released or expired lease is taken over in place.
        // A lease that still names the row (`resend`: its claim ended without outcome or
        // release) may have sent it: the row keeps that as `maybe_delivered`, so a later claim
        // still counts its publication as a re-send.
        let claim_decide_lease = format!(
            "WITH {}, \
             ins AS ( \
               INSERT INTO {state} AS a (aggregate_key, aggregate_type, aggregate_id, \
                                         lease_owner, lease_token, lease_until, lease_row) \
               SELECT h.k, h.aggregate_type, h.aggregate_id, $2, $3, \
                      clock_timestamp() + {lease_i}, h.id \
               FROM h WHERE h.action = 'claim' \
               ON CONFLICT (aggregate_key, aggregate_type, aggregate_id) DO UPDATE \
                 SET lease_owner = EXCLUDED.lease_owner, lease_token = EXCLUDED.lease_token, \
                     lease_until = EXCLUDED.lease_until, lease_row = EXCLUDED.lease_row, \
                     updated_at = clock_timestamp() \
                 WHERE a.lease_until IS NULL OR a.lease_until <= clock_timestamp() \
               RETURNING a.lease_row AS id, \
                 (extract(epoch FROM a.lease_until - clock_timestamp()) * 1000000)::int8 \
                   AS remaining_us), \
             mark AS ( \
               UPDATE {t} m SET maybe_delivered = true FROM h \
               WHERE m.id = h.id AND h.action = 'claim' AND h.resend AND NOT m.maybe_delivered \
               RETURNING 1) \
             SELECT {outcome_cols}, i.remaining_us, (i.id IS NOT NULL) AS claimed \
             FROM h LEFT JOIN ins i ON i.id = h.id \
             WHERE h.action IN ('claim', 'stale', 'gap_park', 'gap_hold')",
            decide(5, 6),
            lease_i = micros(4),
        );
        // Locked mode: the aggregate locks, held until the completion commits, are the claim.
        let claim_decide_locked = format!(
            "WITH {} \
             SELECT {outcome_cols}, NULL::int8 AS remaining_us, (h.action = 'claim') AS claimed \
             FROM h WHERE h.action IN ('claim', 'stale', 'gap_park', 'gap_hold')",
            decide(2, 3),
        );

        // Claimed rows that no longer decode are parked (their leases released), alone.
        let park_undecodable = format!(
            "WITH p AS ( \
               UPDATE {t} t SET status = 'parked', park_kind = 'permanent_error', \
                      parked_at = clock_timestamp(), last_error_class = 'permanent', \
                      last_error_kind = 'invalid_record', \
                      last_error_message = 'stored event does not decode: ' || x.why \
               FROM UNNEST($1::int8[], $2::text[]) AS x(id, why) \
               WHERE t.id = x.id AND t.status = 'pending' RETURNING t.id) \
             UPDATE {state} SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
                    lease_row = NULL, updated_at = clock_timestamp() \
             WHERE aggregate_key = ANY($4::int8[]) AND lease_token = $3 \
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

        // The completion: one row per claimed event, in `OutcomeArrays` order ($1..$15);
        // `release` marks a claimed row without outcome (its claim just ends).
        // `ts`: the one time of an outcome (a published row's `published_at` and `finished_at`
        // are equal, so the publication-time queries use `finished_idx`; migration 5). A
        // retry's delay is counted from the row's own `clock_timestamp()` instead: evaluated
        // again after a wait on a concurrent update of the row (EvalPlanQual), it does not
        // count that wait as part of the delay, as `ts` (read before any wait) would.
        let outcomes = "o AS MATERIALIZED (SELECT *, clock_timestamp() AS ts FROM UNNEST( \
               $1::int8[], $2::int8[], $3::text[], $4::text[], $5::int8[], $6::text[], \
               $7::text[], $8::int4[], $9::int8[], $10::int8[], $11::text[], $12::text[], \
               $13::text[], $14::text[], $15::bool[]) \
             AS o(id, k, at, ai, v, kind, topic, part, off, delay_us, eclass, ekind, emsg, \
                  pkind, uncertain))";
        let set = "status = CASE o.kind WHEN 'published' THEN 'published' \
                                WHEN 'park' THEN 'parked' ELSE 'pending' END, \
             attempts = CASE WHEN o.kind IN ('retry', 'park') THEN t.attempts + 1 \
                             ELSE t.attempts END, \
             next_attempt_at = CASE WHEN o.kind IN ('retry', 'defer') \
                 THEN clock_timestamp() + o.delay_us * interval '1 microsecond' \
                 ELSE t.next_attempt_at END, \
             published_at = CASE WHEN o.kind = 'published' THEN o.ts END, \
             finished_at = CASE WHEN o.kind = 'published' THEN o.ts END, \
             ack_topic = o.topic, ack_partition = o.part, ack_offset = o.off, \
             last_error_class = CASE WHEN o.kind = 'published' THEN t.last_error_class \
                                     ELSE o.eclass END, \
             last_error_kind = CASE WHEN o.kind = 'published' THEN t.last_error_kind \
                                    ELSE o.ekind END, \
             last_error_message = CASE WHEN o.kind = 'published' THEN t.last_error_message \
                                       ELSE o.emsg END, \
             park_kind = CASE WHEN o.kind = 'park' THEN o.pkind END, \
             parked_at = CASE WHEN o.kind = 'park' THEN o.ts END, \
             maybe_delivered = t.maybe_delivered OR COALESCE(o.uncertain, false)";
        // Lease mode: only rows whose aggregate's lease still carries this claim's token
        // (`$16`) get their outcome (fencing); every such lease is released, and a publication
        // advances the aggregate's last version in the same write.
        let complete_lease = format!(
            "WITH {outcomes}, \
             f AS MATERIALIZED ( \
               SELECT o.* FROM o \
               WHERE EXISTS (SELECT 1 FROM {state} a \
                             WHERE a.aggregate_key = o.k AND a.aggregate_type = o.at \
                               AND a.aggregate_id = o.ai AND a.lease_token = $16 \
                               AND a.lease_row = o.id)), \
             upd AS ( \
               UPDATE {t} t SET {set} FROM f o \
               WHERE t.id = o.id AND t.status = 'pending' AND o.kind <> 'release' \
               RETURNING t.id, o.kind, o.k, o.at, o.ai, o.v), \
             rel AS ( \
               UPDATE {state} a SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
                      lease_row = NULL, \
                      last_version = CASE WHEN f.kind = 'published' \
                                           AND f.id IN (SELECT u.id FROM upd u) \
                                          THEN GREATEST(a.last_version, f.v) \
                                          ELSE a.last_version END, \
                      updated_at = clock_timestamp() \
               FROM f \
               WHERE a.aggregate_key = f.k AND a.aggregate_type = f.at \
                 AND a.aggregate_id = f.ai AND a.lease_token = $16 \
               RETURNING 1), \
             {} \
             SELECT ARRAY(SELECT id FROM upd) AS applied",
            promote_after("(SELECT * FROM upd WHERE kind = 'published')"),
        );
        // Locked mode: the claim's transaction still holds the aggregate locks; a publication
        // advances (or creates) the aggregate's state.
        let complete_locked = format!(
            "WITH {outcomes}, \
             upd AS ( \
               UPDATE {t} t SET {set} FROM o \
               WHERE t.id = o.id AND t.status = 'pending' AND o.kind <> 'release' \
               RETURNING t.id, o.kind, o.k, o.at, o.ai, o.v), \
             st AS ( \
               INSERT INTO {state} AS a (aggregate_key, aggregate_type, aggregate_id, \
                                         last_version) \
               SELECT u.k, u.at, u.ai, u.v FROM upd u WHERE u.kind = 'published' \
               ON CONFLICT (aggregate_key, aggregate_type, aggregate_id) DO UPDATE \
                 SET last_version = GREATEST(a.last_version, EXCLUDED.last_version), \
                     updated_at = clock_timestamp() \
               RETURNING 1), \
             {} \
             SELECT ARRAY(SELECT id FROM upd) AS applied",
            promote_after("(SELECT * FROM upd WHERE kind = 'published')"),
        );
        let release_lease = format!(
            "UPDATE {state} SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
                    lease_row = NULL, updated_at = clock_timestamp() \
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
        // Rows of a lease claim made by another store instance (no rows in memory).
        let lease_rows = format!(
            "SELECT e.id, e.event_id, {ke} AS k, e.aggregate_type, e.aggregate_id, \
                    e.aggregate_version \
             FROM {pending} e JOIN LATERAL (SELECT a.lease_token FROM {state} a \
                                      WHERE {se} AND a.lease_row = e.id LIMIT 1) a ON true \
             WHERE a.lease_token = $1",
            ke = agg("e"),
            se = state_of("a", "e"),
        );
        // The live leases of one owner (operator action on a relay that is gone).
        let owner_leases = format!(
            "SELECT e.event_id, {ke} AS k, e.aggregate_type, e.aggregate_id \
             FROM {pending} e JOIN LATERAL (SELECT a.lease_owner, a.lease_until FROM {state} a \
                                      WHERE {se} AND a.lease_row = e.id LIMIT 1) a ON true \
             WHERE a.lease_owner = $1 AND a.lease_until > clock_timestamp()",
            ke = agg("e"),
            se = state_of("a", "e"),
        );
        let release_owner_lease = format!(
            "UPDATE {state} SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
                    lease_row = NULL, updated_at = clock_timestamp() \
             WHERE aggregate_key = $1 AND aggregate_type = $2 AND aggregate_id = $3 \
               AND lease_owner = $4 AND lease_until > clock_timestamp() RETURNING 1"
        );

        // Operator actions: the event's aggregate and state, read again after its lock.
        let event_state = format!(
            "SELECT e.status, e.aggregate_type, e.aggregate_id, e.aggregate_version, \
                    {ke} AS k, COALESCE(a.last_version, 0) AS last, \
                    (SELECT count(*) FROM {t} u \
                      WHERE {ku} = {ke} AND u.status IN ('pending', 'parked') \
                        AND u.aggregate_type = e.aggregate_type \
                        AND u.aggregate_id = e.aggregate_id AND u.id <> e.id \
                        AND u.aggregate_version > COALESCE(a.last_version, 0) \
                        AND u.aggregate_version < e.aggregate_version) AS waiting_below \
             FROM {t} e LEFT JOIN LATERAL (SELECT a.last_version FROM {state} a \
                                           WHERE {se} LIMIT 1) a ON true \
             WHERE e.event_id = $1",
            ke = agg("e"),
            ku = agg("u"),
            se = state_of("a", "e"),
        );
        // Raises the aggregate's last version to at least `$5` ($2..$4 key, type, id).
        let raise_last = format!(
            "st AS ( \
               INSERT INTO {state} AS a (aggregate_key, aggregate_type, aggregate_id, \
                                         last_version) \
               VALUES ($2, $3, $4, $5) \
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
                   AND finished_at < clock_timestamp() - $1::int8 * interval '1 microsecond' \
                 ORDER BY finished_at LIMIT $2 FOR UPDATE SKIP LOCKED) \
               RETURNING *), \
             ar AS (INSERT INTO {archive} SELECT * FROM d WHERE $3::bool RETURNING 1) \
             SELECT (SELECT count(*) FROM d) AS removed, (SELECT count(*) FROM ar) AS archived"
        );
        let stats = format!(
            "SELECT \
               (SELECT count(*) FROM {t} WHERE status = 'pending') AS unpublished, \
               (SELECT count(*) FROM {t} e \
                  WHERE e.status = 'pending' AND NOT e.blocked \
                    AND EXISTS (SELECT 1 FROM {state} a WHERE {se} AND a.lease_row = e.id \
                                  AND a.lease_until > clock_timestamp())) AS leased, \
               (SELECT count(*) FROM {t} WHERE status = 'parked') AS parked, \
               (SELECT count(*) FROM {t} WHERE status = 'published') AS published, \
               (SELECT count(*) FROM {t} WHERE status = 'pending' AND blocked) AS blocked, \
               (SELECT count(*) FROM {t} e WHERE e.status = 'pending' AND NOT e.blocked \
                  AND e.last_error_kind = 'version_gap' \
                  AND e.aggregate_version > 1 + COALESCE( \
                    (SELECT a.last_version FROM {state} a WHERE {se}), 0)) AS gaps_held, \
               (SELECT count(DISTINCT l.k) FROM {t} e \
                  JOIN (SELECT DISTINCT (l.classid::int8 << 32) | l.objid::int8 AS k \
                        FROM pg_locks l \
                        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
                          AND l.database = (SELECT oid FROM pg_database \
                                            WHERE datname = current_database())) l \
                    ON l.k = ({ke} # ({seed})) \
                  WHERE e.status = 'pending' AND NOT e.blocked \
                    AND e.next_attempt_at <= now()) AS locked, \
               (SELECT extract(epoch FROM clock_timestamp() - min(created_at))::float8 FROM {t} \
                  WHERE status = 'pending') AS oldest_pending, \
               (SELECT extract(epoch FROM clock_timestamp() - min(created_at))::float8 FROM {t} \
                  WHERE status = 'parked') AS oldest_parked",
            se = state_of("a", "e"),
            ke = agg("e"),
        );
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
            claim_candidates,
            claim_decide_lease,
            claim_decide_locked,
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

fn prefixed(alias: &str, cols: &str) -> String {
    cols.split(", ")
        .map(|c| format!("{alias}.{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ")
}
