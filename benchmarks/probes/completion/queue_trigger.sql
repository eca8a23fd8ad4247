-- Every row inserted into the event table, by whatever path (an appender of the previous
-- version, outbox_events_append, a hand-written INSERT), gets its queue row in the same
-- statement. Statement-level: one call per INSERT statement, not per row.
CREATE FUNCTION probe25_queue.enqueue() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO probe25_queue.outbox_events_queue (id, k, aggregate_type, aggregate_id, aggregate_version, inserted_at)
  SELECT n.id, hashtextextended(n.aggregate_type || chr(31) || n.aggregate_id, 0), n.aggregate_type,
         n.aggregate_id, n.aggregate_version, n.inserted_at
  FROM new_rows n WHERE n.status = 'pending';
  RETURN NULL;
END $$;
CREATE TRIGGER enqueue AFTER INSERT ON probe25_queue.outbox_events
  REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION probe25_queue.enqueue();
