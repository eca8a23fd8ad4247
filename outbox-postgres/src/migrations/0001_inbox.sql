-- outbox-postgres inbox migration 1: deduplication of consumed events.
CREATE SCHEMA IF NOT EXISTS "__SCHEMA__";

CREATE TABLE IF NOT EXISTS "__SCHEMA__"."__TABLE__" (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Retention cleanup of the dedup window.
CREATE INDEX IF NOT EXISTS "__TABLE___processed_at_idx"
    ON "__SCHEMA__"."__TABLE__" (processed_at);
