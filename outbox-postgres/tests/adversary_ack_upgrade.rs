//! Adversary pass on migration 8 (transport-neutral acknowledgements, docs/transports.md §2):
//! the upgrade from version 7 while relays of version 7 keep claiming and completing.
//!
//! Promised: nothing is lost, nothing is attributed to another transport or position (what a
//! relay of version 7 published, before or during the migration, reads back as the Kafka
//! acknowledgement it wrote), the business append waits at most as long as the old relay's
//! transaction, a claim of the new version waits for the migration instead of running on the
//! old schema, and the migration finishes. A relay of version 7 whose completion comes after
//! the migration committed fails it (it writes `ack_topic`): its lease runs out and the event
//! is published again by the new version (a duplicate, never a loss).
//!
//! The relays of version 7 are played by their statements (the shapes they run against their
//! schema), in transactions the test holds open while the migration starts.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::AckMetadata;
use outbox_postgres::PublishedFilter;
use sqlx::Row;

use common::{claim, event, lease, publish_all};

/// The aggregate key of type `order`, as every version computes it.
const KEY: &str = "hashtextextended('order' || chr(31) || $1, 0)";

/// Backends waiting for a lock on a table of the test's schema.
async fn table_waiters(ctx: &common::Ctx) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT DISTINCT l.pid FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE NOT l.granted AND n.nspname = $1",
    )
    .bind(&ctx.schema)
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Waits until a backend whose last statement contains `query` is blocked by `blocker`.
async fn wait_blocked_by(ctx: &common::Ctx, blocker: i32, query: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let blocked: bool = sqlx::query_scalar(
            "SELECT count(*) > 0 FROM pg_stat_activity \
              WHERE $1 = ANY(pg_blocking_pids(pid)) AND query LIKE '%' || $2 || '%'",
        )
        .bind(blocker)
        .bind(query)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        if blocked {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nothing running {query:?} waits for backend {blocker}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Version 7's completion of one row as published, with its Kafka acknowledgement in the
/// columns of that version, run on `conn`.
async fn v7_publish(
    conn: &mut sqlx::PgConnection,
    ctx: &common::Ctx,
    agg: &str,
    (topic, partition, offset): (&str, i32, i64),
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "UPDATE \"{}\".outbox_events SET status = 'published', published_at = now(), \
            finished_at = now(), ack_topic = $2, ack_partition = $3, ack_offset = $4 \
          WHERE aggregate_id = $1 AND aggregate_version = 1 AND status = 'pending'",
        ctx.schema
    ))
    .bind(agg)
    .bind(topic)
    .bind(partition)
    .bind(offset)
    .execute(conn)
    .await
    .map(|_| ())
}

/// Version 7's lease claim of `agg` (state row with a lease of `secs` for `owner`).
async fn v7_lease(ctx: &common::Ctx, agg: &str, owner: &str, secs: f64) {
    sqlx::query(&format!(
        "INSERT INTO \"{0}\".outbox_events_aggregate AS a (aggregate_key, aggregate_type, \
           aggregate_id, lease_owner, lease_token, lease_until, lease_row) \
         SELECT {KEY}, 'order', $1, $2, gen_random_uuid(), \
                clock_timestamp() + $3 * interval '1 second', e.id \
           FROM \"{0}\".outbox_events e WHERE e.aggregate_id = $1 AND e.aggregate_version = 1 \
         ON CONFLICT (aggregate_key, aggregate_type, aggregate_id) DO UPDATE \
           SET lease_owner = EXCLUDED.lease_owner, lease_token = EXCLUDED.lease_token, \
               lease_until = EXCLUDED.lease_until, lease_row = EXCLUDED.lease_row",
        ctx.schema
    ))
    .bind(agg)
    .bind(owner)
    .bind(secs)
    .execute(&ctx.pool)
    .await
    .unwrap();
}

/// Version 7's end of a lease on `agg` after a publication: lease released, last version 1.
async fn v7_release_published(conn: &mut sqlx::PgConnection, ctx: &common::Ctx, agg: &str) {
    sqlx::query(&format!(
        "UPDATE \"{}\".outbox_events_aggregate a SET lease_owner = NULL, lease_token = NULL, \
            lease_until = NULL, lease_row = NULL, last_version = GREATEST(a.last_version, 1) \
          WHERE aggregate_key = {KEY} AND aggregate_type = 'order' AND aggregate_id = $1",
        ctx.schema
    ))
    .bind(agg)
    .execute(conn)
    .await
    .unwrap();
}

/// (aggregate, status, acknowledgement) of every row of `table`, by aggregate.
async fn rows(ctx: &common::Ctx, table: &str) -> Vec<(String, String, Option<AckMetadata>)> {
    sqlx::query(&format!(
        "SELECT aggregate_id, status, ack_transport, ack_destination, ack_partition, \
                ack_position, ack_route, ack_duplicate \
           FROM \"{}\".{table} ORDER BY aggregate_id, aggregate_version",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
    .iter()
    .map(|r| {
        let transport: Option<String> = r.get(2);
        let ack = AckMetadata::from_columns(
            transport.as_deref(),
            r.get(3),
            r.get(4),
            r.get(5),
            r.get(6),
            r.get(7),
        )
        .unwrap();
        (r.get(0), r.get(1), ack)
    })
    .collect()
}

/// Version 7 → 8 with rows in every state (published with Kafka acknowledgements, one of them
/// archived; parked; discarded; pending; leased by an old relay) and, while the migration
/// starts: an old locked claim that completes during the migration's wait, an old lease
/// completion written but not committed, a business append and a claim of the new version.
/// Then an old relay's completion after the migration, and its lease running out.
#[tokio::test]
async fn upgrade_7_to_8_beside_relays_of_version_7_that_claim_and_complete() {
    let ctx = ctx!(10);
    common::schema_at_version(&ctx, 7).await;
    let store = ctx.store_unmigrated(lease(30.0));
    let aggs = [
        "archived",
        "discarded",
        "inflight",
        "late",
        "leased",
        "locked",
        "p1",
        "p2",
        "parked",
        "pending",
    ];
    let events: Vec<_> = aggs.iter().map(|a| event(a, 1)).collect();
    store.append_many(&ctx.pool, &events).await.unwrap();
    let s = &ctx.schema;
    // What relays of version 7 finished before the upgrade.
    for (agg, ack) in [
        ("p1", ("orders", 3, 41)),
        ("p2", ("payments", 0, 0)),
        ("archived", ("orders", 1, 9)),
    ] {
        let mut conn = ctx.pool.acquire().await.unwrap();
        v7_publish(&mut conn, &ctx, agg, ack).await.unwrap();
    }
    sqlx::raw_sql(&format!(
        "UPDATE \"{s}\".outbox_events SET status = 'parked', parked_at = now(), \
            park_kind = 'permanent_error', last_error_class = 'permanent', \
            last_error_kind = 'record_too_large', last_error_message = 'big' \
          WHERE aggregate_id IN ('parked', 'discarded'); \
         UPDATE \"{s}\".outbox_events SET status = 'discarded', finished_at = now(), \
            discard_reason = 'ops' WHERE aggregate_id = 'discarded'; \
         WITH d AS (DELETE FROM \"{s}\".outbox_events WHERE aggregate_id = 'archived' \
                    RETURNING *) \
         INSERT INTO \"{s}\".outbox_events_archive SELECT * FROM d;"
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    // Leases of version 7 relays: "leased" (completed only after the migration), "inflight"
    // (its completion is in flight when the migration starts), "late" (its relay went away;
    // the lease outlives the migration).
    v7_lease(&ctx, "leased", "v7-a", 6.0).await;
    v7_lease(&ctx, "inflight", "v7-b", 30.0).await;
    v7_lease(&ctx, "late", "v7-c", 30.0).await;
    // An old locked claim: its transaction holds the row and read the state table.
    let mut locked = ctx.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT e.id FROM \"{s}\".outbox_events e \
          WHERE e.aggregate_id = 'locked' AND NOT EXISTS (SELECT 1 FROM \
            \"{s}\".outbox_events_aggregate a WHERE a.aggregate_id = e.aggregate_id \
            AND a.lease_until > clock_timestamp()) FOR UPDATE OF e"
    ))
    .fetch_one(&mut *locked)
    .await
    .unwrap();
    // The "inflight" completion: written, not committed.
    let mut inflight = ctx.pool.begin().await.unwrap();
    v7_publish(&mut inflight, &ctx, "inflight", ("orders", 7, 1000))
        .await
        .unwrap();

    let migrating = {
        let store = store.clone();
        tokio::spawn(async move { store.migrate().await })
    };
    common::wait_for_lock_wait(&ctx).await;
    let waiters = table_waiters(&ctx).await;
    assert_eq!(waiters.len(), 1, "only the migration waits: {waiters:?}");
    let migration = waiters[0];
    // The business appends and a claim of the new version while the migration waits.
    let appending = {
        let store = store.clone();
        let pool = ctx.pool.clone();
        tokio::spawn(async move {
            let t0 = std::time::Instant::now();
            store.append(&pool, &event("appended", 1)).await.unwrap();
            t0.elapsed()
        })
    };
    wait_blocked_by(&ctx, migration, "INSERT INTO").await;
    let claiming = {
        let store = store.clone();
        tokio::spawn(async move { claim(&store, "v8", 100).await })
    };
    wait_blocked_by(&ctx, migration, "pg_advisory_xact_lock_shared").await;

    // The old locked relay completes now: neither waits for the migration nor fails.
    let completion = tokio::time::timeout(Duration::from_secs(5), async {
        v7_publish(&mut locked, &ctx, "locked", ("orders", 2, 100)).await?;
        sqlx::query(&format!(
            "INSERT INTO \"{s}\".outbox_events_aggregate AS a \
               (aggregate_key, aggregate_type, aggregate_id, last_version) \
             VALUES ({KEY}, 'order', $1, 1) \
             ON CONFLICT (aggregate_key, aggregate_type, aggregate_id) DO UPDATE \
               SET last_version = GREATEST(a.last_version, EXCLUDED.last_version)"
        ))
        .bind("locked")
        .execute(&mut *locked)
        .await
        .map(|_| ())
    })
    .await;
    assert!(
        matches!(completion, Ok(Ok(()))),
        "the old locked relay's completion: {completion:?}"
    );
    v7_release_published(&mut inflight, &ctx, "inflight").await;
    assert!(!migrating.is_finished(), "the migration waits for them");
    assert!(
        !appending.is_finished(),
        "the append waits for the migration"
    );
    locked.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !migrating.is_finished(),
        "the migration waits for the other"
    );
    inflight.commit().await.unwrap();
    // Generous: after its transaction the migration builds its indexes concurrently, and
    // `CREATE INDEX CONCURRENTLY` waits for every older transaction of the database, other
    // tests' included (seen over 10 s once beside locked claims held by another binary).
    let applied = tokio::time::timeout(Duration::from_secs(60), migrating)
        .await
        .expect("the migration finishes once the old transactions ended")
        .unwrap()
        .unwrap();
    assert_eq!(applied, 4, "migrations 8 to 11");
    let waited = tokio::time::timeout(Duration::from_secs(10), appending)
        .await
        .expect("the append finishes after the migration")
        .unwrap();
    assert!(waited < Duration::from_secs(10), "{waited:?}");

    // The new claim ran on the new schema: what is due, not what an old lease holds.
    let first = claiming.await.unwrap();
    let claimed: Vec<&str> = first
        .records
        .iter()
        .map(|r| r.envelope.aggregate_id.as_str())
        .collect();
    assert!(claimed.contains(&"pending"), "{claimed:?}");
    for held in ["leased", "inflight", "locked", "late", "parked"] {
        assert!(!claimed.contains(&held), "{held} in {claimed:?}");
    }
    publish_all(&store, &first).await;

    // The relay that leased "leased" completes after the migration: its statement names
    // `ack_topic`, which is gone, so it fails and writes nothing.
    let mut conn = ctx.pool.acquire().await.unwrap();
    let err = v7_publish(&mut conn, &ctx, "leased", ("orders", 4, 4))
        .await
        .expect_err("a completion of version 7 after migration 8");
    assert_eq!(
        err.as_database_error().and_then(|d| d.code()).as_deref(),
        Some("42703"),
        "{err}"
    );
    drop(conn);
    // Its lease runs out and the new version publishes the event (again: a duplicate).
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let mut rest = Vec::new();
    loop {
        let b = claim(&store, "v8", 100).await;
        let ids: Vec<String> = b
            .records
            .iter()
            .map(|r| r.envelope.aggregate_id.clone())
            .collect();
        publish_all(&store, &b).await;
        rest.extend(ids);
        if rest.iter().any(|a| a == "leased") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{rest:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // `late` keeps its lease of 30 s from a relay that went away; take it over by ending it.
    sqlx::query(&format!(
        "UPDATE \"{s}\".outbox_events_aggregate SET lease_until = clock_timestamp() \
          WHERE aggregate_id = 'late'"
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let b = claim(&store, "v8", 100).await;
    publish_all(&store, &b).await;

    let kafka = |t: &str, p: i32, o: i64| Some(AckMetadata::kafka(t, p, o));
    let table = rows(&ctx, "outbox_events").await;
    let by = |agg: &str| {
        table
            .iter()
            .find(|(a, _, _)| a == agg)
            .unwrap_or_else(|| panic!("{agg} lost"))
            .clone()
    };
    assert_eq!(table.len(), aggs.len(), "{table:?}");
    // Written by version 7, before and during the migration: the same Kafka positions.
    assert_eq!(
        by("p1"),
        ("p1".into(), "published".into(), kafka("orders", 3, 41))
    );
    assert_eq!(
        by("p2"),
        ("p2".into(), "published".into(), kafka("payments", 0, 0))
    );
    assert_eq!(
        by("locked"),
        ("locked".into(), "published".into(), kafka("orders", 2, 100))
    );
    assert_eq!(
        by("inflight"),
        (
            "inflight".into(),
            "published".into(),
            kafka("orders", 7, 1000)
        )
    );
    assert_eq!(by("parked"), ("parked".into(), "parked".into(), None));
    assert_eq!(
        by("discarded"),
        ("discarded".into(), "discarded".into(), None)
    );
    // Published by the new version (`publish_all`: topic `orders`, partition 3).
    for agg in ["pending", "appended", "leased", "late"] {
        let (_, status, ack) = by(agg);
        assert_eq!(status, "published", "{agg}");
        assert_eq!(
            ack.as_ref().and_then(|a| a.as_kafka()).map(|k| k.0),
            Some("orders")
        );
    }
    assert_eq!(
        rows(&ctx, "outbox_events_archive").await,
        vec![("archived".into(), "published".into(), kafka("orders", 1, 9))]
    );
    // The state of the aggregates the old relays finished: last version 1, no lease.
    for agg in ["locked", "inflight"] {
        let (last, owner): (Option<i64>, Option<String>) = sqlx::query_as(&format!(
            "SELECT last_version, lease_owner FROM \"{s}\".outbox_events_aggregate \
              WHERE aggregate_id = $1"
        ))
        .bind(agg)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_eq!((last, owner), (Some(1), None), "{agg}");
    }
    // Through the store's reporting API too.
    let published = store
        .published_events(&PublishedFilter::default(), None, 100)
        .await
        .unwrap();
    let locked_ack = published
        .iter()
        .find(|r| r.envelope.aggregate_id == "locked")
        .map(|r| r.ack.to_string());
    assert_eq!(locked_ack.as_deref(), Some("orders/2@100"));
    ctx.drop().await;
}

/// A transaction of version 7 that reads the archive and then writes the event table (an
/// operator command's report, then a completion on the same connection) while migration 8
/// starts. The migration needs both tables: it must not hold the event table while it waits
/// for the archive, or the write would wait for it and the server would abort one of the two
/// as a deadlock.
#[tokio::test]
async fn migration_8_waits_for_a_busy_table_holding_no_other() {
    let ctx = ctx!(6);
    common::schema_at_version(&ctx, 7).await;
    let store = ctx.store_unmigrated(lease(30.0));
    store.append(&ctx.pool, &event("a", 1)).await.unwrap();
    let s = &ctx.schema;
    let mut old = ctx.pool.begin().await.unwrap();
    // This session checks for a deadlock first (the migration's waits after the server's
    // default of 1 s), so a deadlock would abort the old transaction, as it can abort a relay.
    sqlx::query("SET LOCAL deadlock_timeout = '100ms'")
        .execute(&mut *old)
        .await
        .unwrap();
    sqlx::query(&format!(
        "SELECT count(*) FROM \"{s}\".outbox_events_archive"
    ))
    .execute(&mut *old)
    .await
    .unwrap();
    let migrating = {
        let store = store.clone();
        tokio::spawn(async move { store.migrate().await })
    };
    common::wait_for_lock_wait(&ctx).await;
    let write = tokio::time::timeout(
        Duration::from_secs(5),
        v7_publish(&mut old, &ctx, "a", ("orders", 0, 5)),
    )
    .await;
    assert!(
        matches!(write, Ok(Ok(()))),
        "the old transaction's write of the event table: {write:?}"
    );
    assert!(!migrating.is_finished());
    old.commit().await.unwrap();
    assert_eq!(migrating.await.unwrap().unwrap(), 4);
    assert_eq!(
        rows(&ctx, "outbox_events").await,
        vec![(
            "a".into(),
            "published".into(),
            Some(AckMetadata::kafka("orders", 0, 5))
        )]
    );
    ctx.drop().await;
}
