-- outbox-postgres inbox migration 4: each registration keeps the aggregate it was made for.

-- A re-issued copy is deduplicated by its original's id, but only against an event of its own
-- aggregate: a record naming another aggregate's event as its original is not a copy of it.
-- A hash of (aggregate type, aggregate id) computed by the store; NULL for registrations made
-- before this migration or without an aggregate, which stay duplicates of any later copy.
ALTER TABLE "__SCHEMA__"."__TABLE__"
    ADD COLUMN IF NOT EXISTS aggregate uuid;
