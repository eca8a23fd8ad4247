#!/bin/bash
# Stop 45: server CPU of one single-row INSERT statement by variant of the outbox table, without
# a client: a DO loop of 30,000 INSERT statements in one backend (each statement builds its
# executor state again, as a one-event append does; no commit per row), elapsed / 30,000.
# Variants (copies of the migrated table, `LIKE`):
#   pk_only     columns and defaults, primary key only
#   pk_small    + the three small CHECKs (versions >= 1, status in its four values)
#   pk_ack      + only the CHECK published_has_ack
#   pk_checks   + all four CHECKs
#   pk_one      + the four CHECKs as one expression
#   no_checks   the full table (all indexes) without the CHECKs
#   full_t      the table as migrated
# Usage: checkcost.sh OUTBOX_BIN [OUTDIR]
set -e
OUTBOX=${1:?the outbox command}
O=${2:-$(dirname "$0")}
ROUNDS=${ROUNDS:-3}
U=${U:-postgres://postgres@127.0.0.1:5432}
DB=checkcost
psql $U/postgres -qc "DROP DATABASE IF EXISTS $DB" -qc "CREATE DATABASE $DB"
$OUTBOX --database-url $U/$DB migrate >/dev/null
T0=outbox.outbox_events
D="INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING GENERATED"
psql $U/$DB -q <<SQL
CREATE TABLE public.pk_only (LIKE $T0 $D); ALTER TABLE public.pk_only ADD PRIMARY KEY (id);
CREATE TABLE public.pk_checks (LIKE $T0 $D INCLUDING CONSTRAINTS); ALTER TABLE public.pk_checks ADD PRIMARY KEY (id);
CREATE TABLE public.pk_ack (LIKE public.pk_checks INCLUDING ALL);
ALTER TABLE public.pk_ack DROP CONSTRAINT outbox_events_aggregate_version_check, DROP CONSTRAINT outbox_events_schema_version_check, DROP CONSTRAINT outbox_events_status_check;
CREATE TABLE public.pk_small (LIKE public.pk_checks INCLUDING ALL);
ALTER TABLE public.pk_small DROP CONSTRAINT outbox_events_published_has_ack;
CREATE TABLE public.pk_one (LIKE public.pk_only INCLUDING ALL);
DO \$\$ BEGIN
  EXECUTE 'ALTER TABLE public.pk_one ADD CONSTRAINT one_check CHECK (' ||
    (SELECT string_agg(pg_get_expr(conbin, conrelid), ' AND ') FROM pg_constraint
      WHERE conrelid = 'public.pk_checks'::regclass AND contype = 'c') || ')';
END \$\$;
CREATE TABLE public.no_checks (LIKE $T0 $D INCLUDING INDEXES);
CREATE TABLE public.full_t (LIKE $T0 INCLUDING ALL);
SQL
f=$O/checkcost.txt
{ echo "# $(date -u) $(uptime)"
  psql $U/$DB -At -F ' ' -c "SELECT 'node text bytes', conrelid::regclass, conname, length(conbin::text) FROM pg_constraint WHERE connamespace = 'public'::regnamespace AND contype = 'c' AND conrelid IN ('public.pk_checks'::regclass, 'public.pk_one'::regclass) ORDER BY 2, 3"; } > $f
COLS="event_id, aggregate_type, aggregate_id, aggregate_version, event_type, schema_version, content_type, payload, headers, created_at, inserted_at"
PAYLOAD="'\\x$(head -c 207 /dev/zero | tr '\0' 'a' | xxd -p | tr -d '\n')'::bytea"
VALS="gen_random_uuid(), 'order', 'agg-' || i, 1, 'order.changed', 1, 'application/json', $PAYLOAD, '{}', now(), clock_timestamp()"
for r in $(seq 1 $ROUNDS); do
  for v in pk_only pk_small pk_ack pk_checks pk_one no_checks full_t; do
    psql $U/$DB -qc "TRUNCATE public.$v" -qc CHECKPOINT
    ms=$(psql $U/$DB -c '\timing on' -c "DO \$\$ BEGIN FOR i IN 1..30000 LOOP INSERT INTO public.$v ($COLS) VALUES ($VALS); END LOOP; END \$\$" | grep -oE 'Time: [0-9.]+' | grep -oE '[0-9.]+')
    echo "round $r $v $(python3 -c "print(round($ms * 1000 / 30000, 2))") us/statement" | tee -a $f
  done
done
echo "# $(date -u) $(uptime)" >> $f
psql $U/postgres -qc "DROP DATABASE $DB"
