//! End-to-end under SIGKILL: two `outbox relay` processes and one projector process (this test
//! binary started again as [`projector_process`], a consumer through `outbox-inbox` with the
//! PostgreSQL inbox) run against a real PostgreSQL and a real Kafka-protocol broker while
//! business transactions commit and roll back; processes are killed with SIGKILL at seeded
//! random moments and restarted. After the load stops and the system drains, the invariants must hold:
//!
//! * no committed event lost (every one published, in the topic, and applied);
//! * nothing from a rolled-back transaction published;
//! * per aggregate, first deliveries in the topic in version order;
//! * each event's effect applied exactly once;
//! * the projection equals the order state.
//!
//! Seed: `OUTBOX_KILL_SEED` (printed on every run); chaos duration: `OUTBOX_KILL_SECS`
//! (default 15); `OUTBOX_KILL_SAME_GROUP=1` restarts the projector in its own consumer group
//! (for a real Kafka; see `Proc::kill_and_restart` for why not against tansu). Needs `DATABASE_URL` and `KAFKA_BROKERS`
//! (`scripts/test` sets both); skips only with `OUTBOX_SKIP_SERVICE_TESTS=1`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{async_trait, ClaimMode, Envelope};
use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
use outbox_kafka::KafkaSource;
use outbox_postgres::{map_sqlx_error, qualified, PostgresInboxStore, PostgresOutboxStore};
use outbox_test_support::required_var;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::{PgPool, Row};
use sqlx::{Postgres, Transaction};

const PARTITIONS: i32 = 4;
const AGGREGATES: usize = 30;

struct Proc {
    name: &'static str,
    args: Vec<String>,
    child: Child,
    kills: u32,
}

impl Proc {
    fn spawn(name: &'static str, args: Vec<String>) -> Self {
        let child = start(name, &args);
        Self {
            name,
            args,
            child,
            kills: 0,
        }
    }
    fn kill_and_restart(&mut self) {
        self.child.kill().expect("SIGKILL"); // Child::kill sends SIGKILL on Unix
        self.child.wait().expect("reap");
        self.kills += 1;
        if self.name == "projector" && !same_group_after_kill() {
            // tansu 0.6 neither evicts a killed member from its group nor serves a fetch that
            // resumes inside a multi-record batch, so a restarted member of the same group can
            // stall there. Against tansu the restarted projector joins a fresh group and
            // re-reads the topic from the start: every event arrives again and the inbox must
            // absorb it. Against a real Kafka set OUTBOX_KILL_SAME_GROUP=1 to resume from the
            // committed offsets instead.
            let group = self
                .args
                .iter()
                .position(|a| a == "--group")
                .expect("--group")
                + 1;
            self.args[group] = format!("{}-{}", self.args[group], self.kills);
        }
        self.child = start(self.name, &self.args);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn same_group_after_kill() -> bool {
    std::env::var("OUTBOX_KILL_SAME_GROUP").as_deref() == Ok("1")
}

fn start(name: &str, args: &[String]) -> Child {
    let mut cmd = match name {
        "relay" => {
            let mut c = Command::new(env!("CARGO_BIN_EXE_outbox"));
            c.args(["relay"]).args(args);
            c
        }
        _ => {
            // This test binary, running only the projector helper with the arguments in the
            // environment.
            let mut c = Command::new(std::env::current_exe().expect("test binary"));
            c.args([
                "--exact",
                "projector_process",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(PROJECTOR_ARGS, args.join("\u{1f}"));
            c
        }
    };
    cmd.env_remove("OUTBOX_CONFIG")
        .current_dir(std::env::temp_dir())
        .env(
            "RUST_LOG",
            std::env::var("OUTBOX_KILL_LOG").unwrap_or_else(|_| "error".into()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_relays_and_consumer_lose_nothing_and_apply_once() {
    let test = "sigkilled_relays_and_consumer_lose_nothing_and_apply_once";
    let (Some(url), Some(brokers)) = (
        required_var(test, "DATABASE_URL"),
        required_var(test, "KAFKA_BROKERS"),
    ) else {
        return;
    };
    let seed: u64 = std::env::var("OUTBOX_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    println!("OUTBOX_KILL_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let chaos = Duration::from_secs(
        std::env::var("OUTBOX_KILL_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(15),
    );

    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let schema = format!("kill_{run}");
    let topic = format!("kill-{run}");
    let pool = PgPool::connect(&url).await.unwrap();
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA {schema}; CREATE TABLE {schema}.orders (id text PRIMARY KEY, version bigint NOT NULL);"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let store = PostgresOutboxStore::builder(pool.clone())
        .schema(schema.clone())
        .claim_mode(ClaimMode::lease(Duration::from_secs(6)).unwrap())
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    for r in admin
        .create_topics(
            [&NewTopic::new(
                &topic,
                PARTITIONS,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await
        .unwrap()
    {
        r.unwrap();
    }

    let relay_args = vec![
        "--database-url".into(),
        url.clone(),
        "--schema".into(),
        schema.clone(),
        "--brokers".into(),
        brokers.clone(),
        "--topic".into(),
        topic.clone(),
        "--lease".into(),
        "6s".into(),
        "--delivery-timeout".into(),
        "3s".into(),
        "--batch-size".into(),
        "50".into(),
        "--no-http".into(),
        "--no-cleanup".into(),
        // tansu 0.6 cannot resume a consumer inside a multi-record batch: one record per batch.
        "--producer-property".into(),
        "batch.num.messages=1".into(),
    ];
    let projector_args = vec![
        url.clone(),
        schema.clone(),
        brokers.clone(),
        topic.clone(),
        "--group".into(),
        format!("kill-projector-{run}"),
        "projection".into(),
    ];
    let mut procs = vec![
        Proc::spawn("relay", relay_args.clone()),
        Proc::spawn("relay", relay_args),
        Proc::spawn("projector", projector_args),
    ];

    // Business load with chaos.
    let mut versions: HashMap<String, i64> = HashMap::new();
    let mut committed: Vec<(outbox_core::EventId, String, i64)> = vec![];
    let mut rolled_back: HashSet<outbox_core::EventId> = HashSet::new();
    let started = Instant::now();
    let mut total_kills = 0usize;
    let mut next_kill = started + Duration::from_millis(rng.random_range(500..2000));
    while started.elapsed() < chaos {
        let agg = format!("order-{}", rng.random_range(0..AGGREGATES));
        let version = versions.get(&agg).copied().unwrap_or(0) + 1;
        let mut tx = pool.begin().await.unwrap();
        sqlx::query(&format!(
            "INSERT INTO {schema}.orders (id, version) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET version = $2"
        ))
        .bind(&agg)
        .bind(version)
        .execute(&mut *tx)
        .await
        .unwrap();
        let e = Envelope::builder("order", &agg, version, "order.changed")
            .json(&serde_json::json!({ "v": version }))
            .unwrap()
            .build()
            .unwrap();
        store.append(&mut *tx, &e).await.unwrap();
        if rng.random_bool(0.1) {
            tx.rollback().await.unwrap();
            rolled_back.insert(e.event_id);
        } else {
            tx.commit().await.unwrap();
            versions.insert(agg.clone(), version);
            committed.push((e.event_id, agg, version));
        }
        if Instant::now() >= next_kill {
            // Every process gets killed; the order and the moments are random.
            let i = (total_kills + rng.random_range(0..2)) % procs.len();
            total_kills += 1;
            procs[i].kill_and_restart();
            next_kill = Instant::now() + Duration::from_millis(rng.random_range(500..2500));
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..15))).await;
    }
    let kills: Vec<String> = procs
        .iter()
        .map(|p| format!("{}: {}", p.name, p.kills))
        .collect();
    println!(
        "committed {} events, rolled back {}, kills {kills:?}",
        committed.len(),
        rolled_back.len()
    );

    // Drain: everything published and applied.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let stats = store.stats().await.unwrap();
        let applied: i64 = sqlx::query_scalar(&format!(
            "SELECT count(DISTINCT event_id) FROM {schema}.effects"
        ))
        .fetch_one(&pool)
        .await
        .unwrap_or(0);
        if stats.unpublished == 0 && applied as usize == committed.len() {
            assert_eq!(stats.parked, 0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not drained (seed {seed}): {} unpublished, {applied} of {} applied",
            stats.unpublished,
            committed.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Let in-flight duplicates (if any) land before counting effects.
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(procs);

    // No committed event lost: each is marked published in the outbox.
    let published: HashSet<uuid::Uuid> = sqlx::query(&format!(
        "SELECT event_id FROM {schema}.outbox_events WHERE status = 'published'"
    ))
    .fetch_all(&pool)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get("event_id"))
    .collect();
    for (id, _, _) in &committed {
        assert!(
            published.contains(&id.as_uuid()),
            "event {id} not published (seed {seed})"
        );
    }

    // The topic, read by a plain client: everything committed is there, nothing rolled back,
    // first deliveries in version order per aggregate.
    let records = read_topic(&brokers, &topic, committed.len()).await;
    let by_id: HashSet<uuid::Uuid> = records.iter().map(|r| r.1).collect();
    for (id, _, _) in &committed {
        assert!(
            by_id.contains(&id.as_uuid()),
            "event {id} missing from the topic (seed {seed})"
        );
    }
    for id in &rolled_back {
        assert!(
            !by_id.contains(&id.as_uuid()),
            "rolled-back event {id} was published (seed {seed})"
        );
    }
    let mut firsts: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let mut seen = HashSet::new();
    for (agg, id, version) in &records {
        if seen.insert(*id) {
            firsts.entry(agg.clone()).or_default().push(*version);
        }
    }
    for (agg, vs) in &firsts {
        let expected: Vec<i64> = (1..=vs.len() as i64).collect();
        assert_eq!(
            vs, &expected,
            "first deliveries of {agg} out of order (seed {seed})"
        );
    }

    // Effects applied exactly once each; the projection equals the order state.
    let dup: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM (SELECT event_id FROM {schema}.effects GROUP BY event_id HAVING count(*) > 1) d"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(dup, 0, "an effect was applied twice (seed {seed})");
    let total: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {schema}.effects"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(total as usize, committed.len());
    let mismatched: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {schema}.orders o LEFT JOIN {schema}.projection p ON p.id = o.id WHERE p.version IS DISTINCT FROM o.version"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        mismatched, 0,
        "projection differs from the orders (seed {seed})"
    );
    println!(
        "ok: {} records in the topic for {} events ({} duplicates absorbed)",
        records.len(),
        committed.len(),
        records.len() - committed.len()
    );
    sqlx::raw_sql(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}

/// Reads every partition from offset 0 with a plain consumer until at least `at_least`
/// records arrived and the topic stayed quiet for 2 s. Returns (aggregate, event id, version)
/// in offset order per partition.
async fn read_topic(brokers: &str, topic: &str, at_least: usize) -> Vec<(String, uuid::Uuid, i64)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("kill-reader-{topic}"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut per_partition: BTreeMap<i32, Vec<(i64, String, uuid::Uuid, i64)>> = BTreeMap::new();
    let mut count = 0;
    let mut last = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(60);
    while (count < at_least || last.elapsed() < Duration::from_secs(2)) && Instant::now() < deadline
    {
        let Some(m) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let m = m.unwrap();
        let header = |name: &str| -> String {
            let h = m.headers().expect("headers");
            h.iter()
                .find(|h| h.key == name)
                .and_then(|h| h.value)
                .map(|v| String::from_utf8(v.to_vec()).unwrap())
                .unwrap_or_else(|| panic!("header {name} missing"))
        };
        let id: uuid::Uuid = header("event_id").parse().unwrap();
        let version: i64 = header("aggregate_version").parse().unwrap();
        let agg = String::from_utf8(m.key().unwrap().to_vec()).unwrap();
        per_partition
            .entry(m.partition())
            .or_default()
            .push((m.offset(), agg, id, version));
        count += 1;
        last = Instant::now();
    }
    per_partition
        .into_values()
        .flat_map(|mut v| {
            v.sort_by_key(|r| r.0);
            v.into_iter().map(|(_, a, i, ver)| (a, i, ver))
        })
        .collect()
}

/// The projector's arguments (joined by U+001F): url, schema, brokers, topic, `--group`,
/// group, consumer name.
const PROJECTOR_ARGS: &str = "OUTBOX_KILL_PROJECTOR_ARGS";

/// Appends an effect row and moves the projection to the event's version, in the inbox
/// transaction.
struct Projector {
    effect: String,
    insert: String,
    update: String,
}

#[async_trait]
impl Handler<Transaction<'static, Postgres>> for Projector {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        event: &Envelope,
    ) -> Result<(), HandlerError> {
        let err = |e: sqlx::Error| HandlerError::from(map_sqlx_error(e));
        sqlx::query(&self.effect)
            .bind(event.event_id.as_uuid())
            .bind(&event.aggregate_id)
            .bind(event.aggregate_version)
            .execute(&mut **tx)
            .await
            .map_err(err)?;
        let q = if event.aggregate_version == 1 {
            sqlx::query(&self.insert).bind(&event.aggregate_id)
        } else {
            sqlx::query(&self.update)
                .bind(&event.aggregate_id)
                .bind(event.aggregate_version)
        };
        if q.execute(&mut **tx).await.map_err(err)?.rows_affected() != 1 {
            return Err(HandlerError::transient(format!(
                "projection of {} is not at version {}",
                event.aggregate_id,
                event.aggregate_version - 1
            )));
        }
        Ok(())
    }
}

/// The projector process the SIGKILL test starts and kills: not a test of its own (it runs
/// only when started by `sigkilled_relays_and_consumer_lose_nothing_and_apply_once`, which
/// passes its arguments in the environment), so it is ignored in normal runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper process of the SIGKILL test, started (and killed) by it"]
async fn projector_process() {
    let args = std::env::var(PROJECTOR_ARGS)
        .expect("projector_process runs only when started by the SIGKILL test");
    let a: Vec<&str> = args.split('\u{1f}').collect();
    let (url, schema, brokers, topic, group, consumer) = (a[0], a[1], a[2], a[3], a[5], a[6]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await
        .expect("connect");
    outbox_postgres::validate_identifier("schema", schema, outbox_postgres::MAX_IDENTIFIER_LEN)
        .expect("schema");
    let (effects, projection) = (
        qualified(schema, "effects"),
        qualified(schema, "projection"),
    );
    sqlx::raw_sql(&format!(
        "CREATE TABLE IF NOT EXISTS {effects} (event_id uuid NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE IF NOT EXISTS {projection} (id text PRIMARY KEY, version bigint NOT NULL);"
    ))
    .execute(&pool)
    .await
    .expect("tables");
    let inbox = PostgresInboxStore::builder(pool)
        .schema(schema.to_owned())
        .build()
        .expect("inbox");
    inbox.migrate().await.expect("inbox migrate");
    let handler = Projector {
        effect: format!(
            "INSERT INTO {effects} (event_id, aggregate_id, version) VALUES ($1, $2, $3)"
        ),
        insert: format!(
            "INSERT INTO {projection} (id, version) VALUES ($1, 1) ON CONFLICT (id) DO NOTHING"
        ),
        update: format!("UPDATE {projection} SET version = $2 WHERE id = $1 AND version = $2 - 1"),
    };
    let source = KafkaSource::builder(brokers, group)
        .topic(topic)
        .session_timeout(Duration::from_millis(6000))
        .build()
        .expect("source");
    // The engine hands its offset tracker to the source.
    let mut engine = ConsumerEngine::new(
        source,
        InboxProcessor::new(consumer, inbox, handler),
        EngineConfig::default().with_commit(100, Duration::from_millis(200)),
        rand::random(),
    )
    .expect("engine");
    // Runs until the test kills it.
    let report = engine.run(std::future::pending::<()>()).await;
    eprintln!("projector stopped: {report:?}");
}
