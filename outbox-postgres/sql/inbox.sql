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
