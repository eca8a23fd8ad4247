#!/usr/bin/env bash
# complete_lease's plan, today's text (orig.sql) and the rewrite (new.sql), at 200 aggregates
# (20,000 events) and 20,000 aggregates (100,000 events), cycles 2 and 10 under
# EXPLAIN (ANALYZE, BUFFERS, WAL). Uses ../completion/drain.py (scheme `cur`, its claim
# statements; PROBE_COMPLETE swaps the completion). Needs PostgreSQL at $PROBE_DSN and psycopg 3.
#   bash run.sh > plans.txt
set -euo pipefail
cd "$(dirname "$0")/../completion"
for text in orig new; do
  for aggs in 200 20000; do
    events=$((aggs == 200 ? 20000 : 100000))
    for k in 2 10; do
      p=$(mktemp)
      python3 drain.py setup --scheme cur --schema rel25_plan --events "$events" --aggs "$aggs" >/dev/null
      echo "#### $text: $aggs aggregates, $events events, cycle $k; $(date -u +%H:%M:%S) load$(uptime | sed 's/.*load average//')"
      PROBE_COMPLETE=../complete-lease-plan/$text.sql PROBE_PLANS=$p \
        python3 drain.py drain --scheme cur --schema rel25_plan --batch 1000 --explain-at "$k" |
        python3 -c "import json,sys; d=json.load(sys.stdin); print('drain: events/s', d['events_per_s'], 'complete us/event', d['statement_us_per_event']['complete'])"
      python3 drain.py check --scheme cur --schema rel25_plan --events "$events" --aggs "$aggs"
      python3 plantext.py "$p" | sed -n '/^==== execution/,$p' | awk '/^==== execution/{n++} n==2' | sed -n '1,/CTE promote/p'
      rm -f "$p"
    done
  done
done
psql "${PROBE_DSN:-host=127.0.0.1 user=postgres dbname=test}" -qc "SET client_min_messages = warning; DROP SCHEMA IF EXISTS rel25_plan CASCADE"
