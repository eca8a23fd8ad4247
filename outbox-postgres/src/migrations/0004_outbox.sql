-- outbox-postgres migration 4: what operators and monitoring read beside the events.
--
-- Conflicts refused by the application's conditional update of an aggregate (the version check
-- that keeps versions in order): the application counts them with
-- PostgresOutboxStore::record_conflict, the relay daemon exports the totals. One row per
-- aggregate type (low cardinality by construction).
CREATE TABLE IF NOT EXISTS "__SCHEMA__"."__TABLE___conflicts" (
    aggregate_type text        PRIMARY KEY,
    refused        bigint      NOT NULL DEFAULT 0,
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- Topic facts recorded by a relay at start (partition count, partitioner), so that the next
-- start and `outbox check` detect a change that moves keys between partitions.
CREATE TABLE IF NOT EXISTS "__SCHEMA__"."__TABLE___topics" (
    topic       text        PRIMARY KEY,
    partitions  integer     NOT NULL CHECK (partitions >= 1),
    partitioner text        NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);

-- Published rows by publication time: publish latency and flow over a recent window.
CREATE INDEX IF NOT EXISTS "__TABLE___published_at_idx"
    ON "__SCHEMA__"."__TABLE__" (published_at)
    WHERE status = 'published';

