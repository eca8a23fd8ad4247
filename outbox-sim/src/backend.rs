//! What the simulation needs from a backend: the outbox store and the inbox under test, the
//! business transactions of the producer, and read access to the real state for the
//! invariants. [`MemoryBackend`] runs on the testkit's in-memory backends;
//! `PostgresBackend` (feature `postgres`) on a real server.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, AckMetadata, ClaimHandle, ClaimMode, Clock, DeliveryStatus, Envelope, EventId,
    InboxParking, InboxStore, ParkKind, StoreError,
};
use outbox_testkit::{ManualClock, MemoryDb, MemoryInboxStore, MemoryOutboxStore, MemoryTx};
use serde_json::Value;

/// One outbox row as the invariants see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowView {
    /// The event.
    pub event_id: EventId,
    /// Its aggregate.
    pub aggregate_id: String,
    /// Its version.
    pub version: i64,
    /// Delivery status.
    pub status: DeliveryStatus,
    /// The acknowledgement metadata stored on publish.
    pub ack: Option<AckMetadata>,
    /// Attempts spent (record-scoped failures counted by the store).
    pub attempts: u32,
    /// Why it is parked, while it is.
    pub park_kind: Option<ParkKind>,
}

/// One stored outbox row, as [`Backend::delivery_snapshot`] reads it: the row's view and every
/// column the store keeps for it, by name (values as text; a store without columns, the
/// in-memory one, names its row's fields).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredRow {
    /// The row as the invariants see it.
    pub view: RowView,
    /// Every stored column (or field) of the row, by name.
    pub raw: BTreeMap<String, String>,
}

/// One aggregate's delivery state as the store keeps it: its rows, and what the store keeps
/// for the aggregate itself (its last version, its lease) by column name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredAggregate {
    /// The aggregate's own state row, by column (empty for a store that keeps none, or none
    /// yet).
    pub state: BTreeMap<String, String>,
    /// Its rows, by event id.
    pub rows: BTreeMap<EventId, StoredRow>,
}

/// The delivery state of every aggregate, by aggregate id (the simulation appends one
/// aggregate type).
pub type DeliverySnapshot = BTreeMap<String, StoredAggregate>;

/// The effects recorded by [`Backend::record_effect`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EffectsView {
    /// How often each event's effect (by dedup id) committed.
    pub counts: BTreeMap<EventId, u64>,
    /// Effects that committed after a higher version of their aggregate.
    pub out_of_order: Vec<String>,
    /// The highest version applied per aggregate.
    pub last_applied: BTreeMap<String, i64>,
}

/// A lock held on the server by a session of the simulation's own ([`Backend::hold_head`]), so
/// that a claim stops mid-decision while another statement is started against it.
#[async_trait]
pub trait Hold: Send {
    /// How many sessions wait on the hold, directly or behind one that does (a session that
    /// waits for a lock the waiting claim holds counts).
    async fn waiting(&mut self) -> Result<usize, String>;
    /// Ends the hold (nothing was written): the waiters go on, the first in line first.
    async fn release(self: Box<Self>) -> Result<(), String>;
}

/// See [`Backend::short_claim_check`]: `(got, limit)` to a violation, if any.
pub type ShortClaimCheck = Arc<dyn Fn(usize, usize) -> Option<String> + Send + Sync>;

/// The outbox store, inbox and state a simulation runs against.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The outbox store under test.
    type Store: OutboxStore + Clone + 'static;
    /// A business transaction.
    type BizTx: Send + 'static;
    /// The inbox under test.
    type Inbox: InboxParking + Clone + 'static;

    /// The outbox store (one handle per relay and for the operator).
    fn store(&self) -> Self::Store;
    /// The inbox store.
    fn inbox(&self) -> Self::Inbox;
    /// The clock of the relays and the log (the store's own clock for a store that reads
    /// it; a store that reads the database's clock gets the system clock here).
    fn clock(&self) -> Arc<dyn Clock>;
    /// Lets virtual time pass ([`crate::Step::Advance`]). A backend on real time ignores it;
    /// one whose store reads the database's clock may move the stored times back instead.
    async fn advance(&self, by: Duration) -> Result<(), String>;
    /// How long the store holds a version gap before it parks it.
    fn gap_timeout(&self) -> Duration;
    /// Waits (in virtual or real time) until every lease granted so far has expired.
    async fn expire_leases(&self, lease: Duration);

    /// Begins a business transaction.
    async fn begin(&self) -> Result<Self::BizTx, String>;
    /// The aggregate's version and state in `tx` (`Ok(None)`: another open transaction holds
    /// the aggregate, the command is refused as a conflict).
    async fn aggregate(
        &self,
        tx: &mut Self::BizTx,
        aggregate: &str,
    ) -> Result<Option<(i64, Value)>, String>;
    /// Writes the aggregate's version and state in `tx`.
    async fn set_aggregate(
        &self,
        tx: &mut Self::BizTx,
        aggregate: &str,
        version: i64,
        state: Value,
    ) -> Result<(), String>;
    /// Appends `events` to the outbox in `tx` (the store's `append`).
    async fn append(&self, tx: &mut Self::BizTx, events: &[Envelope]) -> Result<(), StoreError>;
    /// Commits; `Ok(false)`: refused as a conflict (rolled back).
    async fn commit(&self, tx: Self::BizTx) -> Result<bool, String>;
    /// Rolls back.
    async fn rollback(&self, tx: Self::BizTx);

    /// Every committed outbox row.
    async fn rows(&self) -> Result<Vec<RowView>, String>;
    /// The whole delivery state, per aggregate: every column of every row and of the
    /// aggregates' own state (last version, lease). Read before and after each operator
    /// action, which must change nothing outside its target. `None`: the backend cannot read
    /// it (the check is skipped).
    async fn delivery_snapshot(&self) -> Result<Option<DeliverySnapshot>, String> {
        Ok(None)
    }
    /// A check run right after every claim that returned fewer events than `limit`: that
    /// no aggregate was left behind whose head was due, unclaimed and not blocked by a parked
    /// version (parking blocks its own aggregate only; nothing claimable starves). `None` for
    /// a store that does not promise it (one that claims from a bounded scan window).
    fn short_claim_check(&self) -> Option<ShortClaimCheck> {
        None
    }
    /// Locks what the next claim of `event`'s aggregate must write after its decision's
    /// snapshot is taken (while it holds the aggregate's lock), so that claim stops there until
    /// the hold is released ([`crate::Step::Overtake`]). `None`: the backend cannot hold a
    /// claim mid-transaction (the step then runs its operations one after another).
    async fn hold_head(&self, event: EventId) -> Result<Option<Box<dyn Hold>>, String> {
        let _ = event;
        Ok(None)
    }
    /// Whether an idle relay waits for a wake-up right now (the store's wake-up gate is
    /// armed: an append made meanwhile must wake it). `None`: the store has no gate.
    fn wake_gate_armed(&self) -> Option<bool> {
        None
    }
    /// Forgets the wake-ups the store's listener received so far.
    async fn clear_wake_ups(&self) {}
    /// Waits up to `within` for a wake-up of the store's listener (since the last
    /// [`Self::clear_wake_ups`]); whether one came. A store without a listener: `true`.
    async fn wake_up(&self, within: Duration) -> bool {
        let _ = within;
        true
    }
    /// The relay holding `claim` died: what its lost connection does to the claim (a locked
    /// claim's transaction rolls back; a lease stays until it expires).
    async fn abandon(&self, claim: &ClaimHandle);

    /// Records the simulation's own effect for `event` in the consumer's transaction: a
    /// counter per dedup id, and an order check per aggregate.
    async fn record_effect(
        &self,
        tx: &mut <Self::Inbox as InboxStore>::Tx,
        event: &Envelope,
    ) -> Result<(), StoreError>;
    /// The committed effects.
    async fn effects(&self) -> Result<EffectsView, String>;
    /// The dedup ids registered by `consumer`.
    async fn registered(&self, consumer: &str) -> Result<BTreeSet<EventId>, String>;
}

/// A snapshot from rows read apart: their views, their columns, and the aggregates' own state
/// rows (aggregate id, columns). Every row must have both.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) fn assemble_snapshot(
    views: Vec<RowView>,
    mut raws: BTreeMap<EventId, BTreeMap<String, String>>,
    states: Vec<(String, BTreeMap<String, String>)>,
) -> Result<DeliverySnapshot, String> {
    let mut snap = DeliverySnapshot::new();
    for view in views {
        let raw = raws
            .remove(&view.event_id)
            .ok_or_else(|| format!("row {} read without its columns", view.event_id))?;
        snap.entry(view.aggregate_id.clone())
            .or_default()
            .rows
            .insert(view.event_id, StoredRow { view, raw });
    }
    if let Some(id) = raws.keys().next() {
        return Err(format!("row {id} read without its view"));
    }
    for (aggregate, state) in states {
        snap.entry(aggregate).or_default().state = state;
    }
    Ok(snap)
}

/// A JSON object's members as text (a string's own text, anything else as JSON).
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) fn json_columns(v: Value) -> Result<BTreeMap<String, String>, String> {
    match v {
        Value::Object(map) => Ok(map
            .into_iter()
            .map(|(k, v)| {
                let text = match v {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                (k, text)
            })
            .collect()),
        other => Err(format!("a row read as {other}, not an object")),
    }
}

const EFFECTS: &str = "sim_effects";
const EFFECT_ORDER: &str = "sim_effect_order";
const EFFECT_DISORDER: &str = "sim_effect_disorder";
const AGGREGATES: &str = "sim_aggregates";

/// The in-memory backends of `outbox-testkit`.
#[derive(Clone, Debug)]
pub struct MemoryBackend {
    clock: ManualClock,
    db: MemoryDb,
    store: MemoryOutboxStore,
    inbox: MemoryInboxStore,
    gap_timeout: Duration,
}

impl MemoryBackend {
    /// A fresh database with the store in `mode` (the store's default gap timeout).
    pub fn new(mode: ClaimMode) -> Self {
        Self::with_gap_timeout(mode, outbox_testkit::DEFAULT_GAP_TIMEOUT)
    }

    /// A fresh database with the store in `mode`, holding a version gap for `gap_timeout`
    /// before it parks it.
    pub fn with_gap_timeout(mode: ClaimMode, gap_timeout: Duration) -> Self {
        let clock = ManualClock::default();
        let db = MemoryDb::new(clock.clone());
        let store = MemoryOutboxStore::new(&db, mode).gap_timeout(gap_timeout);
        let inbox = MemoryInboxStore::new(&db);
        Self {
            clock,
            db,
            store,
            inbox,
            gap_timeout,
        }
    }

    /// The same backend with its outbox store changed by `f` (the seeded bugs of the
    /// in-memory store).
    pub fn map_store(mut self, f: impl FnOnce(MemoryOutboxStore) -> MemoryOutboxStore) -> Self {
        self.store = f(self.store);
        self
    }

    /// The database (for inspection).
    pub fn db(&self) -> &MemoryDb {
        &self.db
    }

    /// The outbox store (for inspection).
    pub fn memory_store(&self) -> &MemoryOutboxStore {
        &self.store
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    type Store = MemoryOutboxStore;
    type BizTx = MemoryTx;
    type Inbox = MemoryInboxStore;

    fn store(&self) -> MemoryOutboxStore {
        self.store.clone()
    }
    fn inbox(&self) -> MemoryInboxStore {
        self.inbox.clone()
    }
    fn clock(&self) -> Arc<dyn Clock> {
        self.clock.shared()
    }
    async fn advance(&self, by: Duration) -> Result<(), String> {
        self.clock.advance(by);
        Ok(())
    }
    fn gap_timeout(&self) -> Duration {
        self.gap_timeout
    }
    async fn expire_leases(&self, lease: Duration) {
        self.clock.advance(lease + Duration::from_secs(60));
    }

    async fn begin(&self) -> Result<MemoryTx, String> {
        Ok(self.db.begin())
    }
    async fn aggregate(
        &self,
        tx: &mut MemoryTx,
        aggregate: &str,
    ) -> Result<Option<(i64, Value)>, String> {
        let row = tx.get(AGGREGATES, aggregate);
        let version = row
            .as_ref()
            .and_then(|r| r.get("v"))
            .and_then(Value::as_i64)
            .unwrap_or(0);
        let state = row.and_then(|r| r.get("s").cloned()).unwrap_or(Value::Null);
        Ok(Some((version, state)))
    }
    async fn set_aggregate(
        &self,
        tx: &mut MemoryTx,
        aggregate: &str,
        version: i64,
        state: Value,
    ) -> Result<(), String> {
        tx.put(
            AGGREGATES,
            aggregate,
            serde_json::json!({ "v": version, "s": state }),
        );
        Ok(())
    }
    async fn append(&self, tx: &mut MemoryTx, events: &[Envelope]) -> Result<(), StoreError> {
        self.store.append(tx, events).await
    }
    async fn commit(&self, tx: MemoryTx) -> Result<bool, String> {
        match tx.commit() {
            Ok(()) => Ok(true),
            Err(e) if e.kind == outbox_core::StoreErrorKind::Conflict => Ok(false),
            Err(e) => Err(format!("business commit failed with {e}")),
        }
    }
    async fn rollback(&self, tx: MemoryTx) {
        tx.rollback();
    }

    async fn rows(&self) -> Result<Vec<RowView>, String> {
        Ok(self
            .store
            .snapshot()
            .into_iter()
            .map(|r| RowView {
                event_id: r.envelope.event_id,
                aggregate_id: r.envelope.aggregate_id.clone(),
                version: r.envelope.aggregate_version,
                status: r.status,
                ack: r.ack,
                attempts: r.attempts,
                park_kind: r.park_reason.map(|p| p.kind),
            })
            .collect())
    }
    async fn delivery_snapshot(&self) -> Result<Option<DeliverySnapshot>, String> {
        let mut snap = DeliverySnapshot::new();
        for r in self.store.snapshot() {
            let mut raw = BTreeMap::new();
            let mut put = |k: &str, v: String| {
                raw.insert(k.to_owned(), v);
            };
            put("status", format!("{:?}", r.status));
            put("attempts", r.attempts.to_string());
            put("next_attempt_at", r.next_attempt_at.to_rfc3339());
            put("last_error", format!("{:?}", r.last_error));
            put("claim", format!("{:?}", r.claim));
            if let Some(c) = &r.claim {
                put("claim_owner", c.owner.clone());
            }
            put("published_at", format!("{:?}", r.published_at));
            put("ack", format!("{:?}", r.ack));
            put("park_reason", format!("{:?}", r.park_reason));
            put("parked_at", format!("{:?}", r.parked_at));
            put("envelope", format!("{:?}", r.envelope));
            let view = RowView {
                event_id: r.envelope.event_id,
                aggregate_id: r.envelope.aggregate_id.clone(),
                version: r.envelope.aggregate_version,
                status: r.status,
                ack: r.ack,
                attempts: r.attempts,
                park_kind: r.park_reason.map(|p| p.kind),
            };
            snap.entry(view.aggregate_id.clone())
                .or_default()
                .rows
                .insert(view.event_id, StoredRow { view, raw });
        }
        Ok(Some(snap))
    }
    async fn abandon(&self, claim: &ClaimHandle) {
        self.store.abandon(claim);
    }
    fn short_claim_check(&self) -> Option<ShortClaimCheck> {
        let store = self.store.clone();
        let clock = self.clock.clone();
        Some(Arc::new(move |got, limit| {
            starved_head(&store, clock.now(), got, limit)
        }))
    }

    async fn record_effect(&self, tx: &mut MemoryTx, event: &Envelope) -> Result<(), StoreError> {
        let key = event.dedup_id().to_string();
        let n = tx.get(EFFECTS, &key).and_then(|v| v.as_u64()).unwrap_or(0);
        tx.put(EFFECTS, &key, (n + 1).into());
        let last = tx
            .get(EFFECT_ORDER, &event.aggregate_id)
            .and_then(|v| v.as_i64())
            .unwrap_or(0);
        if event.aggregate_version <= last {
            tx.put(
                EFFECT_DISORDER,
                &key,
                format!(
                    "{} v{} applied after v{last}",
                    event.aggregate_id, event.aggregate_version
                )
                .into(),
            );
        }
        tx.put(
            EFFECT_ORDER,
            &event.aggregate_id,
            event.aggregate_version.max(last).into(),
        );
        Ok(())
    }
    async fn effects(&self) -> Result<EffectsView, String> {
        let mut view = EffectsView::default();
        for (key, v) in self.db.scan(EFFECTS) {
            let id: EventId = key
                .parse()
                .map_err(|e| format!("effect key {key}: {e:?}"))?;
            view.counts.insert(id, v.as_u64().unwrap_or(0));
        }
        for (agg, v) in self.db.scan(EFFECT_ORDER) {
            view.last_applied.insert(agg, v.as_i64().unwrap_or(0));
        }
        for (_, v) in self.db.scan(EFFECT_DISORDER) {
            view.out_of_order
                .push(v.as_str().unwrap_or_default().to_owned());
        }
        Ok(view)
    }
    async fn registered(&self, consumer: &str) -> Result<BTreeSet<EventId>, String> {
        Ok(self.inbox.registrations(consumer).into_iter().collect())
    }
}

fn starved_head(
    store: &MemoryOutboxStore,
    now: chrono::DateTime<chrono::Utc>,
    got: usize,
    limit: usize,
) -> Option<String> {
    if got >= limit {
        return None;
    }
    let snap = store.snapshot();
    let mut open: BTreeMap<&str, Vec<&outbox_testkit::OutboxRow>> = BTreeMap::new();
    for row in &snap {
        if matches!(row.status, DeliveryStatus::Pending | DeliveryStatus::Parked) {
            open.entry(&row.envelope.aggregate_id)
                .or_default()
                .push(row);
        }
    }
    // The last version done per aggregate, as far as the rows still show it (cleanup may
    // have removed some: then a head looks like a gap and is not judged, never the reverse).
    let mut last: BTreeMap<&str, i64> = BTreeMap::new();
    for row in &snap {
        if matches!(
            row.status,
            DeliveryStatus::Published | DeliveryStatus::Discarded
        ) {
            let l = last.entry(&row.envelope.aggregate_id).or_insert(0);
            *l = (*l).max(row.envelope.aggregate_version);
        }
    }
    for (agg, rows) in open {
        let blocked = rows.iter().any(|r| {
            r.status == DeliveryStatus::Parked || r.claim.as_ref().is_some_and(|c| c.live)
        });
        let done = last.get(agg).copied().unwrap_or(0);
        // An open row at or below the last version done (a re-issued copy of a discarded
        // version, which the store publishes before the next; a stale duplicate it parks) is
        // the store's head, whatever its delay: the aggregate is not judged (never the reverse).
        if rows.iter().any(|r| r.envelope.aggregate_version <= done) {
            continue;
        }
        let Some(head) = rows
            .iter()
            .filter(|r| r.envelope.aggregate_version > done)
            .min_by_key(|r| (r.envelope.aggregate_version, r.seq))
        else {
            continue;
        };
        // A head that skips a version is held (the gap rule), not claimable.
        if head.envelope.aggregate_version > done + 1 {
            continue;
        }
        if !blocked && head.next_attempt_at <= now {
            return Some(format!(
                "a claim returned {got} of {limit} events but {agg} v{} was due",
                head.envelope.aggregate_version
            ));
        }
    }
    None
}
