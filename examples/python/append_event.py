"""Appending an outbox event from a Python service (psycopg 3), in the business transaction.

The order's state change and its event commit together or not at all: the conditional UPDATE
takes the order's row lock and moves its version by one, and the event carries that version,
so version N+1 never commits before N (the ordering guarantee the relay builds on).

    DATABASE_URL=postgres://... OUTBOX_SCHEMA=outbox python3 append_event.py ORDER_ID EXPECTED_VERSION

Exit status 0: shipped, prints the event id; 1: the order moved on (version conflict) and
nothing was written; 2: bad arguments. outbox-postgres/tests/sql_append.rs runs this file.
"""

import json
import os
import sys

import psycopg
from psycopg import sql


def ship(conn, schema, order_id, expected_version):
    """Marks the order shipped and appends `order.shipped`, in one transaction."""
    with conn.transaction():
        row = conn.execute(
            sql.SQL(
                "UPDATE {}.orders SET status = 'shipped', version = version + 1 "
                "WHERE id = %s AND version = %s RETURNING version"
            ).format(sql.Identifier(schema)),
            (order_id, expected_version),
        ).fetchone()
        if row is None:
            return None  # leaving the block without an exception commits nothing written
        (version,) = row
        (event_id,) = conn.execute(
            sql.SQL(
                "SELECT {}.outbox_events_append("
                "aggregate_type => 'order', aggregate_id => %s, aggregate_version => %s, "
                "event_type => 'order.shipped', payload => %s, headers => %s)"
            ).format(sql.Identifier(schema)),
            (
                order_id,
                version,
                json.dumps({"order_id": order_id, "status": "shipped"}).encode(),
                json.dumps({"source": "python-shop"}),
            ),
        ).fetchone()
        return event_id


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
    schema = os.environ.get("OUTBOX_SCHEMA", "outbox")
    with psycopg.connect(url) as conn:
        event_id = ship(conn, schema, sys.argv[1], int(sys.argv[2]))
    if event_id is None:
        print("version conflict: the order changed meanwhile; nothing written", file=sys.stderr)
        return 1
    print(event_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
