#!/bin/bash
# Stop 45: where the CPU of outbox-bench's append scenario goes (client and server), per
# contender: `perf record -a` over one round, samples by process and the top functions of
# each. Usage: benchprof.sh [contender...]   (default: bare only); B = release outbox-bench.
source /work/build/env.sh
export DATABASE_URL=${DATABASE_URL%/*}/bench45
psql ${DATABASE_URL%/*}/postgres -qc "CREATE DATABASE bench45" 2>/dev/null || true
B=${B:-/work/build/rel/release/outbox-bench}
O=$(dirname "$0")
T=$(mktemp -d)
for c in "${@:-bare only}"; do
  for c1 in $c; do
    perf record -a -F 997 -o $T/$c1.data -- $B --rounds 1 append --clients 8 --seconds 10 --only $c1 > $T/$c1.out 2>&1
    {
      echo "== $c1: $(grep -E 'txn/s|tx/s' $T/$c1.out | head -3 | tr -s ' ')"
      echo "-- samples by process (997 Hz on every CPU, the whole run incl. setup)"
      perf script -i $T/$c1.data -F comm 2>/dev/null | sort | uniq -c | sort -rn | head -8
      echo "-- top symbols, every process"
      perf report -i $T/$c1.data --no-children --comm postgres,tokio-rt-worker --sort comm,symbol --stdio 2>/dev/null | grep -E "^ +[0-9]" | tr -s " " | head -45
    } >> $O/benchprof.txt
    cat $T/$c1.out >> $O/benchprof-runs.txt
  done
done
rm -rf $T
psql ${DATABASE_URL%/*}/postgres -qc "DROP DATABASE bench45"
