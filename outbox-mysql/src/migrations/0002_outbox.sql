-- outbox-mysql migration 2: transport-neutral acknowledgement columns (docs/transports.md §2).
--
-- A row's acknowledgement is (ack_transport, ack_destination, ack_partition, ack_position,
-- ack_route, ack_duplicate): Kafka ('kafka', topic, partition, offset, NULL, NULL), JetStream
-- ('nats', stream, NULL, stream sequence, subject, duplicate), RabbitMQ ('rabbitmq', exchange,
-- NULL, NULL, routing key, NULL). Every row written before is a Kafka acknowledgement.
--
-- The published history is not rewritten: the transport of the rows already there comes from
-- the column's default, which MySQL (8.0.12+) and MariaDB (10.3+) keep in the data dictionary
-- for them (an instant ADD COLUMN); the default is dropped at once, so a new row names its
-- transport itself. Only rows without an acknowledgement (unfinished or discarded) are
-- written, back to no transport. Each statement can run again after a failure (the runner
-- skips what is already applied).
--
-- The CHECK names the columns being renamed (MySQL refuses to rename them under it): it is
-- dropped first and added again, rewritten, last. MySQL has no NOT VALID: adding it checks
-- every row.
ALTER TABLE __Q__`__TABLE__` DROP CONSTRAINT __TABLE___published_chk;
ALTER TABLE __Q__`__TABLE__`
    RENAME COLUMN ack_topic TO ack_destination,
    RENAME COLUMN ack_offset TO ack_position;
ALTER TABLE __Q__`__TABLE__`
    ADD COLUMN ack_transport VARCHAR(16) NULL DEFAULT 'kafka',
    ADD COLUMN ack_route     TEXT        NULL,
    ADD COLUMN ack_duplicate TINYINT(1)  NULL;
ALTER TABLE __Q__`__TABLE__` ALTER COLUMN ack_transport DROP DEFAULT;
UPDATE __Q__`__TABLE__` SET ack_transport = NULL
    WHERE ack_destination IS NULL AND ack_transport IS NOT NULL;

ALTER TABLE __Q__`__TABLE___archive`
    RENAME COLUMN ack_topic TO ack_destination,
    RENAME COLUMN ack_offset TO ack_position;
ALTER TABLE __Q__`__TABLE___archive`
    ADD COLUMN ack_transport VARCHAR(16) NULL DEFAULT 'kafka',
    ADD COLUMN ack_route     TEXT        NULL,
    ADD COLUMN ack_duplicate TINYINT(1)  NULL;
ALTER TABLE __Q__`__TABLE___archive` ALTER COLUMN ack_transport DROP DEFAULT;
UPDATE __Q__`__TABLE___archive` SET ack_transport = NULL
    WHERE ack_destination IS NULL AND ack_transport IS NOT NULL;

-- A published row names its transport and destination, and the position its transport has:
-- Kafka a partition and an offset, JetStream a stream sequence, a subject and the duplicate
-- flag, RabbitMQ a routing key.
ALTER TABLE __Q__`__TABLE__` ADD CONSTRAINT __TABLE___published_chk CHECK (
    status <> 'published'
    OR (published_at IS NOT NULL AND ack_transport IS NOT NULL AND ack_destination IS NOT NULL
        AND (ack_transport <> 'kafka'
             OR (ack_partition IS NOT NULL AND ack_position IS NOT NULL))
        AND (ack_transport <> 'nats'
             OR (ack_position IS NOT NULL AND ack_route IS NOT NULL
                 AND ack_duplicate IS NOT NULL))
        AND (ack_transport <> 'rabbitmq' OR ack_route IS NOT NULL)));
