-- outbox-postgres migration 1: the outbox table, its audit trail and its archive.
CREATE SCHEMA IF NOT EXISTS "outbox";

CREATE TABLE IF NOT EXISTS "outbox"."outbox_events" (
    -- Insertion order: "oldest first" and the tie-breaker inside one aggregate version.
    id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,

    -- Envelope: the contract with consumers.
    event_id           uuid        NOT NULL,
    aggregate_type     text        NOT NULL,
    aggregate_id       text        NOT NULL,
    aggregate_version  bigint      NOT NULL CHECK (aggregate_version >= 1),
    event_type         text        NOT NULL,
    schema_version     integer     NOT NULL CHECK (schema_version >= 1),
    content_type       text        NOT NULL,
    payload            bytea       NOT NULL,
    headers            jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at         timestamptz NOT NULL,

    -- Delivery state: relay mechanics, never published.
    status             text        NOT NULL DEFAULT 'pending'
                       CHECK (status IN ('pending', 'published', 'parked', 'discarded')),
    -- true: a lower version of the aggregate is unfinished, so this row is not a claim
    -- candidate (kept out of the claim index). Maintained under per-aggregate advisory locks.
    blocked            boolean     NOT NULL DEFAULT false,
    attempts           integer     NOT NULL DEFAULT 0,
    next_attempt_at    timestamptz NOT NULL DEFAULT '-infinity',
    -- The lease of a row in flight (owner, token, expiry) is in "outbox_events_lease".
    last_error_class   text,
    last_error_kind    text,
    last_error_message text,
    park_kind          text,
    parked_at          timestamptz,
    published_at       timestamptz,
    ack_topic          text,
    ack_partition      integer,
    ack_offset         bigint,
    discard_reason     text,
    -- published_at or the discard time: what retention is measured from.
    finished_at        timestamptz,
    inserted_at        timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT "outbox_events_event_id_key" UNIQUE (event_id),
    CONSTRAINT "outbox_events_published_has_ack" CHECK (
        status <> 'published'
        OR (published_at IS NOT NULL AND ack_topic IS NOT NULL
            AND ack_partition IS NOT NULL AND ack_offset IS NOT NULL)
    )
) WITH (fillfactor = 80);

-- Claim candidates only: pending rows that are not blocked behind a lower version. Published,
-- parked, discarded and blocked rows are not in it, so the claim scan never walks the backlog.
CREATE INDEX IF NOT EXISTS "outbox_events_claim_idx"
    ON "outbox"."outbox_events" (id)
    WHERE status = 'pending' AND NOT blocked;

-- Unfinished rows per aggregate, in version order: an aggregate's head (lowest unfinished
-- version) is the first entry of one of these two short ranges, whatever the aggregate's
-- depth. Blocked rows have their own index, which stays small (only rows queued behind a head
-- that was in flight or parked when they were met), so the probe for them, made by every claim
-- and every completion, is cheap when nothing is blocked.
CREATE INDEX IF NOT EXISTS "outbox_events_aggregate_idx"
    ON "outbox"."outbox_events" (aggregate_type, aggregate_id, aggregate_version, id)
    WHERE status IN ('pending', 'parked') AND NOT blocked;

CREATE INDEX IF NOT EXISTS "outbox_events_blocked_idx"
    ON "outbox"."outbox_events" (aggregate_type, aggregate_id, aggregate_version, id)
    WHERE status IN ('pending', 'parked') AND blocked;

-- Leases of the lease claim mode: one narrow row per aggregate in flight, keyed by the
-- aggregate's lock key (a seeded 64-bit hash of type and id). "Is this aggregate in flight?"
-- is one primary-key probe, and claiming or completing never rewrites the wide event row for
-- the lease. A completion releases its leases (fencing: only rows whose lease still carries
-- the completion's token get an outcome); an expired lease is taken over by the next claim.
-- A released lease keeps its row (token NULL, lease_until = release time), so the next claim
-- of the aggregate updates it in place (HOT: only the key is indexed); cleanup deletes the
-- rows of aggregates that stayed quiet for the retention period.
CREATE TABLE IF NOT EXISTS "outbox"."outbox_events_lease" (
    aggregate_key bigint      PRIMARY KEY,
    event_row     bigint      NOT NULL,
    lease_owner   text,
    lease_token   uuid,
    lease_until   timestamptz NOT NULL
) WITH (fillfactor = 50);

CREATE INDEX IF NOT EXISTS "outbox_events_parked_idx"
    ON "outbox"."outbox_events" (parked_at, id)
    WHERE status = 'parked';

CREATE INDEX IF NOT EXISTS "outbox_events_finished_idx"
    ON "outbox"."outbox_events" (finished_at)
    WHERE status IN ('published', 'discarded');

-- Operator actions on parked events.
CREATE TABLE IF NOT EXISTS "outbox"."outbox_events_audit" (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id     uuid        NOT NULL,
    action       text        NOT NULL CHECK (action IN ('retry', 'discard', 'reissue')),
    actor        text        NOT NULL,
    reason       text        NOT NULL,
    new_event_id uuid,
    at           timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX IF NOT EXISTS "outbox_events_audit_event_idx"
    ON "outbox"."outbox_events_audit" (event_id, id);

-- Optional destination of cleanup (same columns, no constraints).
CREATE TABLE IF NOT EXISTS "outbox"."outbox_events_archive"
    (LIKE "outbox"."outbox_events" INCLUDING DEFAULTS);

-- outbox-postgres migration 2: aggregates are keyed by a 64-bit hash of type and id.
--
-- The aggregate key is hashtextextended(aggregate_type || chr(31) || aggregate_id, 0); the
-- statements of the store use this exact expression, so the planner matches these indexes.
-- Comparing 64-bit keys instead of two collated text columns makes each index probe several
-- times cheaper. Two aggregates whose keys collide are ordered as one (an order stricter than
-- needed, never a wrong one). The advisory lock key and the lease key of an aggregate are its
-- aggregate key XOR a per-table seed, so a collision of aggregate keys is always a collision
-- of lock keys too.
--
-- Unfinished rows (pending or parked, blocked or not), in version order per aggregate: the
-- claim's head check is one probe per candidate ("is an unfinished row of its aggregate
-- ordered before it?") that stops at the first entry it meets.
DROP INDEX IF EXISTS "outbox"."outbox_events_aggregate_idx";

CREATE INDEX IF NOT EXISTS "outbox_events_unfinished_idx"
    ON "outbox"."outbox_events"
       ((hashtextextended(aggregate_type || chr(31) || aggregate_id, 0)), aggregate_version, id)
    WHERE status IN ('pending', 'parked');

-- Blocked rows, by the same key: the completion's probe for the row to unblock next.
DROP INDEX IF EXISTS "outbox"."outbox_events_blocked_idx";

CREATE INDEX IF NOT EXISTS "outbox_events_blocked_idx"
    ON "outbox"."outbox_events"
       ((hashtextextended(aggregate_type || chr(31) || aggregate_id, 0)), aggregate_version, id)
    WHERE status IN ('pending', 'parked') AND blocked;

-- Lease rows are keyed by the new lock key: released leases go (they are only kept for reuse)
-- and live ones are re-keyed from their event row.
DELETE FROM "outbox"."outbox_events_lease"
    WHERE lease_token IS NULL OR lease_until <= clock_timestamp();

UPDATE "outbox"."outbox_events_lease" l
    SET aggregate_key = hashtextextended(e.aggregate_type || chr(31) || e.aggregate_id, 0)
                        # (3147823944665418837)
    FROM "outbox"."outbox_events" e
    WHERE e.id = l.event_row;
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
CREATE TABLE IF NOT EXISTS "outbox"."outbox_events_aggregate" (
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
INSERT INTO "outbox"."outbox_events_aggregate" (aggregate_key, aggregate_type, aggregate_id, last_version)
SELECT hashtextextended(aggregate_type || chr(31) || aggregate_id, 0), aggregate_type, aggregate_id,
       GREATEST(0, COALESCE(
           max(aggregate_version) FILTER (WHERE status IN ('published', 'discarded')),
           min(aggregate_version) FILTER (WHERE status IN ('pending', 'parked')) - 1,
           0))
FROM (SELECT aggregate_type, aggregate_id, aggregate_version, status
        FROM "outbox"."outbox_events"
      UNION ALL
      SELECT aggregate_type, aggregate_id, aggregate_version, status
        FROM "outbox"."outbox_events_archive") r
GROUP BY aggregate_type, aggregate_id
ON CONFLICT DO NOTHING;

-- Rows blocked under the old rules may be heads under the new ones (e.g. behind a late lower
-- version that is now at or below last_version): every claim classifies them again.
UPDATE "outbox"."outbox_events" SET blocked = false WHERE blocked;

-- Live leases move over, so a relay that runs through the upgrade is still fenced correctly.
UPDATE "outbox"."outbox_events_aggregate" a
   SET lease_owner = l.lease_owner, lease_token = l.lease_token, lease_until = l.lease_until,
       lease_row = l.event_row
  FROM "outbox"."outbox_events_lease" l
  JOIN "outbox"."outbox_events" e ON e.id = l.event_row
 WHERE l.lease_token IS NOT NULL AND l.lease_until > clock_timestamp()
   AND a.aggregate_key = hashtextextended(e.aggregate_type || chr(31) || e.aggregate_id, 0)
   AND a.aggregate_type = e.aggregate_type AND a.aggregate_id = e.aggregate_id;

DROP TABLE IF EXISTS "outbox"."outbox_events_lease";

-- An attempt that failed in a way that leaves open whether the broker stored the record (a
-- timeout, a transport failure after sending): shown to an operator before a re-issue.
ALTER TABLE "outbox"."outbox_events"
    ADD COLUMN IF NOT EXISTS maybe_delivered boolean NOT NULL DEFAULT false;

-- When a claim first held this row as a version gap: the gap timeout counts from there (not
-- from the producer's transaction start).
ALTER TABLE "outbox"."outbox_events"
    ADD COLUMN IF NOT EXISTS held_since timestamptz;

-- Operators may also end the claims of a relay that is gone.
ALTER TABLE "outbox"."outbox_events_audit"
    DROP CONSTRAINT IF EXISTS "outbox_events_audit_action_check";
ALTER TABLE "outbox"."outbox_events_audit"
    ADD CONSTRAINT "outbox_events_audit_action_check"
    CHECK (action IN ('retry', 'discard', 'reissue', 'release_claim'));

-- The archive mirrors the table's columns (cleanup copies rows with SELECT *).
ALTER TABLE "outbox"."outbox_events_archive"
    ADD COLUMN IF NOT EXISTS maybe_delivered boolean NOT NULL DEFAULT false;
ALTER TABLE "outbox"."outbox_events_archive"
    ADD COLUMN IF NOT EXISTS held_since timestamptz;
-- outbox-postgres migration 4: what operators and monitoring read beside the events.
--
-- Conflicts refused by the application's conditional update of an aggregate (the version check
-- that keeps versions in order): the application counts them with
-- PostgresOutboxStore::record_conflict, the relay daemon exports the totals. One row per
-- aggregate type (low cardinality by construction).
CREATE TABLE IF NOT EXISTS "outbox"."outbox_events_conflicts" (
    aggregate_type text        PRIMARY KEY,
    refused        bigint      NOT NULL DEFAULT 0,
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- Topic facts recorded by a relay at start (partition count, partitioner), so that the next
-- start and `outbox check` detect a change that moves keys between partitions.
CREATE TABLE IF NOT EXISTS "outbox"."outbox_events_topics" (
    topic       text        PRIMARY KEY,
    partitions  integer     NOT NULL CHECK (partitions >= 1),
    partitioner text        NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);

-- Published rows by publication time: publish latency and flow over a recent window.
CREATE INDEX IF NOT EXISTS "outbox_events_published_at_idx"
    ON "outbox"."outbox_events" (published_at)
    WHERE status = 'published';

-- Rows by creation time: reconciliation per interval and replay by time range.
CREATE INDEX IF NOT EXISTS "outbox_events_created_at_idx"
    ON "outbox"."outbox_events" (created_at);
-- outbox-postgres migration 5: one index entry fewer per completed event.
--
-- A completion changes `status`, which the partial indexes' predicates read, so its update is
-- never HOT: every index whose predicate the published row matches gets a new entry. The
-- published rows had two such time indexes, `finished_idx` (retention, cleanup) and
-- `published_at_idx` (publish latency over a recent window). A completion now writes one time
-- into both `published_at` and `finished_at`, so the window queries filter published rows on
-- `finished_at` through `finished_idx`, and `published_at_idx` goes.
DROP INDEX IF EXISTS "outbox"."outbox_events_published_at_idx";
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
ALTER TABLE "outbox"."outbox_events_aggregate" ALTER COLUMN last_version DROP NOT NULL;
ALTER TABLE "outbox"."outbox_events_aggregate" ALTER COLUMN last_version DROP DEFAULT;

-- Repair: 0 was only ever written for "nothing published or discarded yet" (a lease claim's
-- default, or an operator's retry of a version 1), which NULL now says. For stores without
-- `accept_first_version` the two mean the same; with it, aggregates held as a gap for this
-- reason flow again (those already parked as a version gap need an operator's retry).
UPDATE "outbox"."outbox_events_aggregate" SET last_version = NULL WHERE last_version = 0;
