-- Rows by creation time: reconciliation per interval and replay by time range.
-- On a table that exists already, the runner builds it after the migrations' transaction,
-- with CREATE INDEX CONCURRENTLY (appends go on meanwhile; issue 25).
CREATE INDEX IF NOT EXISTS "__TABLE___created_at_idx"
    ON "__SCHEMA__"."__TABLE__" (created_at);
