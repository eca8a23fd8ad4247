#!/usr/bin/env bash
# Append cost: today's table vs the partitioned variants, pgbench -c 2, rotating order.
#   ROUNDS=3 SECS=15 bash run_append.sh > append.txt 2>&1
set -euo pipefail
cd "$(dirname "$0")"
ROUNDS=${ROUNDS:-3}; SECS=${SECS:-15}; PARTS=${PARTS:-6}
P="psql -h 127.0.0.1 -U postgres test -X -q"
python3 part.py setup --schema probe_part25_ab_cur
for v in side cte chk; do
  python3 part.py setup --schema probe_part25_ab_$v
  case $v in
    side) python3 part.py upgrade --schema probe_part25_ab_$v --size 1000000 --ahead $PARTS ;;
    cte) python3 part.py upgrade --schema probe_part25_ab_$v --size 1000000 --ahead $PARTS --no-trigger ;;
    chk) python3 part.py upgrade --schema probe_part25_ab_$v --size 1000000 --ahead $PARTS --uniq check ;;
  esac
done
V=(cur part_side part_cte part_bare part_check)
n=${#V[@]}
for mode in off on; do
  for ((r = 0; r < ROUNDS; r++)); do
    for ((i = 0; i < n; i++)); do
      v=${V[$(((i + r) % n))]}
      tps=$(PGOPTIONS="-c synchronous_commit=$mode" pgbench -h 127.0.0.1 -U postgres -n -c 2 -j 1 -T "$SECS" -f append_$v.sql test 2>&1 | grep -E '^tps' | sed 's/ (without.*//')
      echo "synchronous_commit=$mode round=$((r + 1)) $v $tps load:$(uptime | sed 's/.*load average: //')"
    done
  done
done
for v in cur side cte chk; do $P -c "SET client_min_messages = warning; DROP SCHEMA probe_part25_ab_$v CASCADE"; done
