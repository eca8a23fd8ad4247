#!/bin/bash
# One hot aggregate: main (claims generic) vs the exploration build with custom plans everywhere.
source /work/build/env.sh
export DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench42
O=/work/notes/b42c
NEW=/work/build/rel/release/outbox-bench
OLD=/work/build/bench-env
for v in old new; do
  f=$O/hot-$v.txt
  { echo "# $v"; date -u; uptime; } > $f
  if [ $v = old ]; then OUTBOX_PG_PLAN_CACHE_MODE=force_custom_plan $OLD --rounds 2 hot --publishers kafka --run 1,100 --seconds 6 --versions 20000 --json $O/hot-$v.json >> $f 2>&1
  else $NEW --rounds 2 hot --publishers kafka --run 1,100 --seconds 6 --versions 20000 --json $O/hot-$v.json >> $f 2>&1; fi
  { date -u; uptime; } >> $f
done
echo done > $O/DONE
