#!/bin/bash
# Stop 43 A/B: landed main (13abfe7, "old") vs this stop's main (5308bef, "new": heads-only decision statements, the run join, the follower rule).
# Summary: cd benchmarks/stop43 && python3 ../stop42/final/summarize.py > summary.txt
source /work/build/env.sh
export DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench43
O=/work/notes/b43
NEW=/work/build/rel/release/outbox-bench
OLD=/work/build/relbase/release/outbox-bench
for pass in 1 2 3; do
  for v in old new; do
    if [ $v = old ]; then B=$OLD; else B=$NEW; fi
    f=$O/latency-$v-$pass.txt
    { echo "# $v pass $pass"; date -u; uptime; } > $f
    $B --rounds 2 latency --seconds 10 --only notify --json $O/latency-$v-$pass.json >> $f 2>&1
    { date -u; uptime; } >> $f
  done
done
for v in old new; do
  if [ $v = old ]; then B=$OLD; else B=$NEW; fi
  f=$O/drain-$v.txt
  { echo "# $v"; date -u; uptime; } > $f
  $B --rounds 2 drain --events 50000 --aggregates 20000 --only naive-sql,instant-lease,instant-locked,lean,lease-1,locked-1 --json $O/drain-$v.json >> $f 2>&1
  { date -u; uptime; } >> $f
done
echo done > $O/DONE
