#!/usr/bin/env bash
# Two relays (two probe.py drains) on one backlog, each holding its batch HOLD_MS between claim
# and completion; ../completion/check_two_relays.py checks exclusivity and per-aggregate order.
#   VARIANTS="cur ctid" EVENTS=20000 AGGS=2000 BATCH=200 HOLD_MS=20 bash two_relays.sh
# PROBE_BREAK=lease makes the claim ignore live leases (the check must then fail).
set -euo pipefail
cd "$(dirname "$0")"
EVENTS=${EVENTS:-20000}; AGGS=${AGGS:-2000}; BATCH=${BATCH:-200}; HOLD_MS=${HOLD_MS:-20}
for v in ${VARIANTS:-cur ctid}; do
  echo "# $v $EVENTS/$AGGS/$BATCH $(date -u +%H:%M:%S) uptime:$(uptime | sed 's/.*load average//')" >&2
  schema="probe25d_2r_$v"
  python3 probe.py setup --variant "$v" --schema "$schema" --events "$EVENTS" --aggs "$AGGS" > /dev/null
  log=$(mktemp)
  python3 probe.py drain --variant "$v" --schema "$schema" --batch "$BATCH" --hold-ms "$HOLD_MS" --until-empty --log "$log" > /dev/null &
  p1=$!
  python3 probe.py drain --variant "$v" --schema "$schema" --batch "$BATCH" --hold-ms "$HOLD_MS" --until-empty --log "$log" > /dev/null &
  p2=$!
  wait "$p1" "$p2"
  python3 ../completion/check_two_relays.py "$log" cur "$schema" | sed "s/\"scheme\": \"cur\"/\"variant\": \"$v\", \"break\": \"${PROBE_BREAK:-}\"/"
  python3 probe.py check --variant "$v" --schema "$schema" --events "$EVENTS" --aggs "$AGGS"
  rm -f "$log"
  psql "${PROBE_DSN:-host=127.0.0.1 user=postgres dbname=test}" -qc "SET client_min_messages = warning; DROP SCHEMA $schema CASCADE"
done
