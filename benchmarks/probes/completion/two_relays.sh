#!/usr/bin/env bash
# Two relays (two drain.py processes) drain one backlog concurrently, each holding its batch
# HOLD_MS between claim and completion; then check_two_relays.py checks exclusivity and order.
#   SCHEMES="cur rowlease" EVENTS=20000 AGGS=2000 BATCH=200 HOLD_MS=20 bash two_relays.sh
set -euo pipefail
cd "$(dirname "$0")"
EVENTS=${EVENTS:-20000}; AGGS=${AGGS:-2000}; BATCH=${BATCH:-200}; HOLD_MS=${HOLD_MS:-20}
for s in ${SCHEMES:-cur rowlease}; do
  echo "# $s $(date -u +%H:%M:%S) uptime:$(uptime | sed 's/.*load average//')" >&2
  python3 drain.py setup --scheme "$s" --schema "probe25_c_$s" --events "$EVENTS" --aggs "$AGGS" > /dev/null
  log=$(mktemp)
  python3 drain.py drain --scheme "$s" --schema "probe25_c_$s" --batch "$BATCH" --hold-ms "$HOLD_MS" --until-empty --log "$log" &
  p1=$!
  python3 drain.py drain --scheme "$s" --schema "probe25_c_$s" --batch "$BATCH" --hold-ms "$HOLD_MS" --until-empty --log "$log" &
  p2=$!
  wait "$p1" "$p2"
  python3 check_two_relays.py "$log" "$s" "probe25_c_$s"
  rm -f "$log"
  psql "${PROBE_DSN:-host=127.0.0.1 user=postgres dbname=test}" -qc "SET client_min_messages = warning; DROP SCHEMA probe25_c_$s CASCADE"
done
