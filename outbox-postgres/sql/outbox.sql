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
-- On a table that exists already, the runner builds it after the migrations' transaction,
-- with CREATE INDEX CONCURRENTLY (appends go on meanwhile; issue 25).
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
-- outbox-postgres migration 7: append from SQL, for services not written in Rust.
--
-- `"outbox"."outbox_events_append"(...)` appends one event to this outbox inside the caller's
-- transaction, exactly as `PostgresOutboxStore::append` does with the default
-- `EnvelopeLimits`: it accepts and rejects the same envelopes (SQLSTATE 22023 with the Rust
-- error's text, nothing written), writes the same row, and takes part in the relay's wake-up
-- the same way (a NOTIFY on the default channel `<schema>_<table>` only while an idle relay
-- holds the wake-up gate; the shared gate lock it takes otherwise is released at the end of
-- the caller's transaction). It returns the event id.
--
-- What it does not do: the in-process backpressure hook (`AppendGuard`) of a Rust service
-- is not consulted; limits other than the defaults and a custom notify channel are not known
-- to it. See outbox-postgres/docs/sql-append.md.
CREATE OR REPLACE FUNCTION "outbox"."outbox_events_append"(
    aggregate_type    text,
    aggregate_id      text,
    aggregate_version bigint,
    event_type        text,
    payload           bytea,
    content_type      text        DEFAULT 'application/json',
    headers           jsonb       DEFAULT '{}'::jsonb,
    schema_version    integer     DEFAULT 1,
    event_id          uuid        DEFAULT gen_random_uuid(),
    created_at        timestamptz DEFAULT now()
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $append$
#variable_conflict use_variable
DECLARE
    -- EnvelopeLimits::default(): names (and aggregate names, the smaller of max_name_len and
    -- max_aggregate_name_bytes) 255 bytes, payload 900 KiB, 32 headers of 16 KiB in all.
    max_name    constant integer := 255;
    max_payload constant integer := 921600;
    max_headers constant integer := 32;
    max_hbytes  constant integer := 16384;
    -- Rust's char::is_control (Unicode Cc) and char::is_whitespace (White_Space).
    -- Everything is validated in the C collation, whatever the caller's: a nondeterministic
    -- one (a case-insensitive column passed as an argument) refuses regular expressions, a
    -- Turkish one lowers 'I' to 'ı'.
    control     constant text COLLATE "C" := '[\u0001-\u001f\u007f-\u009f]';
    blank       constant text COLLATE "C" :=
        '^[\u0009-\u000d\u0020\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]*$';
    field   text;
    val     text COLLATE "C";
    ctype   text COLLATE "C" := content_type;
    n       integer;
    yr      integer;
    hkey    text COLLATE "C";
    hval    jsonb;
    hbytes  integer := 0;
    parts   text[] COLLATE "C";
BEGIN
    IF aggregate_type IS NULL OR aggregate_id IS NULL OR aggregate_version IS NULL
       OR event_type IS NULL OR payload IS NULL OR content_type IS NULL OR headers IS NULL
       OR schema_version IS NULL OR event_id IS NULL OR created_at IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004',
            MESSAGE = 'no argument of outbox_events_append may be NULL (defaults apply when an '
                      'argument is left out)';
    END IF;
    FOREACH field IN ARRAY ARRAY['aggregate_type', 'aggregate_id', 'event_type'] LOOP
        val := CASE field WHEN 'aggregate_type' THEN aggregate_type
                          WHEN 'aggregate_id' THEN aggregate_id
                          ELSE event_type END;
        IF val ~ blank THEN
            RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = field || ' must not be empty';
        END IF;
        n := octet_length(val);
        IF n > max_name THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('%s is %s bytes long; the limit is %s', field, n, max_name);
        END IF;
        IF val ~ control THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = field || ' must not contain control characters';
        END IF;
    END LOOP;
    IF aggregate_version < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('aggregate_version must be at least 1, got %s', aggregate_version);
    END IF;
    IF schema_version < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('schema_version must be at least 1, got %s', schema_version);
    END IF;
    IF ctype ~ blank OR octet_length(ctype) > max_name OR ctype ~ control THEN
        -- Quoted as Rust's `{:?}` quotes it, as far as these rules can meet: `\"`, `\\`, `\t`,
        -- `\r`, `\n`, and other control characters and white space but ' ' as `\u{hex}` (JSON
        -- would leave DEL, U+0085 and the Unicode spaces raw). Rust also escapes format
        -- characters, combining marks and unassigned code points; those stay raw here.
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'invalid payload content type ' || '"' || coalesce((SELECT string_agg(CASE
                WHEN c = '"' THEN '\"' WHEN c = '\' THEN '\\'
                WHEN c = E'\t' THEN '\t' WHEN c = E'\r' THEN '\r' WHEN c = E'\n' THEN '\n'
                WHEN c ~ control OR (c <> ' ' AND c ~ blank)
                    THEN '\u{' || to_hex(ascii(c)) || '}'
                ELSE c END, '' ORDER BY i)
            FROM unnest(regexp_split_to_array(ctype, '')) WITH ORDINALITY AS q(c, i) WHERE c <> ''), '')
            || '"';
    END IF;
    -- 'infinity' has no year (and no Rust envelope holds it): refused like any other year
    -- the wire format cannot carry, not by the integer cast below (SQLSTATE 22003).
    IF NOT isfinite(created_at) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('created_at in year %s is outside 0..=9999, which the wire format '
                             '(RFC 3339) cannot carry', created_at);
    END IF;
    -- The year in UTC as chrono counts it (1 BC is year 0; PostgreSQL has no year 0).
    yr := extract(year FROM created_at AT TIME ZONE 'UTC')::integer;
    IF yr < 0 THEN
        yr := yr + 1;
    END IF;
    IF yr < 0 OR yr > 9999 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('created_at in year %s is outside 0..=9999, which the wire format '
                             '(RFC 3339) cannot carry', yr);
    END IF;
    IF octet_length(payload) > max_payload THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('payload is %s bytes; the limit is %s', octet_length(payload),
                             max_payload);
    END IF;
    IF jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'headers must be a JSON object of string values, got a JSON '
                      || jsonb_typeof(headers);
    END IF;
    SELECT count(*) INTO n FROM jsonb_object_keys(headers);
    IF n > max_headers THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('%s headers; the limit is %s', n, max_headers);
    END IF;
    -- In the order Rust checks them (a BTreeMap: by the names' bytes), so that the first
    -- fault found is the one Rust reports.
    FOR hkey, hval IN SELECT key, value FROM jsonb_each(headers) ORDER BY key COLLATE "C" LOOP
        IF jsonb_typeof(hval) <> 'string' THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('invalid header %s: header values must be JSON strings',
                                 to_json(hkey));
        END IF;
        val := hval #>> '{}';
        IF octet_length(hkey) = 0 OR octet_length(hkey) > max_name
           OR hkey !~ '^[\u0021-\u007e]+$' THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                -- Quoted as the content type is, above.
                MESSAGE = 'invalid header ' || '"' || coalesce((SELECT string_agg(CASE
                WHEN c = '"' THEN '\"' WHEN c = '\' THEN '\\'
                WHEN c = E'\t' THEN '\t' WHEN c = E'\r' THEN '\r' WHEN c = E'\n' THEN '\n'
                WHEN c ~ control OR (c <> ' ' AND c ~ blank)
                    THEN '\u{' || to_hex(ascii(c)) || '}'
                ELSE c END, '' ORDER BY i)
            FROM unnest(regexp_split_to_array(hkey, '')) WITH ORDINALITY AS q(c, i) WHERE c <> ''), '')
            || '"'
                          || ': header names are 1..=max_name_len visible ASCII characters';
        END IF;
        -- lower() in the C collation: with the caller's collation (an argument's COLLATE, or a
        -- database whose default is Turkish) 'EVENT_ID' would lower to 'event_ıd' and pass.
        IF lower(hkey COLLATE "C") IN ('event_id', 'event_type', 'aggregate_type', 'aggregate_id',
                           'aggregate_version', 'schema_version', 'content_type',
                           'created_at') THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('invalid header %s: the name is reserved for envelope fields',
                                 to_json(hkey));
        END IF;
        IF val ~ control THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('invalid header %s: header values must not contain control '
                                 'characters', to_json(hkey));
        END IF;
        IF lower(hkey COLLATE "C") = 'traceparent' THEN
            -- W3C: version-traceid-parentid-flags, lowercase hex, ids not all zero; version
            -- ff is invalid, version 00 has exactly four parts.
            parts := string_to_array(val, '-');
            IF coalesce(array_length(parts, 1), 0) < 4
               OR parts[1] !~ '^[0-9a-f]{2}$' OR parts[1] = 'ff'
               OR parts[2] !~ '^[0-9a-f]{32}$' OR parts[2] ~ '^0*$'
               OR parts[3] !~ '^[0-9a-f]{16}$' OR parts[3] ~ '^0*$'
               OR parts[4] !~ '^[0-9a-f]{2}$'
               OR (parts[1] = '00' AND array_length(parts, 1) <> 4) THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = format('invalid header %s: not a W3C traceparent '
                                     '(version-traceid-parentid-flags)', to_json(hkey));
            END IF;
        END IF;
        hbytes := hbytes + octet_length(hkey) + octet_length(val);
    END LOOP;
    IF hbytes > max_hbytes THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('headers take %s bytes; the limit is %s', hbytes, max_hbytes);
    END IF;

    INSERT INTO "outbox"."outbox_events"
        (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, schema_version,
         content_type, payload, headers, created_at, inserted_at)
    VALUES (event_id, aggregate_type, aggregate_id, aggregate_version, event_type,
            schema_version, content_type, payload, headers, created_at, clock_timestamp());

    -- The wake-up, as the Rust append does it: notify only while an idle relay holds the
    -- gate exclusively; otherwise hold the gate's shared lock to the end of this transaction,
    -- so a relay arming the gate waits for this append to end and then claims it.
    IF 'outbox_outbox_events'::text IS NOT NULL
       AND NOT pg_try_advisory_xact_lock_shared(732909875, 624970837) THEN
        PERFORM pg_notify('outbox_outbox_events'::text, '');
    END IF;
    RETURN event_id;
END
$append$;

COMMENT ON FUNCTION "outbox"."outbox_events_append"(text, text, bigint, text, bytea, text,
    jsonb, integer, uuid, timestamptz) IS
    'Appends one event to "outbox"."outbox_events" in the caller''s transaction, validated as '
    'the Rust envelope is (default limits); returns its event id. See '
    'outbox-postgres/docs/sql-append.md.';
-- outbox-postgres migration 8: transport-neutral acknowledgement columns (docs/transports.md §2).
--
-- A row's acknowledgement is (ack_transport, ack_destination, ack_partition, ack_position,
-- ack_route, ack_duplicate): Kafka ('kafka', topic, partition, offset, NULL, NULL), JetStream
-- ('nats', stream, NULL, stream sequence, subject, duplicate), RabbitMQ ('rabbitmq', exchange,
-- NULL, NULL, routing key, NULL). Every row written before is a Kafka acknowledgement.
--
-- Nothing rewrites the table: the renames are catalog-only, and the transport of the rows
-- already there comes from a column default, which PostgreSQL (11+) keeps in the catalog for
-- the existing rows instead of writing it into each one; the default is dropped at once, so a
-- new row names its transport itself. Only rows without an acknowledgement (unfinished or
-- discarded: not the published history) are written, back to no transport. The new CHECK is
-- added NOT VALID here; the migration runner validates it after this transaction commits
-- (0008_outbox_validate.sql), under a lock that lets relays go on.
--
-- Like the other migrations it can run again on a table it already changed (a no-op).
DO $rename$
BEGIN
    IF EXISTS (SELECT 1 FROM information_schema.columns
               WHERE table_schema = 'outbox' AND table_name = 'outbox_events'
                 AND column_name = 'ack_topic') THEN
        ALTER TABLE "outbox"."outbox_events" RENAME COLUMN ack_topic TO ack_destination;
        ALTER TABLE "outbox"."outbox_events" RENAME COLUMN ack_offset TO ack_position;
    END IF;
    IF EXISTS (SELECT 1 FROM information_schema.columns
               WHERE table_schema = 'outbox' AND table_name = 'outbox_events_archive'
                 AND column_name = 'ack_topic') THEN
        ALTER TABLE "outbox"."outbox_events_archive" RENAME COLUMN ack_topic TO ack_destination;
        ALTER TABLE "outbox"."outbox_events_archive" RENAME COLUMN ack_offset TO ack_position;
    END IF;
END
$rename$;
ALTER TABLE "outbox"."outbox_events"
    ADD COLUMN IF NOT EXISTS ack_transport text DEFAULT 'kafka',
    ADD COLUMN IF NOT EXISTS ack_route     text,
    ADD COLUMN IF NOT EXISTS ack_duplicate boolean;
ALTER TABLE "outbox"."outbox_events" ALTER COLUMN ack_transport DROP DEFAULT;
UPDATE "outbox"."outbox_events" SET ack_transport = NULL
    WHERE ack_destination IS NULL AND status <> 'published';

-- The archive mirrors the table's columns, in the same order (cleanup copies with SELECT *).
ALTER TABLE "outbox"."outbox_events_archive"
    ADD COLUMN IF NOT EXISTS ack_transport text DEFAULT 'kafka',
    ADD COLUMN IF NOT EXISTS ack_route     text,
    ADD COLUMN IF NOT EXISTS ack_duplicate boolean;
ALTER TABLE "outbox"."outbox_events_archive" ALTER COLUMN ack_transport DROP DEFAULT;
UPDATE "outbox"."outbox_events_archive" SET ack_transport = NULL
    WHERE ack_destination IS NULL AND status <> 'published';

-- A published row names its transport and destination, and the position its transport has:
-- Kafka a partition and an offset, JetStream a stream sequence, a subject and the duplicate
-- flag, RabbitMQ a routing key.
ALTER TABLE "outbox"."outbox_events" DROP CONSTRAINT IF EXISTS "outbox_events_published_has_ack";
ALTER TABLE "outbox"."outbox_events" ADD CONSTRAINT "outbox_events_published_has_ack" CHECK (
    status <> 'published'
    OR (published_at IS NOT NULL AND ack_transport IS NOT NULL AND ack_destination IS NOT NULL
        AND (ack_transport <> 'kafka'
             OR (ack_partition IS NOT NULL AND ack_position IS NOT NULL))
        AND (ack_transport <> 'nats'
             OR (ack_position IS NOT NULL AND ack_route IS NOT NULL
                 AND ack_duplicate IS NOT NULL))
        AND (ack_transport <> 'rabbitmq' OR ack_route IS NOT NULL))
) NOT VALID;
-- outbox-postgres migration 8, after its transaction: validates the CHECK it added NOT VALID.
-- VALIDATE takes a SHARE UPDATE EXCLUSIVE lock (reads and writes go on while it scans). The
-- runner runs this after every successful migrate, so it validates only a constraint that is
-- not valid yet (a crash between the two steps): nothing else waits for a lock.
DO $validate$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_constraint
               WHERE conrelid = '"outbox"."outbox_events"'::regclass
                 AND conname = 'outbox_events_published_has_ack' AND NOT convalidated) THEN
        ALTER TABLE "outbox"."outbox_events" VALIDATE CONSTRAINT "outbox_events_published_has_ack";
    END IF;
END
$validate$;
-- outbox-postgres migration 9: the relay registry (`outbox_core::RelayRegistry`).
--
-- One row per relay claim owner: what it registered with when it started, its last heartbeat
-- and the events it held claimed then. A relay deletes its row when it stops gracefully; the
-- row of a relay that was killed stays, and turns stale once its heartbeat is older than three
-- of its intervals (`outbox status`, `outbox parked release-claims`). Times are the database's
-- clock. Rows whose heartbeat is a day old are removed when a relay registers.
CREATE TABLE IF NOT EXISTS "outbox"."outbox_events_relays" (
    owner                 text        PRIMARY KEY,
    host                  text        NOT NULL,
    pid                   bigint      NOT NULL CHECK (pid >= 0),
    version               text        NOT NULL,
    claim_mode            text        NOT NULL,
    heartbeat_interval_ms bigint      NOT NULL CHECK (heartbeat_interval_ms > 0),
    started_at            timestamptz NOT NULL,
    heartbeat_at          timestamptz NOT NULL,
    held                  bigint      NOT NULL DEFAULT 0 CHECK (held >= 0)
);
-- outbox-postgres migration 10: the held version gaps, without reading the backlog.
--
-- The stats (`outbox status`, the relay's metrics) list the aggregates whose head a claim
-- holds as a version gap: pending rows with `held_since`. Without an index that was a read of
-- every pending row (170 ms at 300,000 pending, issue 25). This index holds only those rows,
-- normally none: an append writes no entry (a new row has no `held_since`), a claim that
-- holds a gap writes one, and the completion or park that ends it leaves the predicate.
-- On a table that exists already, the runner builds it after the migrations' transaction,
-- with CREATE INDEX CONCURRENTLY (appends go on meanwhile; issue 25).
CREATE INDEX IF NOT EXISTS "outbox_events_held_idx"
    ON "outbox"."outbox_events" (id)
    WHERE status = 'pending' AND held_since IS NOT NULL;
-- outbox-postgres migration 11: run claims (issue 25, docs/design/hot-aggregate.md).
--
-- A claim may hand out, after an aggregate's head, the next consecutive versions of the same
-- aggregate under the head's lease: its run. The lease keeps naming the head (`lease_row`)
-- and now records the last version of the run (`lease_upto`): the rows of the aggregate above
-- the head's version up to it are the lease's too. The completion's fencing accepts them, a
-- later claim counts them as possibly sent when the lease ended without an outcome, the stats
-- count them as in flight, and an operator's release covers them.
--
-- NULL (every lease taken before this migration, and the leases a relay of the previous
-- version takes beside this one) means what it meant before: the lease covers its head row
-- alone. Adding a nullable column without a default rewrites nothing.
ALTER TABLE "outbox"."outbox_events_aggregate" ADD COLUMN IF NOT EXISTS lease_upto bigint;
