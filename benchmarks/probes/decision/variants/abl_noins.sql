-- Ablation noins of today's decision, for cost attribution only (NOT the same semantics).
-- name: decide
WITH prm AS (SELECT $2::text AS o, $3::uuid AS t, $4::int8 AS l, $5::int8 AS g, $6::int8 AS r), c AS MATERIALIZED (
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
 mark AS (
   UPDATE @T@ m SET maybe_delivered = true FROM h
   WHERE m.id = h.id AND h.action = 'claim' AND h.resend AND NOT m.maybe_delivered
   RETURNING 1)
 SELECT h.id, h.action, h.event_id, h.aggregate_type, h.aggregate_id, h.aggregate_version, h.event_type,
        h.schema_version, h.content_type, h.payload, h.headers, h.created_at,
        h.attempts, h.k, h.last, h.resend, i.remaining_us, (i.id IS NOT NULL) AS claimed
 FROM h LEFT JOIN (SELECT NULL::int8 AS id, NULL::int8 AS remaining_us WHERE false) i ON i.id = h.id
 WHERE h.action IN ('claim', 'stale', 'gap_park', 'gap_hold', 'bad_key')

