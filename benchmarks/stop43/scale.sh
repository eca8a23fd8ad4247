#!/bin/bash
# Stop 43: the claim at 10M queued rows vs 10k, landed main (old) and this stop's (new), one after the other.
source /work/build/env.sh
export DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench43
O=/work/notes/b43
for v in new old; do
  if [ $v = old ]; then B=/work/build/relbase/release/outbox-bench; else B=/work/build/rel/release/outbox-bench; fi
  f=$O/scale-$v.txt
  { echo "# $v"; date -u; uptime; } > $f
  $B --rounds 2 --json $O/scale-$v.json scale --sizes 10000,10000000 --soak-seconds 0 >> $f 2>&1
  { date -u; uptime; } >> $f
done
echo done > $O/SCALEDONE
