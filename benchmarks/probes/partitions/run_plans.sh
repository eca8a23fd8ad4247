#!/usr/bin/env bash
# Today's lease-mode claim + completion (../completion/cur.sql, via drain.py) on today's table
# and on the partitioned one (100,000 events in 10 partitions of 10,000), plans at cycle 40.
#   ROUNDS=2 bash run_plans.sh > plans.jsonl 2> plans-run.txt
set -euo pipefail
cd "$(dirname "$0")"
ROUNDS=${ROUNDS:-2}; EVENTS=${EVENTS:-100000}; AGGS=${AGGS:-20000}
D=../completion/drain.py
for ((r = 1; r <= ROUNDS; r++)); do
  for kind in cur part; do
    s=probe_part25_pl_$kind
    echo "# round $r $kind $(date -u +%H:%M:%S) load:$(uptime | sed 's/.*load average: //')" >&2
    if [[ $kind == cur ]]; then
      python3 $D setup --scheme cur --schema $s --events $EVENTS --aggs $AGGS > /dev/null
    else
      python3 part.py setup --schema $s
      python3 part.py upgrade --schema $s --size 10000 --ahead 11 --uniq check >&2
      python3 part.py fill --schema $s --events $EVENTS --aggs $AGGS
      psql -h 127.0.0.1 -U postgres test -X -q -c "VACUUM ANALYZE $s.outbox_events" -c "VACUUM ANALYZE $s.outbox_events_aggregate"
    fi
    rm -f plans/$kind-r$r.json
    PROBE_PLANS=plans/$kind-r$r.json python3 $D drain --scheme cur --schema $s --batch 1000 --explain-at 40 \
      | sed "s/^{/{\"round\": $r, \"kind\": \"$kind\", /"
    python3 $D check --scheme cur --schema $s --events $EVENTS --aggs $AGGS | sed "s/^{/{\"round\": $r, \"kind\": \"check-$kind\", /"
    python3 ../completion/plantext.py plans/$kind-r$r.json > plans/$kind-r$r.txt
  done
done
for kind in cur part; do psql -h 127.0.0.1 -U postgres test -X -qc "SET client_min_messages = warning; DROP SCHEMA probe_part25_pl_$kind CASCADE"; done
