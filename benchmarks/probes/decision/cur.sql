-- Today's lease-mode claim and completion (outbox-postgres/src/sql.rs at 0493d1c), transcribed verbatim
-- for accept_first_version = false: claim_candidates, claim_decide_lease (decide(5, 6)), lock_keys,
-- complete_lease (with the token as a column of the outcomes, 52bc839). Placeholders as in
-- ../completion/cur.sql: @T@ event table, @S@ aggregate-state table, @SEED@ the per-table seed.

-- name: candidates
SELECT c.id FROM @T@ c
 WHERE c.status = 'pending' AND NOT c.blocked
   AND CASE WHEN c.next_attempt_at <= now()
             AND NOT EXISTS (SELECT 1 FROM @S@ a
                             WHERE a.aggregate_key = hashtextextended(c.aggregate_type || chr(31) || c.aggregate_id, 0)
                               AND a.aggregate_type = c.aggregate_type AND a.aggregate_id = c.aggregate_id
                               AND a.lease_until > clock_timestamp())
            THEN pg_try_advisory_xact_lock(hashtextextended(c.aggregate_type || chr(31) || c.aggregate_id, 0) # (@SEED@)) ELSE false END
 ORDER BY c.id LIMIT $1

-- name: decide
WITH c AS MATERIALIZED (
   SELECT r.id, r.event_id, r.aggregate_type, r.aggregate_id, r.aggregate_version, r.event_type,
          r.schema_version, r.content_type, r.payload, r.headers, r.created_at,
          r.attempts, r.held_since, hashtextextended(r.aggregate_type || chr(31) || r.aggregate_id, 0) AS k,
          r.next_attempt_at <= now() AS due,
          COALESCE(a.last_version, 0) AS last,
          (a.last_version IS NOT NULL) AS known,
          COALESCE(a.lease_until > clock_timestamp(), false) AS leased,
          (COALESCE(a.lease_row = r.id, false) OR r.maybe_delivered) AS resend
   FROM UNNEST($1::int8[]) AS x(id)
   CROSS JOIN LATERAL (SELECT * FROM @T@ r
                       WHERE r.id = x.id AND r.status = 'pending'
                         AND NOT r.blocked OFFSET 0) r
   LEFT JOIN LATERAL (SELECT a.last_version, a.lease_until, a.lease_row
                      FROM @S@ a WHERE a.aggregate_key = hashtextextended(r.aggregate_type || chr(31) || r.aggregate_id, 0)
                        AND a.aggregate_type = r.aggregate_type AND a.aggregate_id = r.aggregate_id LIMIT 1) a ON true),
 h AS MATERIALIZED (
   SELECT c.*, CASE
     WHEN octet_length(c.aggregate_type) > 1024
       OR octet_length(c.aggregate_id) > 1024 THEN 'bad_key'
     WHEN c.leased THEN 'wait'
     WHEN c.aggregate_version <= c.last THEN 'stale'
     WHEN EXISTS (SELECT 1 FROM @T@ u
                  WHERE hashtextextended(u.aggregate_type || chr(31) || u.aggregate_id, 0) = c.k AND u.status IN ('pending', 'parked')
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
 blk AS (
   UPDATE @T@ b SET blocked = true
   WHERE b.id = ANY(ARRAY(SELECT h.id FROM h WHERE h.action = 'follower'))
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
                  WHEN 'stale' THEN CASE WHEN h.known THEN format('version %s is at or below %s, the last version published or discarded for its aggregate',
                    h.aggregate_version, h.last) ELSE format('version %s is below %s, the first version of its aggregate (nothing of it published or discarded yet), which may have reached the broker already', h.aggregate_version, h.last + 1) END
                  WHEN 'bad_key' THEN format('aggregate_type (%s bytes) or aggregate_id (%s bytes) is longer than 1024 bytes, the most a store can key an aggregate by: discard it and append the event again under shorter names',
                    octet_length(h.aggregate_type), octet_length(h.aggregate_id))
                  ELSE format('version %s follows %s: the versions between did not arrive within %s', h.aggregate_version, h.last, $5::int8 * interval '1 microsecond') END AS msg
         FROM h WHERE h.action IN ('stale', 'gap_park', 'bad_key')) x
   WHERE p.id = x.id RETURNING 1),
 hold AS (
   UPDATE @T@ g SET
          held_since = COALESCE(h.held_since, clock_timestamp()),
          next_attempt_at = LEAST(
            COALESCE(h.held_since, clock_timestamp()) + $5::int8 * interval '1 microsecond',
            clock_timestamp() + $6::int8 * interval '1 microsecond'),
          last_error_class = 'transient', last_error_kind = 'version_gap',
          last_error_message = format('waiting for version %s of the aggregate (the last published or discarded is %s)', h.last + 1, h.last)
   FROM h WHERE g.id = h.id AND h.action = 'gap_hold' RETURNING 1),
 promote AS (
   UPDATE @T@ s SET blocked = false
   FROM (SELECT (SELECT b.id FROM @T@ b
                 WHERE hashtextextended(b.aggregate_type || chr(31) || b.aggregate_id, 0) = h.k AND b.status IN ('pending', 'parked')
                   AND b.blocked AND b.aggregate_type = h.aggregate_type
                   AND b.aggregate_id = h.aggregate_id AND b.id <> h.id
                 ORDER BY b.aggregate_version, b.id LIMIT 1) AS id
         FROM h WHERE h.action IN ('stale', 'bad_key')) nx
   WHERE s.id = nx.id AND s.blocked RETURNING 1),
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
   UPDATE @T@ m SET maybe_delivered = true FROM h
   WHERE m.id = h.id AND h.action = 'claim' AND h.resend AND NOT m.maybe_delivered
   RETURNING 1)
 SELECT h.id, h.action, h.event_id, h.aggregate_type, h.aggregate_id, h.aggregate_version, h.event_type,
        h.schema_version, h.content_type, h.payload, h.headers, h.created_at,
        h.attempts, h.k, h.last, h.resend, i.remaining_us, (i.id IS NOT NULL) AS claimed
 FROM h LEFT JOIN ins i ON i.id = h.id
 WHERE h.action IN ('claim', 'stale', 'gap_park', 'gap_hold', 'bad_key')

-- name: lock_keys
SELECT pg_advisory_xact_lock(s.k) FROM (SELECT DISTINCT k FROM UNNEST($1::int8[]) AS k ORDER BY 1) s

-- name: complete
WITH o AS MATERIALIZED (SELECT *, clock_timestamp() AS ts, $19::uuid AS tok FROM UNNEST(
       $1::int8[], $2::int8[], $3::text[], $4::text[], $5::int8[], $6::text[],
       $7::text[], $8::int4[], $9::int8[], $10::int8[], $11::text[], $12::text[],
       $13::text[], $14::text[], $15::bool[], $16::text[], $17::text[], $18::bool[])
     AS o(id, k, at, ai, v, kind, dest, part, pos, delay_us, eclass, ekind, emsg,
          pkind, uncertain, transport, route, dup)),
 f AS MATERIALIZED (
   SELECT o.* FROM o
   WHERE EXISTS (SELECT 1 FROM @S@ a
                 WHERE a.aggregate_key = o.k AND a.aggregate_type = o.at
                   AND a.aggregate_id = o.ai AND a.lease_token = o.tok
                   AND a.lease_row = o.id)),
 upd AS (
   UPDATE @T@ t SET
     status = CASE o.kind WHEN 'published' THEN 'published' WHEN 'park' THEN 'parked' ELSE 'pending' END,
     attempts = CASE WHEN o.kind IN ('retry', 'park') THEN t.attempts + 1 ELSE t.attempts END,
     next_attempt_at = CASE WHEN o.kind IN ('retry', 'defer')
         THEN clock_timestamp() + o.delay_us * interval '1 microsecond' ELSE t.next_attempt_at END,
     published_at = CASE WHEN o.kind = 'published' THEN o.ts END,
     finished_at = CASE WHEN o.kind = 'published' THEN o.ts END,
     ack_transport = o.transport, ack_destination = o.dest, ack_partition = o.part,
     ack_position = o.pos, ack_route = o.route, ack_duplicate = o.dup,
     last_error_class = CASE WHEN o.kind = 'published' THEN t.last_error_class ELSE o.eclass END,
     last_error_kind = CASE WHEN o.kind = 'published' THEN t.last_error_kind ELSE o.ekind END,
     last_error_message = CASE WHEN o.kind = 'published' THEN t.last_error_message ELSE o.emsg END,
     park_kind = CASE WHEN o.kind = 'park' THEN o.pkind END,
     parked_at = CASE WHEN o.kind = 'park' THEN o.ts END,
     maybe_delivered = t.maybe_delivered OR COALESCE(o.uncertain, false)
   FROM f o
   WHERE t.id = o.id AND t.status = 'pending' AND o.kind <> 'release'
   RETURNING t.id, o.kind, o.k, o.at, o.ai, o.v),
 rel AS (
   UPDATE @S@ a SET lease_owner = NULL, lease_token = NULL, lease_until = NULL,
          lease_row = NULL,
          last_version = CASE WHEN f.kind = 'published' AND f.id IN (SELECT u.id FROM upd u)
                              THEN GREATEST(a.last_version, f.v) ELSE a.last_version END,
          updated_at = clock_timestamp()
   FROM f
   WHERE a.aggregate_key = f.k AND a.aggregate_type = f.at
     AND a.aggregate_id = f.ai AND a.lease_token = f.tok
   RETURNING 1),
 promote AS (
   UPDATE @T@ s SET blocked = false
   FROM (SELECT (SELECT b.id FROM @T@ b
                 WHERE hashtextextended(b.aggregate_type || chr(31) || b.aggregate_id, 0) = p.k AND b.status IN ('pending', 'parked')
                   AND b.blocked AND b.aggregate_type = p.at
                   AND b.aggregate_id = p.ai AND b.id <> p.id
                 ORDER BY b.aggregate_version, b.id LIMIT 1) AS id
         FROM (SELECT * FROM upd WHERE kind = 'published') p) nx
   WHERE s.id = nx.id AND s.blocked RETURNING 1)
 SELECT ARRAY(SELECT id FROM upd) AS applied
