-- Ablation norare of today's decision, for cost attribution only (NOT the same semantics).
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
     (extract(epoch FROM a.lease_until - clock_timestamp()) * 1000000)::int8 AS remaining_us)
 SELECT h.id, h.action, h.event_id, h.aggregate_type, h.aggregate_id, h.aggregate_version, h.event_type,
        h.schema_version, h.content_type, h.payload, h.headers, h.created_at,
        h.attempts, h.k, h.last, h.resend, i.remaining_us, (i.id IS NOT NULL) AS claimed
 FROM h LEFT JOIN ins i ON i.id = h.id
 WHERE h.action IN ('claim', 'stale', 'gap_park', 'gap_hold', 'bad_key')

