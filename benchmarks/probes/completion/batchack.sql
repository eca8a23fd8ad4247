-- Scheme B ("queue + one ack row per completion"): scheme A with the acknowledgements of one
-- completion stored as arrays in ONE row of @AB@ (append-only), instead of one row per event.
-- Everything else is queue.sql.

-- name: ddl
CREATE TABLE @AB@ (
    batch           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    finished_at     timestamptz NOT NULL,            -- the completion's time = published_at
    min_id          bigint      NOT NULL,            -- range of the event ids in it
    max_id          bigint      NOT NULL,
    ids             int8[]      NOT NULL,            -- event row ids, ascending
    ack_transport   text[]      NOT NULL,
    ack_destination text[]      NOT NULL,
    ack_partition   int4[]      NOT NULL,
    ack_position    int8[]      NOT NULL,
    ack_route       text[]      NOT NULL,
    ack_duplicate   bool[]      NOT NULL
);
CREATE INDEX ON @AB@ (finished_at);
CREATE INDEX ON @AB@ USING gist (int8range(min_id, max_id, '[]'));

-- name: ack_per_batch
INSERT INTO @AB@ (finished_at, min_id, max_id, ids, ack_transport, ack_destination, ack_partition,
                  ack_position, ack_route, ack_duplicate)
   SELECT max(p.ts), min(p.id), max(p.id), array_agg(p.id ORDER BY p.id),
          array_agg(p.transport ORDER BY p.id), array_agg(p.dest ORDER BY p.id),
          array_agg(p.part ORDER BY p.id), array_agg(p.pos ORDER BY p.id),
          array_agg(p.route ORDER BY p.id), array_agg(p.dup ORDER BY p.id)
   FROM pub p HAVING count(*) > 0
   RETURNING 1
