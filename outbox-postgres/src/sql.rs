//! The SQL text of one outbox store, built once from validated identifiers.

use crate::schema::qualified;

/// Envelope columns, in the order [`crate::outbox::envelope_from_row`] reads them.
pub(crate) const ENVELOPE_COLS: &str = "event_id, aggregate_type, aggregate_id, \
    aggregate_version, event_type, schema_version, content_type, payload, headers, created_at";

#[derive(Debug)]
pub(crate) struct OutboxSql {
    pub table: String,
    pub append: String,
    pub claim_first_lease: String,
    pub claim_first_locked: String,
    pub claim_lease: String,
    pub claim_locked: String,
    pub lock_aggregates_of_events: String,
    pub complete_lease: String,
    pub complete_lease_published: String,
    pub complete_locked: String,
    pub complete_locked_published: String,
    pub release_lease: String,
    pub lease_rows: String,
    pub lock_event_aggregate: String,
    pub promote_aggregate: String,
    pub retry_parked: String,
    pub discard_parked: String,
    pub reissue_parked: String,
    pub list_parked: String,
    pub audit_trail: String,
    pub cleanup: String,
    pub cleanup_leases: String,
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

/// Advisory lock key of the aggregate of row alias `a`.
fn key(a: &str, seed: i64) -> String {
    format!("({} # ({seed}))", agg(a))
}

/// Aggregate key of row alias `a`: the expression of the unfinished and blocked indexes
/// (migration 2), written the same way so that the planner matches them.
fn agg(a: &str) -> String {
    format!("hashtextextended({a}.aggregate_type || chr(31) || {a}.aggregate_id, 0)")
}

/// The head (lowest unfinished version, ties by id) of the aggregate whose key is `{k}`: the
/// first entry of its range in the unfinished index, whatever the aggregate's depth.
fn head_lateral(t: &str, k: &str) -> String {
    let au = agg("u");
    format!(
        "(SELECT u.id, u.status FROM {t} u \
          WHERE {au} = {k} AND u.status IN ('pending', 'parked') \
          ORDER BY u.aggregate_version, u.id LIMIT 1)"
    )
}

impl OutboxSql {
    pub(crate) fn new(schema: &str, table: &str) -> Self {
        let t = qualified(schema, table);
        let audit = qualified(schema, &format!("{table}_audit"));
        let archive = qualified(schema, &format!("{table}_archive"));
        let lease = qualified(schema, &format!("{table}_lease"));
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
                                           WHERE $11::text IS NOT NULL) nn) AS notified"
        );

        // Step 1 of a claim: the first candidates in insertion order whose aggregate has no
        // live lease and which this transaction can lock (the CASE keeps the lease probe and
        // the lock attempt behind the cheap filters; locked mode writes no leases).
        //
        // The statement's snapshot predates its locks, so a transaction that held one of
        // these aggregates may have committed changes this snapshot does not show. A
        // candidate is therefore claimed here only when nothing can have changed under it:
        // `fast` = its row version was never updated or locked (`xmax = 0`), and no unfinished
        // row of its aggregate is ordered before it in this snapshot. Every write that can make
        // a row a non-head or a non-candidate either updates the candidate itself or leaves an
        // earlier row of the aggregate visible here (a head in flight, a parked row), so a
        // stale view shows up as `fast = false`; those candidates go through step 2, which
        // re-reads them in a snapshot taken after the locks. (Lease mode: a lease taken by a
        // transaction this snapshot does not show is caught by the insert's `ON CONFLICT`,
        // which always sees the latest lease.)
        let kc = key("c", seed);
        let candidates = |lease_probe: &str| {
            format!(
                "c AS MATERIALIZED ( \
                   SELECT c.id, {cols}, c.attempts, {kc} AS k, \
                          c.xmax = '0'::xid AND NOT EXISTS ( \
                            SELECT 1 FROM {t} u \
                            WHERE {au} = {ac} AND u.status IN ('pending', 'parked') \
                              AND (u.aggregate_version, u.id) < (c.aggregate_version, c.id)) \
                            AS fast \
                   FROM {t} c \
                   WHERE c.status = 'pending' AND NOT c.blocked \
                     AND CASE WHEN c.next_attempt_at <= now() {lease_probe} \
                              THEN pg_try_advisory_xact_lock({kc}) ELSE false END \
                   ORDER BY c.id LIMIT $1)",
                cols = prefixed("c", ENVELOPE_COLS),
                au = agg("u"),
                ac = agg("c"),
            )
        };
        // Locked mode: the fast candidates are claimed (their locks are the claim).
        let claim_first_locked = format!(
            "WITH {} SELECT c.*, true AS claimed, NULL::int8 AS remaining_us FROM c",
            candidates("")
        );
        // The leases of the picked heads (`pick`: id, k), in the narrow lease table (one row
        // per aggregate in flight), so the wide event row is not rewritten to claim it. An
        // expired lease of the aggregate is taken over; a live one makes the insert a no-op
        // (`ON CONFLICT` sees the latest lease, even one committed after this statement's
        // snapshot), and its row is not claimed. Two aggregates whose keys collide share one
        // lease row, so only one of them is claimed at a time.
        let take_leases = format!(
            "ins AS ( \
               INSERT INTO {lease} AS l \
                 (aggregate_key, event_row, lease_owner, lease_token, lease_until) \
               SELECT p.k, p.id, $2, $3, clock_timestamp() + $4::int8 * interval '1 microsecond' \
               FROM pick p \
               ON CONFLICT (aggregate_key) DO UPDATE SET event_row = EXCLUDED.event_row, \
                 lease_owner = EXCLUDED.lease_owner, lease_token = EXCLUDED.lease_token, \
                 lease_until = EXCLUDED.lease_until \
               WHERE l.lease_until <= clock_timestamp() \
               RETURNING l.aggregate_key, l.event_row, l.lease_until)"
        );
        // Lease mode: the fast candidates get their leases in the same statement.
        let claim_first_lease = format!(
            "WITH {}, \
             pick AS ( \
               SELECT DISTINCT ON (c.k) c.id, c.k FROM c WHERE c.fast ORDER BY c.k, c.id), \
             {take_leases} \
             SELECT c.*, i.event_row IS NOT NULL AS claimed, \
                (extract(epoch FROM i.lease_until - clock_timestamp()) * 1000000)::int8 \
                  AS remaining_us \
             FROM c LEFT JOIN ins i ON i.event_row = c.id",
            candidates(&format!(
                "AND NOT EXISTS (SELECT 1 FROM {lease} l WHERE l.aggregate_key = {kc} \
                                   AND l.lease_until > clock_timestamp())"
            ))
        );

        // Step 2, for the candidates of step 1 that were not `fast`, in a new snapshot taken
        // after the aggregate locks: each candidate ($1, their ids) is re-read and must still
        // be pending, unblocked and due. It is its aggregate's head when no unfinished row of
        // the aggregate (pending or parked, blocked or not) is ordered before it: one probe of
        // the unfinished index, which stops at the first entry it meets. Candidates that are
        // not heads are blocked (out of the claim index) until the row ahead of them is
        // published; heads are claimed.
        let kr = key("r", seed);
        let heads = format!(
            "h AS MATERIALIZED ( \
               SELECT r.id, {cols}, r.attempts, {kr} AS k, \
                      r.next_attempt_at <= now() AS due, \
                      NOT EXISTS ( \
                        SELECT 1 FROM {t} u \
                        WHERE {au} = {ar} AND u.status IN ('pending', 'parked') \
                          AND (u.aggregate_version, u.id) < (r.aggregate_version, r.id)) AS head \
               FROM {t} r \
               WHERE r.id = ANY($1::int8[]) AND r.status = 'pending' AND NOT r.blocked), \
             blk AS ( \
               UPDATE {t} b SET blocked = true \
               WHERE b.id = ANY(ARRAY(SELECT h.id FROM h WHERE NOT h.head)) \
                 AND b.status = 'pending' AND NOT b.blocked \
               RETURNING b.id)",
            cols = prefixed("r", ENVELOPE_COLS),
            au = agg("u"),
            ar = agg("r"),
        );
        // Lease mode: the heads get their leases (see `take_leases`).
        let claim_lease = format!(
            "WITH {heads}, \
             pick AS ( \
               SELECT DISTINCT ON (h.k) h.id, h.k FROM h WHERE h.head AND h.due \
               ORDER BY h.k, h.id), \
             {take_leases} \
             SELECT h.id, {cols}, h.attempts, i.aggregate_key AS k, \
                (extract(epoch FROM i.lease_until - clock_timestamp()) * 1000000)::int8 AS remaining_us \
             FROM ins i JOIN h ON h.id = i.event_row",
            cols = prefixed("h", ENVELOPE_COLS),
        );
        // Locked mode: the aggregate locks, held until the completion commits, are the claim.
        // Every writer of a pending row takes its aggregate's lock first (claims, completions,
        // operator actions), so no row lock is needed.
        let claim_locked = format!(
            "WITH {heads} \
             SELECT h.id, {cols}, h.attempts, h.k, NULL::int8 AS remaining_us \
             FROM h WHERE h.head AND h.due",
            cols = prefixed("h", ENVELOPE_COLS)
        );

        // Keys come from the claim (returned with each row), so no table lookups here.
        let lock_aggregates_of_events = "SELECT pg_advisory_xact_lock(s.k) FROM ( \
               SELECT DISTINCT k FROM UNNEST($1::int8[]) AS k ORDER BY 1) s"
            .to_owned();

        // Unblocking after a published head: the aggregate's first blocked row (one index
        // probe). If an unblocked unfinished row precedes it (a late commit), unblocking is
        // still safe: the claim re-checks head-ness and blocks it again.
        let next = format!(
            "(SELECT u.id FROM {t} u \
              WHERE {au} = pa.ak AND u.status IN ('pending', 'parked') AND u.blocked \
              ORDER BY u.aggregate_version, u.id LIMIT 1)",
            au = agg("u")
        );
        // A released lease keeps its row (no token, expiry = release time): the aggregate's
        // next claim updates it in place (a HOT update of a narrow row, no index churn).
        let release = "lease_owner = NULL, lease_token = NULL, lease_until = clock_timestamp()";
        // The completion, in two forms: any mix of outcomes ($1..$10 in `OutcomeArrays`
        // order), and the common case where every outcome is a publication ($1 ids, $2 topics,
        // $3 partitions, $4 offsets), which sends and evaluates no error columns. `fence`
        // holds the parameter numbers of the lease token and keys (lease mode).
        let complete = |published_only: bool, fence: Option<(u8, u8)>| {
            let (source, set, kind) = if published_only {
                (
                    "UNNEST($1::int8[], $2::text[], $3::int4[], $4::int8[]) \
                       AS o(id, topic, part, off)",
                    "status = 'published', published_at = clock_timestamp(), \
                     finished_at = clock_timestamp(), \
                     ack_topic = o.topic, ack_partition = o.part, ack_offset = o.off",
                    "'published'::text",
                )
            } else {
                (
                    "UNNEST($1::int8[], $2::text[], $3::text[], $4::int4[], \
                        $5::int8[], $6::int8[], $7::text[], $8::text[], $9::text[], $10::text[]) \
                     AS o(id, kind, topic, part, off, delay_us, eclass, ekind, emsg, pkind)",
                    "status = CASE o.kind WHEN 'published' THEN 'published' \
                                          WHEN 'park' THEN 'parked' ELSE 'pending' END, \
                     attempts = CASE WHEN o.kind IN ('published', 'defer') THEN t.attempts \
                                     ELSE t.attempts + 1 END, \
                     next_attempt_at = CASE WHEN o.kind IN ('retry', 'defer') \
                         THEN clock_timestamp() + o.delay_us * interval '1 microsecond' \
                         ELSE t.next_attempt_at END, \
                     published_at = CASE WHEN o.kind = 'published' THEN clock_timestamp() END, \
                     finished_at = CASE WHEN o.kind = 'published' THEN clock_timestamp() END, \
                     ack_topic = o.topic, ack_partition = o.part, ack_offset = o.off, \
                     last_error_class = CASE WHEN o.kind = 'published' THEN t.last_error_class \
                                             ELSE o.eclass END, \
                     last_error_kind = CASE WHEN o.kind = 'published' THEN t.last_error_kind \
                                            ELSE o.ekind END, \
                     last_error_message = CASE WHEN o.kind = 'published' \
                                               THEN t.last_error_message ELSE o.emsg END, \
                     park_kind = CASE WHEN o.kind = 'park' THEN o.pkind END, \
                     parked_at = CASE WHEN o.kind = 'park' THEN clock_timestamp() END",
                    "o.kind",
                )
            };
            // Fencing: the claim's leases (all of its aggregates, token and keys given) are
            // released, and only rows whose lease was still this token's get their outcome.
            // Rows without an outcome are thereby released too. Without a fence to drive the
            // join, `id = ANY(..)` keeps the planner from hashing a scan of every pending row
            // (the cost would grow with the backlog).
            let (fence_cte, fence_join, filter) = match fence {
                Some((token, keys)) => (
                    format!(
                        "fenced AS (UPDATE {lease} l SET {release} \
                           WHERE l.aggregate_key = ANY(${keys}::int8[]) \
                             AND l.lease_token = ${token} \
                           RETURNING l.event_row),"
                    ),
                    "JOIN fenced f ON f.event_row = o.id",
                    "",
                ),
                None => (String::new(), "", "AND t.id = ANY($1::int8[])"),
            };
            // Unblocking: per aggregate with a publication, its first blocked row (one probe
            // of the blocked index), skipped as a whole when no row is blocked at all.
            format!(
                "WITH o AS MATERIALIZED (SELECT o.* FROM {source}), \
                 {fence_cte} \
                 upd AS ( \
                   UPDATE {t} t SET {set} \
                   FROM o {fence_join} \
                   WHERE t.id = o.id AND t.status = 'pending' {filter} \
                   RETURNING t.id, {at} AS ak, {kind} AS kind), \
                 pa AS (SELECT DISTINCT ak FROM upd WHERE kind = 'published'), \
                 promote AS ( \
                   UPDATE {t} s SET blocked = false \
                   FROM (SELECT h.id FROM pa CROSS JOIN LATERAL {next} h \
                         WHERE EXISTS (SELECT 1 FROM {t} b \
                                       WHERE b.status IN ('pending', 'parked') AND b.blocked)) nx \
                   WHERE s.id = nx.id AND s.blocked RETURNING 1) \
                 SELECT ARRAY(SELECT id FROM upd) AS applied",
                at = agg("t")
            )
        };
        let complete_lease = complete(false, Some((11, 12)));
        let complete_lease_published = complete(true, Some((5, 6)));
        let complete_locked = complete(false, None);
        let complete_locked_published = complete(true, None);
        let release_lease = format!(
            "UPDATE {lease} SET {release} WHERE aggregate_key = ANY($2::int8[]) AND lease_token = $1"
        );
        // Rows of a lease claim made by another store instance (no ids in memory): a scan of
        // the lease table, which holds one row per aggregate in flight.
        let lease_rows = format!(
            "SELECT l.event_row AS id, e.event_id, l.aggregate_key AS k \
             FROM {lease} l JOIN {t} e ON e.id = l.event_row WHERE l.lease_token = $1"
        );

        let ks = key("e", seed);
        let lock_event_aggregate = format!(
            "SELECT e.aggregate_type, e.aggregate_id, {ks} AS k FROM {t} e WHERE e.event_id = $1"
        );
        let promote_head = head_lateral(&t, "pa.ak");
        let promote_aggregate = format!(
            "UPDATE {t} s SET blocked = false \
             FROM (SELECT h.id FROM (SELECT hashtextextended($1::text || chr(31) || $2::text, 0) \
                                              AS ak) pa \
                   CROSS JOIN LATERAL {promote_head} h) nx \
             WHERE s.id = nx.id AND s.blocked"
        );
        let retry_parked = format!(
            "WITH u AS ( \
               UPDATE {t} SET status = 'pending', attempts = 0, next_attempt_at = '-infinity', \
                      park_kind = NULL, parked_at = NULL, blocked = false \
               WHERE event_id = $1 AND status = 'parked' RETURNING event_id) \
             INSERT INTO {audit} (event_id, action, actor, reason) \
             SELECT event_id, 'retry', $2, $3 FROM u RETURNING id"
        );
        let discard_parked = format!(
            "WITH u AS ( \
               UPDATE {t} SET status = 'discarded', finished_at = clock_timestamp(), \
                      discard_reason = $3, blocked = false \
               WHERE event_id = $1 AND status = 'parked' RETURNING event_id) \
             INSERT INTO {audit} (event_id, action, actor, reason) \
             SELECT event_id, 'discard', $2, $3 FROM u RETURNING id"
        );
        let reissue_parked = format!(
            "WITH o AS ( \
               UPDATE {t} SET status = 'discarded', finished_at = clock_timestamp(), \
                      discard_reason = $3, blocked = false \
               WHERE event_id = $1 AND status = 'parked' \
               RETURNING {ENVELOPE_COLS}), \
             ins AS ( \
               INSERT INTO {t} ({ENVELOPE_COLS}) \
               SELECT $4, aggregate_type, aggregate_id, aggregate_version, event_type, \
                      schema_version, content_type, payload, headers, created_at FROM o \
               RETURNING event_id), \
             a AS ( \
               INSERT INTO {audit} (event_id, action, actor, reason, new_event_id) \
               SELECT $1, 'reissue', $2, $3, event_id FROM ins RETURNING 1) \
             SELECT count(*) FROM a"
        );
        let list_parked = format!(
            "SELECT id, {ENVELOPE_COLS}, attempts, park_kind, last_error_class, last_error_kind, \
                    last_error_message, parked_at \
             FROM {t} WHERE status = 'parked' ORDER BY parked_at, id LIMIT $1"
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
        // Released lease rows of aggregates that were quiet for the retention period.
        let cleanup_leases = format!(
            "DELETE FROM {lease} WHERE aggregate_key IN ( \
               SELECT aggregate_key FROM {lease} \
               WHERE lease_token IS NULL \
                 AND lease_until < clock_timestamp() - $1::int8 * interval '1 microsecond' \
               LIMIT $2 FOR UPDATE SKIP LOCKED)"
        );
        let stats = format!(
            "SELECT \
               (SELECT count(*) FROM {t} WHERE status = 'pending') AS unpublished, \
               (SELECT count(*) FROM {lease} WHERE lease_until > clock_timestamp()) AS leased, \
               (SELECT count(*) FROM {t} WHERE status = 'parked') AS parked, \
               (SELECT count(*) FROM {t} WHERE status = 'published') AS published, \
               (SELECT count(*) FROM {t} WHERE status = 'pending' AND blocked) AS blocked, \
               (SELECT extract(epoch FROM clock_timestamp() - min(created_at))::float8 FROM {t} \
                  WHERE status = 'pending') AS oldest_pending, \
               (SELECT extract(epoch FROM clock_timestamp() - min(created_at))::float8 FROM {t} \
                  WHERE status = 'parked') AS oldest_parked"
        );
        let table_stats = "SELECT pg_total_relation_size(c.oid)::float8 AS total_bytes, \
                    pg_relation_size(c.oid)::float8 AS table_bytes, \
                    pg_indexes_size(c.oid)::float8 AS index_bytes, \
                    s.n_live_tup::float8 AS live_tuples, s.n_dead_tup::float8 AS dead_tuples, \
                    extract(epoch FROM now() - s.last_autovacuum)::float8 AS autovacuum_age, \
                    extract(epoch FROM now() - s.last_autoanalyze)::float8 AS autoanalyze_age \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid \
             WHERE n.nspname = $1 AND c.relname = $2"
            .to_owned();

        Self {
            table: t,
            append,
            claim_first_lease,
            claim_first_locked,
            claim_lease,
            claim_locked,
            lock_aggregates_of_events,
            complete_lease,
            complete_lease_published,
            complete_locked,
            complete_locked_published,
            release_lease,
            lease_rows,
            lock_event_aggregate,
            promote_aggregate,
            retry_parked,
            discard_parked,
            reissue_parked,
            list_parked,
            audit_trail,
            cleanup,
            cleanup_leases,
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
