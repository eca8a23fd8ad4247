-- outbox-mysql inbox migration 3: a message is parked once per dedup id *and aggregate*.
--
-- Migration 1 deduplicated parked messages by (consumer, dedup id) alone, so a record naming
-- another aggregate's event as its original (or the event such a record named) came back
-- "parked already" when the other one was parked first: its offset final, nothing of it kept,
-- the message lost. The unique key now includes the aggregate (`dedup_scope`: the aggregate
-- key, 32 zero bytes for a record without one, NULL for a record without a dedup id, which is
-- parked once per position as before), so each aggregate's message is kept and a redelivery of
-- either is still parked already. The scope is the key itself: no derived id that another
-- record could be crafted to hold.
--
-- Beside consumers of the previous version: the column is virtual (added without rewriting a
-- row), the unique key is built online (writes go on; MariaDB 10.6+ and MySQL 8 build a
-- secondary index in place), and the old key is dropped last. The rows of the previous version
-- are unique by (consumer, dedup id), hence by the new key too: the key always builds. Between
-- the statements both keys exist, and the old one rejects what it rejected before; after the
-- last, a consumer of the previous version parks the message of the other aggregate too (its
-- code takes only a duplicate key for "parked already"). Each statement's effect is taken as
-- applied when it is found done (duplicate column 1060, duplicate key 1061, key gone 1091),
-- so the migration runs again after a failure.
ALTER TABLE __Q__`__TABLE___parked`
    ADD COLUMN dedup_scope BINARY(32)
        AS (IF(dedup_id IS NULL, NULL, IFNULL(aggregate_key, ''))) VIRTUAL;
ALTER TABLE __Q__`__TABLE___parked`
    ADD UNIQUE KEY dedup_scope_key (consumer, dedup_id, dedup_scope);
ALTER TABLE __Q__`__TABLE___parked` DROP KEY dedup_key;
