-- outbox-postgres migration 5: one index entry fewer per completed event.
--
-- A completion changes `status`, which the partial indexes' predicates read, so its update is
-- never HOT: every index whose predicate the published row matches gets a new entry. The
-- published rows had two such time indexes, `finished_idx` (retention, cleanup) and
-- `published_at_idx` (publish latency over a recent window). A completion now writes one time
-- into both `published_at` and `finished_at`, so the window queries filter published rows on
-- `finished_at` through `finished_idx`, and `published_at_idx` goes.
DROP INDEX IF EXISTS "__SCHEMA__"."__TABLE___published_at_idx";
