//! The SIGKILL scenario, shared by the store it runs on (`kill.rs`: PostgreSQL, `kill_mysql.rs`:
//! MariaDB): two `outbox relay` processes and one projector process (the test binary started
//! again as its `projector_process`) run against a real database and a real Kafka-protocol
//! broker while business transactions commit and roll back; processes are killed with SIGKILL
//! at seeded random moments and restarted. After the load stops and the system drains, the
//! invariants must hold:
//!
//! * no committed event lost (every one published, in the topic, and applied);
//! * nothing from a rolled-back transaction published;
//! * per aggregate, first deliveries in the topic in version order;
//! * each event's effect applied exactly once;
//! * the projection equals the order state.
//!
//! Seed: `OUTBOX_KILL_SEED` (printed on every run); chaos duration: `OUTBOX_KILL_SECS`
//! (default 15); `OUTBOX_KILL_SAME_GROUP=1` restarts the projector in its own consumer group
//! (for a real Kafka; see `Proc::kill_and_restart` for why not against tansu).
#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use outbox_core::{async_trait, Envelope, EventId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

pub const PARTITIONS: i32 = 4;
pub const AGGREGATES: usize = 30;

/// The projector's arguments (joined by U+001F), passed in the environment.
pub const PROJECTOR_ARGS: &str = "OUTBOX_KILL_PROJECTOR_ARGS";

/// The store side of the scenario: the business transaction and what the checks read.
#[async_trait]
pub trait System: Sync {
    /// One business transaction: the order row moves to the event's version and the event is
    /// appended, in one transaction, which commits, or rolls back when `rollback`.
    async fn business(&self, event: &Envelope, rollback: bool);
    /// (unpublished, parked) events in the outbox.
    async fn backlog(&self) -> (u64, u64);
    /// Events whose effect was applied at least once.
    async fn applied_distinct(&self) -> usize;
    /// Ids of the events marked published in the outbox.
    async fn published_ids(&self) -> HashSet<uuid::Uuid>;
    /// Events whose effect was applied more than once.
    async fn duplicate_effects(&self) -> i64;
    /// Effect rows in all.
    async fn total_effects(&self) -> i64;
    /// Orders whose projection differs from their version.
    async fn projection_mismatches(&self) -> i64;
}

pub struct Proc {
    pub name: &'static str,
    args: Vec<String>,
    child: Child,
    pub kills: u32,
}

impl Proc {
    pub fn spawn(name: &'static str, args: Vec<String>) -> Self {
        let child = start(name, &args);
        Self {
            name,
            args,
            child,
            kills: 0,
        }
    }
    pub fn kill_and_restart(&mut self) {
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
            // This test binary, running only its projector helper with the arguments in the
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
        .env_remove("DATABASE_URL")
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

/// The projector's arguments, split, when this process was started as the projector.
pub fn projector_args() -> Vec<String> {
    std::env::var(PROJECTOR_ARGS)
        .expect("projector_process runs only when started by the SIGKILL test")
        .split('\u{1f}')
        .map(str::to_owned)
        .collect()
}

/// The seed (`OUTBOX_KILL_SEED` or a fresh one, printed) and the chaos duration.
pub fn seed_and_duration() -> (u64, Duration) {
    let seed: u64 = std::env::var("OUTBOX_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    println!("OUTBOX_KILL_SEED={seed}");
    let chaos = Duration::from_secs(
        std::env::var("OUTBOX_KILL_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(15),
    );
    (seed, chaos)
}

/// Creates the test's topic with [`PARTITIONS`] partitions.
pub async fn create_topic(brokers: &str, topic: &str) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    for r in admin
        .create_topics(
            [&NewTopic::new(
                topic,
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
}

/// `outbox relay` arguments: `database` (the URL and where the outbox is) plus the scenario's
/// broker, topic, a 6 s lease and a 3 s delivery timeout.
pub fn relay_args(database: &[&str], brokers: &str, topic: &str) -> Vec<String> {
    let mut args: Vec<String> = database.iter().map(|s| (*s).to_owned()).collect();
    args.extend(
        [
            "--brokers",
            brokers,
            "--topic",
            topic,
            "--lease",
            "6s",
            "--delivery-timeout",
            "3s",
            "--batch-size",
            "50",
            "--no-http",
            "--no-cleanup",
            // tansu 0.6 cannot resume a consumer inside a multi-record batch: one record per
            // batch.
            "--producer-property",
            "batch.num.messages=1",
        ]
        .map(str::to_owned),
    );
    args
}

/// What the load needs of a store: the business transaction.
#[async_trait]
pub trait Business: Sync {
    /// As [`System::business`].
    async fn business(&self, event: &Envelope, rollback: bool);
}

#[async_trait]
impl<T: System> Business for T {
    async fn business(&self, event: &Envelope, rollback: bool) {
        System::business(self, event, rollback).await
    }
}

/// What the load did: the committed events (id, aggregate, version) in commit order and the
/// rolled-back ones.
pub struct Load {
    pub committed: Vec<(EventId, String, i64)>,
    pub rolled_back: HashSet<EventId>,
}

/// Runs business transactions (a tenth rolled back) over [`AGGREGATES`] aggregates for the
/// chaos duration, killing one of `procs` with SIGKILL and restarting it at seeded random
/// moments.
pub async fn load_with_kills(
    system: &impl Business,
    procs: &mut [Proc],
    seed: u64,
    chaos: Duration,
) -> Load {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut versions: HashMap<String, i64> = HashMap::new();
    let mut committed: Vec<(EventId, String, i64)> = vec![];
    let mut rolled_back: HashSet<EventId> = HashSet::new();
    let started = Instant::now();
    let mut total_kills = 0usize;
    let mut next_kill = started + Duration::from_millis(rng.random_range(500..2000));
    while started.elapsed() < chaos {
        let agg = format!("order-{}", rng.random_range(0..AGGREGATES));
        let version = versions.get(&agg).copied().unwrap_or(0) + 1;
        let e = Envelope::builder("order", &agg, version, "order.changed")
            .json(&serde_json::json!({ "v": version }))
            .unwrap()
            .build()
            .unwrap();
        let rollback = rng.random_bool(0.1);
        Business::business(system, &e, rollback).await;
        if rollback {
            rolled_back.insert(e.event_id);
        } else {
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
    Load {
        committed,
        rolled_back,
    }
}

/// Runs the load with kills for the chaos duration, drains, and checks every invariant.
pub async fn run(
    system: &impl System,
    mut procs: Vec<Proc>,
    brokers: &str,
    topic: &str,
    seed: u64,
    chaos: Duration,
) {
    let Load {
        committed,
        rolled_back,
    } = load_with_kills(system, &mut procs, seed, chaos).await;

    // Drain: everything published and applied.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (unpublished, parked) = system.backlog().await;
        let applied = system.applied_distinct().await;
        if unpublished == 0 && applied == committed.len() {
            assert_eq!(parked, 0, "nothing parked (seed {seed})");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not drained (seed {seed}): {unpublished} unpublished, {applied} of {} applied",
            committed.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Let in-flight duplicates (if any) land before counting effects.
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(procs);

    // No committed event lost: each is marked published in the outbox.
    let published = system.published_ids().await;
    for (id, _, _) in &committed {
        assert!(
            published.contains(&id.as_uuid()),
            "event {id} not published (seed {seed})"
        );
    }

    // The topic, read by a plain client: everything committed is there, nothing rolled back,
    // first deliveries in version order per aggregate.
    let records = read_topic(brokers, topic, committed.len()).await;
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
    assert_eq!(
        system.duplicate_effects().await,
        0,
        "an effect was applied twice (seed {seed})"
    );
    assert_eq!(system.total_effects().await as usize, committed.len());
    assert_eq!(
        system.projection_mismatches().await,
        0,
        "projection differs from the orders (seed {seed})"
    );
    println!(
        "ok: {} records in the topic for {} events ({} duplicates absorbed)",
        records.len(),
        committed.len(),
        records.len() - committed.len()
    );
}

/// Reads every partition from offset 0 with a plain consumer until at least `at_least`
/// records arrived and the topic stayed quiet for 2 s. Returns (aggregate, event id, version)
/// in offset order per partition.
pub async fn read_topic(
    brokers: &str,
    topic: &str,
    at_least: usize,
) -> Vec<(String, uuid::Uuid, i64)> {
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
