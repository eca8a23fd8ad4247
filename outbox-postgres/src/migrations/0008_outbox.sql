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
               WHERE table_schema = '__SCHEMA__' AND table_name = '__TABLE__'
                 AND column_name = 'ack_topic') THEN
        ALTER TABLE "__SCHEMA__"."__TABLE__" RENAME COLUMN ack_topic TO ack_destination;
        ALTER TABLE "__SCHEMA__"."__TABLE__" RENAME COLUMN ack_offset TO ack_position;
    END IF;
    IF EXISTS (SELECT 1 FROM information_schema.columns
               WHERE table_schema = '__SCHEMA__' AND table_name = '__TABLE___archive'
                 AND column_name = 'ack_topic') THEN
        ALTER TABLE "__SCHEMA__"."__TABLE___archive" RENAME COLUMN ack_topic TO ack_destination;
        ALTER TABLE "__SCHEMA__"."__TABLE___archive" RENAME COLUMN ack_offset TO ack_position;
    END IF;
END
$rename$;
ALTER TABLE "__SCHEMA__"."__TABLE__"
    ADD COLUMN IF NOT EXISTS ack_transport text DEFAULT 'kafka',
    ADD COLUMN IF NOT EXISTS ack_route     text,
    ADD COLUMN IF NOT EXISTS ack_duplicate boolean;
ALTER TABLE "__SCHEMA__"."__TABLE__" ALTER COLUMN ack_transport DROP DEFAULT;
UPDATE "__SCHEMA__"."__TABLE__" SET ack_transport = NULL
    WHERE ack_destination IS NULL AND status <> 'published';

-- The archive mirrors the table's columns, in the same order (cleanup copies with SELECT *).
ALTER TABLE "__SCHEMA__"."__TABLE___archive"
    ADD COLUMN IF NOT EXISTS ack_transport text DEFAULT 'kafka',
    ADD COLUMN IF NOT EXISTS ack_route     text,
    ADD COLUMN IF NOT EXISTS ack_duplicate boolean;
ALTER TABLE "__SCHEMA__"."__TABLE___archive" ALTER COLUMN ack_transport DROP DEFAULT;
UPDATE "__SCHEMA__"."__TABLE___archive" SET ack_transport = NULL
    WHERE ack_destination IS NULL AND status <> 'published';

-- A published row names its transport and destination, and the position its transport has:
-- Kafka a partition and an offset, JetStream a stream sequence, a subject and the duplicate
-- flag, RabbitMQ a routing key.
ALTER TABLE "__SCHEMA__"."__TABLE__" DROP CONSTRAINT IF EXISTS "__TABLE___published_has_ack";
ALTER TABLE "__SCHEMA__"."__TABLE__" ADD CONSTRAINT "__TABLE___published_has_ack" CHECK (
    status <> 'published'
    OR (published_at IS NOT NULL AND ack_transport IS NOT NULL AND ack_destination IS NOT NULL
        AND (ack_transport <> 'kafka'
             OR (ack_partition IS NOT NULL AND ack_position IS NOT NULL))
        AND (ack_transport <> 'nats'
             OR (ack_position IS NOT NULL AND ack_route IS NOT NULL
                 AND ack_duplicate IS NOT NULL))
        AND (ack_transport <> 'rabbitmq' OR ack_route IS NOT NULL))
) NOT VALID;
