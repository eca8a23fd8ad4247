-- outbox-postgres migration 3: per-aggregate delivery state.
--
-- One narrow row per aggregate ever seen by a claim, keyed exactly by (type, id) behind the
-- 64-bit aggregate key of migration 2 (probes compare the key first, the text only on a key
-- match, so two aggregates whose keys collide keep apart states). It holds
--   * last_version: the highest version published or discarded. A claim hands out an
--     aggregate's head only when its version is last_version + 1, so a lower version that
--     commits after a higher one is never published after it. It survives cleanup of old
--     event rows, so the table keeps one row per aggregate (about 100 bytes each);
--   * the lease of the lease claim mode (it replaces "<table>_lease"): owner, token, expiry and
--     the event row under lease. A released lease keeps the row (in-place HOT update at the
--     next claim of the aggregate: no index column changes).
-- Every writer of an aggregate's delivery state (claims, completions, releases, operator
-- actions) takes the aggregate's advisory lock first and decides in a snapshot taken after it.
CREATE TABLE IF NOT EXISTS "__SCHEMA__"."__TABLE___aggregate" (
    aggregate_key   bigint      NOT NULL,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    last_version    bigint      NOT NULL DEFAULT 0 CHECK (last_version >= 0),
    lease_owner     text,
    lease_token     uuid,
    lease_until     timestamptz,
    lease_row       bigint,
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (aggregate_key, aggregate_type, aggregate_id)
) WITH (fillfactor = 50);

-- The state of aggregates that already have rows (in the table, or archived by cleanup): the
-- last version published or discarded that is still retained, or, where cleanup removed
-- those rows without archiving them, one below the lowest unfinished version (what the relay
-- would have handed out next). An aggregate none of whose rows is left has no state: its next
-- event must be version 1, or it is held as a version gap (see the upgrade note in the crate
-- docs: `accept_first_version`).
INSERT INTO "__SCHEMA__"."__TABLE___aggregate" (aggregate_key, aggregate_type, aggregate_id, last_version)
SELECT hashtextextended(aggregate_type || chr(31) || aggregate_id, 0), aggregate_type, aggregate_id,
       GREATEST(0, COALESCE(
           max(aggregate_version) FILTER (WHERE status IN ('published', 'discarded')),
           min(aggregate_version) FILTER (WHERE status IN ('pending', 'parked')) - 1,
           0))
FROM (SELECT aggregate_type, aggregate_id, aggregate_version, status
        FROM "__SCHEMA__"."__TABLE__"
      UNION ALL
      SELECT aggregate_type, aggregate_id, aggregate_version, status
        FROM "__SCHEMA__"."__TABLE___archive") r
GROUP BY aggregate_type, aggregate_id
ON CONFLICT DO NOTHING;

-- Rows blocked under the old rules may be heads under the new ones (e.g. behind a late lower
-- version that is now at or below last_version): every claim classifies them again.
UPDATE "__SCHEMA__"."__TABLE__" SET blocked = false WHERE blocked;

-- Live leases move over, so a relay that runs through the upgrade is still fenced correctly.
UPDATE "__SCHEMA__"."__TABLE___aggregate" a
   SET lease_owner = l.lease_owner, lease_token = l.lease_token, lease_until = l.lease_until,
       lease_row = l.event_row
  FROM "__SCHEMA__"."__TABLE___lease" l
  JOIN "__SCHEMA__"."__TABLE__" e ON e.id = l.event_row
 WHERE l.lease_token IS NOT NULL AND l.lease_until > clock_timestamp()
   AND a.aggregate_key = hashtextextended(e.aggregate_type || chr(31) || e.aggregate_id, 0)
   AND a.aggregate_type = e.aggregate_type AND a.aggregate_id = e.aggregate_id;

DROP TABLE IF EXISTS "__SCHEMA__"."__TABLE___lease";

-- An attempt that failed in a way that leaves open whether the broker stored the record (a
-- timeout, a transport failure after sending): shown to an operator before a re-issue.
ALTER TABLE "__SCHEMA__"."__TABLE__"
    ADD COLUMN IF NOT EXISTS maybe_delivered boolean NOT NULL DEFAULT false;

-- When a claim first held this row as a version gap: the gap timeout counts from there (not
-- from the producer's transaction start).
ALTER TABLE "__SCHEMA__"."__TABLE__"
    ADD COLUMN IF NOT EXISTS held_since timestamptz;

-- Operators may also end the claims of a relay that is gone.
ALTER TABLE "__SCHEMA__"."__TABLE___audit"
    DROP CONSTRAINT IF EXISTS "__TABLE___audit_action_check";
ALTER TABLE "__SCHEMA__"."__TABLE___audit"
    ADD CONSTRAINT "__TABLE___audit_action_check"
    CHECK (action IN ('retry', 'discard', 'reissue', 'release_claim'));

-- The archive mirrors the table's columns (cleanup copies rows with SELECT *).
ALTER TABLE "__SCHEMA__"."__TABLE___archive"
    ADD COLUMN IF NOT EXISTS maybe_delivered boolean NOT NULL DEFAULT false;
ALTER TABLE "__SCHEMA__"."__TABLE___archive"
    ADD COLUMN IF NOT EXISTS held_since timestamptz;
