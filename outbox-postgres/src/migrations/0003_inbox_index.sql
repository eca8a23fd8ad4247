-- Cleanup removes one consumer's registrations past its own dedup window.
-- On a table that exists already, the runner builds it after the migrations' transaction,
-- with CREATE INDEX CONCURRENTLY (registrations go on meanwhile; issue 25).
CREATE INDEX IF NOT EXISTS "__TABLE___consumer_at_idx"
    ON "__SCHEMA__"."__TABLE__" (consumer, processed_at);
