#!/bin/bash
source /work/build/env.sh
export DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench42
B=/work/build/rel/release/outbox-bench
f=/work/notes/b42/scale-generic.txt
{ echo "# OUTBOX_PG_PLAN_CACHE_MODE=force_generic_plan"; date -u; uptime; } > $f
OUTBOX_PG_PLAN_CACHE_MODE=force_generic_plan $B --rounds 2 --json /work/notes/b42/scale-generic.json scale --sizes 10000,10000000 --soak-seconds 0 >> $f 2>&1
{ date -u; uptime; } >> $f
echo done > /work/notes/b42/SCALEDONE
