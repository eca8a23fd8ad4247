#!/bin/bash
# Stop 45: what the outbox table's definition costs a plain INSERT of one row (pgbench, 8
# clients, 2 threads, prepared statements), by variant of the table; same row, same statement,
# alternating rounds. Variants (copies of the migrated table, `LIKE`):
#   bare           the issue's reference: the envelope columns only, primary key only
#   pk_only        the outbox table's columns and defaults, primary key only
#   pk_checks      + its four CHECK constraints
#   no_entry_free  the full table without the four partial indexes a new row never enters
#   no_checks      the full table without the CHECK constraints
#   full           the outbox table as migrated
# Usage: tableprof.sh OUTBOX_BIN [OUTDIR]
set -e
OUTBOX=${1:?the outbox command}
O=${2:-$(dirname "$0")}
ROUNDS=${ROUNDS:-3}; SECS=${SECS:-10}
U=${U:-postgres://postgres@127.0.0.1:5432}
DB=tableprof
psql $U/postgres -qc "DROP DATABASE IF EXISTS $DB" -qc "CREATE DATABASE $DB"
$OUTBOX --database-url $U/$DB migrate >/dev/null
COLS="event_id, aggregate_type, aggregate_id, aggregate_version, event_type, schema_version, content_type, payload, headers, created_at"
PAYLOAD="'\\x$(head -c 207 /dev/zero | tr '\0' 'a' | xxd -p | tr -d '\n')'::bytea"
T0=outbox.outbox_events
D="INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING GENERATED"
psql $U/$DB -q <<SQL
CREATE TABLE public.bare (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL, aggregate_version bigint NOT NULL, event_type text NOT NULL, schema_version int NOT NULL, content_type text NOT NULL, payload bytea NOT NULL, headers jsonb NOT NULL, created_at timestamptz NOT NULL, inserted_at timestamptz NOT NULL);
CREATE TABLE public.pk_only (LIKE $T0 $D); ALTER TABLE public.pk_only ADD PRIMARY KEY (id);
CREATE TABLE public.pk_checks (LIKE $T0 $D INCLUDING CONSTRAINTS); ALTER TABLE public.pk_checks ADD PRIMARY KEY (id);
CREATE TABLE public.no_entry_free (LIKE $T0 INCLUDING ALL);
CREATE TABLE public.no_checks (LIKE $T0 $D INCLUDING INDEXES);
CREATE TABLE public.full_t (LIKE $T0 INCLUDING ALL);
DO \$\$ DECLARE r record; BEGIN
  FOR r IN SELECT indexname FROM pg_indexes WHERE schemaname = 'public' AND tablename = 'no_entry_free'
           AND (indexdef LIKE '%finished_at%' OR indexdef LIKE '%parked_at%'
                OR indexdef LIKE '%held_since%' OR indexdef LIKE '%AND blocked') LOOP
    EXECUTE format('DROP INDEX public.%I', r.indexname);
  END LOOP; END \$\$;
SQL
psql $U/$DB -At -c "SELECT tablename, count(*) FROM pg_indexes WHERE schemaname = 'public' GROUP BY 1 ORDER BY 1" \
  -c "SELECT conrelid::regclass, count(*) FROM pg_constraint WHERE contype = 'c' AND connamespace = 'public'::regnamespace GROUP BY 1"
T=$(mktemp -d)
VALS="gen_random_uuid(), 'order', 'agg-' || :n, 1, 'order.changed', 1, 'application/json', $PAYLOAD, '{}', now()"
VARIANTS="bare pk_only pk_checks no_entry_free no_checks full_t"
for v in $VARIANTS; do
  printf '\\set n random(1, 1000000000)\nINSERT INTO public.%s (%s, inserted_at) VALUES (%s, clock_timestamp());\n' "$v" "$COLS" "$VALS" > $T/$v.sql
done
PGB="pgbench -n -M prepared -c 8 -j 2"
# SYNC=off: commits without the WAL flush (PGOPTIONS), so that the CPU of the statement, not the
# disk's flush time, decides; a CHECKPOINT before each run, so none runs with full-page writes
# that another did not pay.
[ "${SYNC:-on}" = off ] && export PGOPTIONS="-c synchronous_commit=off"
f=$O/tableprof-sync${SYNC:-on}.txt
{ echo "# $(date -u) $(uptime) SYNC=${SYNC:-on} SECS=$SECS"; } > $f
for r in $(seq 1 $ROUNDS); do
  for v in $VARIANTS; do
    psql $U/$DB -qc CHECKPOINT
    tps=$($PGB -T $SECS -f $T/$v.sql $U/$DB 2>&1 | grep -E '^tps' | grep -oE '[0-9]+\.[0-9]+' | head -1)
    echo "round $r $v tps $tps" | tee -a $f
  done
done
echo "# $(date -u) $(uptime)" >> $f
rm -rf $T
psql $U/postgres -qc "DROP DATABASE $DB"
