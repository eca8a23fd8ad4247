\set aid random(1, 10000)
INSERT INTO outbox.outbox_events (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, schema_version, content_type, payload, headers, created_at) VALUES (gen_random_uuid(), 'order', 'o' || :aid, 1, 'order.changed', 1, 'application/json', decode(repeat('ab', 200), 'hex'), '{"x-trace": "abc"}'::jsonb, now());
