-- outbox-mysql migration 4: the relay registry (`outbox_core::RelayRegistry`).
--
-- One row per relay claim owner: what it registered with when it started, its last heartbeat
-- and the events it held claimed then. A relay deletes its row when it stops gracefully; the
-- row of a relay that was killed stays, and turns stale once its heartbeat is older than three
-- of its intervals (`outbox status`, `outbox parked release-claims`). Times are the server's
-- UTC clock. Rows whose heartbeat is a day old are removed when a relay registers. The owner
-- is a binary string: compared byte for byte (`utf8mb4_bin` would pad spaces).
CREATE TABLE IF NOT EXISTS __Q__`__TABLE___relays` (
    owner                 VARBINARY(255) NOT NULL,
    host                  TEXT           NOT NULL,
    pid                   BIGINT         NOT NULL,
    version               TEXT           NOT NULL,
    claim_mode            VARCHAR(16)    NOT NULL,
    heartbeat_interval_ms BIGINT         NOT NULL,
    started_at            DATETIME(6)    NOT NULL,
    heartbeat_at          DATETIME(6)    NOT NULL,
    held                  BIGINT         NOT NULL DEFAULT 0,
    PRIMARY KEY (owner),
    CONSTRAINT __TABLE___relays_chk CHECK (pid >= 0 AND heartbeat_interval_ms > 0 AND held >= 0)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
