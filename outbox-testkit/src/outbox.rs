//! [`MemoryOutboxStore`]: the in-memory [`OutboxStore`].
//!
//! Rows get a sequence number when they are appended, not when they commit, so (as in
//! PostgreSQL) rows can become visible out of sequence order; claiming never depends on a
//! high-water mark, so such rows are still claimed.
//!
//! # Version order
//!
//! As every store must ([`OutboxStore`]'s contract): per aggregate the store keeps the highest
//! version published or discarded (`last`, kept when rows are cleaned up), hands out a head only
//! at `last + 1`, holds a head that skips a version (parking it as a version gap after
//! [`MemoryOutboxStore::gap_timeout`]) and parks pending rows at or below `last` as out of
//! order.
//!
//! # Runs
//!
//! A claim asking for runs ([`ClaimRequest::run`]) gets, after each head, its aggregate's next
//! versions while they are consecutive, each the only unfinished row of its version, pending,
//! due and unclaimed (a gap, a duplicate version, a parked or a not-due row ends the run).
//! Heads come first: runs only fill what the heads leave of the limit, oldest head first. A
//! completion applies an outcome for an event of a run only when its predecessor is `last`
//! (published before or earlier in the same completion; outcomes are taken in version order
//! per aggregate), and refuses it otherwise (counted as superseded); rows without an outcome
//! are released unchanged and claimable at once. [`MemoryOutboxStore::runs`] turns runs off
//! (a store without them).
//!
//! # Claim modes
//!
//! * [`ClaimMode::Lease`]: a claim records owner, a unique token and an expiry on the injected
//!   clock. An expired lease returns the row to the pool. [`RelayStore::complete`] applies an
//!   outcome only while the row still carries the claim's token (a lease that expired but was not
//!   taken over by another claim still owns its rows: applying its ack avoids a needless
//!   duplicate); outcomes for rows taken over are counted as `superseded`.
//! * [`ClaimMode::LockedTransaction`]: rows stay locked until the claim is completed or released,
//!   or until [`MemoryOutboxStore::abandon`] models the relay's connection dropping (the locks go
//!   with the transaction).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::prelude::*;
use outbox_core::{
    async_trait, AckMetadata, AuditEntry, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch,
    ClaimedRecord, CleanupReport, CompletionReport, DeliveryStatus, Envelope, EnvelopeLimits,
    ErrorClass, EventId, IntervalCount, LastError, LatencySummary, OperatorAction, OutboxStats,
    Outcome, ParkKind, ParkReason, ParkedAtClaim, ParkedEvent, PublishedFilter, PublishedId,
    PublishedPosition, PublishedRow, RelayEntry, RelayRegistration, StoreError, StoreErrorKind,
};
use uuid::Uuid;

use crate::db::{MemoryDb, MemoryTx};

type AggKey = (String, String);

#[derive(Debug, Clone)]
pub(crate) struct StagedRow {
    pub(crate) seq: u64,
    pub(crate) envelope: Envelope,
}

#[derive(Debug, Clone)]
struct RowClaim {
    token: Uuid,
    owner: String,
    expires_at: Option<DateTime<Utc>>,
    /// 0 for a head, `k` for the `k`-th event of its run after the head.
    run_position: u32,
}

impl RowClaim {
    fn live(&self, now: DateTime<Utc>) -> bool {
        self.expires_at.is_none_or(|t| t > now)
    }
}

#[derive(Debug, Clone)]
struct Row {
    seq: u64,
    envelope: Envelope,
    status: DeliveryStatus,
    attempts: u32,
    next_attempt_at: DateTime<Utc>,
    last_error: Option<LastError>,
    claim: Option<RowClaim>,
    appended_at: DateTime<Utc>,
    published_at: Option<DateTime<Utc>>,
    ack: Option<AckMetadata>,
    park_reason: Option<ParkReason>,
    parked_at: Option<DateTime<Utc>>,
    finished_at: Option<DateTime<Utc>>,
    /// An attempt failed in a way that leaves open that the broker stored it.
    maybe_delivered: bool,
    /// When a claim first held this row as a version gap.
    held_since: Option<DateTime<Utc>>,
    /// Place in publication order (0 until published): the reporting view's tie-breaker,
    /// since completions in one instant of the manual clock share their time.
    published_order: u64,
}

#[derive(Debug)]
struct ClaimState {
    seqs: Vec<u64>,
}

/// Outbox tables of a [`MemoryDb`].
#[derive(Debug, Default)]
pub(crate) struct OutboxState {
    rows: BTreeMap<u64, Row>,
    by_id: HashMap<EventId, u64>,
    /// Rows neither published nor discarded, per aggregate, ordered by (version, seq).
    open: BTreeMap<AggKey, BTreeSet<(i64, u64)>>,
    /// Per aggregate: the highest version published or discarded. Survives cleanup.
    last: HashMap<AggKey, i64>,
    /// Aggregates without state accept their lowest unfinished version as the first.
    accept_first_version: bool,
    claims: HashMap<Uuid, ClaimState>,
    audit: Vec<AuditEntry>,
    token_counter: u64,
    superseded_total: u64,
    /// Runs the seeded bug `run_skips_gaps` handed out past a missing version (the witness
    /// that a run's traffic met the bug).
    run_gap_skips: u64,
    /// Publications so far.
    publications: u64,
    /// The relay registry, by owner: (registration, started at, heartbeat at, held).
    relays: BTreeMap<String, (RelayRegistration, DateTime<Utc>, DateTime<Utc>, u64)>,
}

fn agg_key(e: &Envelope) -> AggKey {
    (e.aggregate_type.clone(), e.aggregate_id.clone())
}

impl OutboxState {
    pub(crate) fn contains_event(&self, id: EventId) -> bool {
        self.by_id.contains_key(&id)
    }

    pub(crate) fn insert_committed(&mut self, staged: StagedRow, now: DateTime<Utc>) {
        let key = agg_key(&staged.envelope);
        self.by_id.insert(staged.envelope.event_id, staged.seq);
        self.open
            .entry(key)
            .or_default()
            .insert((staged.envelope.aggregate_version, staged.seq));
        self.rows.insert(
            staged.seq,
            Row {
                seq: staged.seq,
                envelope: staged.envelope,
                status: DeliveryStatus::Pending,
                attempts: 0,
                next_attempt_at: now,
                last_error: None,
                claim: None,
                appended_at: now,
                published_at: None,
                ack: None,
                park_reason: None,
                parked_at: None,
                finished_at: None,
                maybe_delivered: false,
                held_since: None,
                published_order: 0,
            },
        );
    }

    /// The version the aggregate's next must follow: the last published or discarded; for an
    /// aggregate without one, 0, or with `accept_first_version` one below its first version:
    /// its lowest unfinished version that may have been sent (a failure that left delivery
    /// uncertain, or a claim that ended without an outcome or a release), or else its lowest
    /// unfinished version.
    fn last_version(&self, key: &AggKey) -> i64 {
        match self.last.get(key) {
            Some(last) => *last,
            None if self.accept_first_version => {
                let open = self.open.get(key);
                let maybe_sent = open.and_then(|set| {
                    set.iter().find(|(_, seq)| {
                        let row = &self.rows[seq];
                        row.maybe_delivered || row.claim.is_some()
                    })
                });
                maybe_sent
                    .or_else(|| open.and_then(|set| set.first()))
                    .map_or(0, |(v, _)| v - 1)
            }
            None => 0,
        }
    }

    /// For operator actions: unfinished rows of the aggregate between `last` and `version`
    /// (lower versions that arrived after the event was parked) must go out first.
    fn refuse_if_versions_wait(&self, id: EventId) -> Result<(), StoreError> {
        let seq = self.by_id[&id];
        let row = &self.rows[&seq];
        let (key, version) = (agg_key(&row.envelope), row.envelope.aggregate_version);
        let last = self.last_version(&key);
        let waiting = self.open.get(&key).map_or(0, |set| {
            set.iter()
                .filter(|(v, s)| *s != seq && *v > last && *v < version)
                .count()
        });
        if waiting > 0 {
            return Err(StoreError::new(
                StoreErrorKind::Conflict,
                format!(
                    "event {id} has version {version}, and {waiting} event(s) of its aggregate \
                     between version {last} and it are waiting to go out first; act on this \
                     event after they are delivered (or act on them first)"
                ),
            )
            .with_class(ErrorClass::Permanent));
        }
        Ok(())
    }

    /// The rest of the run after the head `head`: at most `max` rows of its aggregate at the
    /// next versions, consecutive, each the only unfinished row of its version, pending and
    /// due (and under no live claim). Ends at the first row that is not. Also returns whether
    /// the run went past a missing version (only with `skip_gaps`, the seeded bug).
    fn run_after(
        &self,
        head: u64,
        max: usize,
        now: DateTime<Utc>,
        skip_gaps: bool,
    ) -> (Vec<u64>, bool) {
        let row = &self.rows[&head];
        let Some(set) = self.open.get(&agg_key(&row.envelope)) else {
            return (Vec::new(), false);
        };
        let from = (row.envelope.aggregate_version, head);
        let mut after = set
            .range((std::ops::Bound::Excluded(from), std::ops::Bound::Unbounded))
            .peekable();
        let (mut expected, mut run, mut skipped) = (from.0 + 1, Vec::new(), false);
        while run.len() < max {
            let Some(&(version, seq)) = after.next() else {
                break;
            };
            let duplicate = after.peek().is_some_and(|(v, _)| *v == version);
            let r = &self.rows[&seq];
            if (version != expected && !(skip_gaps && version > expected))
                || duplicate
                || r.status != DeliveryStatus::Pending
                || r.next_attempt_at > now
                || r.claim.as_ref().is_some_and(|c| c.live(now))
            {
                break;
            }
            skipped |= version != expected;
            run.push(seq);
            expected = version + 1;
        }
        (run, skipped)
    }

    fn advance_last(&mut self, key: AggKey, version: i64) {
        let last = self.last.entry(key).or_insert(0);
        *last = (*last).max(version);
    }

    fn park(&mut self, seq: u64, kind: ParkKind, message: String, now: DateTime<Utc>) {
        let row = self.rows.get_mut(&seq).expect("open rows exist");
        let error = LastError {
            class: ErrorClass::Permanent,
            kind: kind.as_str().to_owned(),
            message,
        };
        row.status = DeliveryStatus::Parked;
        row.last_error = Some(error.clone());
        row.park_reason = Some(ParkReason { kind, error });
        row.parked_at = Some(now);
        row.claim = None;
    }

    fn close(&mut self, seq: u64) {
        if let Some(row) = self.rows.get(&seq) {
            let key = agg_key(&row.envelope);
            let version = row.envelope.aggregate_version;
            if let Some(set) = self.open.get_mut(&key) {
                set.remove(&(version, seq));
                if set.is_empty() {
                    self.open.remove(&key);
                }
            }
        }
    }

    fn end_claim(&mut self, token: Uuid) {
        if let Some(claim) = self.claims.remove(&token) {
            for seq in claim.seqs {
                if let Some(row) = self.rows.get_mut(&seq) {
                    if row.claim.as_ref().is_some_and(|c| c.token == token) {
                        row.claim = None;
                    }
                }
            }
        }
    }

    /// For retry and re-issue: the parked row's version must be above `last`; the operator's
    /// action accepts it as the aggregate's next version.
    fn accept_version(&mut self, id: EventId) -> Result<(), StoreError> {
        self.parked_row(id)?;
        self.refuse_if_versions_wait(id)?;
        let row = self.parked_row(id)?;
        let (key, version) = (agg_key(&row.envelope), row.envelope.aggregate_version);
        let last = self.last_version(&key);
        if version <= last {
            return Err(out_of_order_refusal(id, version, last));
        }
        self.advance_last(key, version - 1);
        Ok(())
    }

    fn parked_row(&mut self, id: EventId) -> Result<&mut Row, StoreError> {
        self.by_id
            .get(&id)
            .and_then(|seq| self.rows.get_mut(seq))
            .filter(|r| r.status == DeliveryStatus::Parked)
            .ok_or_else(|| {
                StoreError::new(StoreErrorKind::NotFound, format!("no parked event {id}"))
            })
    }
}

/// A claim on a row, as shown by [`MemoryOutboxStore::snapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RowClaimInfo {
    /// The claim's token.
    pub token: Uuid,
    /// The claiming relay.
    pub owner: String,
    /// Lease expiry (`None` for a locked transaction).
    pub expires_at: Option<DateTime<Utc>>,
    /// Whether the claim still excludes other relays now.
    pub live: bool,
}

/// One committed outbox row with its delivery state, for inspection by tests and simulations.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct OutboxRow {
    /// Sequence number assigned at append time.
    pub seq: u64,
    /// The event.
    pub envelope: Envelope,
    /// Delivery status.
    pub status: DeliveryStatus,
    /// Failed attempts.
    pub attempts: u32,
    /// Not claimable before this time.
    pub next_attempt_at: DateTime<Utc>,
    /// Last failure.
    pub last_error: Option<LastError>,
    /// Current claim, if any (possibly an expired lease).
    pub claim: Option<RowClaimInfo>,
    /// Commit time on the store's clock.
    pub appended_at: DateTime<Utc>,
    /// When it was marked published.
    pub published_at: Option<DateTime<Utc>>,
    /// The broker's ack metadata.
    pub ack: Option<AckMetadata>,
    /// Why it was parked (kept while parked).
    pub park_reason: Option<ParkReason>,
    /// When it was parked.
    pub parked_at: Option<DateTime<Utc>>,
}

impl OutboxRow {
    fn from_row(r: &Row, now: DateTime<Utc>) -> Self {
        Self {
            seq: r.seq,
            envelope: r.envelope.clone(),
            status: r.status,
            attempts: r.attempts,
            next_attempt_at: r.next_attempt_at,
            last_error: r.last_error.clone(),
            claim: r.claim.as_ref().map(|c| RowClaimInfo {
                token: c.token,
                owner: c.owner.clone(),
                expires_at: c.expires_at,
                live: c.live(now),
            }),
            appended_at: r.appended_at,
            published_at: r.published_at,
            ack: r.ack.clone(),
            park_reason: r.park_reason.clone(),
            parked_at: r.parked_at,
        }
    }
}

/// The in-memory [`OutboxStore`] over a [`MemoryDb`]. Appends join a [`MemoryTx`].
///
/// Several stores over the same database behave like several relays' connections to one
/// PostgreSQL database: they share rows, claims and the audit trail. Cloning is cheap.
#[derive(Clone)]
pub struct MemoryOutboxStore {
    db: MemoryDb,
    mode: ClaimMode,
    limits: EnvelopeLimits,
    gap_timeout: Duration,
    accept_first_version: bool,
    /// Ignores [`ClaimRequest::run`] (heads only), as a store without runs does.
    heads_only_runs: bool,
    /// Seeded bug (the simulation's): applies outcomes of a run's events whatever came
    /// before them, breaking the prefix rule.
    accept_run_holes: bool,
    /// Seeded bug (the simulation's): runs go on past a missing version.
    run_skips_gaps: bool,
}

/// Default of [`MemoryOutboxStore::gap_timeout`], the same as the PostgreSQL store's.
pub const DEFAULT_GAP_TIMEOUT: Duration = Duration::from_secs(300);

impl fmt::Debug for MemoryOutboxStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryOutboxStore")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl MemoryOutboxStore {
    /// A store over `db` handing out work in `mode`.
    pub fn new(db: &MemoryDb, mode: ClaimMode) -> Self {
        Self {
            db: db.clone(),
            mode,
            limits: EnvelopeLimits::default(),
            gap_timeout: DEFAULT_GAP_TIMEOUT,
            accept_first_version: false,
            heads_only_runs: false,
            accept_run_holes: false,
            run_skips_gaps: false,
        }
    }

    /// Whether claims hand out runs ([`ClaimRequest::run`]; default `true`). `false` models
    /// a store without runs, which hands out heads only (conformant).
    pub fn runs(mut self, on: bool) -> Self {
        self.heads_only_runs = !on;
        self
    }

    /// A deliberate bug for the simulation's seeded-bug checks: completions apply outcomes of
    /// a run's events out of prefix order (a `Published` after an unpublished version).
    /// Never for anything else.
    #[doc(hidden)]
    pub fn seeded_bug_accept_run_holes(mut self, on: bool) -> Self {
        self.accept_run_holes = on;
        self
    }

    /// A deliberate bug for the simulation's seeded-bug checks: a run goes on past a missing
    /// version. Never for anything else.
    #[doc(hidden)]
    pub fn seeded_bug_run_skips_gaps(mut self, on: bool) -> Self {
        self.run_skips_gaps = on;
        self
    }

    /// How many runs the seeded bug [`Self::seeded_bug_run_skips_gaps`] has handed out past a
    /// missing version on this store's database: the witness that a test's traffic met the
    /// bug (a checker that passes such a run is blind to it).
    #[doc(hidden)]
    pub fn seeded_bug_runs_past_gaps(&self) -> u64 {
        self.db.lock().outbox.run_gap_skips
    }

    /// Accept the lowest unfinished version of an aggregate without state as its first
    /// (default `false`: the first must be version 1), as the PostgreSQL store's option of the
    /// same name.
    pub fn accept_first_version(mut self, on: bool) -> Self {
        self.accept_first_version = on;
        self
    }

    /// The database's state, with this store's version rule in effect.
    fn lock(&self) -> std::sync::MutexGuard<'_, crate::db::DbState> {
        let mut st = self.db.lock();
        st.outbox.accept_first_version = self.accept_first_version;
        st
    }

    /// How long a head that skips a version is held before it is parked as a version gap
    /// (default [`DEFAULT_GAP_TIMEOUT`]), measured on the database clock from the first claim
    /// that held it.
    pub fn gap_timeout(mut self, timeout: Duration) -> Self {
        self.gap_timeout = timeout;
        self
    }

    /// A store with a 30 s lease.
    pub fn with_lease(db: &MemoryDb) -> Self {
        Self::new(
            db,
            ClaimMode::Lease {
                duration: Duration::from_secs(30),
            },
        )
    }

    /// Overrides the validation limits applied on append. Appends fail with a `Configuration`
    /// error while `max_aggregate_name_bytes` is above [`outbox_core::MAX_AGGREGATE_NAME_BYTES`]
    /// (as the PostgreSQL store's `build()` refuses such limits).
    pub fn limits(mut self, limits: EnvelopeLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The database.
    pub fn db(&self) -> &MemoryDb {
        &self.db
    }

    fn lease_duration(&self) -> Option<Duration> {
        match self.mode {
            ClaimMode::Lease { duration } => Some(duration),
            _ => None,
        }
    }

    /// Models the relay holding `claim` crashing. In `LockedTransaction` mode its connection
    /// drops, its transaction rolls back and the rows are free at once. In `Lease` mode nothing
    /// happens: the lease stays until it expires on the clock.
    pub fn abandon(&self, claim: &ClaimHandle) {
        if self.lease_duration().is_none() {
            self.db.lock().outbox.end_claim(claim.token);
        }
    }

    /// Every committed row, in sequence order.
    pub fn snapshot(&self) -> Vec<OutboxRow> {
        let now = self.db.now();
        self.db
            .lock()
            .outbox
            .rows
            .values()
            .map(|r| OutboxRow::from_row(r, now))
            .collect()
    }

    /// The committed row of `event_id`.
    pub fn row(&self, event_id: EventId) -> Option<OutboxRow> {
        let now = self.db.now();
        let st = self.db.lock();
        let seq = st.outbox.by_id.get(&event_id)?;
        st.outbox.rows.get(seq).map(|r| OutboxRow::from_row(r, now))
    }

    /// Outcomes refused by fencing since the database was created.
    pub fn superseded_total(&self) -> u64 {
        self.db.lock().outbox.superseded_total
    }

    /// Number of claims not yet completed, released or abandoned (including expired leases).
    pub fn open_claims(&self) -> usize {
        self.db.lock().outbox.claims.len()
    }
}

#[async_trait]
impl AppendStore for MemoryOutboxStore {
    type Tx = MemoryTx;

    async fn append(&self, tx: &mut MemoryTx, events: &[Envelope]) -> Result<(), StoreError> {
        if !std::sync::Arc::ptr_eq(&tx.db().shared, &self.db.shared) {
            return Err(StoreError::new(
                StoreErrorKind::Configuration,
                "the transaction belongs to another MemoryDb",
            ));
        }
        // As the PostgreSQL store refuses to be built with them: no store can key longer
        // aggregate names.
        self.limits
            .check_storable()
            .map_err(|e| StoreError::new(StoreErrorKind::Configuration, e.0))?;
        for e in events {
            e.validate(&self.limits)?;
        }
        {
            let st = self.lock();
            let mut seen = std::collections::HashSet::new();
            for e in events {
                let id = e.event_id;
                if st.outbox.contains_event(id)
                    || tx.outbox.iter().any(|r| r.envelope.event_id == id)
                    || !seen.insert(id)
                {
                    return Err(StoreError::new(
                        StoreErrorKind::Constraint,
                        format!("duplicate event id {id}"),
                    ));
                }
            }
        }
        for e in events {
            let seq = self.db.next_seq();
            tx.outbox.push(StagedRow {
                seq,
                envelope: e.clone(),
            });
        }
        Ok(())
    }
}

#[async_trait]
impl RelayStore for MemoryOutboxStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        let now = self.db.now();
        let lease = self.lease_duration();
        let mut st = self.lock();
        let out = &mut st.outbox;
        out.token_counter += 1;
        let token = Uuid::from_u64_pair(0x7e57_0000_0000_0000, out.token_counter);
        let handle = ClaimHandle {
            token,
            owner: request.owner.clone(),
        };
        if request.limit == 0 {
            return Ok(ClaimedBatch::new(handle, Vec::new(), lease));
        }
        let gap_timeout =
            chrono::Duration::from_std(self.gap_timeout).unwrap_or(chrono::Duration::MAX);
        let mut heads: Vec<u64> = Vec::new();
        let mut parked = Vec::new();
        let mut gaps_held = 0usize;
        let keys: Vec<AggKey> = out.open.keys().cloned().collect();
        for key in keys {
            let last = out.last_version(&key);
            let set = &out.open[&key];
            // Pending rows at or below `last` would go out after a later version: parked.
            let stale: Vec<u64> = set
                .iter()
                .take_while(|(v, _)| *v <= last)
                .map(|&(_, seq)| seq)
                .filter(|seq| {
                    let r = &out.rows[seq];
                    r.status == DeliveryStatus::Pending
                        && !r.claim.as_ref().is_some_and(|c| c.live(now))
                })
                .collect();
            for seq in stale {
                let e = &out.rows[&seq].envelope;
                parked.push(ParkedAtClaim::new(
                    e.event_id,
                    e.aggregate_type.clone(),
                    e.aggregate_id.clone(),
                    e.aggregate_version,
                    ParkKind::OutOfOrder,
                ));
                let msg = format!(
                    "version {} is at or below {last}, the last version published or discarded \
                     for its aggregate",
                    e.aggregate_version
                );
                out.park(seq, ParkKind::OutOfOrder, msg, now);
            }
            let set = &out.open[&key];
            let busy = set
                .iter()
                .any(|(_, seq)| out.rows[seq].claim.as_ref().is_some_and(|c| c.live(now)));
            let Some(&(version, head_seq)) = set.iter().find(|(v, _)| *v > last) else {
                continue;
            };
            let head = &out.rows[&head_seq];
            if busy || head.status != DeliveryStatus::Pending {
                continue;
            }
            if version > last + 1 {
                let held_since = head.held_since.unwrap_or(now);
                if held_since + gap_timeout <= now {
                    let e = &head.envelope;
                    parked.push(ParkedAtClaim::new(
                        e.event_id,
                        e.aggregate_type.clone(),
                        e.aggregate_id.clone(),
                        version,
                        ParkKind::VersionGap,
                    ));
                    let msg = format!(
                        "version {version} follows {last}: the versions between never arrived \
                         within {:?}",
                        self.gap_timeout
                    );
                    out.park(head_seq, ParkKind::VersionGap, msg, now);
                } else {
                    out.rows
                        .get_mut(&head_seq)
                        .expect("open rows exist")
                        .held_since = Some(held_since);
                    gaps_held += 1;
                }
                continue;
            }
            if head.next_attempt_at > now {
                continue;
            }
            heads.push(head_seq);
        }
        heads.sort_unstable();
        heads.truncate(request.limit);
        // Runs fill what the heads leave of the limit, oldest head first: other aggregates'
        // heads are never crowded out by a hot aggregate's run.
        let mut room = request.limit - heads.len();
        let mut claimed: Vec<(u64, u32)> = Vec::with_capacity(heads.len());
        for &head in &heads {
            claimed.push((head, 0));
            if self.heads_only_runs || room == 0 || request.run_len() < 2 {
                continue;
            }
            let max = (request.run_len() - 1).min(room);
            let (run, skipped) = out.run_after(head, max, now, self.run_skips_gaps);
            out.run_gap_skips += u64::from(skipped);
            room -= run.len();
            claimed.extend(run.into_iter().zip(1..));
        }
        let expires_at = lease.map(|d| now + chrono::Duration::from_std(d).unwrap_or_default());
        let mut records = Vec::with_capacity(claimed.len());
        for &(seq, run_position) in &claimed {
            let row = out.rows.get_mut(&seq).expect("open rows exist");
            // A claim still on a claimable row is an expired lease whose relay neither
            // completed nor released it: it may have sent the event.
            if row.claim.is_some() {
                row.maybe_delivered = true;
            }
            row.claim = Some(RowClaim {
                token,
                owner: request.owner.clone(),
                expires_at,
                run_position,
            });
            records.push(
                ClaimedRecord::new(row.envelope.clone(), row.attempts)
                    .with_maybe_sent_before(row.maybe_delivered)
                    .with_run_position(run_position),
            );
        }
        if !claimed.is_empty() {
            let seqs = claimed.into_iter().map(|(seq, _)| seq).collect();
            out.claims.insert(token, ClaimState { seqs });
        }
        Ok(ClaimedBatch::new(handle, records, lease).with_version_notices(parked, gaps_held))
    }

    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        let now = self.db.now();
        let mut st = self.lock();
        let out = &mut st.outbox;
        let (mut applied, mut superseded) = (0usize, Vec::new());
        // Per aggregate in version order, so a run's prefix rule does not depend on the order
        // of the outcomes (the sort is stable: unknown events keep their place at the front).
        let mut order: Vec<&Outcome> = outcomes.iter().collect();
        order.sort_by_cached_key(|o| {
            out.by_id
                .get(&o.event_id())
                .and_then(|s| out.rows.get(s))
                .map(|r| (agg_key(&r.envelope), r.envelope.aggregate_version))
        });
        for o in order {
            let seq = out.by_id.get(&o.event_id()).copied();
            let owned = seq.and_then(|s| out.rows.get(&s)).is_some_and(|r| {
                r.status == DeliveryStatus::Pending
                    && r.claim.as_ref().is_some_and(|c| c.token == claim.token)
            });
            let (true, Some(seq)) = (owned, seq) else {
                superseded.push(o.event_id());
                continue;
            };
            // The prefix rule: an event of a run gets an outcome only right after `last`,
            // so only when every version before it in the run was published (by this
            // completion or before); after the run's first non-published outcome, none.
            let row = &out.rows[&seq];
            let in_run = row.claim.as_ref().is_some_and(|c| c.run_position > 0);
            if in_run
                && !self.accept_run_holes
                && out.last.get(&agg_key(&row.envelope)).copied()
                    != Some(row.envelope.aggregate_version - 1)
            {
                superseded.push(o.event_id());
                continue;
            }
            let row = out.rows.get_mut(&seq).expect("checked above");
            let mut closes = false;
            match o {
                Outcome::Published { ack, .. } => {
                    row.status = DeliveryStatus::Published;
                    row.published_at = Some(now);
                    row.finished_at = Some(now);
                    row.ack = Some(ack.clone());
                    out.publications += 1;
                    row.published_order = out.publications;
                    closes = true;
                }
                Outcome::Retry { delay, error, .. } | Outcome::Defer { delay, error, .. } => {
                    if matches!(o, Outcome::Retry { .. }) {
                        row.attempts = row.attempts.saturating_add(1);
                    }
                    // A delay beyond a year is a policy bug; capped so time cannot overflow.
                    let delay = (*delay).min(Duration::from_secs(365 * 24 * 3600));
                    row.next_attempt_at =
                        now + chrono::Duration::from_std(delay).expect("capped delay");
                    row.maybe_delivered |= error.delivery_uncertain();
                    row.last_error = Some(error.clone());
                }
                Outcome::Park { reason, .. } => {
                    row.attempts = row.attempts.saturating_add(1);
                    row.maybe_delivered |= reason.error.delivery_uncertain();
                    row.status = DeliveryStatus::Parked;
                    row.last_error = Some(reason.error.clone());
                    row.park_reason = Some(reason.clone());
                    row.parked_at = Some(now);
                }
            }
            row.claim = None;
            if closes {
                let (key, version) = (agg_key(&row.envelope), row.envelope.aggregate_version);
                out.close(seq);
                out.advance_last(key, version);
            }
            applied += 1;
        }
        out.end_claim(claim.token);
        out.superseded_total += superseded.len() as u64;
        Ok(CompletionReport::new(applied, superseded))
    }

    async fn release(&self, claim: &ClaimHandle) -> Result<(), StoreError> {
        self.lock().outbox.end_claim(claim.token);
        Ok(())
    }

    fn claim_mode(&self) -> ClaimMode {
        self.mode
    }
}

#[async_trait]
impl OperatorStore for MemoryOutboxStore {
    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedEvent>, StoreError> {
        let st = self.lock();
        let mut parked: Vec<&Row> = st
            .outbox
            .rows
            .values()
            .filter(|r| r.status == DeliveryStatus::Parked)
            .collect();
        parked.sort_by_key(|r| (r.parked_at, r.seq));
        Ok(parked.into_iter().take(limit).map(parked_event).collect())
    }

    async fn parked_event(&self, event_id: EventId) -> Result<ParkedEvent, StoreError> {
        let mut st = self.lock();
        Ok(parked_event(st.outbox.parked_row(event_id)?))
    }

    async fn retry_parked(&self, event_id: EventId, actor: &str) -> Result<(), StoreError> {
        self.retry_parked_with_reason(event_id, actor, "").await
    }

    async fn retry_parked_with_reason(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        let now = self.db.now();
        let mut st = self.lock();
        st.outbox.accept_version(event_id)?;
        let row = st.outbox.parked_row(event_id)?;
        row.status = DeliveryStatus::Pending;
        row.attempts = 0;
        row.next_attempt_at = now;
        row.park_reason = None;
        row.parked_at = None;
        st.outbox.audit.push(AuditEntry::new(
            event_id,
            OperatorAction::Retry,
            actor,
            reason.trim(),
            None,
            now,
        ));
        Ok(())
    }

    async fn discard_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        require_reason(reason)?;
        let now = self.db.now();
        let mut st = self.lock();
        st.outbox.parked_row(event_id)?;
        st.outbox.refuse_if_versions_wait(event_id)?;
        let row = st.outbox.parked_row(event_id)?;
        row.status = DeliveryStatus::Discarded;
        row.finished_at = Some(now);
        let (seq, key, version) = (
            row.seq,
            agg_key(&row.envelope),
            row.envelope.aggregate_version,
        );
        // Never below what claims count from (a discarded out-of-order version of an aggregate
        // without state is below its first version, which stays next).
        let last = st.outbox.last_version(&key);
        st.outbox.close(seq);
        st.outbox.advance_last(key, version.max(last));
        st.outbox.audit.push(AuditEntry::new(
            event_id,
            OperatorAction::Discard,
            actor,
            reason,
            None,
            now,
        ));
        Ok(())
    }

    async fn reissue_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<EventId, StoreError> {
        require_reason(reason)?;
        let now = self.db.now();
        let new_seq = self.db.next_seq();
        let mut st = self.lock();
        let out = &mut st.outbox;
        out.accept_version(event_id)?;
        let row = out.parked_row(event_id)?;
        row.status = DeliveryStatus::Discarded;
        row.finished_at = Some(now);
        let mut copy = row.envelope.clone();
        copy.headers.insert(
            outbox_core::wire::ORIGINAL_EVENT_ID.to_owned(),
            copy.dedup_id().to_string(),
        );
        let old_seq = row.seq;
        out.close(old_seq);
        // Deterministic: derived from the sequence number, in a namespace (top bit set) that
        // test code numbering its own ids from 0 never reaches; unique within this database.
        let mut salt = (1 << 63) | new_seq;
        let new_id = loop {
            let id = crate::deterministic_event_id(now, salt);
            if !out.contains_event(id) && id != event_id {
                break id;
            }
            salt = salt.wrapping_add(1 << 40);
        };
        copy.event_id = new_id;
        out.insert_committed(
            StagedRow {
                seq: new_seq,
                envelope: copy,
            },
            now,
        );
        out.audit.push(AuditEntry::new(
            event_id,
            OperatorAction::Reissue,
            actor,
            reason,
            Some(new_id),
            now,
        ));
        Ok(new_id)
    }

    async fn audit_trail(&self, event_id: Option<EventId>) -> Result<Vec<AuditEntry>, StoreError> {
        Ok(self
            .db
            .lock()
            .outbox
            .audit
            .iter()
            .filter(|a| event_id.is_none_or(|id| a.event_id == id))
            .cloned()
            .collect())
    }

    async fn release_claims_of(&self, owner: &str, actor: &str) -> Result<u64, StoreError> {
        if self.lease_duration().is_none() {
            // A locked claim ends with its relay's connection.
            return Ok(0);
        }
        let now = self.db.now();
        let mut st = self.lock();
        let out = &mut st.outbox;
        let mut released = Vec::new();
        for row in out.rows.values_mut() {
            if row
                .claim
                .as_ref()
                .is_some_and(|c| c.owner == owner && c.live(now))
            {
                row.claim = None;
                // The gone relay may have sent it: its next publication is a re-publication.
                row.maybe_delivered = true;
                released.push(row.envelope.event_id);
            }
        }
        for id in &released {
            out.audit.push(AuditEntry::new(
                *id,
                OperatorAction::ReleaseClaim,
                actor,
                format!("claims of relay {owner} released"),
                None,
                now,
            ));
        }
        Ok(released.len() as u64)
    }
}

#[async_trait]
impl RelayRegistry for MemoryOutboxStore {
    async fn register_relay(&self, registration: &RelayRegistration) -> Result<(), StoreError> {
        let now = self.db.now();
        let forget = chrono::Duration::from_std(outbox_core::store::FORGET_AFTER)
            .unwrap_or_else(|_| chrono::Duration::days(1));
        let mut st = self.lock();
        let relays = &mut st.outbox.relays;
        relays.retain(|_, (_, _, hb, _)| now - *hb <= forget);
        relays.insert(
            registration.owner.clone(),
            (registration.clone(), now, now, 0),
        );
        Ok(())
    }

    async fn heartbeat_relay(&self, owner: &str, held: u64) -> Result<bool, StoreError> {
        let now = self.db.now();
        let mut st = self.lock();
        Ok(match st.outbox.relays.get_mut(owner) {
            Some(entry) => {
                entry.2 = now;
                entry.3 = held;
                true
            }
            None => false,
        })
    }

    async fn deregister_relay(&self, owner: &str) -> Result<(), StoreError> {
        self.lock().outbox.relays.remove(owner);
        Ok(())
    }

    async fn relays(&self) -> Result<Vec<RelayEntry>, StoreError> {
        let now = self.db.now();
        Ok(self
            .lock()
            .outbox
            .relays
            .values()
            .map(|(r, started, hb, held)| {
                RelayEntry::new(
                    r.clone(),
                    *started,
                    *hb,
                    (now - *hb).to_std().unwrap_or_default(),
                    *held,
                )
            })
            .collect())
    }

    async fn live_claims_of(&self, owner: &str) -> Result<u64, StoreError> {
        if self.lease_duration().is_none() {
            return Ok(0);
        }
        let now = self.db.now();
        Ok(self
            .lock()
            .outbox
            .rows
            .values()
            .filter(|r| {
                r.claim
                    .as_ref()
                    .is_some_and(|c| c.owner == owner && c.live(now))
            })
            .count() as u64)
    }
}

#[async_trait]
impl MaintenanceStore for MemoryOutboxStore {
    async fn cleanup(
        &self,
        retention: Duration,
        batch_size: usize,
    ) -> Result<CleanupReport, StoreError> {
        if batch_size == 0 {
            return Err(StoreError::new(
                StoreErrorKind::Configuration,
                "cleanup batch size must be at least 1",
            ));
        }
        let retention = chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX);
        let (mut removed, mut batches) = (0u64, 0u32);
        loop {
            // One lock per batch: other work interleaves between batches, as it would between
            // short transactions.
            let now = self.db.now();
            let mut st = self.lock();
            let out = &mut st.outbox;
            let victims: Vec<u64> = out
                .rows
                .values()
                .filter(|r| {
                    matches!(
                        r.status,
                        DeliveryStatus::Published | DeliveryStatus::Discarded
                    ) && r
                        .finished_at
                        .is_some_and(|t| t.checked_add_signed(retention).is_some_and(|d| d <= now))
                })
                .map(|r| r.seq)
                .take(batch_size)
                .collect();
            batches += 1;
            for seq in &victims {
                if let Some(r) = out.rows.remove(seq) {
                    out.by_id.remove(&r.envelope.event_id);
                }
            }
            removed += victims.len() as u64;
            if victims.len() < batch_size {
                break;
            }
        }
        Ok(CleanupReport::new(removed, batches))
    }

    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        let now = self.db.now();
        let st = self.lock();
        let mut s = OutboxStats::default();
        // Ages from the commit on the store's clock (`appended_at`), never from `created_at`.
        let age = |r: &Row| (now - r.appended_at).to_std().unwrap_or(Duration::ZERO);
        let older = |o: Option<Duration>, a: Duration| Some(o.map_or(a, |o| o.max(a)));
        for r in st.outbox.rows.values() {
            match r.status {
                DeliveryStatus::Pending => {
                    s.unpublished += 1;
                    if r.claim.as_ref().is_some_and(|c| c.live(now)) {
                        s.in_flight += 1;
                    }
                }
                DeliveryStatus::Parked => {
                    s.parked += 1;
                    s.oldest_parked_age = older(s.oldest_parked_age, age(r));
                }
                DeliveryStatus::Published => s.published_retained += 1,
                _ => {}
            }
        }
        // Where each pending event stands (see `OutboxStats`): walk each aggregate's
        // unfinished events in (version, sequence) order.
        for (key, set) in &st.outbox.open {
            let last = st.outbox.last_version(key);
            let head = set
                .iter()
                .find(|(v, _)| *v > last)
                .map(|(v, seq)| (*v, &st.outbox.rows[seq]));
            let held = head.is_some_and(|(v, r)| {
                r.status == DeliveryStatus::Pending && v > last + 1 && r.held_since.is_some()
            });
            if held {
                s.version_gaps_held += 1;
            }
            let mut behind_parked = false;
            for (v, seq) in set {
                let r = &st.outbox.rows[seq];
                match r.status {
                    DeliveryStatus::Parked if *v > last => behind_parked = true,
                    DeliveryStatus::Pending if behind_parked => {
                        s.blocked += 1;
                        s.oldest_blocked_age = older(s.oldest_blocked_age, age(r));
                    }
                    DeliveryStatus::Pending if held && *v > last => s.gap_held += 1,
                    DeliveryStatus::Pending => {
                        s.oldest_claimable_age = older(s.oldest_claimable_age, age(r));
                    }
                    _ => {}
                }
            }
        }
        s.extra
            .push(("rows".to_owned(), st.outbox.rows.len() as f64));
        s.extra
            .push(("audit_entries".to_owned(), st.outbox.audit.len() as f64));
        Ok(s)
    }
}

fn parked_event(r: &Row) -> ParkedEvent {
    ParkedEvent::new(
        r.envelope.clone(),
        r.attempts,
        r.park_reason.clone().expect("parked rows have a reason"),
        r.parked_at.unwrap_or(r.appended_at),
    )
    .with_delivery_uncertain(r.maybe_delivered)
}

fn out_of_order_refusal(id: EventId, version: i64, last: i64) -> StoreError {
    StoreError::new(
        StoreErrorKind::Conflict,
        format!(
            "event {id} has version {version}, at or below {last}, the last version published \
             or discarded for its aggregate: sending it now would deliver it after a later \
             version; discard it instead"
        ),
    )
    .with_class(ErrorClass::Permanent)
}

fn require_reason(reason: &str) -> Result<(), StoreError> {
    if reason.trim().is_empty() {
        return Err(StoreError::new(
            StoreErrorKind::Validation,
            "an operator action needs a non-empty reason",
        ));
    }
    Ok(())
}

/// The reporting role in memory, on the store's clock: publication times are the completions'
/// `published_at`, the row sequence breaks ties, and the windows end at [`MemoryDb::now`].
#[async_trait]
impl ReportingStore for MemoryOutboxStore {
    async fn backlog(&self) -> Result<OutboxStats, StoreError> {
        MaintenanceStore::stats(self).await
    }

    async fn publish_latency(&self, window: Duration) -> Result<LatencySummary, StoreError> {
        let now = self.db.now();
        let from = now - chrono::Duration::from_std(window).unwrap_or(chrono::Duration::MAX);
        let st = self.lock();
        let rows = st.outbox.rows.values();
        let latencies: Vec<f64> = rows
            .clone()
            .filter(|r| r.status == DeliveryStatus::Published)
            .filter_map(|r| r.published_at.map(|p| (p, r)))
            .filter(|(p, _)| *p >= from)
            .map(|(p, r)| (p - r.envelope.created_at).as_seconds_f64())
            .collect();
        let created = rows.filter(|r| r.envelope.created_at >= from).count() as u64;
        Ok(LatencySummary::from_latencies(latencies, created))
    }

    async fn cleanup_candidates(&self, retention: Duration) -> Result<u64, StoreError> {
        let now = self.db.now();
        let retention = chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX);
        let st = self.lock();
        // The rule `cleanup` removes by.
        let n = st
            .outbox
            .rows
            .values()
            .filter(|r| {
                matches!(
                    r.status,
                    DeliveryStatus::Published | DeliveryStatus::Discarded
                ) && r
                    .finished_at
                    .is_some_and(|t| t.checked_add_signed(retention).is_some_and(|d| d <= now))
            })
            .count();
        Ok(n as u64)
    }

    async fn count_published(&self, filter: &PublishedFilter) -> Result<u64, StoreError> {
        let st = self.lock();
        Ok(st
            .outbox
            .rows
            .values()
            .filter(|r| r.status == DeliveryStatus::Published && filter.matches(&r.envelope))
            .count() as u64)
    }

    async fn published_events(
        &self,
        filter: &PublishedFilter,
        after: Option<PublishedPosition>,
        limit: usize,
    ) -> Result<Vec<PublishedRow>, StoreError> {
        let st = self.lock();
        let mut rows: Vec<PublishedRow> = st
            .outbox
            .rows
            .values()
            .filter(|r| r.status == DeliveryStatus::Published && filter.matches(&r.envelope))
            .filter_map(|r| {
                let at = r.published_at?;
                let ack = r.ack.clone()?;
                let order = i64::try_from(r.published_order).unwrap_or(i64::MAX);
                let pos = PublishedPosition::new(at, order);
                Some(PublishedRow::new(pos, r.envelope.clone(), ack))
            })
            .filter(|r| after.is_none_or(|a| r.position > a))
            .collect();
        rows.sort_by_key(|r| r.position);
        rows.truncate(limit.max(1));
        Ok(rows)
    }

    async fn interval_counts(
        &self,
        since: DateTime<Utc>,
        interval: Duration,
        grace: Duration,
    ) -> Result<Vec<IntervalCount>, StoreError> {
        if interval.is_zero() {
            return Err(StoreError::new(
                StoreErrorKind::Configuration,
                "interval must be greater than zero",
            ));
        }
        let now = self.db.now();
        let grace = chrono::Duration::from_std(grace).unwrap_or(chrono::Duration::MAX);
        let step = i64::try_from(interval.as_micros()).unwrap_or(i64::MAX);
        let st = self.lock();
        let mut counts: BTreeMap<(DateTime<Utc>, String), IntervalCount> = BTreeMap::new();
        for r in st.outbox.rows.values() {
            let created = r.envelope.created_at;
            if created < since {
                continue;
            }
            let offset = (created - since).num_microseconds().unwrap_or(i64::MAX);
            let start = since + chrono::Duration::microseconds(offset / step * step);
            let key = (start, r.envelope.event_type.clone());
            let c = counts
                .entry(key)
                .or_insert_with(|| IntervalCount::zero(start, r.envelope.event_type.clone()));
            c.events += 1;
            match r.status {
                DeliveryStatus::Published if r.ack.is_some() => c.published += 1,
                DeliveryStatus::Pending
                    if created.checked_add_signed(grace).is_some_and(|d| d < now) =>
                {
                    c.overdue += 1
                }
                DeliveryStatus::Parked => c.parked += 1,
                DeliveryStatus::Discarded => c.discarded += 1,
                _ => {}
            }
        }
        Ok(counts.into_values().collect())
    }

    async fn published_ids(
        &self,
        event_type: &str,
        start: DateTime<Utc>,
        end: DateTime<Utc>,
        topics: &[String],
        grace: Duration,
    ) -> Result<Vec<PublishedId>, StoreError> {
        let now = self.db.now();
        let grace = chrono::Duration::from_std(grace).unwrap_or(chrono::Duration::MAX);
        let st = self.lock();
        Ok(st
            .outbox
            .rows
            .values()
            .filter(|r| {
                let e = &r.envelope;
                r.status == DeliveryStatus::Published
                    && e.event_type == event_type
                    && e.created_at >= start
                    && e.created_at < end
                    && (topics.is_empty()
                        || r.ack
                            .as_ref()
                            .is_some_and(|a| topics.iter().any(|t| t == a.destination())))
                    && r.published_at
                        .and_then(|p| p.checked_add_signed(grace))
                        .is_some_and(|d| d < now)
            })
            .map(|r| PublishedId::new(r.envelope.event_id, r.envelope.original_event_id()))
            .collect())
    }
}
