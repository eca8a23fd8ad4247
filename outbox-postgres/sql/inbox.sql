-- outbox-postgres inbox migration 1: deduplication of consumed events.
CREATE SCHEMA IF NOT EXISTS "outbox";

CREATE TABLE IF NOT EXISTS "outbox"."processed_events" (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Retention cleanup of the dedup window.
CREATE INDEX IF NOT EXISTS "processed_events_processed_at_idx"
    ON "outbox"."processed_events" (processed_at);
-- outbox-postgres inbox migration 2: per-aggregate versions, parked messages and their audit.

-- What a consumer knows about each aggregate: the last version it applied (or an operator
-- discarded) and whether a parked message blocks the aggregate's later messages.
CREATE TABLE IF NOT EXISTS "outbox"."processed_events_aggregates" (
    consumer        text        NOT NULL,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    applied_version bigint,
    blocked         boolean     NOT NULL DEFAULT false,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
);

-- Messages a consumer could not apply (status 'parked', kind 'unprocessable' or 'version_gap')
-- and those waiting behind them ('waiting'), with the raw record; kept after resolution
-- ('applied', 'skipped', 'discarded') for the audit trail.
CREATE TABLE IF NOT EXISTS "outbox"."processed_events_parked" (
    id                bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer          text        NOT NULL,
    topic             text        NOT NULL,
    "partition"       integer     NOT NULL,
    "offset"          bigint      NOT NULL,
    record_key        bytea,
    header_names      text[]      NOT NULL,
    header_values     bytea[]     NOT NULL,
    value             bytea,
    aggregate_type    text,
    aggregate_id      text,
    event_id          uuid,
    dedup_id          uuid,
    aggregate_version bigint,
    status            text        NOT NULL
        CHECK (status IN ('parked', 'waiting', 'applied', 'skipped', 'discarded')),
    kind              text,
    reason            text        NOT NULL,
    attempts          integer     NOT NULL,
    parked_at         timestamptz NOT NULL DEFAULT now(),
    resolved_at       timestamptz,
    CHECK (cardinality(header_names) = cardinality(header_values))
);

-- A redelivered message is parked once: by its dedup id, or by its position when undecodable.
CREATE UNIQUE INDEX IF NOT EXISTS "processed_events_parked_dedup_idx"
    ON "outbox"."processed_events_parked" (consumer, dedup_id) WHERE dedup_id IS NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS "processed_events_parked_position_idx"
    ON "outbox"."processed_events_parked" (consumer, topic, "partition", "offset")
    WHERE dedup_id IS NULL;
-- Open messages of an aggregate, in release order.
CREATE INDEX IF NOT EXISTS "processed_events_parked_open_idx"
    ON "outbox"."processed_events_parked" (consumer, aggregate_type, aggregate_id, aggregate_version, id)
    WHERE status IN ('parked', 'waiting');

-- Every operator action on a parked message.
CREATE TABLE IF NOT EXISTS "outbox"."processed_events_audit" (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer  text        NOT NULL,
    parked_id bigint      NOT NULL,
    action    text        NOT NULL,
    actor     text        NOT NULL,
    reason    text        NOT NULL,
    outcome   text        NOT NULL,
    at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS "processed_events_audit_parked_idx"
    ON "outbox"."processed_events_audit" (consumer, parked_id);
-- outbox-postgres inbox migration 3: operator retry requests, per-consumer cleanup.

-- A retry requested by an operator (`outbox parked retry --consumer`): the consumer service,
-- which has the handler, performs it at its next check and clears the request.
ALTER TABLE "outbox"."processed_events_parked"
    ADD COLUMN IF NOT EXISTS retry_requested_at     timestamptz,
    ADD COLUMN IF NOT EXISTS retry_requested_by     text,
    ADD COLUMN IF NOT EXISTS retry_requested_reason text;
CREATE INDEX IF NOT EXISTS "processed_events_parked_retry_idx"
    ON "outbox"."processed_events_parked" (consumer, retry_requested_at)
    WHERE retry_requested_at IS NOT NULL;

-- Cleanup removes one consumer's registrations past its own dedup window.
-- On a table that exists already, the runner builds it after the migrations' transaction,
-- with CREATE INDEX CONCURRENTLY (registrations go on meanwhile; issue 25).
CREATE INDEX IF NOT EXISTS "processed_events_consumer_at_idx"
    ON "outbox"."processed_events" (consumer, processed_at);
-- outbox-postgres inbox migration 4: each registration keeps the aggregate it was made for.

-- A re-issued copy is deduplicated by its original's id, but only against an event of its own
-- aggregate: a record naming another aggregate's event as its original is not a copy of it.
-- A hash of (aggregate type, aggregate id) computed by the store; NULL for registrations made
-- before this migration or without an aggregate, which stay duplicates of any later copy.
ALTER TABLE "outbox"."processed_events"
    ADD COLUMN IF NOT EXISTS aggregate uuid;
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
ALTER TABLE "outbox"."processed_events_parked"
    ADD COLUMN IF NOT EXISTS native_transport   text,
    ADD COLUMN IF NOT EXISTS native_sequence    bigint,
    ADD COLUMN IF NOT EXISTS native_consumer    text,
    ADD COLUMN IF NOT EXISTS native_exchange    text,
    ADD COLUMN IF NOT EXISTS native_routing_key text,
    ADD COLUMN IF NOT EXISTS native_redelivered boolean;
