#!/usr/bin/env bash
# Flamegraphs of the relay's drain (lease mode, instant publisher): perf samples the whole
# machine (-a) with DWARF call graphs, only while the drain runs (outbox-bench writes
# enable/disable to perf's control FIFO around each drain), then inferno folds the stacks and
# draws one SVG for everything, one for the relay process and one for the PostgreSQL backends.
# Needs: perf (root), inferno (cargo install inferno), a release build, DATABASE_URL.
set -euo pipefail
B=${B:-target/release/outbox-bench}
OUT=${OUT:-benchmarks/profiles}
MODE=${MODE:-lease}
FREQ=${FREQ:-499}
work=$(mktemp -d)
mkfifo "$work/ctl"
perf record -a -F "$FREQ" --call-graph dwarf,16384 -D -1 --control "fifo:$work/ctl" \
    -o "$work/perf.data" -- sleep 100000 &
perf_pid=$!
sleep 2
"$B" --rounds 1 profile --modes "$MODE" --perf-ctl "$work/ctl" | tee "$OUT/perf-drain-$MODE.txt"
kill -INT "$perf_pid"; wait "$perf_pid" || true
perf script -i "$work/perf.data" --no-inline -F comm,pid,tid,time,event,ip,sym,dso \
    > "$work/perf.script" 2>/dev/null
inferno-collapse-perf --all --pid < "$work/perf.script" > "$OUT/drain-$MODE-all.folded"
# Per process: the relay (its pid; threads outbox-bench and tokio-runtime-w) and the run's
# PostgreSQL backends (the pids the program printed); the rest is other work on the machine.
relay=$(sed -n 's/^relay process pid \([0-9]*\);.*/\1/p' "$OUT/perf-drain-$MODE.txt" | head -1)
backends=$(sed -n 's/.*backends of the run.s database: \[\(.*\)\]/\1/p' "$OUT/perf-drain-$MODE.txt" | head -1 | tr -d ' ' | tr ',' '|')
grep -E "^[^;]*-$relay(/[0-9]+)?;" "$OUT/drain-$MODE-all.folded" > "$OUT/drain-$MODE-relay.folded" || true
grep -E "^postgres-($backends)(/[0-9]+)?;" "$OUT/drain-$MODE-all.folded" > "$OUT/drain-$MODE-postgres.folded" || true
for f in all relay postgres; do
    inferno-flamegraph --title "drain ($MODE), $f: perf -a -F $FREQ --call-graph dwarf" \
        < "$OUT/drain-$MODE-$f.folded" > "$OUT/drain-$MODE-$f.svg"
done
rm -rf "$work"
