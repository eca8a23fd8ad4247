-- outbox-mysql migration 1: the outbox table, the per-aggregate delivery state, the audit trail
-- and the archive. MySQL 8.0.13+ and MariaDB 10.6+ (InnoDB; SKIP LOCKED, CHECK constraints,
-- stored generated columns). Every DDL statement is idempotent (MySQL commits DDL at once, so a
-- migration that fails half-way is run again from the top).
--
-- Text that identifies (types, ids, statuses) is utf8mb4_bin: compared byte for byte, so
-- `Order-1` and `order-1` are two aggregates whatever the server's default collation.
CREATE TABLE IF NOT EXISTS __Q__`__TABLE__` (
    -- Insertion order: "oldest first" and the tie-breaker inside one aggregate version.
    id                 BIGINT       NOT NULL AUTO_INCREMENT,

    -- Envelope: the contract with consumers.
    event_id           BINARY(16)   NOT NULL,
    aggregate_type     TEXT         NOT NULL,
    aggregate_id       TEXT         NOT NULL,
    -- The aggregate's key: SHA-256 of type, U+001F, id. Every index and lock of an aggregate
    -- uses it, so an aggregate id of any length (InnoDB keys stop at 3072 bytes, 768 utf8mb4
    -- characters) is indexed in 32 bytes, and appends from any language get it for free.
    aggregate_key      BINARY(32)   AS (UNHEX(SHA2(CONCAT(aggregate_type, CHAR(31 USING utf8mb4), aggregate_id), 256))) STORED,
    aggregate_version  BIGINT       NOT NULL,
    event_type         TEXT         NOT NULL,
    schema_version     INT          NOT NULL,
    content_type       TEXT         NOT NULL,
    payload            LONGBLOB     NOT NULL,
    -- A JSON object of string values, kept as text: MariaDB's JSON is LONGTEXT and MySQL's a
    -- binary type that reorders keys; text reads back the same on both.
    headers            MEDIUMTEXT   NOT NULL,
    created_at         DATETIME(6)  NOT NULL,

    -- Delivery state: relay mechanics, never published. Times are UTC, on the database clock
    -- (UTC_TIMESTAMP(6)), whatever the session's time_zone.
    status             VARCHAR(16)  NOT NULL DEFAULT 'pending',
    -- 1: an earlier version of the aggregate is unfinished; the row is not a claim candidate
    -- until the store unblocks it. Maintained under the aggregate's state-row lock.
    blocked            TINYINT(1)   NOT NULL DEFAULT 0,
    attempts           INT          NOT NULL DEFAULT 0,
    next_attempt_at    DATETIME(6)  NOT NULL DEFAULT '1000-01-01 00:00:00.000000',
    -- When a claim first held this row as a version gap: the gap timeout counts from there.
    held_since         DATETIME(6)  NULL,
    -- An earlier attempt may have reached the broker (a timeout, an expired lease).
    maybe_delivered    TINYINT(1)   NOT NULL DEFAULT 0,
    last_error_class   VARCHAR(16)  NULL,
    last_error_kind    TEXT         NULL,
    last_error_message TEXT         NULL,
    park_kind          VARCHAR(32)  NULL,
    parked_at          DATETIME(6)  NULL,
    published_at       DATETIME(6)  NULL,
    ack_topic          TEXT         NULL,
    ack_partition      INT          NULL,
    ack_offset         BIGINT       NULL,
    discard_reason     TEXT         NULL,
    -- published_at or the discard time: what retention is measured from.
    finished_at        DATETIME(6)  NULL,
    -- When the row was inserted, on the database clock (the appends of this crate write
    -- UTC_TIMESTAMP(6); the default is the session's clock, for other writers): the ages in
    -- the stats are measured from here, never from the producer's created_at.
    inserted_at        DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),

    PRIMARY KEY (id),
    UNIQUE KEY event_id_key (event_id),
    -- Claim candidates in insertion order.
    KEY claim_idx (status, blocked, id),
    -- An aggregate's unfinished rows in version order (its head), and its history.
    KEY aggregate_idx (aggregate_key, status, aggregate_version, id),
    KEY parked_idx (status, parked_at, id),
    KEY finished_idx (finished_at),
    -- The oldest pending row by insertion time (stats).
    KEY age_idx (status, blocked, inserted_at),
    KEY created_idx (created_at),
    CONSTRAINT __TABLE___status_chk
        CHECK (status IN ('pending', 'published', 'parked', 'discarded')),
    CONSTRAINT __TABLE___version_chk CHECK (aggregate_version >= 1),
    CONSTRAINT __TABLE___schema_version_chk CHECK (schema_version >= 1),
    CONSTRAINT __TABLE___published_chk CHECK (
        status <> 'published'
        OR (published_at IS NOT NULL AND ack_topic IS NOT NULL
            AND ack_partition IS NOT NULL AND ack_offset IS NOT NULL))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Per-aggregate delivery state: one narrow row per aggregate a claim has met, keyed by the
-- aggregate key. Its row lock is the aggregate's lock: every writer of an aggregate's delivery
-- state (claims with SKIP LOCKED, completions, releases, operator actions) locks it first, and
-- decides in a statement that starts after the lock. It holds
--   * last_version: the highest version published or discarded; NULL before any (the first
--     event must then be version 1, or with accept_first_version the lowest one pending). It
--     survives cleanup of old event rows;
--   * the lease of the lease claim mode: owner, token, expiry (database clock), the row.
CREATE TABLE IF NOT EXISTS __Q__`__TABLE___aggregate` (
    aggregate_key   BINARY(32)   NOT NULL,
    aggregate_type  TEXT         NOT NULL,
    aggregate_id    TEXT         NOT NULL,
    last_version    BIGINT       NULL,
    lease_owner     TEXT         NULL,
    lease_token     BINARY(16)   NULL,
    lease_until     DATETIME(6)  NULL,
    lease_row       BIGINT       NULL,
    updated_at      DATETIME(6)  NOT NULL,
    PRIMARY KEY (aggregate_key),
    KEY lease_token_idx (lease_token),
    CONSTRAINT __TABLE___last_version_chk CHECK (last_version IS NULL OR last_version >= 0)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Operator actions on parked events, and on the claims of a relay that is gone.
CREATE TABLE IF NOT EXISTS __Q__`__TABLE___audit` (
    id           BIGINT       NOT NULL AUTO_INCREMENT,
    event_id     BINARY(16)   NOT NULL,
    action       VARCHAR(32)  NOT NULL,
    actor        TEXT         NOT NULL,
    reason       TEXT         NOT NULL,
    new_event_id BINARY(16)   NULL,
    at           DATETIME(6)  NOT NULL,
    PRIMARY KEY (id),
    KEY event_idx (event_id, id),
    CONSTRAINT __TABLE___audit_action_chk
        CHECK (action IN ('retry', 'discard', 'reissue', 'release_claim'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Optional destination of cleanup: the table's columns without its constraints; the aggregate
-- key is a plain column here (cleanup copies it).
CREATE TABLE IF NOT EXISTS __Q__`__TABLE___archive` (
    id                 BIGINT       NOT NULL,
    event_id           BINARY(16)   NOT NULL,
    aggregate_type     TEXT         NOT NULL,
    aggregate_id       TEXT         NOT NULL,
    aggregate_key      BINARY(32)   NOT NULL,
    aggregate_version  BIGINT       NOT NULL,
    event_type         TEXT         NOT NULL,
    schema_version     INT          NOT NULL,
    content_type       TEXT         NOT NULL,
    payload            LONGBLOB     NOT NULL,
    headers            MEDIUMTEXT   NOT NULL,
    created_at         DATETIME(6)  NOT NULL,
    status             VARCHAR(16)  NOT NULL,
    attempts           INT          NOT NULL,
    maybe_delivered    TINYINT(1)   NOT NULL,
    last_error_class   VARCHAR(16)  NULL,
    last_error_kind    TEXT         NULL,
    last_error_message TEXT         NULL,
    published_at       DATETIME(6)  NULL,
    ack_topic          TEXT         NULL,
    ack_partition      INT          NULL,
    ack_offset         BIGINT       NULL,
    discard_reason     TEXT         NULL,
    finished_at        DATETIME(6)  NULL,
    inserted_at        DATETIME(6)  NOT NULL,
    archived_at        DATETIME(6)  NOT NULL,
    PRIMARY KEY (id),
    KEY aggregate_idx (aggregate_key, aggregate_version)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
