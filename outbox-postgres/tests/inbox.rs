//! The PostgreSQL inbox under the consumer engine: durability independent of server defaults,
//! parking with the partition moving on, operator retry and discard with their audit, version
//! policies, and the table contents an operator sees. Needs PostgreSQL at `DATABASE_URL`.

mod common;

use std::time::Duration;

use outbox_core::{
    async_trait, wire, Envelope, InboxParking, InboxStore, ParkKind, ParkedFilter, ParkedStatus,
    Publisher, RetryPolicy,
};
use outbox_inbox::{
    ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor, ParkedMessages,
    VersionPolicy,
};
use outbox_postgres::{map_sqlx_error, PostgresInboxStore};
use outbox_testkit::MemoryLog;
use sqlx::{Postgres, Row, Transaction};

/// Writes one effect row per event; refuses aggregates named `poison*` until a row in `fixes`
/// names them.
struct Effects {
    schema: String,
}

#[async_trait]
impl Handler<Transaction<'static, Postgres>> for Effects {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        e: &Envelope,
    ) -> Result<(), HandlerError> {
        let s = &self.schema;
        let err = |e: sqlx::Error| HandlerError::from(map_sqlx_error(e));
        if e.aggregate_id.starts_with("poison") {
            let fixed: Option<i32> =
                sqlx::query_scalar(&format!("SELECT 1 FROM \"{s}\".fixes WHERE id = $1"))
                    .bind(&e.aggregate_id)
                    .fetch_optional(&mut **tx)
                    .await
                    .map_err(err)?;
            if fixed.is_none() {
                return Err(HandlerError::permanent("unknown customer"));
            }
        }
        sqlx::query(&format!(
            "INSERT INTO \"{s}\".effects (dedup_id, aggregate_id, version) VALUES ($1, $2, $3)"
        ))
        .bind(e.dedup_id().as_uuid())
        .bind(&e.aggregate_id)
        .bind(e.aggregate_version)
        .execute(&mut **tx)
        .await
        .map_err(err)?;
        Ok(())
    }
}

fn ev(agg: &str, v: i64) -> Envelope {
    Envelope::builder("order", agg, v, "order.changed")
        .json(&serde_json::json!({ "v": v }))
        .unwrap()
        .build()
        .unwrap()
}

fn fast() -> EngineConfig {
    EngineConfig::default()
        .with_commit(1, Duration::from_secs(60))
        .with_poll_timeout(Duration::from_millis(5))
        .with_retry(
            RetryPolicy::builder()
                .base(Duration::from_millis(1))
                .max_delay(Duration::from_millis(2))
                .min_delay(Duration::from_millis(1))
                .max_attempts(3)
                .build()
                .unwrap(),
        )
}

async fn setup(ctx: &common::Ctx) -> PostgresInboxStore {
    let inbox = ctx.inbox().await;
    let s = &ctx.schema;
    sqlx::raw_sql(&format!(
        "CREATE TABLE \"{s}\".effects (dedup_id uuid PRIMARY KEY, aggregate_id text NOT NULL, version bigint NOT NULL, n bigserial);
         CREATE TABLE \"{s}\".fixes (id text PRIMARY KEY);"
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    inbox
}

async fn versions(ctx: &common::Ctx, agg: &str) -> Vec<i64> {
    sqlx::query_scalar(&format!(
        "SELECT version FROM \"{}\".effects WHERE aggregate_id = $1 ORDER BY version",
        ctx.schema
    ))
    .bind(agg)
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// The inbox transaction commits with `synchronous_commit = on` although the role's default is
/// `off`: an acknowledged commit is flushed before the engine commits the offset.
#[tokio::test]
async fn inbox_transactions_are_durable_whatever_the_role_default() {
    let ctx = ctx!(2);
    let inbox = setup(&ctx).await;
    let role = format!("r_{}", &ctx.schema[4..]);
    sqlx::raw_sql(&format!(
        "CREATE ROLE {role} LOGIN;
         ALTER ROLE {role} SET synchronous_commit = off;
         GRANT USAGE ON SCHEMA \"{s}\" TO {role};
         GRANT ALL ON ALL TABLES IN SCHEMA \"{s}\" TO {role};",
        s = ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| common::DEFAULT_URL.to_owned());
    let mut opts: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    opts = opts.username(&role);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(opts)
        .await
        .unwrap();
    let show = "SELECT current_setting('synchronous_commit')";
    let default: String = sqlx::query_scalar(show).fetch_one(&pool).await.unwrap();
    assert_eq!(
        default, "off",
        "the role's default must be off for this test"
    );
    let role_inbox = PostgresInboxStore::builder(pool.clone())
        .schema(&ctx.schema)
        .build()
        .unwrap();
    let mut tx = role_inbox.begin().await.unwrap();
    let inside: String = sqlx::query_scalar(show).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(
        inside, "on",
        "the inbox transaction runs with the server default"
    );
    role_inbox.rollback(tx).await.unwrap();
    // The setting is local to the transaction.
    let after: String = sqlx::query_scalar(show).fetch_one(&pool).await.unwrap();
    assert_eq!(after, "off");
    pool.close().await;
    drop(inbox);
    sqlx::raw_sql(&format!("DROP OWNED BY {role}; DROP ROLE {role};"))
        .execute(&ctx.pool)
        .await
        .unwrap();
    ctx.drop().await;
}

/// Tried as an operator would: a poison message and malformed records park, the partition
/// continues to its end, the poison aggregate's later message waits, the others flow; after
/// the fix an operator retry applies both in order; a discard of the malformed record is
/// recorded; every action is in the audit trail.
#[tokio::test]
async fn poison_and_malformed_messages_park_and_the_operator_releases_them() {
    let ctx = ctx!(6);
    let inbox = setup(&ctx).await;
    let log = MemoryLog::new("orders", 1);
    for r in log
        .publish(&[
            &ev("a", 1),
            &ev("poison", 1),
            &ev("b", 1),
            &ev("poison", 2),
            &ev("a", 2),
        ])
        .await
    {
        r.unwrap();
    }
    log.append_raw("orders", 0, None, vec![], b"not an event".to_vec())
        .unwrap();
    let handler = Effects {
        schema: ctx.schema.clone(),
    };
    let processor = InboxProcessor::new("billing", inbox.clone(), handler);
    let mut engine =
        ConsumerEngine::new(log.consumer("billing", &["orders"]), processor, fast(), 1).unwrap();
    let report = engine
        .run_until_quiet(Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(
        (report.applied, report.parked, report.waiting),
        (3, 2, 1),
        "{report:?}"
    );
    assert_eq!(log.committed("billing", "orders", 0), Some(6));
    assert_eq!(versions(&ctx, "a").await, vec![1, 2]);
    assert!(versions(&ctx, "poison").await.is_empty());

    // What the operator sees, straight from the tables (in log order: a batch parks its heads
    // before the messages waiting behind them, so ids follow that, not the offsets).
    let rows = sqlx::query(&format!(
        "SELECT status, kind, reason, attempts, \"offset\", value, cardinality(header_names) AS headers \
         FROM \"{}\".processed_events_parked ORDER BY \"offset\"",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 3);
    let status: Vec<String> = rows.iter().map(|r| r.get("status")).collect();
    assert_eq!(status, vec!["parked", "waiting", "parked"]);
    let kind: Option<String> = rows[0].get("kind");
    assert_eq!(kind.as_deref(), Some("unprocessable"));
    let reason: String = rows[0].get("reason");
    assert!(reason.contains("unknown customer"), "{reason}");
    let raw: Option<Vec<u8>> = rows[2].get("value");
    assert_eq!(raw.as_deref(), Some(b"not an event".as_slice()));
    assert_eq!(rows[2].get::<i32, _>("headers"), 0);

    let ops = engine.parked();
    let open = ops.list(&ParkedFilter::open()).await.unwrap();
    let poison = open
        .iter()
        .find(|m| m.status == outbox_core::ParkedStatus::Parked && m.record.aggregate.is_some())
        .unwrap()
        .id;
    let junk = open
        .iter()
        .find(|m| m.record.aggregate.is_none())
        .unwrap()
        .id;
    sqlx::query(&format!(
        "INSERT INTO \"{}\".fixes VALUES ('poison')",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let r = ops
        .retry(poison, "alice", "customer created")
        .await
        .unwrap();
    assert_eq!((r.applied, r.released), (2, true));
    assert_eq!(versions(&ctx, "poison").await, vec![1, 2]);
    let r = ops
        .discard(junk, "alice", "written by a test tool")
        .await
        .unwrap();
    assert_eq!((r.discarded, r.released), (1, true));
    assert!(ops.list(&ParkedFilter::open()).await.unwrap().is_empty());
    let trail = ops.audit_trail(None).await.unwrap();
    assert_eq!(trail.len(), 2);
    assert_eq!(trail[0].reason, "customer created");
    assert_eq!(trail[1].reason, "written by a test tool");
    let stats = inbox.parked_stats("billing").await.unwrap();
    assert_eq!((stats.parked, stats.waiting), (0, 0));

    // The aggregate flows again.
    for r in log.publish(&[&ev("poison", 3)]).await {
        r.unwrap();
    }
    let report = engine
        .run_until_quiet(Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(report.waiting, 1, "no new message waited");
    assert_eq!(versions(&ctx, "poison").await, vec![1, 2, 3]);
    drop(engine);
    ctx.drop().await;
}

/// A re-issued copy (header `outbox_original_event_id`) of an applied event is a duplicate in
/// PostgreSQL: one effect row.
#[tokio::test]
async fn a_reissued_copy_is_deduplicated_with_its_original() {
    let ctx = ctx!(4);
    let inbox = setup(&ctx).await;
    let original = ev("c", 1);
    let copy = Envelope::builder("order", "c", 1, "order.changed")
        .header(wire::ORIGINAL_EVENT_ID, original.event_id.to_string())
        .build()
        .unwrap();
    let log = MemoryLog::new("orders", 1);
    for r in log.publish(&[&original, &copy]).await {
        r.unwrap();
    }
    let handler = Effects {
        schema: ctx.schema.clone(),
    };
    // Unchecked: only the dedup id tells the copy from a new event.
    let processor = InboxProcessor::new("billing", inbox, handler)
        .with_version_policy(VersionPolicy::Unchecked);
    let mut engine =
        ConsumerEngine::new(log.consumer("billing", &["orders"]), processor, fast(), 1).unwrap();
    let report = engine
        .run_until_quiet(Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!((report.applied, report.duplicates), (1, 1));
    assert_eq!(versions(&ctx, "c").await, vec![1]);
    drop(engine);
    ctx.drop().await;
}

/// A version gap parks (Reject) or waits for the missing version (Hold) per policy, against
/// the PostgreSQL versions table.
#[tokio::test]
async fn version_gaps_park_or_wait_per_policy() {
    let ctx = ctx!(6);
    let inbox = setup(&ctx).await;
    let handler = || Effects {
        schema: ctx.schema.clone(),
    };
    // Reject: v3 parks as a gap, v4 waits.
    let log = MemoryLog::new("orders", 1);
    for r in log.publish(&[&ev("g", 1), &ev("g", 3), &ev("g", 4)]).await {
        r.unwrap();
    }
    let processor = InboxProcessor::new("reject", inbox.clone(), handler());
    let mut engine =
        ConsumerEngine::new(log.consumer("reject", &["orders"]), processor, fast(), 1).unwrap();
    let report = engine
        .run_until_quiet(Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!((report.parked, report.waiting), (1, 1));
    let head = &inbox
        .list_parked("reject", &ParkedFilter::open())
        .await
        .unwrap()[0];
    assert_eq!(
        (head.status, head.kind),
        (ParkedStatus::Parked, Some(ParkKind::VersionGap))
    );
    // Hold: v3 waits until v2 arrives, then all apply in order.
    let log = MemoryLog::new("orders2", 1);
    for r in log.publish(&[&ev("h", 1), &ev("h", 3)]).await {
        r.unwrap();
    }
    let processor = InboxProcessor::new("hold", inbox.clone(), handler())
        .with_version_policy(VersionPolicy::hold(10, Duration::from_secs(30)));
    let mut engine =
        ConsumerEngine::new(log.consumer("hold", &["orders2"]), processor, fast(), 1).unwrap();
    for _ in 0..40 {
        engine.step().await.unwrap();
    }
    assert_eq!(engine.report().held, 1);
    assert_eq!(versions(&ctx, "h").await, vec![1]);
    for r in log.publish(&[&ev("h", 2)]).await {
        r.unwrap();
    }
    engine
        .run_until_quiet(Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(versions(&ctx, "h").await, vec![1, 2, 3]);
    assert_eq!(log.committed("hold", "orders2", 0), Some(3));
    drop(engine);
    ctx.drop().await;
}

/// An operator process built separately from the engine (same consumer name, store, handler)
/// sees and releases what the engine parked.
#[tokio::test]
async fn a_separate_operator_process_releases_what_the_engine_parked() {
    let ctx = ctx!(6);
    let inbox = setup(&ctx).await;
    let log = MemoryLog::new("orders", 1);
    for r in log.publish(&[&ev("poison-x", 1)]).await {
        r.unwrap();
    }
    let processor = InboxProcessor::new(
        "billing",
        inbox.clone(),
        Effects {
            schema: ctx.schema.clone(),
        },
    );
    let mut engine =
        ConsumerEngine::new(log.consumer("billing", &["orders"]), processor, fast(), 1).unwrap();
    engine
        .run_until_quiet(Duration::from_millis(100))
        .await
        .unwrap();
    let ops = ParkedMessages::new(InboxProcessor::new(
        "billing",
        inbox.clone(),
        Effects {
            schema: ctx.schema.clone(),
        },
    ));
    let m = &ops.list(&ParkedFilter::open()).await.unwrap()[0];
    assert_eq!(m.attempts, 1);
    // Still broken: fails again, attempts counted, audited.
    let r = ops.retry(m.id, "bob", "try").await.unwrap();
    assert!(r.still_parked.is_some());
    let again = ops.show(m.id).await.unwrap().unwrap();
    assert_eq!(again.attempts, 2);
    let r = ops.discard(m.id, "bob", "customer deleted").await.unwrap();
    assert!(r.released);
    // Discarded means registered: a redelivery is a duplicate, never applied.
    let mut tx = inbox.begin().await.unwrap();
    let reg = inbox
        .register(&mut tx, "billing", &[m.record.dedup_id.unwrap()])
        .await
        .unwrap();
    inbox.rollback(tx).await.unwrap();
    assert_eq!(reg, vec![outbox_core::Registration::Duplicate]);
    assert_eq!(ops.audit_trail(Some(m.id)).await.unwrap().len(), 2);
    drop(engine);
    ctx.drop().await;
}

/// `outbox parked retry --consumer` from a process without the handler records a request; the
/// consumer's engine performs it at start and then on its interval, with its handler: a retry
/// that fails again leaves the message parked (attempts counted, audited) and clears the
/// request; a fixed one applies the head and releases the waiting messages in order. Requests
/// on unknown or resolved messages are refused.
#[tokio::test]
async fn requested_retries_are_performed_by_the_engine_with_its_handler() {
    let ctx = ctx!(6);
    let inbox = setup(&ctx).await;
    let log = MemoryLog::new("orders", 1);
    for r in log
        .publish(&[&ev("poison-r", 1), &ev("poison-r", 2), &ev("poison-r", 3)])
        .await
    {
        r.unwrap();
    }
    let effects = || Effects {
        schema: ctx.schema.clone(),
    };
    let processor = InboxProcessor::new("billing", inbox.clone(), effects());
    let mut engine = ConsumerEngine::new(
        log.consumer("billing", &["orders"]),
        processor,
        fast().with_retry_requests_interval(Duration::from_millis(20)),
        1,
    )
    .unwrap();
    engine
        .run_until_quiet(Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!((engine.report().parked, engine.report().waiting), (1, 2));
    // The operator's side (the CLI): a processor whose handler is never run by a request.
    let ops = ParkedMessages::new(InboxProcessor::new("billing", inbox.clone(), effects()));
    let head = ops
        .list(&ParkedFilter::open())
        .await
        .unwrap()
        .into_iter()
        .find(|m| m.status == ParkedStatus::Parked)
        .unwrap();
    // Still broken: the requested retry fails again.
    ops.request_retry(head.id, "alice", "try").await.unwrap();
    let shown = ops.show(head.id).await.unwrap().unwrap();
    let request = shown.retry_request.expect("pending request");
    assert_eq!(
        (request.actor.as_str(), request.reason.as_str()),
        ("alice", "try")
    );
    assert_eq!(ops.requested_retries().await.unwrap().len(), 1);
    engine
        .run_until_quiet(Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(engine.report().requested_retries, 1);
    let m = ops.show(head.id).await.unwrap().unwrap();
    assert_eq!((m.status, m.attempts), (ParkedStatus::Parked, 2));
    assert!(m.retry_request.is_none(), "cleared after a failed retry");
    assert!(ops.requested_retries().await.unwrap().is_empty());
    let trail = ops.audit_trail(Some(head.id)).await.unwrap();
    let actions: Vec<&str> = trail.iter().map(|a| a.action.as_str()).collect();
    assert_eq!(actions, vec!["request_retry", "retry"]);
    assert!(trail[1].outcome.contains("failed again"), "{:?}", trail[1]);
    assert_eq!(trail[1].actor, "alice");
    assert!(versions(&ctx, "poison-r").await.is_empty());
    // Fixed: the next request applies v1, v2, v3 in order.
    sqlx::query(&format!(
        "INSERT INTO \"{}\".fixes (id) VALUES ('poison-r')",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    ops.request_retry(head.id, "alice", "customer created")
        .await
        .unwrap();
    engine
        .run_until_quiet(Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(engine.report().requested_retries, 2);
    let in_order: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT version FROM \"{}\".effects ORDER BY n",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(in_order, vec![1, 2, 3]);
    assert!(ops.list(&ParkedFilter::open()).await.unwrap().is_empty());
    let m = ops.show(head.id).await.unwrap().unwrap();
    assert_eq!(m.status, ParkedStatus::Applied);
    assert!(m.retry_request.is_none());
    // Refused: a resolved message, an unknown one, no actor.
    assert!(matches!(
        ops.request_retry(head.id, "alice", "again").await,
        Err(outbox_inbox::OperatorError::NotOpen { .. })
    ));
    assert!(matches!(
        ops.request_retry(outbox_core::ParkedId(999_999), "alice", "x")
            .await,
        Err(outbox_inbox::OperatorError::NotFound(_))
    ));
    assert!(matches!(
        ops.request_retry(head.id, " ", "x").await,
        Err(outbox_inbox::OperatorError::Invalid(_))
    ));
    // The store refuses a request on a resolved message itself (a race with the check above).
    let mut tx = inbox.begin().await.unwrap();
    let err = inbox
        .request_retry(
            &mut tx,
            "billing",
            head.id,
            &outbox_core::RetryRequest::new("alice", "x", chrono::Utc::now()),
        )
        .await
        .unwrap_err();
    inbox.rollback(tx).await.unwrap();
    assert_eq!(err.kind, outbox_core::StoreErrorKind::NotFound);
    drop(engine);
    ctx.drop().await;
}
