//! # outbox-testkit
//!
//! In-memory backends for the outbox traits of [`outbox_core`], honouring the same contracts as
//! the real ones, so whole pipelines run in one process on virtual time:
//!
//! * [`ManualClock`]: virtual time.
//! * [`MemoryDb`] / [`MemoryTx`]: an in-memory database with explicit transactions, optimistic
//!   validation of business reads and crash = drop semantics.
//! * [`MemoryOutboxStore`]: the [`outbox_core::OutboxStore`] (both claim modes, fencing,
//!   head-of-line claiming, parking, operator actions, cleanup, stats).
//! * [`MemoryLog`] / [`MemoryConsumer`]: a partitioned log implementing
//!   [`outbox_core::Publisher`] and [`outbox_core::MessageSource`], with scripted broker faults.
//! * [`MemoryInboxStore`]: the [`outbox_core::InboxStore`] and [`outbox_core::InboxParking`]
//!   (registrations, per-aggregate versions, parked messages and their audit), committing with
//!   business writes.
//!
//! And the tools every backend and every user of the library can test with:
//!
//! * [`conformance`]: one generic check per contract clause of `OutboxStore`, `InboxStore` and
//!   `Publisher`, turned into one named test each by
//!   [`outbox_conformance_tests!`], [`inbox_conformance_tests!`] and
//!   [`publisher_conformance_tests!`] from a setup expression; backends describe their
//!   differences as [`conformance::Capabilities`]; [`conformance::outage`] is the publisher
//!   outage suite (a server stopped mid-batch and restarted) that every transport runs.
//! * [`fault`]: wrappers injecting transient and permanent errors, latency and lost
//!   replies/acknowledgements into any store, publisher or message source, driven by a
//!   script, a countdown or a seed (`OUTBOX_SIM_SEED`).
//!
//! The crash-at-every-step simulation, which drives the real relay and consumer engine over
//! these backends (and over PostgreSQL), lives in its own crate, `outbox-sim`, because it
//! runs `outbox-inbox`'s engine.
//!
//! ## Design notes
//!
//! * Crashes are modelled as durable versus in-flight state: committed state lives in
//!   [`MemoryDb`]; a [`MemoryTx`] holds everything uncommitted and dropping it is a rollback.
//!   A relay or consumer "crash" drops its in-flight state; a locked claim's crash is
//!   [`MemoryOutboxStore::abandon`].
//! * Sequence numbers are assigned at append time, not at commit, so rows commit out of order
//!   as in PostgreSQL; the claim never uses a high-water mark.
//! * Time is a [`ManualClock`] shared by store, log and relay; nothing reads the system clock
//!   and nothing random is unseeded (claim tokens and re-issued ids are counters).
//!
//! ## Example: append, relay, consume
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use std::time::Duration;
//! use outbox_core::{
//!     AppendStore, ClaimMode, Envelope, InboxStore, InboxStoreExt, MessageSource, Registration,
//!     Relay, RelayConfig,
//! };
//! use outbox_testkit::{ManualClock, MemoryDb, MemoryInboxStore, MemoryLog, MemoryOutboxStore};
//! use rand::{rngs::StdRng, SeedableRng};
//!
//! let clock = ManualClock::default();
//! let db = MemoryDb::new(clock.clone());
//! let store = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30)).unwrap());
//! let log = MemoryLog::builder().topic("orders", 4).default_topic("orders").build();
//!
//! // The business change and its event commit together.
//! let mut tx = db.begin();
//! tx.put("orders", "o-1", serde_json::json!({"status": "placed", "version": 1}));
//! let event = Envelope::builder("order", "o-1", 1, "order.placed")
//!     .created_at(outbox_core::Clock::now(&clock))
//!     .build()
//!     .unwrap();
//! store.append(&mut tx, &[event.clone()]).await.unwrap();
//! tx.commit().unwrap();
//!
//! // The relay publishes it.
//! let config = RelayConfig::builder().owner("relay-1").build().unwrap();
//! let mut relay = Relay::new(
//!     store.clone(), log.clone(), config, clock.shared(), Box::new(StdRng::seed_from_u64(7)),
//! ).unwrap();
//! let cycle = relay.run_once().await.unwrap();
//! assert_eq!(cycle.published, 1);
//!
//! // A consumer applies it once, in one transaction with its inbox registration.
//! let inbox = MemoryInboxStore::new(&db);
//! let consumer = log.consumer("projection", &["orders"]);
//! let msg = consumer.poll(Duration::ZERO).await.unwrap().expect("one message");
//! let received = msg.envelope.unwrap();
//! assert_eq!(received, event);
//! let mut tx = inbox.begin().await.unwrap();
//! assert_eq!(inbox.register_event(&mut tx, "projection", &received).await.unwrap(), Registration::Fresh);
//! tx.put("projection", "o-1", serde_json::json!({"status": "placed"}));
//! inbox.commit(tx).await.unwrap();
//! let p = &msg.position;
//! consumer.commit(&[p.next()]).await.unwrap(); // next offset to read
//! assert_eq!(log.committed("projection", "orders", p.partition), Some(p.offset + 1));
//! # });
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod clock;
pub mod conformance;
pub mod db;
pub mod fault;
pub mod inbox;
pub mod log;
pub mod outbox;
pub mod randomized;
pub mod rules;
pub mod scenarios;
pub mod store_checks;

pub use clock::ManualClock;
pub use db::{MemoryDb, MemoryTx, TxCounters};
pub use inbox::MemoryInboxStore;
pub use log::{
    FaultAction, FaultMatch, LogFault, LogRecord, MemoryConsumer, MemoryLog, MemoryLogBuilder,
};
pub use outbox::{MemoryOutboxStore, OutboxRow, RowClaimInfo, DEFAULT_GAP_TIMEOUT};

/// A deterministic, well-spread v7 [`outbox_core::EventId`] for `n` at time `at`: distinct `n`
/// give distinct ids (the bits of `n` are mixed into the random part that
/// [`outbox_core::EventId::from_parts`] keeps).
pub fn deterministic_event_id(at: chrono::DateTime<chrono::Utc>, n: u64) -> outbox_core::EventId {
    // A bijective mix of n into 64 bits, placed in bytes 2..10 of the random input, which the
    // UUID v7 layout keeps intact.
    let mut x = n;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    outbox_core::EventId::from_parts(at, u128::from(x) << 16)
}

/// Claims at most `limit` events of `store` for `owner`, in runs of up to `run` versions per
/// aggregate; panics when the claim fails.
pub async fn claim_run<S: outbox_core::OutboxStore>(
    store: &S,
    owner: &str,
    limit: usize,
    run: usize,
) -> outbox_core::ClaimedBatch {
    store
        .claim(&outbox_core::ClaimRequest::new(owner, limit).with_run(run))
        .await
        .expect("claim")
}

/// A claimed batch as (aggregate, version, run position) per record, in batch order: what
/// run checks compare and print.
pub fn batch_layout(batch: &outbox_core::ClaimedBatch) -> Vec<(String, i64, u32)> {
    batch
        .records
        .iter()
        .map(|r| {
            (
                r.envelope.aggregate_id.clone(),
                r.envelope.aggregate_version,
                r.run_position,
            )
        })
        .collect()
}

/// The layout ([`batch_layout`]) of one run of `aggregate` over `versions`: positions 0, 1, ...
pub fn run_layout(
    aggregate: &str,
    versions: std::ops::RangeInclusive<i64>,
) -> Vec<(String, i64, u32)> {
    let first = *versions.start();
    versions
        .map(|v| (aggregate.to_owned(), v, (v - first) as u32))
        .collect()
}
