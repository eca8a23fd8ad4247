#!/usr/bin/env bash
# Issue 25 decision probe: drains the same backlog with today's claim (cur) and each variant of
# its decision, in rotating order, each followed by drain.py's `check`; summary.py reads the
# output. Needs PostgreSQL at $PROBE_DSN (default 127.0.0.1:5432, user postgres, db test) and
# python3 with psycopg 3. Creates schemas probe25d_<variant> and drops them at the end.
#   ROUNDS=2 EVENTS=100000 AGGS=20000 BATCH=1000 VARIANTS="cur narrow" bash run.sh > results.jsonl
set -euo pipefail
cd "$(dirname "$0")"
ROUNDS=${ROUNDS:-2}; EVENTS=${EVENTS:-100000}; AGGS=${AGGS:-20000}; BATCH=${BATCH:-1000}
VARIANTS=(${VARIANTS:-cur narrow split narrow_split})
n=${#VARIANTS[@]}
for ((r = 0; r < ROUNDS; r++)); do
  for ((i = 0; i < n; i++)); do
    v=${VARIANTS[$(((i + r) % n))]}
    echo "# round $((r + 1)) $v $(date -u +%H:%M:%S) uptime:$(uptime | sed 's/.*load average//')" >&2
    # A drain can fail for reasons outside it ("out of shared memory": the server's lock table
    # is shared with other sessions' advisory locks); it is then set up and run again, once.
    for try in 1 2; do
      python3 probe.py setup --variant "$v" --schema "probe25d_$v" --events "$EVENTS" --aggs "$AGGS" \
        | sed "s/^{/{\"round\": $((r + 1)), \"kind\": \"setup\", /"
      if out=$(python3 probe.py drain --variant "$v" --schema "probe25d_$v" --batch "$BATCH"); then
        echo "$out" | sed "s/^{/{\"round\": $((r + 1)), \"kind\": \"drain\", /"
        break
      fi
      echo "# round $((r + 1)) $v drain failed (try $try) $(date -u +%H:%M:%S)" >&2
    done
    python3 probe.py check --variant "$v" --schema "probe25d_$v" --events "$EVENTS" --aggs "$AGGS" \
      | sed "s/^{/{\"round\": $((r + 1)), \"kind\": \"check\", /"
  done
done
if [[ -z "${KEEP:-}" ]]; then
  for v in "${VARIANTS[@]}"; do
    psql "${PROBE_DSN:-host=127.0.0.1 user=postgres dbname=test}" -qc "SET client_min_messages = warning; DROP SCHEMA IF EXISTS probe25d_$v CASCADE"
  done
fi
