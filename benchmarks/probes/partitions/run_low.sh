#!/usr/bin/env bash
# Steady-state claim: 100,000 events, 80,000 published (8 finished partitions for part), the
# last 20,000 drained by today's statements (cur, part) and with the low-water mark (partlow).
#   ROUNDS=2 bash run_low.sh > low.jsonl 2> low-run.txt
set -euo pipefail
cd "$(dirname "$0")"
ROUNDS=${ROUNDS:-2}
for ((r = 1; r <= ROUNDS; r++)); do
  for kind in cur part partlow; do
    s=probe_part25_lw_$kind
    echo "# round $r $kind $(date -u +%H:%M:%S) load:$(uptime | sed 's/.*load average: //')" >&2
    python3 drain_low.py setup --kind "${kind/partlow/part}" --schema $s
    rm -f plans/low-$kind-r$r.json
    PROBE_PLANS=plans/low-$kind-r$r.json python3 drain_low.py drain --kind $kind --schema $s --explain-at 10 \
      | sed "s/^{/{\"round\": $r, \"kind\": \"$kind\", /"
    python3 drain_low.py check --kind $kind --schema $s | sed "s/^{/{\"round\": $r, \"kind\": \"check-$kind\", /"
    python3 ../completion/plantext.py plans/low-$kind-r$r.json > plans/low-$kind-r$r.txt
    psql -h 127.0.0.1 -U postgres test -X -qc "SET client_min_messages = warning; DROP SCHEMA $s CASCADE"
  done
done
