-- Scheme C ("queue + row lease"): scheme A (queue.sql) with the lease of lease mode moved from
-- the aggregate-state row onto the claimed event's queue row. The state row is then written
-- once per event (at completion: last_version), not twice (lease at claim, release at
-- completion), and nothing reads it for the lease: the candidates check the lease of their
-- aggregate's first unfinished queue row, the completion is fenced by its own DELETE
-- (`lease_token = $19`).
--
-- Why a row lease is still a per-aggregate lease: only a head (version = last_version + 1) is
-- ever claimed, and last_version changes only by that head's completion or by operator actions
-- refused while a lower version waits. So every live lease of an aggregate sits on a queue row
-- with version = last_version + 1; the decision probes exactly that range ('busy') before it
-- claims, which covers the row that was appended late with the same version and a lower id.
-- Uses queue.sql's tables plus three columns; @ACK_INSERT@ as in queue.sql.

-- name: ddl
ALTER TABLE @Q@ ADD COLUMN lease_owner text, ADD COLUMN lease_token uuid,
                ADD COLUMN lease_until timestamptz;
-- Room for the claim's update of every row of a page (a claim takes them in id order): HOT.
ALTER TABLE @Q@ SET (fillfactor = 45);

-- name: candidates
-- The aggregate's first unfinished, unblocked queue row must not be under a live lease (the
-- head in flight: its followers are not even try-locked, as today with the state-row probe).
SELECT c.id FROM @Q@ c
 WHERE NOT c.parked AND NOT c.blocked
   AND CASE WHEN c.next_attempt_at <= now()
             AND NOT COALESCE((SELECT u.lease_until > clock_timestamp() FROM @Q@ u
                               WHERE u.k = c.k AND u.aggregate_type = c.aggregate_type
                                 AND u.aggregate_id = c.aggregate_id AND NOT u.blocked
                               ORDER BY u.aggregate_version, u.id LIMIT 1), false)
            THEN pg_try_advisory_xact_lock(c.k # (@SEED@)) ELSE false END
 ORDER BY c.id LIMIT $1

-- name: decide
WITH c AS MATERIALIZED (
   SELECT q.id, q.k, q.aggregate_type, q.aggregate_id, q.aggregate_version, q.attempts, q.held_since,
          q.next_attempt_at <= now() AS due,
          COALESCE(a.last_version, 0) AS last,
          (a.last_version IS NOT NULL) AS known,
          COALESCE(q.lease_until > clock_timestamp(), false) AS leased,
          (q.lease_token IS NOT NULL) AS lease_named
   FROM UNNEST($1::int8[]) AS x(id)
   CROSS JOIN LATERAL (SELECT * FROM @Q@ q
                       WHERE q.id = x.id AND NOT q.parked AND NOT q.blocked OFFSET 0) q
   LEFT JOIN LATERAL (SELECT a.last_version
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
     -- busy: another row of the aggregate (same version, later id) is in flight
     WHEN EXISTS (SELECT 1 FROM @Q@ u
                  WHERE u.k = c.k AND u.aggregate_version = c.last + 1 AND u.id <> c.id
                    AND u.aggregate_type = c.aggregate_type AND u.aggregate_id = c.aggregate_id
                    AND u.lease_until > clock_timestamp()) THEN 'wait'
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
   UPDATE @Q@ p SET parked = true, lease_owner = NULL, lease_token = NULL, lease_until = NULL
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
   UPDATE @Q@ l SET lease_owner = $2, lease_token = $3,
          lease_until = clock_timestamp() + $4::int8 * interval '1 microsecond'
   WHERE l.id = ANY(ARRAY(SELECT h.id FROM h WHERE h.action = 'claim'))
     AND NOT l.parked AND NOT l.blocked
     AND (l.lease_until IS NULL OR l.lease_until <= clock_timestamp())
   RETURNING l.id,
     (extract(epoch FROM l.lease_until - clock_timestamp()) * 1000000)::int8 AS remaining_us),
 mark AS (
   UPDATE @T@ m SET maybe_delivered = true FROM hc
   WHERE m.id = hc.id AND hc.action = 'claim' AND hc.resend AND NOT m.maybe_delivered
   RETURNING 1)
 SELECT hc.id, hc.action, hc.event_id, hc.aggregate_type, hc.aggregate_id, hc.aggregate_version, hc.event_type,
        hc.schema_version, hc.content_type, hc.payload, hc.headers, hc.created_at,
        hc.attempts, hc.k, hc.last, hc.resend, i.remaining_us, (i.id IS NOT NULL) AS claimed
 FROM hc LEFT JOIN ins i ON i.id = hc.id

-- name: complete
-- Fencing is the DELETE's own condition: only queue rows whose lease still carries this
-- claim's token get an outcome. A publication: queue row deleted, ack row inserted, the
-- state row's last_version raised (created at the aggregate's first publication).
WITH o AS MATERIALIZED (SELECT *, clock_timestamp() AS ts FROM UNNEST(
       $1::int8[], $2::int8[], $3::text[], $4::text[], $5::int8[], $6::text[],
       $7::text[], $8::int4[], $9::int8[], $10::int8[], $11::text[], $12::text[],
       $13::text[], $14::text[], $15::bool[], $16::text[], $17::text[], $18::bool[])
     AS o(id, k, at, ai, v, kind, dest, part, pos, delay_us, eclass, ekind, emsg,
          pkind, uncertain, transport, route, dup)),
 pub AS (
   DELETE FROM @Q@ q USING o
   WHERE q.id = o.id AND o.kind = 'published' AND q.lease_token = $19
     AND NOT q.parked AND NOT q.blocked
   RETURNING q.id, o.kind, o.k, o.at, o.ai, o.v, o.ts, o.transport, o.dest, o.part, o.pos, o.route, o.dup),
 ack AS (
   @ACK_INSERT@),
 rq AS (
   UPDATE @Q@ q SET
     attempts = CASE WHEN o.kind IN ('retry', 'park') THEN q.attempts + 1 ELSE q.attempts END,
     next_attempt_at = CASE WHEN o.kind IN ('retry', 'defer')
         THEN clock_timestamp() + o.delay_us * interval '1 microsecond' ELSE q.next_attempt_at END,
     parked = (o.kind = 'park'), lease_owner = NULL, lease_token = NULL, lease_until = NULL
   FROM o
   WHERE q.id = o.id AND o.kind IN ('retry', 'defer', 'park', 'release') AND q.lease_token = $19
     AND NOT q.parked AND NOT q.blocked
   RETURNING q.id, o.kind, o.ts, o.eclass, o.ekind, o.emsg, o.pkind, o.uncertain, q.attempts),
 re AS (
   UPDATE @T@ t SET
     status = CASE WHEN r.kind = 'park' THEN 'parked' ELSE t.status END,
     attempts = r.attempts,
     last_error_class = r.eclass, last_error_kind = r.ekind, last_error_message = r.emsg,
     park_kind = CASE WHEN r.kind = 'park' THEN r.pkind END,
     parked_at = CASE WHEN r.kind = 'park' THEN r.ts END,
     maybe_delivered = t.maybe_delivered OR COALESCE(r.uncertain, false)
   FROM rq r WHERE t.id = r.id AND r.kind <> 'release' RETURNING 1),
 st AS (
   INSERT INTO @S@ AS a (aggregate_key, aggregate_type, aggregate_id, last_version)
   SELECT p.k, p.at, p.ai, p.v FROM pub p
   ON CONFLICT (aggregate_key, aggregate_type, aggregate_id) DO UPDATE
     SET last_version = GREATEST(a.last_version, EXCLUDED.last_version),
         updated_at = clock_timestamp()
   RETURNING 1),
 promote AS (
   UPDATE @Q@ s SET blocked = false
   FROM (SELECT p.k, (SELECT b.id FROM @Q@ b
                 WHERE b.k = p.k AND b.blocked AND b.aggregate_type = p.at
                   AND b.aggregate_id = p.ai AND b.id <> p.id
                 ORDER BY b.aggregate_version, b.id LIMIT 1) AS id
         FROM pub p) nx
   WHERE s.k = nx.k AND s.id = nx.id AND s.blocked RETURNING 1)
 SELECT ARRAY(SELECT id FROM pub UNION ALL SELECT id FROM rq WHERE kind <> 'release') AS applied
