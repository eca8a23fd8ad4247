#!/bin/bash
# Stop 45: where an append's cost goes on the server, without the Rust client.
# pgbench (8 clients, 2 threads, prepared statements: as sqlx sends them) runs the same row
# four ways, alternating, ROUNDS rounds of SECS seconds each:
#   bare        INSERT into a table with only a primary key (issue 25's reference)
#   outbox-ins  the same INSERT into the outbox table (its indexes)
#   append      the store's single-event append statement (CTE, count, wake-up gate probe)
#   append-pk   the same statement with the outbox table's secondary indexes dropped
# then profiles one bare and one append run with `perf record -a` (CPU per transaction by
# process, top server functions).
# Usage: appendprof.sh OUTBOX_BIN [OUTDIR]   (OUTBOX_BIN: the `outbox` command, for `migrate`)
set -e
OUTBOX=${1:?the outbox command}
O=${2:-$(dirname "$0")}
ROUNDS=${ROUNDS:-5}; SECS=${SECS:-10}
U=${U:-postgres://postgres@127.0.0.1:5432}
DB=appendprof
psql $U/postgres -qc "DROP DATABASE IF EXISTS $DB" -qc "CREATE DATABASE $DB"
$OUTBOX --database-url $U/$DB migrate >/dev/null
COLS="event_id, aggregate_type, aggregate_id, aggregate_version, event_type, schema_version, content_type, payload, headers, created_at"
PAYLOAD="'\\x$(head -c 207 /dev/zero | tr '\0' 'a' | xxd -p | tr -d '\n')'::bytea"
psql $U/$DB -q <<SQL
CREATE TABLE public.bare (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL, aggregate_version bigint NOT NULL, event_type text NOT NULL, schema_version int NOT NULL, content_type text NOT NULL, payload bytea NOT NULL, headers jsonb NOT NULL, created_at timestamptz NOT NULL, inserted_at timestamptz NOT NULL);
CREATE TABLE public.outbox_pk (LIKE outbox.outbox_events INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING IDENTITY);
ALTER TABLE public.outbox_pk ADD PRIMARY KEY (id);
SQL
T=$(mktemp -d)
# The row: the same values in every script (a fresh uuid and aggregate id per row, as the bench).
VALS="gen_random_uuid(), 'order', 'agg-' || :n, 1, 'order.changed', 1, 'application/json', $PAYLOAD, '{}', now()"
printf '\\set n random(1, 1000000000)\nINSERT INTO public.bare (%s, inserted_at) VALUES (%s, clock_timestamp());\n' "$COLS" "$VALS" > $T/bare.sql
printf '\\set n random(1, 1000000000)\nINSERT INTO outbox.outbox_events (%s, inserted_at) VALUES (%s, clock_timestamp());\n' "$COLS" "$VALS" > $T/outbox-ins.sql
# The store's append_one statement (outbox-postgres/src/sql.rs), parameters as literals; the gate
# keys are arbitrary (no relay holds them: the probe succeeds and nothing is notified, as when
# no relay waits).
APPEND="WITH ins AS (INSERT INTO TABLE ($COLS, inserted_at) VALUES ($VALS, clock_timestamp()) RETURNING 1) SELECT (SELECT count(*) FROM ins) AS n, (SELECT count(*) FROM (SELECT pg_notify('outbox_events'::text, '') WHERE 'outbox_events'::text IS NOT NULL AND (7::int4 IS NULL OR NOT pg_try_advisory_xact_lock_shared(7::int4, 11::int4))) nn) AS notified;"
printf '\\set n random(1, 1000000000)\n%s\n' "${APPEND/TABLE/outbox.outbox_events}" > $T/append.sql
printf '\\set n random(1, 1000000000)\n%s\n' "${APPEND/TABLE/public.outbox_pk}" > $T/append-pk.sql
PGB="pgbench -n -M prepared -c 8 -j 2"
{ echo "# $(date -u) $(uptime)"; nproc; } > $O/appendprof.txt
for r in $(seq 1 $ROUNDS); do
  for s in bare outbox-ins append append-pk; do
    tps=$($PGB -T $SECS -f $T/$s.sql $U/$DB 2>&1 | grep -E '^tps' | grep -oE '[0-9]+\.[0-9]+' | head -1)
    echo "round $r $s tps $tps" | tee -a $O/appendprof.txt
  done
done
echo "# $(date -u) $(uptime)" >> $O/appendprof.txt
# Profiles: CPU by process and the server's top functions.
for s in bare append; do
  $PGB -T 12 -f $T/$s.sql $U/$DB > $T/$s.pgb 2>&1 &
  sleep 1
  perf record -a -g -F 997 -o $T/$s.data -- sleep 10 2> /dev/null
  wait
  tps=$(grep -E '^tps' $T/$s.pgb | grep -oE '[0-9]+\.[0-9]+' | head -1)
  {
    echo "== profile $s: tps $tps (12 s run, 10 s sampled at 997 Hz on every CPU)"
    perf report -i $T/$s.data --no-children --sort comm --stdio 2>/dev/null | grep -E '^ +[0-9]' | head -8
    echo "-- postgres, top functions (self)"
    perf report -i $T/$s.data --no-children --comm postgres --sort symbol --stdio -g none 2>/dev/null | grep -E '^ +[0-9]' | head -40
    echo "-- total samples by comm"
    perf script -i $T/$s.data -F comm 2>/dev/null | sort | uniq -c | sort -rn | head -6
  } >> $O/appendprof-perf.txt
done
rm -rf $T
psql $U/postgres -qc "DROP DATABASE $DB"
