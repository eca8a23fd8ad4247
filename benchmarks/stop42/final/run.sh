#!/bin/bash
# Final A/B: main (claims generic, completions custom) vs the env-patched binary with custom plans everywhere.
source /work/build/env.sh
export DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench42
O=/work/notes/b42b
NEW=/work/build/rel/release/outbox-bench
OLD=/work/build/bench-env
for pass in 1 2 3; do
  for v in old new; do
    f=$O/latency-$v-$pass.txt
    { echo "# $v pass $pass"; date -u; uptime; } > $f
    if [ $v = old ]; then OUTBOX_PG_PLAN_CACHE_MODE=force_custom_plan $OLD --rounds 2 latency --seconds 10 --only notify --json $O/latency-$v-$pass.json >> $f 2>&1
    else $NEW --rounds 2 latency --seconds 10 --only notify --json $O/latency-$v-$pass.json >> $f 2>&1; fi
    { date -u; uptime; } >> $f
  done
done
for v in old new; do
  f=$O/drain-$v.txt
  { echo "# $v"; date -u; uptime; } > $f
  if [ $v = old ]; then OUTBOX_PG_PLAN_CACHE_MODE=force_custom_plan $OLD --rounds 2 drain --events 50000 --aggregates 20000 --only naive-sql,instant-lease,instant-locked,lean,lease-1,locked-1 --json $O/drain-$v.json >> $f 2>&1
  else $NEW --rounds 2 drain --events 50000 --aggregates 20000 --only naive-sql,instant-lease,instant-locked,lean,lease-1,locked-1 --json $O/drain-$v.json >> $f 2>&1; fi
  { date -u; uptime; } >> $f
done
echo done > $O/DONE
