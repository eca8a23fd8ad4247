-- pgbench: the append of today (the event row only); the queue row is written by a
-- statement-level AFTER INSERT trigger (queue_trigger.sql), so every insert path gets one.
\set i random(1, 100000)
INSERT INTO probe25_queue.outbox_events (event_id, aggregate_type, aggregate_id, aggregate_version,
    event_type, schema_version, content_type, payload, headers, created_at, inserted_at)
VALUES (gen_random_uuid(), 'order', 'order-' || :i, 1, 'order.changed', 1, 'application/json',
        convert_to(repeat('x', 207), 'UTF8'), '{}', now(), clock_timestamp());
