#!/bin/bash
# Stop 44: the append against a bare insert, release build, quiet machine (nothing else running).
# B: release outbox-bench (`cargo build --release -p outbox-bench`); own database bench44.
source /work/build/env.sh
export DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench44
B=${B:-/work/build/rel/release/outbox-bench}
O=$(dirname "$0")
f=$O/append.txt
{ date -u; uptime; } > $f
$B --rounds 5 --json $O/append.json append --clients 8 \
   --only none,gate,gate-bare,bare,bare-outbox,only,only-pk >> $f 2>&1
{ date -u; uptime; } >> $f
f=$O/append-1.txt
{ date -u; uptime; } > $f
$B --rounds 3 --json $O/append-1.json append --clients 1 --only bare,bare-outbox,only >> $f 2>&1
{ date -u; uptime; } >> $f
# What each index costs the append (release, quiet):
f=$O/append-indexes.txt
{ date -u; uptime; } > $f
$B --rounds 3 --json $O/append-indexes.json append --clients 8 \
   --only bare,only,only-no-created-idx,only-no-event-id-key,only-no-claim-idx,only-no-unfinished-idx,only-pk >> $f 2>&1
{ date -u; uptime; } >> $f
# The two that the target compares, longer and more rounds (the runs above spread +-30 %):
f=$O/append-pair.txt
{ date -u; uptime; } > $f
$B --rounds 7 --json $O/append-pair.json append --clients 8 --seconds 10 --only bare,only >> $f 2>&1
{ date -u; uptime; } >> $f
