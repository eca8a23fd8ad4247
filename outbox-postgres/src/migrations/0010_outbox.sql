-- outbox-postgres migration 10: the held version gaps, without reading the backlog.
--
-- The stats (`outbox status`, the relay's metrics) list the aggregates whose head a claim
-- holds as a version gap: pending rows with `held_since`. Without an index that was a read of
-- every pending row (170 ms at 300,000 pending, issue 25). This index holds only those rows,
-- normally none: an append writes no entry (a new row has no `held_since`), a claim that
-- holds a gap writes one, and the completion or park that ends it leaves the predicate.
-- On a table that exists already, the runner builds it after the migrations' transaction,
-- with CREATE INDEX CONCURRENTLY (appends go on meanwhile; issue 25).
CREATE INDEX IF NOT EXISTS "__TABLE___held_idx"
    ON "__SCHEMA__"."__TABLE__" (id)
    WHERE status = 'pending' AND held_since IS NOT NULL;
