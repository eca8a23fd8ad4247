-- Ablation c of today's decision, for cost attribution only (NOT the same semantics).
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
                        AND a.aggregate_type = r.aggregate_type AND a.aggregate_id = r.aggregate_id LIMIT 1) a ON true)
 SELECT count(*) FROM c
