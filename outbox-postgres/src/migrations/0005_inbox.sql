-- outbox-postgres inbox migration 5: a parked message keeps its transport's own position.
--
-- Beside (topic, partition, offset), which the engine orders and commits by, a parked message
-- keeps what the transport calls it (docs/transports.md §3): Kafka ('kafka'; the coordinates
-- are the identity), JetStream ('nats', stream sequence, durable consumer; `offset` is the
-- consumer's delivery sequence), RabbitMQ ('rabbitmq', exchange, routing key, redelivered;
-- `offset` is the channel's delivery tag). A transport fills only its own columns.
--
-- Rows written before have no transport and read back as the Kafka positions they were read
-- as then. Unlike outbox migration 8 there is no 'kafka' default for them: consumers of the
-- previous version go on parking rows without a transport during a rolling upgrade, so "no
-- transport" must read as Kafka anyway. Nullable columns without a default: catalog-only, the
-- table is not rewritten. Like the other migrations it can run again (a no-op).
ALTER TABLE "__SCHEMA__"."__TABLE___parked"
    ADD COLUMN IF NOT EXISTS native_transport   text,
    ADD COLUMN IF NOT EXISTS native_sequence    bigint,
    ADD COLUMN IF NOT EXISTS native_consumer    text,
    ADD COLUMN IF NOT EXISTS native_exchange    text,
    ADD COLUMN IF NOT EXISTS native_routing_key text,
    ADD COLUMN IF NOT EXISTS native_redelivered boolean;
