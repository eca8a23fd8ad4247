-- pgbench: one append per transaction in the queue schemes: the event row and its queue row in
-- one statement (what the Rust append and outbox_events_append would send).
\set i random(1, 100000)
WITH e AS (
  INSERT INTO probe25_queue.outbox_events (event_id, aggregate_type, aggregate_id, aggregate_version,
      event_type, schema_version, content_type, payload, headers, created_at, inserted_at)
  VALUES (gen_random_uuid(), 'order', 'order-' || :i, 1, 'order.changed', 1, 'application/json',
          convert_to(repeat('x', 207), 'UTF8'), '{}', now(), clock_timestamp())
  RETURNING id, aggregate_type, aggregate_id, aggregate_version, inserted_at)
INSERT INTO probe25_queue.outbox_events_queue (id, k, aggregate_type, aggregate_id, aggregate_version, inserted_at)
SELECT id, hashtextextended(aggregate_type || chr(31) || aggregate_id, 0), aggregate_type, aggregate_id,
       aggregate_version, inserted_at FROM e;
