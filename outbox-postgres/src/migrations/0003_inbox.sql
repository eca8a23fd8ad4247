-- outbox-postgres inbox migration 3: operator retry requests, per-consumer cleanup.

-- A retry requested by an operator (`outbox parked retry --consumer`): the consumer service,
-- which has the handler, performs it at its next check and clears the request.
ALTER TABLE "__SCHEMA__"."__TABLE___parked"
    ADD COLUMN IF NOT EXISTS retry_requested_at     timestamptz,
    ADD COLUMN IF NOT EXISTS retry_requested_by     text,
    ADD COLUMN IF NOT EXISTS retry_requested_reason text;
CREATE INDEX IF NOT EXISTS "__TABLE___parked_retry_idx"
    ON "__SCHEMA__"."__TABLE___parked" (consumer, retry_requested_at)
    WHERE retry_requested_at IS NOT NULL;

