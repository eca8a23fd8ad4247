-- outbox-mysql inbox migration 1: registrations, per-aggregate versions, parked messages and
-- their audit trail. MySQL 8.0.13+ and MariaDB 10.6+ (InnoDB).
--
-- Aggregates are keyed by SHA-256 of type, U+001F, id (computed by the server), so an
-- aggregate named by a record's headers, of any length, fits an index key.

-- What a consumer has applied, for deduplication inside the effect's transaction.
CREATE TABLE IF NOT EXISTS __Q__`__TABLE__` (
    consumer     VARCHAR(255) NOT NULL,
    event_id     BINARY(16)   NOT NULL,
    processed_at DATETIME(6)  NOT NULL,
    PRIMARY KEY (consumer, event_id),
    -- Cleanup of one consumer's registrations past its dedup window.
    KEY consumer_at_idx (consumer, processed_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- What a consumer knows about each aggregate: the last version it applied (or an operator
-- discarded) and whether a parked message blocks the aggregate's later messages.
CREATE TABLE IF NOT EXISTS __Q__`__TABLE___aggregates` (
    consumer        VARCHAR(255) NOT NULL,
    aggregate_key   BINARY(32)   NOT NULL,
    aggregate_type  TEXT         NOT NULL,
    aggregate_id    TEXT         NOT NULL,
    applied_version BIGINT       NULL,
    blocked         TINYINT(1)   NOT NULL DEFAULT 0,
    updated_at      DATETIME(6)  NOT NULL,
    PRIMARY KEY (consumer, aggregate_key)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Messages a consumer could not apply ('parked') and those waiting behind them ('waiting'),
-- with the raw record; kept after resolution ('applied', 'skipped', 'discarded').
CREATE TABLE IF NOT EXISTS __Q__`__TABLE___parked` (
    id                BIGINT       NOT NULL AUTO_INCREMENT,
    consumer          VARCHAR(255) NOT NULL,
    topic             TEXT         NOT NULL,
    `partition`       INT          NOT NULL,
    `offset`          BIGINT       NOT NULL,
    record_key        LONGBLOB     NULL,
    -- The headers, raw (names, values, null values): see `inbox_parking::encode_headers`.
    headers           LONGBLOB     NOT NULL,
    value             LONGBLOB     NULL,
    aggregate_type    TEXT         NULL,
    aggregate_id      TEXT         NULL,
    aggregate_key     BINARY(32)   NULL,
    event_id          BINARY(16)   NULL,
    dedup_id          BINARY(16)   NULL,
    aggregate_version BIGINT       NULL,
    -- A record without a dedup id (undecodable) is parked once per position.
    position_key      BINARY(32)   AS (IF(dedup_id IS NULL,
        UNHEX(SHA2(CONCAT(topic, CHAR(31 USING utf8mb4), `partition`, CHAR(31 USING utf8mb4), `offset`), 256)),
        NULL)) STORED,
    status            VARCHAR(16)  NOT NULL,
    kind              VARCHAR(32)  NULL,
    reason            TEXT         NOT NULL,
    attempts          INT          NOT NULL,
    parked_at         DATETIME(6)  NOT NULL,
    resolved_at       DATETIME(6)  NULL,
    retry_requested_at     DATETIME(6) NULL,
    retry_requested_by     TEXT        NULL,
    retry_requested_reason TEXT        NULL,
    PRIMARY KEY (id),
    -- A redelivered message is parked once (NULLs never collide in a unique key).
    UNIQUE KEY dedup_key (consumer, dedup_id),
    UNIQUE KEY position_key (consumer, position_key),
    -- Open messages of an aggregate, in release order.
    KEY open_idx (consumer, aggregate_key, status, aggregate_version, id),
    KEY retry_idx (consumer, retry_requested_at),
    CONSTRAINT __TABLE___parked_status_chk
        CHECK (status IN ('parked', 'waiting', 'applied', 'skipped', 'discarded'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Every operator action on a parked message.
CREATE TABLE IF NOT EXISTS __Q__`__TABLE___audit` (
    id        BIGINT       NOT NULL AUTO_INCREMENT,
    consumer  VARCHAR(255) NOT NULL,
    parked_id BIGINT       NOT NULL,
    action    VARCHAR(32)  NOT NULL,
    actor     TEXT         NOT NULL,
    reason    TEXT         NOT NULL,
    outcome   TEXT         NOT NULL,
    at        DATETIME(6)  NOT NULL,
    PRIMARY KEY (id),
    KEY parked_idx (consumer, parked_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
