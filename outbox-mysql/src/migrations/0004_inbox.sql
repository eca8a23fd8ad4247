-- outbox-mysql inbox migration 4: a parked message keeps its transport's own position.
--
-- Beside (topic, partition, offset), which the engine orders and commits by, a parked message
-- keeps what the transport calls it (docs/transports.md §3): Kafka ('kafka'; the coordinates
-- are the identity), JetStream ('nats', stream sequence, durable consumer; `offset` is the
-- consumer's delivery sequence), RabbitMQ ('rabbitmq', exchange, routing key, redelivered;
-- `offset` is the channel's delivery tag). A transport fills only its own columns.
--
-- Rows written before have no transport and read back as the Kafka positions they were read
-- as then. Unlike outbox migration 2 there is no 'kafka' default for them: consumers of the
-- previous version go on parking rows without a transport during a rolling upgrade, so "no
-- transport" must read as Kafka anyway. Nullable columns without a default are an instant
-- ADD COLUMN (MySQL 8.0.12+, MariaDB 10.3+): no row is rewritten. The statement runs again
-- after a failure (a duplicate column, 1060, is taken as applied).
ALTER TABLE __Q__`__TABLE___parked`
    ADD COLUMN native_transport   VARCHAR(16) NULL,
    ADD COLUMN native_sequence    BIGINT      NULL,
    ADD COLUMN native_consumer    TEXT        NULL,
    ADD COLUMN native_exchange    TEXT        NULL,
    ADD COLUMN native_routing_key TEXT        NULL,
    ADD COLUMN native_redelivered TINYINT(1)  NULL;
