#!/usr/bin/env bash
# A/B in one drain: the claims of one drain of today's tables decide with today's text and each
# variant in turn (probe.py --ab), so every text meets the same backlog, moment and load.
#   ROUNDS=2 AB=narrow,split,ctid bash ab.sh > results-ab.jsonl 2> run-ab.txt
set -euo pipefail
cd "$(dirname "$0")"
ROUNDS=${ROUNDS:-2}; EVENTS=${EVENTS:-100000}; AGGS=${AGGS:-20000}; BATCH=${BATCH:-1000}
AB=${AB:-narrow,split,ctid}
for ((r = 1; r <= ROUNDS; r++)); do
  echo "# ab round $r $(date -u +%H:%M:%S) uptime:$(uptime | sed 's/.*load average//')" >&2
  python3 probe.py setup --variant cur --schema probe25d_ab --events "$EVENTS" --aggs "$AGGS" > /dev/null
  python3 probe.py drain --variant cur --ab "$AB" --schema probe25d_ab --batch "$BATCH" \
    | sed "s/^{/{\"round\": $r, \"kind\": \"ab\", /"
  python3 probe.py check --variant cur --schema probe25d_ab --events "$EVENTS" --aggs "$AGGS" \
    | sed "s/^{/{\"round\": $r, \"kind\": \"check\", /"
done
psql "${PROBE_DSN:-host=127.0.0.1 user=postgres dbname=test}" -qc "SET client_min_messages = warning; DROP SCHEMA IF EXISTS probe25d_ab CASCADE"
