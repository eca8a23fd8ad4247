#!/usr/bin/env bash
# The append statement's shape alone: one autocommit statement per transaction, 8 clients,
# alternating the three forms twice. Needs a database with the outbox schema:
#   createdb appendexp && psql -d appendexp -f outbox-postgres/sql/outbox.sql
set -euo pipefail
cd "$(dirname "$0")"
db="${1:-appendexp}"
for round in 1 2; do
    for f in library-form values-in-cte plain-values; do
        printf '%s round %s: ' "$f" "$round"
        pgbench -h 127.0.0.1 -U postgres -n -M prepared -c 8 -j 2 -T 8 -f "$f.sql" "$db" 2>&1 |
            grep -E '^tps' | tr '\n' ' '
        echo
    done
done
