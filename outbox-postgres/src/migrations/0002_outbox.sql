
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
DROP INDEX IF EXISTS "__SCHEMA__"."__TABLE___aggregate_idx";

CREATE INDEX IF NOT EXISTS "__TABLE___unfinished_idx"
    ON "__SCHEMA__"."__TABLE__"
       ((hashtextextended(aggregate_type || chr(31) || aggregate_id, 0)), aggregate_version, id)
    WHERE status IN ('pending', 'parked');

-- Blocked rows, by the same key: the completion's probe for the row to unblock next.
DROP INDEX IF EXISTS "__SCHEMA__"."__TABLE___blocked_idx";

CREATE INDEX IF NOT EXISTS "__TABLE___blocked_idx"
    ON "__SCHEMA__"."__TABLE__"
       ((hashtextextended(aggregate_type || chr(31) || aggregate_id, 0)), aggregate_version, id)
    WHERE status IN ('pending', 'parked') AND blocked;

-- Lease rows are keyed by the new lock key: released leases go (they are only kept for reuse)
-- and live ones are re-keyed from their event row.
DELETE FROM "__SCHEMA__"."__TABLE___lease"
    WHERE lease_token IS NULL OR lease_until <= clock_timestamp();

UPDATE "__SCHEMA__"."__TABLE___lease" l
    SET aggregate_key = hashtextextended(e.aggregate_type || chr(31) || e.aggregate_id, 0)
                        # (__SEED__)
    FROM "__SCHEMA__"."__TABLE__" e
    WHERE e.id = l.event_row;
