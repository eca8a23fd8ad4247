-- outbox-postgres migration 6: an aggregate's last version is unknown until something of it
-- is published or discarded.
--
-- A lease claim creates the aggregate's state row to hold its lease. Before this migration the
-- row got `last_version` 0 from the column default, so a claim that ended without a
-- publication (a release, a deferral during a broker outage, a retry, a relay's crash) left
-- the aggregate with a known last version of 0: with `accept_first_version` its head (version
-- N > 1) was then held as a version gap and parked. Now `last_version` is NULL until a
-- publication or a discard sets it, and every reader treats NULL as "no state": version 1 is
-- next, or, with `accept_first_version`, the aggregate's lowest unfinished version.
--
-- Safe beside relays of the previous version: they insert state rows without naming
-- `last_version` (now NULL, which they read through the same COALESCE), and they raise it
-- with GREATEST, which ignores a NULL. The ALTERs lock the state table first, so the repair
-- below sees every committed claim and no claim of either version writes meanwhile.
ALTER TABLE "__SCHEMA__"."__TABLE___aggregate" ALTER COLUMN last_version DROP NOT NULL;
ALTER TABLE "__SCHEMA__"."__TABLE___aggregate" ALTER COLUMN last_version DROP DEFAULT;

-- Repair: 0 was only ever written for "nothing published or discarded yet" (a lease claim's
-- default, or an operator's retry of a version 1), which NULL now says. For stores without
-- `accept_first_version` the two mean the same; with it, aggregates held as a gap for this
-- reason flow again (those already parked as a version gap need an operator's retry).
UPDATE "__SCHEMA__"."__TABLE___aggregate" SET last_version = NULL WHERE last_version = 0;
