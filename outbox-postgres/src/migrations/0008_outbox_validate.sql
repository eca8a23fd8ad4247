-- outbox-postgres migration 8, after its transaction: validates the CHECK it added NOT VALID.
-- VALIDATE takes a SHARE UPDATE EXCLUSIVE lock (reads and writes go on while it scans). The
-- runner runs this after every successful migrate, so it validates only a constraint that is
-- not valid yet (a crash between the two steps): nothing else waits for a lock.
DO $validate$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_constraint
               WHERE conrelid = '"__SCHEMA__"."__TABLE__"'::regclass
                 AND conname = '__TABLE___published_has_ack' AND NOT convalidated) THEN
        ALTER TABLE "__SCHEMA__"."__TABLE__" VALIDATE CONSTRAINT "__TABLE___published_has_ack";
    END IF;
END
$validate$;
