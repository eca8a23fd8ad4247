//! The in-memory store as a [`RandomizedBackend`]: the randomized run
//! (`outbox-testkit/tests/randomized.rs`) and the adversary scenarios
//! (`outbox-testkit/tests/run_adversary.rs`, through [`crate::run_adversary_tests!`]) run on it
//! unchanged, without a server.

use std::collections::HashMap;
use std::sync::Arc;

use outbox_core::prelude::*;
use outbox_core::{async_trait, DeliveryStatus, Envelope, EventId, StoreError, SystemClock};

use super::{FinalRow, RandomizedBackend, StoreParams, LABEL};
use crate::{MemoryDb, MemoryOutboxStore, MemoryTx};

/// The in-memory store behind [`RandomizedBackend`], on the system clock (the relays' clock),
/// so the server runs and scenarios run on it unchanged. Every store of a backend shares one
/// [`MemoryDb`]. Locked mode has no hold limit here (a crashed relay's locks stay): the runs
/// and scenarios that need a claim to end run in lease mode on it. It keeps no blocked flag,
/// so nothing stalls behind one ([`RandomizedBackend::stalled`] is always empty).
pub struct MemoryBackend {
    db: MemoryDb,
    test_binary: &'static str,
    run_skips_gaps: bool,
}

impl MemoryBackend {
    /// The prefix of the in-memory runs' replay variables (`OUTBOX_MEMORY_RANDOM_SEED`,
    /// `OUTBOX_MEMORY_RANDOM_SECS`): [`RandomizedBackend::env_prefix`].
    pub const ENV_PREFIX: &'static str = "OUTBOX_MEMORY";

    /// A fresh database whose replay command names the test binary `test_binary` of
    /// `outbox-testkit`.
    pub fn replayed_by(test_binary: &'static str) -> Self {
        Self {
            db: MemoryDb::with_shared_clock(Arc::new(SystemClock)),
            test_binary,
            run_skips_gaps: false,
        }
    }

    /// A fresh database, replayed by the `run_adversary` test binary: the constructor
    /// [`crate::run_adversary_tests!`] calls (`connections` is ignored; the signature matches
    /// the server backends', which may find no server and return `None`; this one never does).
    pub async fn new(_connections: u32) -> Option<Self> {
        Some(Self::replayed_by("run_adversary"))
    }

    /// Every store of the backend with the store's deliberate run bug
    /// ([`MemoryOutboxStore::seeded_bug_run_skips_gaps`]), for the checks that must find it.
    /// Never for anything else.
    #[doc(hidden)]
    pub fn seeded_bug_run_skips_gaps(mut self, on: bool) -> Self {
        self.run_skips_gaps = on;
        self
    }

    /// How many runs the seeded bug has handed out past a missing version so far
    /// ([`MemoryOutboxStore::seeded_bug_runs_past_gaps`]); a clone of the backend's handle,
    /// readable after the backend has moved into a run.
    #[doc(hidden)]
    pub fn seeded_bug_witness(&self) -> impl Fn() -> u64 + Send + 'static {
        let reader = self.reader();
        move || reader.seeded_bug_runs_past_gaps()
    }

    /// A store for the backend's own reads.
    fn reader(&self) -> MemoryOutboxStore {
        MemoryOutboxStore::with_lease(&self.db)
    }
}

#[async_trait]
impl RandomizedBackend for MemoryBackend {
    type Store = MemoryOutboxStore;
    type Tx = MemoryTx;

    fn store(&self, p: &StoreParams) -> MemoryOutboxStore {
        MemoryOutboxStore::new(&self.db, p.mode)
            .gap_timeout(p.gap_timeout)
            .seeded_bug_run_skips_gaps(self.run_skips_gaps)
    }

    async fn prepare(&self, _store: &MemoryOutboxStore) -> Result<(), StoreError> {
        Ok(())
    }

    async fn begin(&self) -> Result<MemoryTx, StoreError> {
        Ok(self.db.begin())
    }

    async fn append(
        &self,
        store: &MemoryOutboxStore,
        tx: &mut MemoryTx,
        events: &[Envelope],
    ) -> Result<(), StoreError> {
        store.append(tx, events).await
    }

    async fn commit(&self, tx: MemoryTx) -> Result<(), StoreError> {
        tx.commit()
    }

    async fn rollback(&self, tx: MemoryTx) {
        drop(tx);
    }

    async fn statuses(&self, ids: &[EventId]) -> Option<HashMap<EventId, DeliveryStatus>> {
        // One snapshot (one lock), as a database read is one statement: read row by row, a
        // completion of a run between two reads showed a later version published and an
        // earlier one not yet (a prefix violation that never existed).
        let all: HashMap<EventId, DeliveryStatus> = self
            .reader()
            .snapshot()
            .into_iter()
            .map(|r| (r.envelope.event_id, r.status))
            .collect();
        ids.iter()
            .map(|id| all.get(id).map(|s| (*id, *s)))
            .collect()
    }

    async fn counts(&self) -> Result<(u64, u64), StoreError> {
        let rows = self.reader().snapshot();
        let of = |s: DeliveryStatus| rows.iter().filter(|r| r.status == s).count() as u64;
        Ok((of(DeliveryStatus::Pending), of(DeliveryStatus::Parked)))
    }

    async fn stalled(&self) -> Result<Vec<(String, i64, String)>, StoreError> {
        // The in-memory store keeps no blocked flag: nothing can stall behind one.
        Ok(Vec::new())
    }

    async fn stuck(&self) -> Vec<String> {
        self.reader()
            .snapshot()
            .into_iter()
            .filter(|r| matches!(r.status, DeliveryStatus::Pending | DeliveryStatus::Parked))
            .take(10)
            .map(|r| {
                format!(
                    "{:?} {} v{} {:?}",
                    r.envelope.headers.get(LABEL),
                    r.envelope.aggregate_id,
                    r.envelope.aggregate_version,
                    r.status
                )
            })
            .collect()
    }

    async fn final_rows(&self) -> Result<Vec<FinalRow>, StoreError> {
        let mut rows = self.reader().snapshot();
        rows.sort_by_key(|r| r.seq);
        Ok(rows
            .into_iter()
            .map(|r| {
                let ack = r
                    .ack
                    .as_ref()
                    .and_then(|a| a.as_kafka())
                    .map(|(t, p, o)| (t.to_owned(), p, o));
                FinalRow::new(
                    r.envelope.event_id,
                    r.status.as_str(),
                    r.envelope.headers.get(LABEL).cloned(),
                    ack,
                )
            })
            .collect())
    }

    fn location(&self) -> String {
        "in-memory store".to_owned()
    }

    fn env_prefix(&self) -> &'static str {
        Self::ENV_PREFIX
    }

    fn replay_command(&self, test: &str, seed: u64) -> String {
        format!(
            "{}_RANDOM_SEED={seed} cargo test -p outbox-testkit --test {} {test}",
            Self::ENV_PREFIX,
            self.test_binary
        )
    }

    async fn finish(&self) {}
}
