#!/usr/bin/env bash
# Issue 25 completion probe: drains the same backlog with the naive SKIP LOCKED drain, today's
# lease-mode statements, and the completion schemes of this folder, in rotating order, and
# summarizes the medians (summary.py). Needs PostgreSQL at $PROBE_DSN (default: 127.0.0.1:5432,
# user postgres, db test) and python3 with psycopg 3. Creates schemas probe25_<scheme> and
# drops them at the end.
#   ROUNDS=3 EVENTS=100000 AGGS=20000 BATCH=1000 bash run.sh > results.jsonl
set -euo pipefail
cd "$(dirname "$0")"
ROUNDS=${ROUNDS:-3}; EVENTS=${EVENTS:-100000}; AGGS=${AGGS:-20000}; BATCH=${BATCH:-1000}
SCHEMES=(${SCHEMES:-naive cur queue batchack rowlease rowlease_batchack})
n=${#SCHEMES[@]}
for ((r = 0; r < ROUNDS; r++)); do
  for ((i = 0; i < n; i++)); do
    s=${SCHEMES[$(((i + r) % n))]}
    echo "# round $((r + 1)) $s $(date -u +%H:%M:%S) uptime:$(uptime | sed 's/.*load average//')" >&2
    python3 drain.py setup --scheme "$s" --schema "probe25_$s" --events "$EVENTS" --aggs "$AGGS" \
      | sed "s/^{/{\"round\": $((r + 1)), \"kind\": \"setup\", /"
    python3 drain.py drain --scheme "$s" --schema "probe25_$s" --batch "$BATCH" \
      | sed "s/^{/{\"round\": $((r + 1)), \"kind\": \"drain\", /"
    python3 drain.py check --scheme "$s" --schema "probe25_$s" --events "$EVENTS" --aggs "$AGGS" \
      | sed "s/^{/{\"round\": $((r + 1)), \"kind\": \"check\", /"
  done
done
if [[ -z "${KEEP:-}" ]]; then
  for s in "${SCHEMES[@]}"; do
    psql "${PROBE_DSN:-host=127.0.0.1 user=postgres dbname=test}" -qc "SET client_min_messages = warning; DROP SCHEMA IF EXISTS probe25_$s CASCADE"
  done
fi
