#!/usr/bin/env bash
# Cost attribution: one drain with today's statements; before each real decision, today's text
# and each ablation (variants/abl_*.sql: one part removed, NOT the same semantics) decide on the
# same ids in a savepoint that is rolled back (probe.py --shadows, rotating order).
#   bash shadow.sh > results-shadow.jsonl 2> run-shadow.txt
set -euo pipefail
cd "$(dirname "$0")"
EVENTS=${EVENTS:-100000}; AGGS=${AGGS:-20000}; BATCH=${BATCH:-1000}
SHADOWS=${SHADOWS:-cur,abl_c,abl_ch,abl_nofollower,abl_norare,abl_noins,ctid}
echo "# shadow $(date -u +%H:%M:%S) uptime:$(uptime | sed 's/.*load average//')" >&2
python3 probe.py setup --variant cur --schema probe25d_shadow --events "$EVENTS" --aggs "$AGGS" > /dev/null
python3 probe.py drain --variant cur --shadows "$SHADOWS" --schema probe25d_shadow --batch "$BATCH" | sed 's/^{/{"kind": "shadow", /'
python3 probe.py check --variant cur --schema probe25d_shadow --events "$EVENTS" --aggs "$AGGS" | sed 's/^{/{"kind": "check", /'
echo "# shadow end $(date -u +%H:%M:%S) uptime:$(uptime | sed 's/.*load average//')" >&2
psql "${PROBE_DSN:-host=127.0.0.1 user=postgres dbname=test}" -qc "SET client_min_messages = warning; DROP SCHEMA IF EXISTS probe25d_shadow CASCADE"
