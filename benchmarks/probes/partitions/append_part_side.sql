-- pgbench: the same append into the partitioned table; the trigger writes the side table row.
\set i random(1, 100000)
INSERT INTO probe_part25_ab_side.outbox_events (event_id, aggregate_type, aggregate_id, aggregate_version,
    event_type, schema_version, content_type, payload, headers, created_at, inserted_at)
VALUES (gen_random_uuid(), 'order', 'order-' || :i, 1, 'order.changed', 1, 'application/json',
        convert_to(repeat('x', 207), 'UTF8'), '{}', now(), clock_timestamp());
