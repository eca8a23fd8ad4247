//! Migrations run beside relays of the previous version (issue 20, item 7). A deployment
//! upgrades while the relays of the version before still claim, complete and release: a
//! migration that derives state from what those relays write must see all of it, and a relay
//! of the previous version must keep working on the new schema until it is replaced (up to
//! migration 7; migration 8 renames the acknowledgement columns, so a relay of version 7
//! fails its completions after it and its events are sent again by an upgraded relay: a
//! duplicate, never a loss; `adversary_ack_upgrade.rs` tests that).
//!
//! The relays of the previous version are played by their statements (the shapes they run
//! against their schema), in a transaction the test holds open while the migration starts;
//! the test waits until the migration waits for a lock behind it (`pg_locks`), then commits.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use outbox_core::ClaimMode;
use outbox_postgres::PostgresOutboxStore;
use sqlx::Row;

use common::{claim, event, lease, publish_all, versions};

/// The state row of `agg` (type `order`): last version, lease owner, whether the lease is live.
async fn state(ctx: &common::Ctx, agg: &str) -> Option<(Option<i64>, Option<String>, bool)> {
    sqlx::query(&format!(
        "SELECT last_version, lease_owner, COALESCE(lease_until > clock_timestamp(), false) \
           AS live \
         FROM \"{}\".outbox_events_aggregate WHERE aggregate_type = 'order' AND aggregate_id = $1",
        ctx.schema
    ))
    .bind(agg)
    .fetch_optional(&ctx.pool)
    .await
    .unwrap()
    .map(|r| {
        (
            r.get("last_version"),
            r.get("lease_owner"),
            r.get::<bool, _>("live"),
        )
    })
}

fn lenient(ctx: &common::Ctx, mode: ClaimMode) -> PostgresOutboxStore {
    PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .accept_first_version(true)
        .build()
        .unwrap()
}

// FOUND (issue 20, item 7, reproduced): migration 3 derived each aggregate's last version and
// copied the live leases from a snapshot taken at its first statement; a relay of version 2
// that completed (published v2 and released its lease) or released a claim (shutdown) while
// the migration ran committed after that snapshot, and the migration only waited for it at
// its DROP TABLE. The upgraded table then had `last_version` 1 behind a published v2 (so v3
// was held as a gap and parked) and a released lease copied as live (its aggregate stuck
// until the lease ran out). Fix: the runner locks the tables a migration rewrites before its
// first statement.
#[tokio::test]
async fn migration_3_sees_what_a_relay_of_version_2_commits_while_it_runs() {
    let ctx = ctx!(6);
    common::version_2_schema(&ctx).await;
    let store = ctx.store_unmigrated(lease(30.0));
    // "raced": v1 published, v2 in flight under the old relay's lease, v3 waiting.
    // "released": v1 in flight under the old relay's lease, released at its shutdown.
    let raced: Vec<_> = (1..=3).map(|v| event("raced", v)).collect();
    store.append_many(&ctx.pool, &raced).await.unwrap();
    store
        .append(&ctx.pool, &event("released", 1))
        .await
        .unwrap();
    let token = uuid::Uuid::now_v7();
    sqlx::raw_sql(&format!(
        "UPDATE \"{0}\".outbox_events SET status = 'published', published_at = now(), \
            finished_at = now(), ack_topic = 't', ack_partition = 0, ack_offset = 0 \
         WHERE aggregate_id = 'raced' AND aggregate_version = 1; \
         INSERT INTO \"{0}\".outbox_events_lease \
           (aggregate_key, event_row, lease_owner, lease_token, lease_until) \
         SELECT row_number() OVER (ORDER BY id), id, 'old-relay', '{token}', \
                now() + interval '1 hour' \
           FROM \"{0}\".outbox_events \
          WHERE (aggregate_id = 'raced' AND aggregate_version = 2) \
             OR aggregate_id = 'released';",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();

    // The old relay's completion of raced v2 and the release of its other lease, committed
    // while the migration runs.
    let mut old = ctx.pool.begin().await.unwrap();
    sqlx::raw_sql(&format!(
        "UPDATE \"{0}\".outbox_events SET status = 'published', published_at = now(), \
            finished_at = now(), ack_topic = 't', ack_partition = 0, ack_offset = 1 \
         WHERE aggregate_id = 'raced' AND aggregate_version = 2; \
         UPDATE \"{0}\".outbox_events_lease SET lease_owner = NULL, lease_token = NULL, \
            lease_until = clock_timestamp() WHERE lease_token = '{token}';",
        ctx.schema
    ))
    .execute(&mut *old)
    .await
    .unwrap();
    let migrating = {
        let store = store.clone();
        tokio::spawn(async move { store.migrate().await })
    };
    common::wait_for_lock_wait(&ctx).await;
    old.commit().await.unwrap();
    assert_eq!(
        migrating.await.unwrap().unwrap(),
        9,
        "migrations 3 to 11 run"
    );

    assert_eq!(
        state(&ctx, "raced").await,
        Some((Some(2), None, false)),
        "the last version includes the publication committed during the migration, and the \
         released lease is not live"
    );
    let released = state(&ctx, "released").await.expect("a state row");
    assert!(
        !released.2,
        "a released lease was copied as live: {released:?}"
    );
    let b = claim(&store, "new", 10).await;
    assert_eq!(
        versions(&b),
        vec![("raced".into(), 3), ("released".into(), 1)],
        "both aggregates flow at once (held: {}, parked: {:?})",
        b.gaps_held,
        b.parked
    );
    publish_all(&store, &b).await;
    ctx.drop().await;
}

/// A deadlock between the migration's table locks and a relay of the previous version that
/// takes the same tables in the other order (here: the lease table, then the event table) is
/// resolved by the server aborting the migration; the runner runs it again, and it succeeds
/// once the relay's transaction ended.
#[tokio::test]
async fn a_migration_aborted_by_a_deadlock_with_an_old_relay_runs_again() {
    let ctx = ctx!(6);
    common::version_2_schema(&ctx).await;
    let store = ctx.store_unmigrated(lease(30.0));
    store.append(&ctx.pool, &event("dl", 1)).await.unwrap();
    let mut old = ctx.pool.begin().await.unwrap();
    // The server aborts the transaction whose deadlock check runs first: each waiter checks
    // once it has waited `deadlock_timeout` (1 s). The migration waits first, by milliseconds,
    // which a loaded machine can undo; the old relay checks much later, so the migration is
    // the one aborted, every time.
    sqlx::query("SET LOCAL deadlock_timeout = '20s'")
        .execute(&mut *old)
        .await
        .unwrap();
    sqlx::query(&format!(
        "UPDATE \"{}\".outbox_events_lease SET lease_until = clock_timestamp()",
        ctx.schema
    ))
    .execute(&mut *old)
    .await
    .unwrap();
    let migrating = {
        let store = store.clone();
        tokio::spawn(async move { store.migrate().await })
    };
    // The migration holds the event table and waits for the lease table.
    common::wait_for_lock_wait(&ctx).await;
    // The old relay now reads the event table: a cycle. The server aborts the transaction
    // whose deadlock check runs first, the migration's.
    let read = sqlx::query(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events",
        ctx.schema
    ))
    .execute(&mut *old)
    .await;
    assert!(read.is_ok(), "the old relay was aborted instead: {read:?}");
    old.commit().await.unwrap();
    assert_eq!(
        migrating.await.unwrap().unwrap(),
        9,
        "the migration ran again and applied 3 to 11"
    );
    let b = claim(&store, "new", 10).await;
    assert_eq!(versions(&b), vec![("dl".into(), 1)]);
    publish_all(&store, &b).await;
    ctx.drop().await;
}

/// Migration 6 beside a relay of version 5 (the previous one): a lease claim of that relay
/// that commits while the migration runs is repaired by it (the migration waits for it), a
/// claim of that relay after the migration leaves the last version unknown too (the column
/// has no default any more), and that relay's completion raises it from unknown (GREATEST
/// ignores NULL). An aggregate a version 5 relay claimed and released before the upgrade
/// (last version 0, its head v3 held as a gap under `accept_first_version`) flows again.
#[tokio::test]
async fn migration_6_beside_a_relay_of_version_5() {
    let ctx = ctx!(6);
    common::schema_at_version(&ctx, 5).await;
    let store = lenient(&ctx, lease(30.0));
    for agg in ["stuck", "racing", "late"] {
        store
            .append_many(&ctx.pool, &[event(agg, 3), event(agg, 4)])
            .await
            .unwrap();
    }
    // What a version 5 lease claim wrote into the state row (it names no last version).
    let v5_claim = |agg: &str, token: uuid::Uuid| {
        format!(
            "INSERT INTO \"{0}\".outbox_events_aggregate AS a (aggregate_key, aggregate_type, \
               aggregate_id, lease_owner, lease_token, lease_until, lease_row) \
             SELECT hashtextextended(aggregate_type || chr(31) || aggregate_id, 0), \
                    aggregate_type, aggregate_id, 'relay-v5', '{token}', \
                    clock_timestamp() + interval '1 hour', id \
               FROM \"{0}\".outbox_events WHERE aggregate_id = '{agg}' AND aggregate_version = 3",
            ctx.schema
        )
    };
    // "stuck": claimed and released by a version 5 relay before the upgrade.
    sqlx::raw_sql(&format!(
        "{}; UPDATE \"{}\".outbox_events_aggregate SET lease_owner = NULL, lease_token = NULL, \
           lease_until = NULL, lease_row = NULL WHERE aggregate_id = 'stuck';",
        v5_claim("stuck", uuid::Uuid::now_v7()),
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(state(&ctx, "stuck").await, Some((Some(0), None, false)));

    // "racing": a version 5 relay's claim commits while migration 6 runs.
    let racing = uuid::Uuid::now_v7();
    let mut old = ctx.pool.begin().await.unwrap();
    sqlx::raw_sql(&v5_claim("racing", racing))
        .execute(&mut *old)
        .await
        .unwrap();
    let migrating = {
        let store = store.clone();
        tokio::spawn(async move { store.migrate().await })
    };
    common::wait_for_lock_wait(&ctx).await;
    old.commit().await.unwrap();
    assert_eq!(
        migrating.await.unwrap().unwrap(),
        6,
        "migrations 6 to 11 run"
    );
    assert_eq!(state(&ctx, "stuck").await, Some((None, None, false)));
    assert_eq!(
        state(&ctx, "racing").await,
        Some((None, Some("relay-v5".into()), true)),
        "the claim committed during the migration was repaired too"
    );

    // "late": a version 5 relay's claim after the upgrade.
    sqlx::raw_sql(&v5_claim("late", uuid::Uuid::now_v7()))
        .execute(&ctx.pool)
        .await
        .unwrap();
    assert_eq!(
        state(&ctx, "late").await.map(|s| s.0),
        Some(None),
        "a version 5 claim leaves the last version unknown"
    );
    // The append wrote "racing" v4 blocked behind v3 (one batch, docs/design/hot-aggregate.md):
    // only the old relay's completion can release it.
    assert!(
        common::blocked(&ctx, "racing", 4).await,
        "written blocked by the append"
    );
    // The version 5 relay completes "racing" v3: publication and lease release in one write
    // of the state row, and the promotion of the aggregate's first blocked row, as that
    // version does. (Its acknowledgement columns under the names of migration 8, which this
    // upgrade also ran: a relay of version 5 or 7 writing `ack_topic` fails its completion
    // until upgraded, docs/transports.md §2.)
    sqlx::raw_sql(&format!(
        "UPDATE \"{0}\".outbox_events SET status = 'published', published_at = now(), \
            finished_at = now(), ack_transport = 'kafka', ack_destination = 't', \
            ack_partition = 0, ack_position = 0 \
          WHERE aggregate_id = 'racing' AND aggregate_version = 3; \
         UPDATE \"{0}\".outbox_events_aggregate a SET lease_owner = NULL, lease_token = NULL, \
            lease_until = NULL, lease_row = NULL, \
            last_version = GREATEST(a.last_version, 3) WHERE a.lease_token = '{racing}'; {1}",
        ctx.schema,
        common::old_relay_promotion(&ctx, "aggregate_id = 'racing' AND aggregate_version = 3")
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(state(&ctx, "racing").await, Some((Some(3), None, false)));

    // The new relay: "stuck" v3 and "racing" v4 go out ("late" is still under the old
    // relay's lease); nothing is held or parked.
    let b = claim(&store, "new", 10).await;
    assert_eq!(
        versions(&b),
        vec![("racing".into(), 4), ("stuck".into(), 3)],
        "held: {}, parked: {:?}",
        b.gaps_held,
        b.parked
    );
    assert_eq!((b.gaps_held, b.parked.len()), (0, 0));
    publish_all(&store, &b).await;
    assert_eq!(state(&ctx, "stuck").await, Some((Some(3), None, false)));
    ctx.drop().await;
}
