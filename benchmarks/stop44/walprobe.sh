#!/bin/bash
# Stop 44: what one insert writes, per statement (EXPLAIN (ANALYZE, BUFFERS, WAL)): a bare row
# into a PK-only table, the same row into the outbox table, and the outbox table with each
# secondary index an append writes dropped (inside a rolled-back transaction). Warm session:
# the last of three EXPLAINs is kept (the first in a session also opens every index).
# Usage: walprobe.sh OUTBOX_BIN   (the `outbox` command, for `migrate`); uses database walprobe.
set -e
OUTBOX=${1:?the outbox command}
U=${U:-postgres://postgres@127.0.0.1:5432}
psql $U/postgres -qc "DROP DATABASE IF EXISTS walprobe" -qc "CREATE DATABASE walprobe"
$OUTBOX --database-url $U/walprobe migrate >/dev/null
U=$U/walprobe
COLS="event_id, aggregate_type, aggregate_id, aggregate_version, event_type, schema_version, content_type, payload, headers, created_at, inserted_at"
VALS="gen_random_uuid(), 'order', 'agg-' || random(), 1, 'order.changed', 1, 'application/json', decode(repeat('ab',207),'hex'), '{}', now(), clock_timestamp()"
psql $U -q <<SQL
CREATE TABLE public.bare (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL, aggregate_version bigint NOT NULL, event_type text NOT NULL, schema_version int NOT NULL, content_type text NOT NULL, payload bytea NOT NULL, headers jsonb NOT NULL, created_at timestamptz NOT NULL, inserted_at timestamptz NOT NULL);
INSERT INTO public.bare ($COLS) SELECT $VALS FROM generate_series(1,20000);
INSERT INTO outbox.outbox_events ($COLS) SELECT $VALS FROM generate_series(1,20000);
VACUUM ANALYZE public.bare; VACUUM ANALYZE outbox.outbox_events;
SQL
for v in bare outbox no-created_at_idx no-claim_idx no-unfinished_idx no-event_id_key pk-only; do
  t=outbox.outbox_events; d=""
  case $v in
    bare) t=public.bare;;
    outbox) ;;
    no-event_id_key) d="ALTER TABLE $t DROP CONSTRAINT outbox_events_event_id_key;";;
    pk-only) d="DROP INDEX outbox.outbox_events_created_at_idx, outbox.outbox_events_claim_idx, outbox.outbox_events_unfinished_idx; ALTER TABLE $t DROP CONSTRAINT outbox_events_event_id_key;";;
    *) d="DROP INDEX outbox.outbox_events_${v#no-};";;
  esac
  E="EXPLAIN (ANALYZE, BUFFERS, WAL, COSTS OFF, TIMING OFF) INSERT INTO $t ($COLS) VALUES ($VALS);"
  r=$(printf 'BEGIN; %s\n%s\n%s\n%s\nROLLBACK;\n' "$d" "$E" "$E" "$E" | psql $U -At | grep -E "^  (Buffers|WAL)" | tail -2 | tr -s ' ' | tr '\n' ' ')
  echo "$v: $r"
done
psql ${U%/walprobe}/postgres -qc "DROP DATABASE walprobe"
