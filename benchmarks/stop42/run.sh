#!/bin/bash
# Plan-cache-mode A/B/C, alternating modes per pass.
source /work/build/env.sh
export DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench42
B=/work/build/rel/release/outbox-bench
O=/work/notes/b42
for pass in 1 2; do
for mode in force_custom_plan force_generic_plan auto; do
  f=$O/drain-$mode-$pass.txt
  { echo "# mode $mode pass $pass"; date -u; uptime; } > $f
  OUTBOX_PG_PLAN_CACHE_MODE=$mode $B --rounds 2 drain --events 50000 --aggregates 20000 --only naive-sql,instant-lease,lean,lease-1 --json $O/drain-$mode-$pass.json >> $f 2>&1
  { date -u; uptime; } >> $f
done
for mode in force_custom_plan force_generic_plan auto; do
  f=$O/latency-$mode-$pass.txt
  { echo "# mode $mode pass $pass"; date -u; uptime; } > $f
  OUTBOX_PG_PLAN_CACHE_MODE=$mode $B --rounds 2 latency --seconds 10 --only notify --json $O/latency-$mode-$pass.json >> $f 2>&1
  { date -u; uptime; } >> $f
done
done
echo done > $O/DONE
