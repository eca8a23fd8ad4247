-- Scheme A ("queue + ack log"): the event row is written once, at append, on the happy path.
--
--   @Q@  <table>_queue: one narrow row per UNFINISHED event (pending or parked), inserted with
--        the event, deleted by the completion that publishes it (or a discard). Carries the
--        per-row delivery mechanics a claim reads or writes: due time, attempts, gap hold,
--        parked / blocked flags. Replaces the event table's claim, unfinished, blocked and
--        held indexes.
--   @A@  <table>_ack: one narrow row per PUBLISHED event (append-only): its acknowledgement and
--        publication time. published  <=>  a row here.
--   @S@  the aggregate-state table, unchanged (last_version, lease).
--   @T@  the event table: unchanged columns; `status` now changes only on the rare paths
--        (parked, discarded, operator retry) and stays 'pending' for a published event.
-- Placeholders as in cur.sql.

-- name: ddl
DROP INDEX IF EXISTS @SCHEMA@."outbox_events_claim_idx";
DROP INDEX IF EXISTS @SCHEMA@."outbox_events_unfinished_idx";
DROP INDEX IF EXISTS @SCHEMA@."outbox_events_blocked_idx";
DROP INDEX IF EXISTS @SCHEMA@."outbox_events_held_idx";
CREATE TABLE @Q@ (
    id                bigint      NOT NULL,          -- the event row's id (no FK: cost)
    k                 bigint      NOT NULL,          -- hashtextextended(type || chr(31) || id, 0)
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    parked            boolean     NOT NULL DEFAULT false,
    blocked           boolean     NOT NULL DEFAULT false,
    attempts          integer     NOT NULL DEFAULT 0,
    next_attempt_at   timestamptz NOT NULL DEFAULT '-infinity',
    held_since        timestamptz,
    inserted_at       timestamptz NOT NULL
) WITH (fillfactor = 90);
-- claim candidates, in id order (pending, not blocked)
CREATE INDEX ON @Q@ (id) WHERE NOT parked AND NOT blocked;
-- unfinished rows per aggregate, version order (the head / follower probe, stats ranges)
CREATE INDEX ON @Q@ (k, aggregate_version, id);
-- blocked rows per aggregate (the promote probe)
CREATE INDEX ON @Q@ (k, aggregate_version, id) WHERE blocked;
CREATE TABLE @A@ (
    id              bigint      PRIMARY KEY,         -- the event row's id
    finished_at     timestamptz NOT NULL,            -- = published_at
    ack_transport   text        NOT NULL,
    ack_destination text        NOT NULL,
    ack_partition   integer,
    ack_position    bigint,
    ack_route       text,
    ack_duplicate   boolean
);
CREATE INDEX ON @A@ (finished_at, id);

-- name: candidates
SELECT c.id FROM @Q@ c
 WHERE NOT c.parked AND NOT c.blocked
   AND CASE WHEN c.next_attempt_at <= now()
             AND NOT EXISTS (SELECT 1 FROM @S@ a
                             WHERE a.aggregate_key = c.k
                               AND a.aggregate_type = c.aggregate_type AND a.aggregate_id = c.aggregate_id
                               AND a.lease_until > clock_timestamp())
            THEN pg_try_advisory_xact_lock(c.k # (@SEED@)) ELSE false END
 ORDER BY c.id LIMIT $1

-- name: decide
-- Decided on the narrow queue rows; the event rows (payloads) are read once, for the rows the
-- claim reports.
WITH c AS MATERIALIZED (
   SELECT q.id, q.k, q.aggregate_type, q.aggregate_id, q.aggregate_version, q.attempts, q.held_since,
          q.next_attempt_at <= now() AS due,
          COALESCE(a.last_version, 0) AS last,
          (a.last_version IS NOT NULL) AS known,
          COALESCE(a.lease_until > clock_timestamp(), false) AS leased,
          COALESCE(a.lease_row = q.id, false) AS lease_named
   FROM UNNEST($1::int8[]) AS x(id)
   CROSS JOIN LATERAL (SELECT * FROM @Q@ q
                       WHERE q.id = x.id AND NOT q.parked AND NOT q.blocked OFFSET 0) q
   LEFT JOIN LATERAL (SELECT a.last_version, a.lease_until, a.lease_row
                      FROM @S@ a WHERE a.aggregate_key = q.k
                        AND a.aggregate_type = q.aggregate_type AND a.aggregate_id = q.aggregate_id LIMIT 1) a ON true),
 h AS MATERIALIZED (
   SELECT c.*, CASE
     WHEN octet_length(c.aggregate_type) > 1024
       OR octet_length(c.aggregate_id) > 1024 THEN 'bad_key'
     WHEN c.leased THEN 'wait'
     WHEN c.aggregate_version <= c.last THEN 'stale'
     WHEN EXISTS (SELECT 1 FROM @Q@ u
                  WHERE u.k = c.k
                    AND u.aggregate_version > c.last
                    AND (u.aggregate_version, u.id) < (c.aggregate_version, c.id)
                    AND u.aggregate_type = c.aggregate_type
                    AND u.aggregate_id = c.aggregate_id
                    AND NOT u.blocked) THEN 'follower'
     WHEN c.aggregate_version > c.last + 1 THEN
       CASE WHEN c.held_since <= clock_timestamp() - $5::int8 * interval '1 microsecond' THEN 'gap_park'
            ELSE 'gap_hold' END
     WHEN NOT c.due THEN 'wait'
     ELSE 'claim' END AS action
   FROM c),
 hc AS MATERIALIZED (
   SELECT h.*, e.event_id, e.event_type, e.schema_version, e.content_type, e.payload, e.headers,
          e.created_at, (h.lease_named OR e.maybe_delivered) AS resend
   FROM h JOIN @T@ e ON e.id = h.id
   WHERE h.action IN ('claim', 'stale', 'gap_park', 'gap_hold', 'bad_key')),
 blk AS (
   UPDATE @Q@ b SET blocked = true
   WHERE b.id = ANY(ARRAY(SELECT h.id FROM h WHERE h.action = 'follower'))
     AND NOT b.parked AND NOT b.blocked
   RETURNING 1),
 prq AS (
   UPDATE @Q@ p SET parked = true
   WHERE p.id = ANY(ARRAY(SELECT h.id FROM h WHERE h.action IN ('stale', 'gap_park', 'bad_key')))
     AND NOT p.parked AND NOT p.blocked
   RETURNING 1),
 prk AS (
   UPDATE @T@ p SET status = 'parked', parked_at = clock_timestamp(),
          park_kind = x.kind, last_error_class = 'permanent',
          last_error_kind = CASE x.kind WHEN 'permanent_error' THEN 'invalid_record' ELSE x.kind END,
          last_error_message = x.msg
   FROM (SELECT h.id,
                CASE h.action WHEN 'stale' THEN 'out_of_order'
                              WHEN 'bad_key' THEN 'permanent_error'
                              ELSE 'version_gap' END AS kind,
                CASE h.action
                  WHEN 'stale' THEN format('version %s is at or below %s', h.aggregate_version, h.last)
                  WHEN 'bad_key' THEN 'aggregate names too long'
                  ELSE format('version %s follows %s: the versions between did not arrive within %s', h.aggregate_version, h.last, $5::int8 * interval '1 microsecond') END AS msg
         FROM h WHERE h.action IN ('stale', 'gap_park', 'bad_key')) x
   WHERE p.id = x.id RETURNING 1),
 hold AS (
   UPDATE @Q@ g SET
          held_since = COALESCE(h.held_since, clock_timestamp()),
          next_attempt_at = LEAST(
            COALESCE(h.held_since, clock_timestamp()) + $5::int8 * interval '1 microsecond',
            clock_timestamp() + $6::int8 * interval '1 microsecond')
   FROM h WHERE g.id = h.id AND h.action = 'gap_hold' AND NOT g.parked AND NOT g.blocked RETURNING 1),
 promote AS (
   UPDATE @Q@ s SET blocked = false
   FROM (SELECT h.k, (SELECT b.id FROM @Q@ b
                 WHERE b.k = h.k AND b.blocked AND b.aggregate_type = h.aggregate_type
                   AND b.aggregate_id = h.aggregate_id AND b.id <> h.id
                 ORDER BY b.aggregate_version, b.id LIMIT 1) AS id
         FROM h WHERE h.action IN ('stale', 'bad_key')) nx
   WHERE s.k = nx.k AND s.id = nx.id AND s.blocked RETURNING 1),
 ins AS (
   INSERT INTO @S@ AS a (aggregate_key, aggregate_type, aggregate_id,
                         lease_owner, lease_token, lease_until, lease_row)
   SELECT h.k, h.aggregate_type, h.aggregate_id, $2, $3,
          clock_timestamp() + $4::int8 * interval '1 microsecond', h.id
   FROM h WHERE h.action = 'claim'
   ON CONFLICT (aggregate_key, aggregate_type, aggregate_id) DO UPDATE
     SET lease_owner = EXCLUDED.lease_owner, lease_token = EXCLUDED.lease_token,
         lease_until = EXCLUDED.lease_until, lease_row = EXCLUDED.lease_row,
         updated_at = clock_timestamp()
     WHERE a.lease_until IS NULL OR a.lease_until <= clock_timestamp()
   RETURNING a.lease_row AS id,
     (extract(epoch FROM a.lease_until - clock_timestamp()) * 1000000)::int8 AS remaining_us),
 mark AS (
   UPDATE @T@ m SET maybe_delivered = true FROM hc
   WHERE m.id = hc.id AND hc.action = 'claim' AND hc.resend AND NOT m.maybe_delivered
   RETURNING 1)
 SELECT hc.id, hc.action, hc.event_id, hc.aggregate_type, hc.aggregate_id, hc.aggregate_version, hc.event_type,
        hc.schema_version, hc.content_type, hc.payload, hc.headers, hc.created_at,
        hc.attempts, hc.k, hc.last, hc.resend, i.remaining_us, (i.id IS NOT NULL) AS claimed
 FROM hc LEFT JOIN ins i ON i.id = hc.id

-- name: lock_keys
SELECT pg_advisory_xact_lock(s.k) FROM (SELECT DISTINCT k FROM UNNEST($1::int8[]) AS k ORDER BY 1) s

-- name: complete
-- A publication: DELETE of the narrow queue row + INSERT of a narrow ack row + the state row's
-- HOT update (lease released, last_version raised). No write of the event row.
-- retry / defer / park (rare): the queue row; park and errors also the event row.
WITH o AS MATERIALIZED (SELECT *, clock_timestamp() AS ts FROM UNNEST(
       $1::int8[], $2::int8[], $3::text[], $4::text[], $5::int8[], $6::text[],
       $7::text[], $8::int4[], $9::int8[], $10::int8[], $11::text[], $12::text[],
       $13::text[], $14::text[], $15::bool[], $16::text[], $17::text[], $18::bool[])
     AS o(id, k, at, ai, v, kind, dest, part, pos, delay_us, eclass, ekind, emsg,
          pkind, uncertain, transport, route, dup)),
 f AS MATERIALIZED (
   SELECT o.* FROM o
   WHERE EXISTS (SELECT 1 FROM @S@ a
                 WHERE a.aggregate_key = o.k AND a.aggregate_type = o.at
                   AND a.aggregate_id = o.ai AND a.lease_token = $19
                   AND a.lease_row = o.id)),
 pub AS (
   DELETE FROM @Q@ q USING f o
   WHERE q.id = o.id AND o.kind = 'published' AND NOT q.parked AND NOT q.blocked
   RETURNING q.id, o.kind, o.k, o.at, o.ai, o.v, o.ts, o.transport, o.dest, o.part, o.pos, o.route, o.dup),
 ack AS (
   @ACK_INSERT@),
 rq AS (
   UPDATE @Q@ q SET
     attempts = CASE WHEN o.kind IN ('retry', 'park') THEN q.attempts + 1 ELSE q.attempts END,
     next_attempt_at = CASE WHEN o.kind IN ('retry', 'defer')
         THEN clock_timestamp() + o.delay_us * interval '1 microsecond' ELSE q.next_attempt_at END,
     parked = (o.kind = 'park')
   FROM f o
   WHERE q.id = o.id AND o.kind IN ('retry', 'defer', 'park') AND NOT q.parked AND NOT q.blocked
   RETURNING q.id, o.kind, o.ts, o.eclass, o.ekind, o.emsg, o.pkind, o.uncertain, q.attempts),
 re AS (
   UPDATE @T@ t SET
     status = CASE WHEN r.kind = 'park' THEN 'parked' ELSE t.status END,
     attempts = r.attempts,
     last_error_class = r.eclass, last_error_kind = r.ekind, last_error_message = r.emsg,
     park_kind = CASE WHEN r.kind = 'park' THEN r.pkind END,
     parked_at = CASE WHEN r.kind = 'park' THEN r.ts END,
     maybe_delivered = t.maybe_delivered OR COALESCE(r.uncertain, false)
   FROM rq r WHERE t.id = r.id RETURNING 1),
 rel AS (
   UPDATE @S@ a SET lease_owner = NULL, lease_token = NULL, lease_until = NULL,
          lease_row = NULL,
          last_version = CASE WHEN f.kind = 'published' AND f.id IN (SELECT p.id FROM pub p)
                              THEN GREATEST(a.last_version, f.v) ELSE a.last_version END,
          updated_at = clock_timestamp()
   FROM f
   WHERE a.aggregate_key = f.k AND a.aggregate_type = f.at
     AND a.aggregate_id = f.ai AND a.lease_token = $19
   RETURNING 1),
 promote AS (
   UPDATE @Q@ s SET blocked = false
   FROM (SELECT p.k, (SELECT b.id FROM @Q@ b
                 WHERE b.k = p.k AND b.blocked AND b.aggregate_type = p.at
                   AND b.aggregate_id = p.ai AND b.id <> p.id
                 ORDER BY b.aggregate_version, b.id LIMIT 1) AS id
         FROM pub p) nx
   WHERE s.k = nx.k AND s.id = nx.id AND s.blocked RETURNING 1)
 SELECT ARRAY(SELECT id FROM pub UNION ALL SELECT id FROM rq) AS applied

-- name: ack_per_event
INSERT INTO @A@ (id, finished_at, ack_transport, ack_destination, ack_partition, ack_position,
                 ack_route, ack_duplicate)
   SELECT p.id, p.ts, p.transport, p.dest, p.part, p.pos, p.route, p.dup FROM pub p
   RETURNING 1
