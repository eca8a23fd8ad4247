//! The plan of the lease completion with few aggregates (issue 25, BENCHMARKS.md "Few
//! aggregates: the lease completion's release plan"): the release step (`rel`, the update of
//! the aggregate state from the fenced outcomes `f`) must reach the state table through its
//! primary key. Compared with the claim's token as a constant (`a.lease_token = $19`), the
//! planner estimated the state table at about one row (tokens are nearly all NULL) and ran
//! the release as a Seq Scan of the state table with `f` rescanned for every row it found
//! (batch x batch).
//!
//! The plan is the one the server chose for the store's own statement: the store runs over a
//! pool whose sessions load `auto_explain` (every plan sent to the client as a NOTICE), and
//! the test reads the notices sqlx reports (tracing target `sqlx::postgres::notice`). Needs a
//! superuser (`LOAD`) at `DATABASE_URL`, like the other tests; see `common`.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_postgres::PostgresOutboxStore;
use sqlx::postgres::PgPoolOptions;
use sqlx::Executor;

use common::{claim, event, lease, publish_all};

/// Collects the message of every `sqlx::postgres::notice` event.
struct Notices(Arc<Mutex<Vec<String>>>);

struct Message(String);

impl tracing::field::Visit for Message {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.0 = value.to_owned();
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl tracing::Subscriber for Notices {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        metadata.target() == "sqlx::postgres::notice"
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut m = Message(String::new());
        event.record(&mut m);
        self.0.lock().unwrap().push(m.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// The indentation of a plan line's node (`->` or the line's first character).
fn depth(line: &str) -> usize {
    line.find("->")
        .unwrap_or_else(|| line.len() - line.trim_start().len())
}

/// Checks a completion plan: no Seq Scan of the state table directly under a Nested Loop
/// (scanned in full, the other side read again for each of its rows), and the release (`CTE
/// rel`) reads the state table by its primary key.
fn check(plan: &str, state: &str) -> Result<(), String> {
    let lines: Vec<&str> = plan.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if !line.contains(&format!("Seq Scan on {state}")) {
            continue;
        }
        let d = depth(line);
        let parent = lines[..i]
            .iter()
            .rev()
            .find(|l| l.contains("->") && depth(l) < d)
            .copied()
            .unwrap_or("");
        if parent.contains("Nested Loop") {
            return Err(format!("Seq Scan of {state} under a Nested Loop"));
        }
    }
    let rel = lines
        .iter()
        .position(|l| l.trim_start().starts_with("CTE rel"))
        .ok_or("no CTE rel in the plan")?;
    let d = depth(lines[rel]);
    let end = lines[rel + 1..]
        .iter()
        .position(|l| !l.trim().is_empty() && depth(l) <= d && !l.contains("->"))
        .map_or(lines.len(), |p| rel + 1 + p);
    let keyed = lines[rel..end].iter().any(|l| {
        (l.contains("Index Scan using") || l.contains("Index Only Scan using"))
            && l.contains(&format!("{state}_pkey on {state}"))
    });
    if !keyed {
        return Err(format!("CTE rel does not read {state} by its primary key"));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_release_keys_the_state_table_with_few_aggregates() {
    let notices = Arc::new(Mutex::new(Vec::new()));
    tracing::subscriber::set_global_default(Notices(notices.clone())).unwrap();
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    const AGGREGATES: usize = 200;

    // Cycle 1: 200 aggregates get their state rows (lease released: tokens NULL); the
    // statistics then see what autovacuum sees in the field.
    let v1: Vec<_> = (0..AGGREGATES)
        .map(|i| event(&format!("agg-{i}"), 1))
        .collect();
    store.append_many(&ctx.pool, &v1).await.unwrap();
    let b = claim(&store, "relay", AGGREGATES).await;
    assert_eq!(b.records.len(), AGGREGATES);
    publish_all(&store, &b).await;
    sqlx::raw_sql(&format!(
        "ANALYZE \"{}\".outbox_events_aggregate",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();

    // Cycle 2, completed through a store whose sessions explain every statement.
    let v2: Vec<_> = (0..AGGREGATES)
        .map(|i| event(&format!("agg-{i}"), 2))
        .collect();
    store.append_many(&ctx.pool, &v2).await.unwrap();
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| common::DEFAULT_URL.to_owned());
    let explained = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(
                    "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; \
                     SET auto_explain.log_level = 'notice'; \
                     SET auto_explain.log_format = 'text'",
                )
                .await?;
                Ok(())
            })
        })
        .connect(&url)
        .await
        .unwrap();
    let relay = PostgresOutboxStore::builder(explained.clone())
        .schema(&ctx.schema)
        .claim_mode(lease(30.0))
        .build()
        .unwrap();
    let b = claim(&relay, "relay", AGGREGATES).await;
    assert_eq!(b.records.len(), AGGREGATES);
    notices.lock().unwrap().clear();
    publish_all(&relay, &b).await;

    let state = "outbox_events_aggregate";
    let plans: Vec<String> = notices
        .lock()
        .unwrap()
        .iter()
        .filter(|n| n.contains("SELECT ARRAY(SELECT id FROM upd) AS applied"))
        .cloned()
        .collect();
    assert_eq!(plans.len(), 1, "one completion plan: {plans:#?}");
    if let Err(e) = check(&plans[0], state) {
        panic!("{e}:\n{}", plans[0]);
    }
    explained.close().await;
    ctx.drop().await;
}

/// The checker itself, on the two plan shapes of the probe
/// (`benchmarks/probes/complete-lease-plan/plans.txt`), abridged.
#[test]
fn the_checker_tells_the_shapes_apart() {
    let quadratic = "Query Text: WITH ...\n\
        CTE Scan on x  (cost=1..2 rows=1 width=32)\n\
          CTE rel\n\
            ->  Update on outbox_events_aggregate a  (cost=0.00..9.1 rows=1 width=70)\n\
                  ->  Nested Loop  (cost=0.00..9.1 rows=1 width=70)\n\
                        Join Filter: ((a.aggregate_key = f.k))\n\
                        ->  Seq Scan on outbox_events_aggregate a  (cost=0.00..8.5 rows=1 width=6)\n\
                              Filter: (lease_token = $19)\n\
                        ->  CTE Scan on f  (cost=0.00..0.02 rows=1 width=80)\n\
          CTE promote\n\
            ->  Update on outbox_events s\n";
    let keyed = "Query Text: WITH ...\n\
        CTE Scan on x  (cost=1..2 rows=1 width=32)\n\
          CTE rel\n\
            ->  Update on outbox_events_aggregate a  (cost=0.28..8.3 rows=1 width=70)\n\
                  ->  Nested Loop  (cost=0.28..8.3 rows=1 width=70)\n\
                        ->  CTE Scan on f  (cost=0.00..0.02 rows=1 width=80)\n\
                        ->  Index Scan using outbox_events_aggregate_pkey on outbox_events_aggregate a  (cost=0.28..8.29 rows=1 width=6)\n\
                              Index Cond: (aggregate_key = f.k)\n\
          CTE promote\n\
            ->  Update on outbox_events s\n";
    let hashed = keyed.replace(
        "->  Index Scan using outbox_events_aggregate_pkey on outbox_events_aggregate a",
        "->  Hash\n                              ->  Seq Scan on outbox_events_aggregate a",
    );
    let state = "outbox_events_aggregate";
    assert!(check(quadratic, state).is_err());
    assert!(check(keyed, state).is_ok());
    // A hashed state table is no loop over it, but the release does not key it either.
    assert!(check(&hashed, state).is_err());
}
