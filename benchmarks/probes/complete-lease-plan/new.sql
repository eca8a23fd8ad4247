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
