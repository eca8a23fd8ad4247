-- outbox-postgres migration 9: the relay registry (`outbox_core::RelayRegistry`).
--
-- One row per relay claim owner: what it registered with when it started, its last heartbeat
-- and the events it held claimed then. A relay deletes its row when it stops gracefully; the
-- row of a relay that was killed stays, and turns stale once its heartbeat is older than three
-- of its intervals (`outbox status`, `outbox parked release-claims`). Times are the database's
-- clock. Rows whose heartbeat is a day old are removed when a relay registers.
CREATE TABLE IF NOT EXISTS "__SCHEMA__"."__TABLE___relays" (
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
