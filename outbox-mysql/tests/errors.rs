//! Errors and server checks against the real server: deadlocks, lock wait timeouts, duplicate
//! keys and unknown tables are classified from their error numbers; the start-up durability
//! check reads this server; an inbox transaction the server rolled back cannot be committed as
//! if it had held.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{ErrorClass, EventId, InboxStore, Registration, StoreErrorKind};
use outbox_mysql::{map_sqlx_error, Check, Flavor, Severity};
use sqlx::{Connection, MySqlConnection};

async fn conn(ctx: &common::Ctx) -> MySqlConnection {
    ctx.pool.acquire().await.unwrap().detach()
}

/// Two transactions that lock rows 1 and 2 in opposite orders; `heavy` first writes many rows
/// so the server picks the other one as the victim. Returns the victim's error.
async fn deadlock(ctx: &common::Ctx, victim: &mut MySqlConnection) -> sqlx::Error {
    let t = ctx.table("dl");
    let mut heavy = conn(ctx).await;
    sqlx::query(&format!("UPDATE {t} SET v = v + 1 WHERE id = 1"))
        .execute(&mut *victim)
        .await
        .unwrap();
    sqlx::query("START TRANSACTION")
        .execute(&mut heavy)
        .await
        .unwrap();
    sqlx::query(&format!(
        "INSERT INTO {} (id) WITH RECURSIVE s (n) AS \
           (SELECT 1000 UNION ALL SELECT n + 1 FROM s WHERE n < 1100) SELECT n FROM s",
        ctx.table("ballast")
    ))
    .execute(&mut heavy)
    .await
    .unwrap();
    sqlx::query(&format!("UPDATE {t} SET v = v + 1 WHERE id = 2"))
        .execute(&mut heavy)
        .await
        .unwrap();
    let sql = format!("UPDATE {t} SET v = v + 1 WHERE id = 1");
    let heavy_side = tokio::spawn(async move {
        let r = sqlx::query(&sql).execute(&mut heavy).await;
        let _ = sqlx::query("ROLLBACK").execute(&mut heavy).await;
        r.map(|_| ())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let err = sqlx::query(&format!("UPDATE {t} SET v = v + 1 WHERE id = 2"))
        .execute(&mut *victim)
        .await
        .expect_err("one side of the cycle is rolled back");
    heavy_side
        .await
        .unwrap()
        .expect("the heavier transaction survives");
    err
}

async fn setup(ctx: &common::Ctx) {
    let mut c = conn(ctx).await;
    sqlx::query(&format!("CREATE DATABASE `{}`", ctx.database))
        .execute(&mut c)
        .await
        .unwrap();
    for ddl in [
        format!(
            "CREATE TABLE {} (id INT PRIMARY KEY, v INT NOT NULL DEFAULT 0) ENGINE = InnoDB",
            ctx.table("dl")
        ),
        format!("INSERT INTO {} (id) VALUES (1), (2)", ctx.table("dl")),
        format!(
            "CREATE TABLE {} (id INT PRIMARY KEY) ENGINE = InnoDB",
            ctx.table("ballast")
        ),
    ] {
        sqlx::query(&ddl).execute(&mut c).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_classified_by_number() {
    let ctx = ctx!(6);
    setup(&ctx).await;

    // A deadlock: transient conflict (the store runs such a transaction again).
    let mut victim = conn(&ctx).await;
    sqlx::query("START TRANSACTION")
        .execute(&mut victim)
        .await
        .unwrap();
    let err = map_sqlx_error(deadlock(&ctx, &mut victim).await);
    assert_eq!(
        (err.kind, err.class),
        (StoreErrorKind::Conflict, ErrorClass::Transient),
        "{err}"
    );
    assert!(err.message.contains("1213"), "{err}");

    // A lock wait timeout: transient conflict.
    let mut holder = conn(&ctx).await;
    sqlx::query("START TRANSACTION")
        .execute(&mut holder)
        .await
        .unwrap();
    sqlx::query(&format!(
        "UPDATE {} SET v = 0 WHERE id = 1",
        ctx.table("dl")
    ))
    .execute(&mut holder)
    .await
    .unwrap();
    let mut waiter = conn(&ctx).await;
    sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
        .execute(&mut waiter)
        .await
        .unwrap();
    let e = sqlx::query(&format!(
        "UPDATE {} SET v = 0 WHERE id = 1",
        ctx.table("dl")
    ))
    .execute(&mut waiter)
    .await
    .unwrap_err();
    let err = map_sqlx_error(e);
    assert_eq!(
        (err.kind, err.class),
        (StoreErrorKind::Conflict, ErrorClass::Transient),
        "{err}"
    );
    assert!(err.message.contains("1205"), "{err}");
    let _ = holder.close().await;

    // A duplicate key: permanent constraint.
    let e = sqlx::query(&format!("INSERT INTO {} (id) VALUES (1)", ctx.table("dl")))
        .execute(&mut waiter)
        .await
        .unwrap_err();
    let err = map_sqlx_error(e);
    assert_eq!(
        (err.kind, err.class),
        (StoreErrorKind::Constraint, ErrorClass::Permanent),
        "{err}"
    );

    // An unknown table: schema.
    let e = sqlx::query(&format!("SELECT * FROM {}", ctx.table("missing")))
        .execute(&mut waiter)
        .await
        .unwrap_err();
    assert_eq!(map_sqlx_error(e).kind, StoreErrorKind::Schema);

    // A session the server killed: transient connection.
    let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut waiter)
        .await
        .unwrap();
    sqlx::query(&format!("KILL {id}"))
        .execute(&ctx.pool)
        .await
        .unwrap();
    let e = sqlx::query("SELECT 1")
        .execute(&mut waiter)
        .await
        .unwrap_err();
    let err = map_sqlx_error(e);
    assert_eq!(
        (err.kind, err.class),
        (StoreErrorKind::Connection, ErrorClass::Transient),
        "{err}"
    );
    ctx.drop().await;
}

/// The start-up check on this server: MariaDB 10.11 with `innodb_flush_log_at_trx_commit = 1`
/// passes; a store table that is not InnoDB is refused.
#[tokio::test]
async fn durability_check_reads_this_server() {
    let ctx = ctx!(4);
    let store = ctx.store(common::lease(30.0)).await;
    let report = store.check_durability().await.unwrap();
    assert!(!report.refused(), "{:#?}", report.findings);
    assert_eq!(report.flavor, Flavor::MariaDb, "{}", report.version);
    assert!(report
        .findings
        .iter()
        .any(|f| f.check == Check::FlushAtCommit && f.severity == Severity::Info));
    let other = format!("{}_myisam", ctx.database);
    sqlx::query(&format!("CREATE DATABASE `{other}`"))
        .execute(&ctx.pool)
        .await
        .unwrap();
    sqlx::query(&format!(
        "CREATE TABLE `{other}`.`outbox_events` (id INT PRIMARY KEY) ENGINE = MyISAM"
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let report = outbox_mysql::check_durability(&ctx.pool, Some(&other), &["outbox_events"])
        .await
        .unwrap();
    assert!(report.refused());
    assert!(report
        .at_least(Severity::Refuse)
        .any(|f| f.check == Check::StorageEngine));
    sqlx::query(&format!("DROP DATABASE `{other}`"))
        .execute(&ctx.pool)
        .await
        .unwrap();
    ctx.drop().await;
}

/// MySQL goes on in autocommit mode after the server rolled a transaction back for a deadlock.
/// A handler that ignores that error must not get its later statements committed while the
/// registration is gone: the inbox's commit checks that the transaction is still open
/// (MariaDB's `@@in_transaction`) and fails. (Without the check the commit succeeded and the
/// message would have counted as applied with no registration: verified by removing it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_transaction_the_server_rolled_back_does_not_commit() {
    let ctx = ctx!(6);
    setup(&ctx).await;
    let inbox = ctx.inbox().await;
    let mut tx = inbox.begin().await.unwrap();
    let id = EventId::now_v7();
    assert_eq!(
        inbox.register(&mut tx, "c", &[id]).await.unwrap(),
        vec![Registration::Fresh]
    );
    // The handler's statement is the deadlock's victim; the handler ignores the error.
    let _ignored = deadlock(&ctx, &mut tx).await;
    let err = inbox.commit(tx).await.expect_err("the transaction is gone");
    assert_eq!(err.kind, StoreErrorKind::Conflict, "{err}");
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox.register(&mut tx, "c", &[id]).await.unwrap(),
        vec![Registration::Fresh],
        "nothing of the rolled-back transaction remains"
    );
    inbox.rollback(tx).await.unwrap();
    ctx.drop().await;
}

/// A completion that a deadlock rolls back is run again by the store, not handed to the relay
/// as an error: the completion waits for aggregate B while holding A; another transaction
/// (made the heavier one, so InnoDB picks the completion as the victim) holds B and asks for
/// A. (Without the store's retry the completion failed with the deadlock: verified by
/// removing it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_rolled_back_by_a_deadlock_is_run_again() {
    let ctx = ctx!(8);
    setup(&ctx).await;
    let store = ctx.store(common::lease(30.0)).await;
    let (a, b) = (common::event("dl-a", 1), common::event("dl-b", 1));
    common::append(&ctx, &store, &[a.clone(), b.clone()]).await;
    let batch = common::claim(&store, "r", 10).await;
    assert_eq!(batch.records.len(), 2);
    let state = ctx.table("outbox_events_aggregate");
    let keys: Vec<Vec<u8>> = sqlx::query_scalar(&format!(
        "SELECT aggregate_key FROM {state} ORDER BY aggregate_key"
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    let (first, second) = (keys[0].clone(), keys[1].clone());
    let deadlocks = || async {
        let (_, n): (String, String) = sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")
            .fetch_one(&ctx.pool)
            .await
            .unwrap();
        n.parse::<u64>().unwrap()
    };
    let before = deadlocks().await;
    let mut other = conn(&ctx).await;
    sqlx::query("START TRANSACTION")
        .execute(&mut other)
        .await
        .unwrap();
    sqlx::query(&format!(
        "INSERT INTO {} (id) WITH RECURSIVE s (n) AS \
           (SELECT 1 UNION ALL SELECT n + 1 FROM s WHERE n < 200) SELECT n FROM s",
        ctx.table("ballast")
    ))
    .execute(&mut other)
    .await
    .unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {state} WHERE aggregate_key = ? FOR UPDATE"
    ))
    .bind(&second)
    .execute(&mut other)
    .await
    .unwrap();
    let completing = {
        let store = store.clone();
        let handle = batch.handle.clone();
        let outcomes = vec![common::published(&a, 1), common::published(&b, 2)];
        tokio::spawn(async move { store.complete(&handle, &outcomes).await })
    };
    // The completion holds the first key and waits for the second.
    tokio::time::sleep(Duration::from_millis(400)).await;
    sqlx::query(&format!(
        "SELECT 1 FROM {state} WHERE aggregate_key = ? FOR UPDATE"
    ))
    .bind(&first)
    .execute(&mut other)
    .await
    .expect("the heavier transaction is not the victim");
    tokio::time::sleep(Duration::from_millis(100)).await;
    sqlx::query("COMMIT").execute(&mut other).await.unwrap();
    let report = completing
        .await
        .unwrap()
        .expect("the store ran the completion again after the deadlock");
    assert_eq!(report.applied, 2, "{report:?}");
    assert!(deadlocks().await > before, "a deadlock happened");
    ctx.drop().await;
}
