//! Adversary pass (helper mixed46) over the MariaDB store with mixed relays on one table:
//!
//! 1. randomized: two Lease-mode store instances (lease 0.3 s: leases expire and are taken
//!    over) and two LockedTransaction instances (`locked_max_hold` 1 s) claim from one table
//!    while three producers append versions, copies and stale copies in transactions that
//!    commit out of id order or roll back; relays publish, retry, park, release, abandon
//!    (never complete) and complete late, after their lease expired. Judged against a ledger
//!    (the model of `outbox-postgres/tests/common/ledger45.rs`) that orders commits and claim
//!    starts on one sequence, plus two checks of its own: no two claims hold one aggregate at
//!    once (by wall time: a lease until its end, a locked claim until its completion), and a
//!    row handed out while an earlier lease claim of it had ended without an outcome is handed
//!    out flagged `maybe_sent_before`. Seeded: `ADV46_SEED`, else the clock (printed).
//! 2. a locked claim that takes over an expired lease and parks a stale copy in the same claim,
//!    then releases (or crashes, or retries): the lease holder's late completion.
//! 3. operator actions (`discard_parked`, `retry_parked`, `reissue_parked`) on a parked copy
//!    while a locked claim holds the aggregate; `release_claims_of` racing a late completion.
//! 4. `stats().in_flight` beside a locked claim of a run of 3.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, ClaimedBatch, CompletionReport, Envelope, EventId, Outcome, StoreError,
    StoreErrorKind,
};
use outbox_mysql::MySqlOutboxStore;
use outbox_testkit::{batch_layout as layout, claim_run};
use uuid::Uuid;

use common::{event, lease, park, published, retry, Ctx};

const LEASE: f64 = 0.3;
const HOLD: Duration = Duration::from_secs(1);

fn seed_from_env() -> u64 {
    std::env::var("ADV46_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
}

fn store_with(
    ctx: &Ctx,
    mode: ClaimMode,
    accept_first: bool,
    gap: Duration,
    hold: Duration,
) -> MySqlOutboxStore {
    ctx.builder(mode)
        .accept_first_version(accept_first)
        .gap_timeout(gap)
        .locked_max_hold(hold)
        .build()
        .expect("build")
}

// ---------------------------------------------------------------------------------------------
// The ledger.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Info {
    agg: String,
    v: i64,
    commit: Option<u64>,
    rolled_back: bool,
}

#[derive(Clone, Debug)]
struct ClaimInfo {
    owner: String,
    lease: Option<Duration>,
    start: Instant,
    end: Instant,
    /// When its completion, release or abandonment started.
    ended: Option<Instant>,
}

#[derive(Default)]
struct Ledger {
    seq: u64,
    rows: HashMap<Uuid, Info>,
    pubs: HashMap<Uuid, u64>,
    first_handout: HashMap<Uuid, u64>,
    handed: HashMap<(String, i64), Vec<Uuid>>,
    two_copies_sent: Vec<String>,
    retried: Vec<(String, i64, u64)>,
    claims: HashMap<Uuid, ClaimInfo>,
    /// Event -> the claims (tokens) that handed it out.
    handouts: HashMap<Uuid, Vec<Uuid>>,
    /// Aggregate -> the claims that handed it out (pruned).
    holders: HashMap<String, Vec<Uuid>>,
    exclusivity: Vec<String>,
    unflagged: Vec<String>,
    /// Events an operator retried (`retry_parked`).
    op_retried: HashSet<Uuid>,
    /// Unflagged re-sends of events an operator retried after a locked claim parked them
    /// (the finding of `a_locked_takeover_that_parks_keeps_the_uncertain_delivery`).
    unflagged_after_retry: Vec<String>,
    /// Handouts that had to be flagged (an earlier lease claim of the row unresolved).
    must_flag: usize,
}

#[derive(Clone, Default)]
struct L(Arc<Mutex<Ledger>>);

impl L {
    fn tick(&self) -> u64 {
        let mut g = self.0.lock().unwrap();
        g.seq += 1;
        g.seq
    }

    fn g(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.0.lock().unwrap()
    }

    fn ended(&self, token: Uuid) {
        if let Some(c) = self.g().claims.get_mut(&token) {
            c.ended.get_or_insert(Instant::now());
        }
    }
}

struct Tx {
    tx: sqlx::Transaction<'static, sqlx::MySql>,
    events: Vec<Uuid>,
}

async fn open(ctx: &Ctx) -> Tx {
    Tx {
        tx: ctx.pool.begin().await.unwrap(),
        events: Vec::new(),
    }
}

impl Tx {
    async fn put(&mut self, store: &MySqlOutboxStore, l: &L, agg: &str, vs: &[i64]) -> Vec<Uuid> {
        let evs: Vec<Envelope> = vs.iter().map(|v| event(agg, *v)).collect();
        store.append_many_in(&mut self.tx, &evs).await.unwrap();
        let ids: Vec<Uuid> = evs.iter().map(|e| e.event_id.as_uuid()).collect();
        let mut g = l.g();
        for e in &evs {
            g.rows.insert(
                e.event_id.as_uuid(),
                Info {
                    agg: agg.to_owned(),
                    v: e.aggregate_version,
                    commit: None,
                    rolled_back: false,
                },
            );
        }
        self.events.extend(&ids);
        ids
    }

    async fn commit(self, l: &L) {
        self.tx.commit().await.unwrap();
        let s = l.tick();
        let mut g = l.g();
        for id in self.events {
            g.rows.get_mut(&id).unwrap().commit = Some(s);
        }
    }

    async fn rollback(self, l: &L) {
        self.tx.rollback().await.unwrap();
        let mut g = l.g();
        for id in self.events {
            g.rows.get_mut(&id).unwrap().rolled_back = true;
        }
    }
}

struct Claim {
    b: ClaimedBatch,
    seq: u64,
}

async fn claim(l: &L, store: &MySqlOutboxStore, owner: &str, limit: usize, run: usize) -> Claim {
    let seq = l.tick();
    let start = Instant::now();
    let b = claim_run(store, owner, limit, run).await;
    let end = Instant::now();
    let lease = match store.claim_mode() {
        ClaimMode::Lease { duration } => Some(duration),
        _ => None,
    };
    handed_out(l, &b, seq, owner, lease, start, end);
    Claim { b, seq }
}

/// Records a handout and checks exclusivity and the `maybe_sent_before` flag against the
/// claims before it.
fn handed_out(
    l: &L,
    b: &ClaimedBatch,
    seq: u64,
    owner: &str,
    lease: Option<Duration>,
    start: Instant,
    end: Instant,
) {
    let mut g = l.g();
    let token = b.handle.token;
    let aggs: HashSet<String> = b
        .records
        .iter()
        .map(|r| r.envelope.aggregate_id.clone())
        .collect();
    // Exclusivity: another claim that handed out one of these aggregates and certainly still
    // held it when this claim decided (a lease not yet ended; a locked claim before its
    // completion and before the server could have closed its session).
    let margin = Duration::from_millis(60);
    for a in &aggs {
        let holders = g.holders.entry(a.clone()).or_default().clone();
        let mut keep = Vec::new();
        for h in holders {
            let Some(c) = g.claims.get(&h).cloned() else {
                continue;
            };
            if c.ended.is_some_and(|t| t + Duration::from_secs(10) < start) {
                continue;
            }
            keep.push(h);
            if c.ended.is_some_and(|t| t < end) {
                continue;
            }
            let held_until = match c.lease {
                Some(d) => c.start + d,
                None => c.end + HOLD,
            };
            if end + margin < held_until {
                let msg = format!(
                    "{a}: handed to {owner} (claim {:?} after {:?}) while {} (lease {:?}) held it \
                     since {:?} before",
                    end - start,
                    start.saturating_duration_since(c.start),
                    c.owner,
                    c.lease,
                    end.saturating_duration_since(c.start)
                );
                g.exclusivity.push(msg);
            }
        }
        keep.push(token);
        g.holders.insert(a.clone(), keep);
    }
    for r in &b.records {
        let id = r.envelope.event_id.as_uuid();
        // An earlier lease claim of this row that had not started its completion or release
        // when this claim returned left its token on the row: this may be a re-send.
        let earlier = g.handouts.get(&id).cloned().unwrap_or_default();
        for t in earlier {
            let Some(c) = g.claims.get(&t) else { continue };
            if c.lease.is_none() || c.ended.is_some_and(|e| e <= end) {
                continue;
            }
            let prev = c.owner.clone();
            g.must_flag += 1;
            if !r.maybe_sent_before {
                let msg = format!(
                    "{} v{} (event {}) handed to {owner} without maybe_sent_before after {}'s \
                     lease claim ended without an outcome",
                    r.envelope.aggregate_id,
                    r.envelope.aggregate_version,
                    short(id),
                    prev
                );
                if g.op_retried.contains(&id) && std::env::var("ADV46_LENIENT_FLAGS").is_ok() {
                    g.unflagged_after_retry.push(msg);
                } else {
                    g.unflagged.push(msg);
                }
            }
        }
        g.handouts.entry(id).or_default().push(token);
        g.first_handout.entry(id).or_insert(seq);
        let key = (
            r.envelope.aggregate_id.clone(),
            r.envelope.aggregate_version,
        );
        let copies = g.handed.entry(key.clone()).or_default();
        if !copies.contains(&id) {
            copies.push(id);
            if copies.len() > 1 {
                let msg = format!("{} v{}: copies {:?}", key.0, key.1, copies);
                g.two_copies_sent.push(msg);
            }
        }
    }
    g.claims.insert(
        token,
        ClaimInfo {
            owner: owner.to_owned(),
            lease,
            start,
            end,
            ended: None,
        },
    );
}

fn outcomes(b: &ClaimedBatch, n: usize, tail: Option<fn(&Envelope) -> Outcome>) -> Vec<Outcome> {
    let mut outs = Vec::new();
    let mut i = 0;
    while i < b.records.len() {
        let mut j = i + 1;
        while j < b.records.len() && b.records[j].run_position > 0 {
            j += 1;
        }
        for (k, r) in b.records[i..j].iter().enumerate() {
            if k < n {
                outs.push(published(&r.envelope, k as i64));
            } else {
                if let Some(t) = tail {
                    outs.push(t(&r.envelope));
                }
                break;
            }
        }
        i = j;
    }
    outs
}

fn retry0(e: &Envelope) -> Outcome {
    retry(e, Duration::ZERO)
}

fn record_pubs(l: &L, c: &Claim, outs: &[Outcome], rep: &CompletionReport) {
    let refused: HashSet<Uuid> = rep.superseded_events.iter().map(|e| e.as_uuid()).collect();
    let mut g = l.g();
    for o in outs {
        if matches!(o, Outcome::Published { .. }) && !refused.contains(&o.event_id().as_uuid()) {
            g.pubs.insert(o.event_id().as_uuid(), c.seq);
        }
    }
}

async fn try_complete(
    l: &L,
    store: &MySqlOutboxStore,
    c: &Claim,
    outs: &[Outcome],
) -> Result<CompletionReport, StoreError> {
    l.ended(c.b.handle.token);
    let rep = store.complete(&c.b.handle, outs).await?;
    record_pubs(l, c, outs, &rep);
    Ok(rep)
}

async fn complete(l: &L, store: &MySqlOutboxStore, c: &Claim, outs: &[Outcome]) {
    let rep = try_complete(l, store, c, outs).await.unwrap();
    assert_eq!(
        rep.superseded, 0,
        "a live claim's outcomes are refused: {rep:?}"
    );
}

async fn release(l: &L, store: &MySqlOutboxStore, c: &Claim) {
    l.ended(c.b.handle.token);
    store.release(&c.b.handle).await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// The checks.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, sqlx::FromRow)]
struct Row {
    id: i64,
    event_id: Uuid,
    aggregate_id: String,
    aggregate_version: i64,
    status: String,
    blocked: bool,
    park_kind: Option<String>,
    maybe_delivered: bool,
}

async fn rows(ctx: &Ctx) -> Vec<Row> {
    sqlx::query_as(&format!(
        "SELECT id, event_id, CAST(aggregate_id AS CHAR) AS aggregate_id, aggregate_version, \
                CAST(status AS CHAR) AS status, blocked <> 0 AS blocked, \
                CAST(park_kind AS CHAR) AS park_kind, maybe_delivered <> 0 AS maybe_delivered \
         FROM {} ORDER BY id",
        ctx.table("outbox_events")
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

fn short(id: Uuid) -> String {
    id.simple().to_string()[24..].to_owned()
}

fn dump(rows: &[Row], l: &Ledger) -> String {
    let mut s = String::new();
    for r in rows {
        let i = l.rows.get(&r.event_id);
        s.push_str(&format!(
            "\n  row {} {} v{} {} blocked={} park={:?} maybe_delivered={} commit_seq={:?} \
             first_handout={:?} pub_seq={:?} event={}",
            r.id,
            r.aggregate_id,
            r.aggregate_version,
            r.status,
            r.blocked,
            r.park_kind,
            r.maybe_delivered,
            i.and_then(|i| i.commit),
            l.first_handout.get(&r.event_id),
            l.pubs.get(&r.event_id),
            short(r.event_id)
        ));
    }
    s
}

async fn check_published_order(ctx: &Ctx) {
    let t = ctx.table("outbox_events");
    let bad: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT CAST(CONCAT(p.aggregate_id, ' v', p.aggregate_version, ' (row ', p.id, ') at ', \
                p.published_at, ' after v', q.aggregate_version, ' (row ', q.id, ') at ', \
                q.published_at) AS CHAR) \
         FROM {t} p JOIN {t} q ON q.aggregate_key = p.aggregate_key \
           AND q.aggregate_version > p.aggregate_version AND q.published_at < p.published_at \
         WHERE p.status = 'published' AND q.status = 'published'"
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert!(bad.is_empty(), "published out of order: {bad:?}");
}

/// The contract over the database and the ledger. `quiet`: nothing runs concurrently.
async fn check(ctx: &Ctx, l: &L, quiet: bool, what: &str) {
    check_published_order(ctx).await;
    let applied_before: HashSet<Uuid> = l.g().pubs.keys().copied().collect();
    let rows = rows(ctx).await;
    let g = l.g();
    let fail = |msg: String| panic!("{what}: {msg}\nrows:{}", dump(&rows, &g));
    if let Some(x) = g.exclusivity.first() {
        fail(format!(
            "two claims held one aggregate: {x} ({} in all)",
            g.exclusivity.len()
        ));
    }
    if let Some(x) = g.unflagged.first() {
        fail(format!("{x} ({} in all)", g.unflagged.len()));
    }
    for r in &rows {
        match g.rows.get(&r.event_id) {
            None => fail(format!("row {} was never appended", r.id)),
            Some(i) if i.rolled_back => fail(format!("row {} of a rolled-back transaction", r.id)),
            Some(i) if i.agg != r.aggregate_id || i.v != r.aggregate_version => {
                fail(format!("row {} is not the event appended", r.id))
            }
            Some(_) => {}
        }
    }
    let mut per_version: HashMap<(&str, i64), Vec<&Row>> = HashMap::new();
    for r in &rows {
        per_version
            .entry((r.aggregate_id.as_str(), r.aggregate_version))
            .or_default()
            .push(r);
    }
    for ((a, v), copies) in &per_version {
        let n = copies.iter().filter(|r| r.status == "published").count();
        if n > 1 {
            fail(format!("{a} v{v} published {n} times"));
        }
    }
    let db: HashSet<Uuid> = rows
        .iter()
        .filter(|r| r.status == "published")
        .map(|r| r.event_id)
        .collect();
    let logged: HashSet<Uuid> = g.pubs.keys().copied().collect();
    if quiet && db != logged {
        fail(format!(
            "published rows {:?} and applied publications {:?} differ",
            db.difference(&logged).collect::<Vec<_>>(),
            logged.difference(&db).collect::<Vec<_>>()
        ));
    }
    if let Some(x) = applied_before.difference(&db).next() {
        fail(format!(
            "an applied publication {x} is not published in the database"
        ));
    }
    for p in rows.iter().filter(|r| r.status == "published") {
        let Some(&s) = g.pubs.get(&p.event_id) else {
            continue;
        };
        for e in &per_version[&(p.aggregate_id.as_str(), p.aggregate_version)] {
            let committed_before = g.rows[&e.event_id].commit.is_some_and(|c| c < s);
            if e.id < p.id && e.status != "discarded" && committed_before {
                fail(format!(
                    "{} v{}: row {} went out (claim seq {s}) while the earlier row {} ({}) had \
                     committed before that claim",
                    p.aggregate_id, p.aggregate_version, p.id, e.id, e.status
                ));
            }
        }
    }
    for e in rows
        .iter()
        .filter(|r| r.status == "parked" && r.park_kind.as_deref() == Some("out_of_order"))
    {
        let commit = g.rows[&e.event_id].commit;
        let after = |s: u64| commit.is_none_or(|c| c > s);
        let explained = rows.iter().any(|q| {
            q.id != e.id
                && q.aggregate_id == e.aggregate_id
                && q.aggregate_version >= e.aggregate_version
                && (q.status == "discarded"
                    || q.status == "published"
                        && q.aggregate_version == e.aggregate_version
                        && q.id < e.id
                    || g.first_handout.get(&q.event_id).is_some_and(|s| after(*s)))
        }) || g
            .retried
            .iter()
            .any(|(a, v, s)| *a == e.aggregate_id && *v > e.aggregate_version && after(*s));
        if !explained {
            fail(format!(
                "row {} ({} v{}) was parked out of order, but no version at or above it went out \
                 before it committed: a version was skipped",
                e.id, e.aggregate_id, e.aggregate_version
            ));
        }
    }
}

/// Pending rows that nothing will hand out.
async fn stalled(ctx: &Ctx) -> Vec<String> {
    let t = ctx.table("outbox_events");
    let s = ctx.table("outbox_events_aggregate");
    sqlx::query_scalar(&format!(
        "SELECT CAST(CONCAT(r.aggregate_id, ' v', r.aggregate_version, ' (row ', r.id, \
                ', blocked ', r.blocked, ', due ', r.next_attempt_at <= UTC_TIMESTAMP(6), ')') \
                AS CHAR) \
         FROM {t} r WHERE r.status = 'pending' AND NOT EXISTS ( \
           SELECT 1 FROM {t} u LEFT JOIN {s} a ON a.aggregate_key = u.aggregate_key \
           WHERE u.aggregate_key = r.aggregate_key \
             AND (u.aggregate_version < r.aggregate_version \
                  OR u.aggregate_version = r.aggregate_version AND u.id < r.id) \
             AND u.status = 'parked' AND u.aggregate_version > COALESCE(a.last_version, 0)) \
         ORDER BY r.id"
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

async fn pending_count(ctx: &Ctx) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {} WHERE status = 'pending'",
        ctx.table("outbox_events")
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

async fn drain(ctx: &Ctx, l: &L, store: &MySqlOutboxStore, run: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let c = claim(l, store, "drain", 7, run).await;
        if c.b.records.is_empty() {
            release(l, store, &c).await;
        } else {
            let outs = outcomes(&c.b, usize::MAX, None);
            complete(l, store, &c, &outs).await;
        }
        check(ctx, l, true, what).await;
        if c.b.records.is_empty() && c.b.parked.is_empty() && c.b.gaps_held == 0 {
            let left = stalled(ctx).await;
            if left.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: pending rows never handed out: {left:?}\nrows:{}",
                dump(&rows(ctx).await, &l.g())
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn last_version_of(ctx: &Ctx, event: Uuid) -> Option<i64> {
    sqlx::query_scalar(&format!(
        "SELECT a.last_version FROM {} a JOIN {} e ON e.aggregate_key = a.aggregate_key \
         WHERE e.event_id = ?",
        ctx.table("outbox_events_aggregate"),
        ctx.table("outbox_events")
    ))
    .bind(event)
    .fetch_optional(&ctx.pool)
    .await
    .unwrap()
    .flatten()
}

async fn operator(l: &L, store: &MySqlOutboxStore, ctx: &Ctx) -> usize {
    let mut n = 0;
    for r in rows(ctx).await {
        if r.status != "parked" || r.park_kind.as_deref() == Some("out_of_order") {
            continue;
        }
        let s = l.tick();
        let id = EventId::from_uuid(r.event_id);
        match store.retry_parked(id, "op").await {
            Ok(()) => {
                let mut g = l.g();
                g.retried
                    .push((r.aggregate_id.clone(), r.aggregate_version, s));
                g.op_retried.insert(r.event_id);
                n += 1;
            }
            Err(e) => {
                assert_eq!(e.kind, StoreErrorKind::Conflict, "{e:?}");
                let last = last_version_of(ctx, r.event_id).await;
                if last.is_some_and(|last| r.aggregate_version <= last) {
                    store.discard_parked(id, "op", "below last").await.unwrap();
                    n += 1;
                }
            }
        }
    }
    n
}

async fn settle(ctx: &Ctx, l: &L, store: &MySqlOutboxStore, run: usize, what: &str) {
    for _ in 0..10 {
        drain(ctx, l, store, run, what).await;
        if operator(l, store, ctx).await == 0 {
            break;
        }
        check(ctx, l, true, what).await;
    }
    drain(ctx, l, store, run, what).await;
    assert_eq!(
        pending_count(ctx).await,
        0,
        "{what}: pending rows left\nrows:{}",
        dump(&rows(ctx).await, &l.g())
    );
}

// ---------------------------------------------------------------------------------------------
// 1. Mixed relays, randomized.
// ---------------------------------------------------------------------------------------------

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0.max(1);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The statements of one business transaction (as in ledger45's `shape`).
fn shape(rng: &mut Rng, next: &mut i64) -> Vec<Vec<i64>> {
    let n = *next;
    match rng.below(8) {
        0 | 1 => {
            let k = 1 + rng.below(3) as i64;
            *next += k;
            vec![(n..n + k).collect()]
        }
        2 => vec![vec![(n - 1 - rng.below(2) as i64).max(1)]],
        3 => {
            *next += 2;
            let mut stmts = vec![vec![(n - 1).max(1), n, n + 1]];
            if rng.below(2) == 0 {
                stmts.push(vec![n]);
            }
            stmts
        }
        4 => {
            *next += 2;
            vec![vec![n, n + 1], vec![n]]
        }
        5 => {
            *next += 2;
            vec![vec![n], vec![n, n + 1]]
        }
        // Versions one per statement (none blocked at insert).
        6 => {
            *next += 3;
            vec![vec![n], vec![n + 1], vec![n + 2]]
        }
        _ => {
            *next += 1;
            vec![vec![n]]
        }
    }
}

async fn mixed_relays(seed: u64, secs: u64) {
    let mut rng = Rng(seed);
    let accept_first = rng.below(2) == 0;
    println!("mixed46 seed {seed} (ADV46_SEED to replay): accept_first {accept_first}");
    let Some(ctx) = Ctx::new(24).await else {
        return;
    };
    let gap = Duration::from_secs(2);
    let la = store_with(&ctx, lease(LEASE), accept_first, gap, HOLD);
    la.migrate().await.unwrap();
    let lb = store_with(&ctx, lease(LEASE), accept_first, gap, HOLD);
    let ka = store_with(&ctx, ClaimMode::LockedTransaction, accept_first, gap, HOLD);
    let kb = store_with(&ctx, ClaimMode::LockedTransaction, accept_first, gap, HOLD);
    let ctx = Arc::new(ctx);
    let l = L::default();
    let stop_producers = Arc::new(AtomicBool::new(false));
    let stop_relays = Arc::new(AtomicBool::new(false));
    let next: Arc<Mutex<HashMap<String, i64>>> = Arc::default();
    let fenced = Arc::new(AtomicUsize::new(0));
    let late_applied = Arc::new(AtomicUsize::new(0));
    let lost = Arc::new(AtomicUsize::new(0));

    let mut producers = Vec::new();
    for p in 0..3u64 {
        let (ctx, store, l, stop, next) = (
            ctx.clone(),
            la.clone(),
            l.clone(),
            stop_producers.clone(),
            next.clone(),
        );
        let mut rng = Rng(seed ^ (p + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        producers.push(tokio::spawn(async move {
            let mut txs = 0;
            while !stop.load(Ordering::SeqCst) {
                let agg = format!("m{}", rng.below(6));
                if rng.below(5) == 0 {
                    let n = {
                        let mut g = next.lock().unwrap();
                        let n = g.entry(agg.clone()).or_insert(1);
                        *n += 2;
                        *n - 2
                    };
                    let mut ta = open(&ctx).await;
                    ta.put(&store, &l, &agg, &[n]).await;
                    let mut tb = open(&ctx).await;
                    tb.put(&store, &l, &agg, &[n, n + 1]).await;
                    tokio::time::sleep(Duration::from_millis(rng.below(40))).await;
                    tb.commit(&l).await;
                    tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
                    txs += 2;
                    if rng.below(8) == 0 {
                        ta.rollback(&l).await;
                    } else {
                        ta.commit(&l).await;
                    }
                    continue;
                }
                let stmts = {
                    let mut g = next.lock().unwrap();
                    let n = g.entry(agg.clone()).or_insert(1);
                    shape(&mut rng, n)
                };
                loop {
                    let mut t = open(&ctx).await;
                    for vs in &stmts {
                        t.put(&store, &l, &agg, vs).await;
                        if rng.below(2) == 0 {
                            tokio::time::sleep(Duration::from_millis(rng.below(30))).await;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(rng.below(60))).await;
                    txs += 1;
                    if rng.below(8) == 0 {
                        t.rollback(&l).await;
                    } else {
                        t.commit(&l).await;
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(rng.below(50))).await;
            }
            txs
        }));
    }

    let mut relays = Vec::new();
    for (i, store) in [la.clone(), ka.clone(), lb.clone(), kb.clone()]
        .into_iter()
        .enumerate()
    {
        let (l, stop, fenced, late_applied, lost) = (
            l.clone(),
            stop_relays.clone(),
            fenced.clone(),
            late_applied.clone(),
            lost.clone(),
        );
        let mut rng = Rng(seed ^ (i as u64 + 11).wrapping_mul(0x2545_f491_4f6c_dd1d));
        let locked = i % 2 == 1;
        let owner = format!("relay{i}-{}", if locked { "locked" } else { "lease" });
        relays.push(tokio::spawn(async move {
            let mut claims = 0;
            let mut kinds: BTreeMap<&'static str, usize> = BTreeMap::new();
            while !stop.load(Ordering::SeqCst) {
                let limit = 1 + rng.below(5) as usize;
                let run = if rng.below(2) == 0 { 1 } else { 3 };
                let t0 = Instant::now();
                let c = claim(&l, &store, &owner, limit, run).await;
                claims += 1;
                for w in c.b.records.windows(2) {
                    if w[1].run_position > 0 {
                        assert_eq!(
                            w[1].envelope.aggregate_version,
                            w[0].envelope.aggregate_version + 1,
                            "seed {seed}: {:?}",
                            layout(&c.b)
                        );
                    }
                }
                if c.b.records.is_empty() {
                    release(&l, &store, &c).await;
                    tokio::time::sleep(Duration::from_millis(5 + rng.below(20))).await;
                    continue;
                }
                tokio::time::sleep(Duration::from_millis(rng.below(15))).await;
                let pick = rng.below(24);
                let late = matches!(pick, 19..=21);
                if late {
                    // Outlive the lease (lease relays) or the session (locked relays).
                    let ms = if locked { 1_400 } else { 350 + rng.below(200) };
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                let kind = match pick {
                    0..=9 | 19 => "publish",
                    10 | 11 | 20 => "prefix-retry",
                    12 | 13 | 21 => "prefix-none",
                    14 => "prefix-park",
                    15 | 16 => "release",
                    17 => "crash",
                    _ => "never",
                };
                *kinds.entry(kind).or_default() += 1;
                let k = rng.below(3) as usize;
                let outs = match kind {
                    "publish" => Some(outcomes(&c.b, usize::MAX, None)),
                    "prefix-retry" => Some(outcomes(&c.b, k, Some(retry0))),
                    "prefix-none" => Some(outcomes(&c.b, k, None)),
                    "prefix-park" => Some(outcomes(&c.b, k.min(1), Some(park))),
                    _ => None,
                };
                match (outs, kind) {
                    (Some(outs), _) => match try_complete(&l, &store, &c, &outs).await {
                        Ok(rep) => {
                            // Refused outcomes: only once the lease may have ended (it ends
                            // 0.3 s after a reading of the clock taken after `t0`).
                            let live = !locked
                                && Instant::now() + Duration::from_millis(30)
                                    < t0 + Duration::from_secs_f64(LEASE);
                            if (locked && !late) || live {
                                assert_eq!(
                                    rep.superseded, 0,
                                    "seed {seed}: {owner}: a live claim refused: {rep:?}"
                                );
                            }
                            if late && rep.applied > 0 {
                                late_applied.fetch_add(1, Ordering::SeqCst);
                            }
                            fenced.fetch_add(rep.superseded, Ordering::SeqCst);
                        }
                        Err(e) => {
                            assert!(
                                locked && late && e.kind == StoreErrorKind::LeaseLost,
                                "seed {seed}: {owner}: completion failed: {e:?}"
                            );
                            lost.fetch_add(1, Ordering::SeqCst);
                        }
                    },
                    (None, "release") => release(&l, &store, &c).await,
                    (None, "crash") => {
                        l.ended(c.b.handle.token);
                        if locked {
                            assert!(store.abandon_locked_claim(&c.b.handle).await);
                        }
                    }
                    // Never completed: a lease ends by itself, a locked session by the server.
                    _ => {}
                }
            }
            println!("seed {seed}: {owner}: {claims} claims, ends {kinds:?}");
            claims
        }));
    }

    // The operator retries parked rows (or discards those at or below last) while the relays
    // run, so parked heads do not stop the aggregates for the rest of the run.
    let op = {
        let (ctx, l, store, stop) = (ctx.clone(), l.clone(), lb.clone(), stop_relays.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(400)).await;
                n += operator(&l, &store, &ctx).await;
            }
            n
        })
    };
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        check(&ctx, &l, false, &format!("seed {seed}")).await;
    }
    stop_producers.store(true, Ordering::SeqCst);
    let mut txs = 0;
    for p in producers {
        txs += p.await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while pending_count(&ctx).await > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop_relays.store(true, Ordering::SeqCst);
    let mut claims = 0;
    for r in relays {
        claims += r.await.unwrap();
    }
    let op_actions = op.await.unwrap();
    // Locked claims never completed end with their sessions (1 s); leases within 0.3 s.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let what = format!("seed {seed}");
    check(&ctx, &l, true, &what).await;
    settle(&ctx, &l, &la, 3, &what).await;
    check(&ctx, &l, true, &what).await;
    let rows = rows(&ctx).await;
    let mut by_version: BTreeMap<(String, i64), Vec<&Row>> = BTreeMap::new();
    for r in &rows {
        by_version
            .entry((r.aggregate_id.clone(), r.aggregate_version))
            .or_default()
            .push(r);
    }
    let mut skipped = Vec::new();
    for ((a, v), copies) in &by_version {
        let out = copies.iter().any(|r| r.status == "published");
        let all_ooo = copies.iter().all(|r| {
            r.status == "discarded"
                || r.status == "parked" && r.park_kind.as_deref() == Some("out_of_order")
        });
        if !out && !all_ooo {
            skipped.push(format!("{a} v{v}"));
        }
    }
    assert!(
        skipped.is_empty(),
        "{what}: versions neither published nor parked out of order: {skipped:?}\nrows:{}",
        dump(&rows, &l.g())
    );
    let others: BTreeMap<String, usize> =
        rows.iter()
            .filter(|r| r.status != "published")
            .fold(BTreeMap::new(), |mut m, r| {
                *m.entry(format!(
                    "{}:{}",
                    r.status,
                    r.park_kind.clone().unwrap_or_default()
                ))
                .or_insert(0) += 1;
                m
            });
    let published = rows.iter().filter(|r| r.status == "published").count();
    let two = l.g().two_copies_sent.len();
    let after_retry = l.g().unflagged_after_retry.clone();
    let must_flag = l.g().must_flag;
    println!(
        "{what}: {txs} transactions, {claims} claims, {op_actions} operator actions, {} rows, \
         {published} published, others {others:?}, {} late outcomes fenced, {} late \
         completions applied, {} locked completions lost, {two} versions handed out as two \
         copies, {must_flag} handouts after an unresolved lease (all flagged), {} re-sends after an operator retry not flagged (counted only with \
         ADV46_LENIENT_FLAGS=1, else they fail the run): {after_retry:?}",
        rows.len(),
        fenced.load(Ordering::SeqCst),
        late_applied.load(Ordering::SeqCst),
        lost.load(Ordering::SeqCst),
        after_retry.len(),
    );
    assert!(published > 0, "{what}: nothing was published");
    let ctx = Arc::try_unwrap(ctx).ok().expect("ctx");
    ctx.drop().await;
}

/// Priority 1: the randomized mixed relays, one seed (`ADV46_SEED`, else the clock), about
/// 20 s of producers (`ADV46_SECS`).
#[tokio::test]
async fn mixed_lease_and_locked_relays_with_expiring_leases() {
    let seed = seed_from_env();
    let secs = std::env::var("ADV46_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    mixed_relays(seed, secs).await;
}

// ---------------------------------------------------------------------------------------------
// Shared setup of the takeover tests.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, sqlx::FromRow)]
struct ARow {
    id: i64,
    event_id: Uuid,
    aggregate_version: i64,
    status: String,
    maybe_delivered: bool,
    park_kind: Option<String>,
}

async fn agg_rows(ctx: &Ctx, agg: &str) -> Vec<ARow> {
    sqlx::query_as(&format!(
        "SELECT id, event_id, aggregate_version, CAST(status AS CHAR) AS status, \
                maybe_delivered <> 0 AS maybe_delivered, CAST(park_kind AS CHAR) AS park_kind \
         FROM {} WHERE aggregate_id = ? ORDER BY id",
        ctx.table("outbox_events")
    ))
    .bind(agg)
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

fn adump(rs: &[ARow]) -> String {
    rs.iter()
        .map(|r| {
            format!(
                "\n  row {} v{} {} maybe_delivered={} park={:?} event={}",
                r.id,
                r.aggregate_version,
                r.status,
                r.maybe_delivered,
                r.park_kind,
                short(r.event_id)
            )
        })
        .collect()
}

fn bids(b: &ClaimedBatch) -> Vec<Uuid> {
    b.records
        .iter()
        .map(|r| r.envelope.event_id.as_uuid())
        .collect()
}

fn publish_outs(b: &ClaimedBatch) -> Vec<Outcome> {
    b.records
        .iter()
        .enumerate()
        .map(|(i, r)| published(&r.envelope, i as i64))
        .collect()
}

/// Publishes everything left of `agg` with `store` (heads one by one), recording whether each
/// handout of `watch` was flagged `maybe_sent_before`. Returns those flags.
async fn drain_agg(store: &MySqlOutboxStore, watch: Uuid, what: &str) -> Vec<bool> {
    let mut flags = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut idle = 0;
    while idle < 3 {
        assert!(Instant::now() < deadline, "{what}: drain did not finish");
        let b = claim_run(store, "drain", 10, 1).await;
        if b.records.is_empty() {
            store.release(&b.handle).await.unwrap();
            idle += 1;
            tokio::time::sleep(Duration::from_millis(60)).await;
            continue;
        }
        idle = 0;
        for r in &b.records {
            if r.envelope.event_id.as_uuid() == watch {
                flags.push(r.maybe_sent_before);
            }
        }
        let rep = store.complete(&b.handle, &publish_outs(&b)).await.unwrap();
        assert_eq!(rep.superseded, 0, "{what}: drain: {rep:?}");
    }
    flags
}

fn published_count(rs: &[ARow], v: i64) -> usize {
    rs.iter()
        .filter(|r| r.aggregate_version == v && r.status == "published")
        .count()
}

/// `a` v1 published; H = `a` v2 claimed by a lease relay x (0.3 s); a stale copy S of v1
/// appended after x's claim. Returns (xs, ys, x's batch, H, S) once x's lease has ended.
async fn lease_then_stale(
    ctx: &Ctx,
    ys_mode: ClaimMode,
) -> (
    MySqlOutboxStore,
    MySqlOutboxStore,
    ClaimedBatch,
    Envelope,
    Envelope,
) {
    let xs = store_with(ctx, lease(LEASE), false, Duration::from_secs(30), HOLD * 30);
    xs.migrate().await.unwrap();
    let ys = store_with(ctx, ys_mode, false, Duration::from_secs(30), HOLD * 30);
    let v1 = event("a", 1);
    common::append(ctx, &xs, std::slice::from_ref(&v1)).await;
    let b = claim_run(&ys, "setup", 10, 1).await;
    assert_eq!(bids(&b), vec![v1.event_id.as_uuid()]);
    let rep = ys.complete(&b.handle, &publish_outs(&b)).await.unwrap();
    assert_eq!(rep.applied, 1);
    let h = event("a", 2);
    common::append(ctx, &xs, std::slice::from_ref(&h)).await;
    let x = claim_run(&xs, "x", 10, 1).await;
    assert_eq!(bids(&x), vec![h.event_id.as_uuid()], "x's claim");
    let s = event("a", 1);
    common::append(ctx, &xs, std::slice::from_ref(&s)).await;
    tokio::time::sleep(Duration::from_millis(450)).await;
    (xs, ys, x, h, s)
}

// ---------------------------------------------------------------------------------------------
// 2. A locked takeover with a park round.
// ---------------------------------------------------------------------------------------------

/// x (lease 0.3 s) claims H = a v2; a stale copy S of v1 commits; after the lease ended a
/// LockedTransaction claim y hands out H (flagged `maybe_sent_before`) and parks S as out of
/// order in the same claim. y then releases, crashes (connection cut) or retries H. x's late
/// publication of H: after a release or crash nobody else published H, so it may apply; if it
/// is refused the next claim must hand H out flagged and H is published exactly once. After
/// y's retry x must be refused (y's claim took the row over). Either way v2 is published
/// exactly once and S stays parked.
#[tokio::test]
async fn a_locked_takeover_that_parks_then_releases_keeps_the_late_completion_sound() {
    let mut report = Vec::new();
    for end in ["release", "crash", "retry"] {
        let what = format!("y_end={end}");
        let Some(ctx) = Ctx::new(8).await else {
            return;
        };
        let (xs, ys, x, h, s) = lease_then_stale(&ctx, ClaimMode::LockedTransaction).await;
        let y = claim_run(&ys, "y", 10, 1).await;
        assert_eq!(
            bids(&y),
            vec![h.event_id.as_uuid()],
            "{what}: y's claim {:?}",
            layout(&y)
        );
        assert!(
            y.records[0].maybe_sent_before,
            "{what}: H's lease ended without an outcome: the takeover must be flagged"
        );
        assert_eq!(
            y.parked.iter().map(|p| p.event_id).collect::<Vec<_>>(),
            vec![s.event_id],
            "{what}: y's claim parks the stale copy: {:?}",
            y.parked
        );
        match end {
            "release" => ys.release(&y.handle).await.unwrap(),
            "crash" => assert!(ys.abandon_locked_claim(&y.handle).await),
            _ => {
                let rep = ys
                    .complete(&y.handle, &[retry(&y.records[0].envelope, Duration::ZERO)])
                    .await
                    .unwrap();
                assert_eq!(rep.applied, 1, "{what}: {rep:?}");
            }
        }
        let rep = xs.complete(&x.handle, &publish_outs(&x)).await.unwrap();
        let after = agg_rows(&ctx, "a").await;
        println!(
            "{what}: x's late completion {rep:?}; rows:{}",
            adump(&after)
        );
        let flags = drain_agg(&ys, h.event_id.as_uuid(), &what).await;
        let fin = agg_rows(&ctx, "a").await;
        println!(
            "{what}: H handed out again with flags {flags:?}; rows:{}",
            adump(&fin)
        );
        report.push(format!(
            "{what}: x's late completion applied {}",
            rep.applied
        ));
        assert_eq!(published_count(&fin, 2), 1, "{what}: rows:{}", adump(&fin));
        assert_eq!(published_count(&fin, 1), 1, "{what}: rows:{}", adump(&fin));
        let s_row = fin
            .iter()
            .find(|r| r.event_id == s.event_id.as_uuid())
            .unwrap();
        assert_eq!(
            (s_row.status.as_str(), s_row.park_kind.as_deref()),
            ("parked", Some("out_of_order")),
            "{what}"
        );
        if end == "retry" {
            assert_eq!(
                (rep.applied, rep.superseded),
                (0, 1),
                "{what}: x's completion after y's retry of H must be refused"
            );
        }
        if rep.applied == 0 {
            assert_eq!(
                flags,
                vec![true],
                "{what}: H goes out again once, flagged maybe_sent_before"
            );
        } else {
            assert!(
                flags.is_empty(),
                "{what}: H handed out after it was published"
            );
        }
        ctx.drop().await;
    }
    println!("{}", report.join("\n"));
}

/// The same takeover with the stale copy of a *different* aggregate parked in y's claim (the
/// PostgreSQL bug's shape: the parks commit in the claim's first transaction), y released.
#[tokio::test]
async fn a_locked_takeover_parking_another_aggregate_then_releasing() {
    let Some(ctx) = Ctx::new(8).await else {
        return;
    };
    let xs = store_with(
        &ctx,
        lease(LEASE),
        false,
        Duration::from_secs(30),
        HOLD * 30,
    );
    xs.migrate().await.unwrap();
    let ys = store_with(
        &ctx,
        ClaimMode::LockedTransaction,
        false,
        Duration::from_secs(30),
        HOLD * 30,
    );
    // b v1 published, then a stale b v1 copy waits to be parked.
    let b1 = event("b", 1);
    common::append(&ctx, &xs, std::slice::from_ref(&b1)).await;
    let c = claim_run(&ys, "setup", 10, 1).await;
    ys.complete(&c.handle, &publish_outs(&c)).await.unwrap();
    let h = event("a", 1);
    common::append(&ctx, &xs, std::slice::from_ref(&h)).await;
    let x = claim_run(&xs, "x", 10, 1).await;
    assert_eq!(bids(&x), vec![h.event_id.as_uuid()]);
    let stale = event("b", 1);
    common::append(&ctx, &xs, std::slice::from_ref(&stale)).await;
    tokio::time::sleep(Duration::from_millis(450)).await;
    let y = claim_run(&ys, "y", 10, 1).await;
    assert_eq!(bids(&y), vec![h.event_id.as_uuid()], "{:?}", layout(&y));
    assert!(y.records[0].maybe_sent_before);
    assert_eq!(y.parked.len(), 1, "{:?}", y.parked);
    ys.release(&y.handle).await.unwrap();
    let rep = xs.complete(&x.handle, &publish_outs(&x)).await.unwrap();
    println!("x's late completion after the release: {rep:?}");
    let flags = drain_agg(&ys, h.event_id.as_uuid(), "other-aggregate").await;
    let fin = agg_rows(&ctx, "a").await;
    assert_eq!(published_count(&fin, 1), 1, "rows:{}", adump(&fin));
    if rep.applied == 0 {
        assert_eq!(flags, vec![true], "rows:{}", adump(&fin));
    } else {
        assert!(flags.is_empty());
    }
    ctx.drop().await;
}

/// Beside the brief: x's lease ends without an outcome; a LockedTransaction claim y takes H
/// over (flagged `maybe_sent_before`: x may have sent it) and parks it (a permanent error that
/// leaves delivery certain). The operator's view of the parked event must still say that an
/// earlier attempt may have reached the broker (x's), and after `retry_parked` the next claim
/// must hand H out flagged `maybe_sent_before`. A Lease-mode y (which writes
/// `maybe_delivered` at its takeover) is the reference.
///
/// FINDING (mixed46, fixed in stop 46: the locked claim writes `maybe_delivered` in the
/// transaction it keeps): a LockedTransaction claim persisted nothing of "may have been sent": it
/// flags the record (`sent_before` read from x's token on the row) but writes no
/// `maybe_delivered` (only lease mode's `write_leases` does); the park outcome keeps x's token
/// on the row but the row is no longer pending, and `retry_parked` clears the token.
/// Reproduction: Lease store xs (0.3 s), LockedTransaction store ys on one table; append a v1
/// (H); xs claims H; sleep 0.45 s; ys claims H (`maybe_sent_before` = true) and completes it
/// with `Park` (permanent `record_too_large`); `ys.parked_event(H).delivery_uncertain` is
/// false (lease-mode y: true); `retry_parked(H)`; the next claim hands H out with
/// `maybe_sent_before` = false (lease-mode y: true). Fix idea: the locked claim writes
/// `maybe_delivered = 1` on rows it takes over (as lease mode does), in its decision
/// transaction or with the completion.
#[tokio::test]
async fn a_locked_takeover_that_parks_keeps_the_uncertain_delivery() {
    let mut failures = Vec::new();
    for y_mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let what = format!("y={y_mode:?}");
        let Some(ctx) = Ctx::new(8).await else {
            return;
        };
        let xs = store_with(
            &ctx,
            lease(LEASE),
            false,
            Duration::from_secs(30),
            HOLD * 30,
        );
        xs.migrate().await.unwrap();
        let ys = store_with(&ctx, y_mode, false, Duration::from_secs(30), HOLD * 30);
        let h = event("a", 1);
        common::append(&ctx, &xs, std::slice::from_ref(&h)).await;
        let x = claim_run(&xs, "x", 10, 1).await;
        assert_eq!(bids(&x), vec![h.event_id.as_uuid()]);
        tokio::time::sleep(Duration::from_millis(450)).await;
        let y = claim_run(&ys, "y", 10, 1).await;
        assert_eq!(bids(&y), vec![h.event_id.as_uuid()], "{what}");
        assert!(y.records[0].maybe_sent_before, "{what}: takeover flagged");
        let rep = ys.complete(&y.handle, &[park(&h)]).await.unwrap();
        assert_eq!(rep.applied, 1, "{what}");
        let pe = ys.parked_event(h.event_id).await.unwrap();
        ys.retry_parked(h.event_id, "op").await.unwrap();
        let z = claim_run(&ys, "z", 10, 1).await;
        assert_eq!(bids(&z), vec![h.event_id.as_uuid()], "{what}");
        let flagged = z.records[0].maybe_sent_before;
        let rep = ys.complete(&z.handle, &publish_outs(&z)).await.unwrap();
        assert_eq!(rep.applied, 1, "{what}");
        println!(
            "{what}: parked_event.delivery_uncertain={} next claim maybe_sent_before={flagged}",
            pe.delivery_uncertain
        );
        if !pe.delivery_uncertain || !flagged {
            failures.push(format!(
                "{what}: after x's lease ended unresolved and y parked H: \
                 delivery_uncertain={} and, after retry_parked, maybe_sent_before={flagged}",
                pe.delivery_uncertain
            ));
        }
        ctx.drop().await;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The same loss seen by `accept_first_version`: on a fresh aggregate H = a v5 is accepted as
/// the first version and claimed by x (lease 0.3 s); the lease ends unresolved (x may have
/// sent v5); a claim y takes H over and parks it (a permanent error that leaves delivery
/// certain); then v3 commits. Builder docs: "once a version may have reached the broker (... a
/// lease that ended without an outcome or a release), it stays the first: a lower version that
/// commits later is parked as out of order". The next claim must park v3 as out of order,
/// not hand it out (v3 after v5 at the broker). A Lease-mode y is the reference.
///
/// FINDING (mixed46, fixed in stop 46), the order consequence of the one above: the `accept_first_version`
/// view (`min_sent` in `src/outbox/head.rs`) counts a row as maybe sent when it has
/// `maybe_delivered`, or is pending with a claim token; the locked takeover wrote no
/// `maybe_delivered` and the park made the row non-pending, so v5 is forgotten as sent and v3
/// becomes the first version. Reproduction: stores with `accept_first_version(true)`; Lease
/// xs (0.3 s) and LockedTransaction ys; append a v5 (H); xs claims H; sleep 0.45 s; ys claims
/// H and completes it with `Park` (permanent `record_too_large`); append a v3 (committed);
/// ys's next claim hands out a v3 (lease-mode y: the claim parks a v3 as `out_of_order`). If
/// x's send of v5 had reached the broker, v3 now goes out after v5.
#[tokio::test]
async fn accept_first_remembers_a_lost_lease_after_a_locked_park() {
    let mut failures = Vec::new();
    for y_mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let what = format!("y={y_mode:?}");
        let Some(ctx) = Ctx::new(8).await else {
            return;
        };
        let xs = store_with(&ctx, lease(LEASE), true, Duration::from_secs(30), HOLD * 30);
        xs.migrate().await.unwrap();
        let ys = store_with(&ctx, y_mode, true, Duration::from_secs(30), HOLD * 30);
        let h = event("a", 5);
        common::append(&ctx, &xs, std::slice::from_ref(&h)).await;
        let x = claim_run(&xs, "x", 10, 1).await;
        assert_eq!(
            bids(&x),
            vec![h.event_id.as_uuid()],
            "{what}: v5 accepted first"
        );
        tokio::time::sleep(Duration::from_millis(450)).await;
        let y = claim_run(&ys, "y", 10, 1).await;
        assert_eq!(bids(&y), vec![h.event_id.as_uuid()], "{what}");
        assert!(y.records[0].maybe_sent_before, "{what}: takeover flagged");
        let rep = ys.complete(&y.handle, &[park(&h)]).await.unwrap();
        assert_eq!(rep.applied, 1, "{what}");
        let v3 = event("a", 3);
        common::append(&ctx, &xs, std::slice::from_ref(&v3)).await;
        let z = claim_run(&ys, "z", 10, 1).await;
        let handed = bids(&z);
        let parked: Vec<EventId> = z.parked.iter().map(|p| p.event_id).collect();
        if !z.records.is_empty() {
            ys.complete(&z.handle, &publish_outs(&z)).await.unwrap();
        } else {
            ys.release(&z.handle).await.unwrap();
        }
        let fin = agg_rows(&ctx, "a").await;
        println!(
            "{what}: after the park, v3's claim handed out {handed:?} parked {parked:?}; rows:{}",
            adump(&fin)
        );
        let v3_row = fin
            .iter()
            .find(|r| r.event_id == v3.event_id.as_uuid())
            .unwrap();
        if handed.contains(&v3.event_id.as_uuid())
            || (v3_row.status.as_str(), v3_row.park_kind.as_deref())
                != ("parked", Some("out_of_order"))
        {
            failures.push(format!(
                "{what}: v3, committed after v5 may have reached the broker (x's lease ended \
                 unresolved), was handed out instead of parked out of order; rows:{}",
                adump(&fin)
            ));
        }
        ctx.drop().await;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// 3. Operator actions during a takeover.
// ---------------------------------------------------------------------------------------------

/// `a` v1 published; x (lease 0.3 s) claims H = a v2; a stale copy S of v1 commits; after
/// the lease ended a locked claim y takes H over and parks S. While y holds the aggregate the
/// operator discards, retries or re-issues S (waiting for y's lock, then acting on the state
/// y left); y publishes H or releases. What must hold: v1 and v2 each published once, S never
/// published, x's late completion refused after y published, the operator contract (discard
/// allowed, retry refused as out of order, the re-issued copy parked out of order).
#[tokio::test]
async fn operator_actions_on_a_copy_parked_by_a_locked_takeover() {
    for action in ["discard", "retry", "reissue"] {
        for y_end in ["publish", "release"] {
            let what = format!("{action} y_end={y_end}");
            let Some(ctx) = Ctx::new(10).await else {
                return;
            };
            let (xs, ys, x, h, s) = lease_then_stale(&ctx, ClaimMode::LockedTransaction).await;
            let y = claim_run(&ys, "y", 10, 1).await;
            assert_eq!(bids(&y), vec![h.event_id.as_uuid()], "{what}");
            assert_eq!(y.parked.len(), 1, "{what}: {:?}", y.parked);
            let op = {
                let ops = xs.clone();
                let id = s.event_id;
                tokio::spawn(async move {
                    let t0 = Instant::now();
                    let r = match action {
                        "discard" => ops.discard_parked(id, "op", "stale").await.map(|_| None),
                        "retry" => ops.retry_parked(id, "op").await.map(|_| None),
                        _ => ops.reissue_parked(id, "op", "again").await.map(Some),
                    };
                    (r, t0.elapsed())
                })
            };
            tokio::time::sleep(Duration::from_millis(300)).await;
            let waited = !op.is_finished();
            match y_end {
                "publish" => {
                    let rep = ys.complete(&y.handle, &publish_outs(&y)).await.unwrap();
                    assert_eq!(rep.applied, 1, "{what}: {rep:?}");
                }
                _ => ys.release(&y.handle).await.unwrap(),
            }
            let (res, took) = op.await.unwrap();
            println!("{what}: operator waited={waited} ({took:?}): {res:?}");
            match action {
                "discard" => assert!(res.is_ok(), "{what}: {res:?}"),
                "retry" => assert_eq!(
                    res.as_ref().map_err(|e| e.kind),
                    Err(StoreErrorKind::Conflict),
                    "{what}: a retry of a version at or below last is refused"
                ),
                // A re-issue of a version at or below last: refused, or a copy that the next
                // claim parks as out of order (checked below).
                _ => assert!(
                    res.as_ref().is_ok()
                        || res
                            .as_ref()
                            .is_err_and(|e| e.kind == StoreErrorKind::Conflict),
                    "{what}: {res:?}"
                ),
            }
            let rep = xs.complete(&x.handle, &publish_outs(&x)).await.unwrap();
            if y_end == "publish" {
                assert_eq!(rep.applied, 0, "{what}: x's completion after y published H");
            }
            let flags = drain_agg(&ys, h.event_id.as_uuid(), &what).await;
            let fin = agg_rows(&ctx, "a").await;
            println!("{what}: x {rep:?}, flags {flags:?}; rows:{}", adump(&fin));
            assert_eq!(published_count(&fin, 1), 1, "{what}: rows:{}", adump(&fin));
            assert_eq!(published_count(&fin, 2), 1, "{what}: rows:{}", adump(&fin));
            let s_row = fin
                .iter()
                .find(|r| r.event_id == s.event_id.as_uuid())
                .unwrap();
            assert_ne!(s_row.status, "published", "{what}");
            if let Ok(Some(copy)) = res {
                let c = fin
                    .iter()
                    .find(|r| r.event_id == copy.as_uuid())
                    .expect("the re-issued copy");
                assert_eq!(
                    (c.status.as_str(), c.park_kind.as_deref()),
                    ("parked", Some("out_of_order")),
                    "{what}: rows:{}",
                    adump(&fin)
                );
            }
            if y_end == "release" && rep.applied == 0 {
                assert_eq!(flags, vec![true], "{what}: rows:{}", adump(&fin));
            }
            ctx.drop().await;
        }
    }
}

/// A parked copy of the version a locked claim holds: the lease helper's shape
/// (`park_a_copy_beside_its_uncommitted_twin`: a copy C of v1 parked, the lower-id twin T
/// committed after it, pending head). x (lease 0.3 s) claims T; the lease ends; a locked claim
/// y takes T over; while y holds it the operator discards, retries or re-issues C (waiting for
/// y's lock); y then publishes T or releases. Version 1 must be published once, and x's late
/// completion (after the operator's action) must not publish a second copy.
#[tokio::test]
async fn operator_actions_on_a_parked_twin_during_a_locked_takeover() {
    let mut notes = Vec::new();
    for action in ["discard", "retry", "reissue"] {
        for y_end in ["publish", "release"] {
            let what = format!("{action} y_end={y_end}");
            let Some(ctx) = Ctx::new(10).await else {
                return;
            };
            let xs = store_with(
                &ctx,
                lease(LEASE),
                false,
                Duration::from_secs(30),
                HOLD * 30,
            );
            xs.migrate().await.unwrap();
            let ys = store_with(
                &ctx,
                ClaimMode::LockedTransaction,
                false,
                Duration::from_secs(30),
                HOLD * 30,
            );
            let copy = event("a", 1);
            let twin = event("a", 1);
            common::lease::park_a_copy_beside_its_uncommitted_twin(&ctx, &xs, &copy, &twin).await;
            let x = claim_run(&xs, "x", 10, 1).await;
            assert_eq!(bids(&x), vec![twin.event_id.as_uuid()], "{what}");
            tokio::time::sleep(Duration::from_millis(450)).await;
            let y = claim_run(&ys, "y", 10, 1).await;
            assert_eq!(
                bids(&y),
                vec![twin.event_id.as_uuid()],
                "{what}: {:?}",
                layout(&y)
            );
            let op = {
                let ops = xs.clone();
                let id = copy.event_id;
                tokio::spawn(async move {
                    match action {
                        "discard" => ops.discard_parked(id, "op", "dup").await.map(|_| None),
                        "retry" => ops.retry_parked(id, "op").await.map(|_| None),
                        _ => ops.reissue_parked(id, "op", "again").await.map(Some),
                    }
                })
            };
            tokio::time::sleep(Duration::from_millis(300)).await;
            let waited = !op.is_finished();
            match y_end {
                "publish" => {
                    let rep = ys.complete(&y.handle, &publish_outs(&y)).await.unwrap();
                    assert_eq!(rep.applied, 1, "{what}: {rep:?}");
                }
                _ => ys.release(&y.handle).await.unwrap(),
            }
            let res = op.await.unwrap();
            let mid = agg_rows(&ctx, "a").await;
            let rep = xs.complete(&x.handle, &publish_outs(&x)).await.unwrap();
            let after = agg_rows(&ctx, "a").await;
            println!(
                "{what}: operator waited={waited}: {res:?}; rows before x:{}\nx's late \
                 completion {rep:?}; rows:{}",
                adump(&mid),
                adump(&after)
            );
            notes.push(format!(
                "{what}: operator {:?}, x applied {}",
                res.as_ref().map(|_| ()).map_err(|e| e.kind),
                rep.applied
            ));
            assert!(
                published_count(&after, 1) <= 1,
                "{what}: v1 published twice; rows:{}",
                adump(&after)
            );
            let _ = drain_agg(&ys, twin.event_id.as_uuid(), &what).await;
            let fin = agg_rows(&ctx, "a").await;
            assert!(
                published_count(&fin, 1) <= 1,
                "{what}: v1 published twice; rows:{}",
                adump(&fin)
            );
            // v1 goes out once unless the operator discarded it (a discard raises last to 1
            // while the twin was in flight: then the twin is refused or parked).
            let discarded = fin.iter().any(|r| r.status == "discarded");
            assert!(
                published_count(&fin, 1) == 1 || discarded,
                "{what}: v1 neither published nor discarded; rows:{}",
                adump(&fin)
            );
            assert_eq!(
                fin.iter().filter(|r| r.status == "pending").count(),
                0,
                "{what}: rows:{}",
                adump(&fin)
            );
            ctx.drop().await;
        }
    }
    println!("{}", notes.join("\n"));
}

/// `release_claims_of(x)` racing x's late completion (its lease ended, or still live): either
/// the completion applies first (the release finds nothing) or the release ends the claim
/// (x refused, H flagged `maybe_sent_before` at its next handout); H is published once.
#[tokio::test]
async fn release_claims_of_racing_a_late_completion() {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut rng = Rng(seed_from_env());
    for round in 0..12 {
        let expired = round % 2 == 0;
        let what = format!("round {round} expired={expired}");
        let Some(ctx) = Ctx::new(10).await else {
            return;
        };
        let secs = if expired { LEASE } else { 30.0 };
        let xs = store_with(&ctx, lease(secs), false, Duration::from_secs(30), HOLD * 30);
        xs.migrate().await.unwrap();
        let ops = store_with(&ctx, lease(30.0), false, Duration::from_secs(30), HOLD * 30);
        let h = event("a", 1);
        common::append(&ctx, &xs, std::slice::from_ref(&h)).await;
        let x = claim_run(&xs, "x", 10, 1).await;
        assert_eq!(bids(&x), vec![h.event_id.as_uuid()], "{what}");
        if expired {
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        let d1 = rng.below(15);
        let d2 = rng.below(15);
        let done = {
            let (xs, x) = (xs.clone(), x.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(d1)).await;
                xs.complete(&x.handle, &publish_outs(&x)).await
            })
        };
        let rel = {
            let ops = ops.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(d2)).await;
                ops.release_claims_of("x", "op").await
            })
        };
        let rep = done.await.unwrap().unwrap();
        let released = rel.await.unwrap().unwrap();
        let mid = agg_rows(&ctx, "a").await;
        let flags = drain_agg(&ops, h.event_id.as_uuid(), &what).await;
        let fin = agg_rows(&ctx, "a").await;
        let key = format!(
            "expired={expired} applied={} released={released} flags={flags:?}",
            rep.applied
        );
        *seen.entry(key).or_default() += 1;
        assert_eq!(published_count(&fin, 1), 1, "{what}: rows:{}", adump(&fin));
        if rep.applied == 1 {
            assert!(flags.is_empty(), "{what}: {flags:?}");
            assert_eq!(mid[0].status, "published", "{what}");
        } else {
            assert_eq!(
                flags,
                vec![true],
                "{what}: x's claim ended by the operator, unresolved: the next handout is \
                 flagged; rows:{}",
                adump(&mid)
            );
            assert_eq!(released, 1, "{what}: x refused though nothing released it");
        }
        ctx.drop().await;
    }
    println!("{seen:#?}");
}

// ---------------------------------------------------------------------------------------------
// 4. stats().in_flight with runs.
// ---------------------------------------------------------------------------------------------

/// Three versions of one aggregate (in one statement, or in three), claimed with a run of 3 by
/// a Lease-mode and by a LockedTransaction-mode store: `in_flight` counts the records handed
/// out (MariaDB hands out heads only: one).
#[tokio::test]
async fn in_flight_counts_a_claimed_run() {
    let mut failures = Vec::new();
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        for one_statement in [true, false] {
            let what = format!("{mode:?} one_statement={one_statement}");
            let Some(ctx) = Ctx::new(8).await else {
                return;
            };
            let s = store_with(&ctx, mode, false, Duration::from_secs(30), HOLD * 30);
            s.migrate().await.unwrap();
            let evs: Vec<Envelope> = (1..=3).map(|v| event("a", v)).collect();
            if one_statement {
                common::append(&ctx, &s, &evs).await;
            } else {
                let mut tx = ctx.pool.begin().await.unwrap();
                for e in &evs {
                    s.append_many_in(&mut tx, std::slice::from_ref(e))
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
            }
            let b = claim_run(&s, "k", 10, 3).await;
            assert!(!b.records.is_empty(), "{what}: nothing claimed");
            let st = s.stats().await.unwrap();
            println!(
                "{what}: handed out {:?}, in_flight {}, unpublished {}, blocked {}",
                layout(&b),
                st.in_flight,
                st.unpublished,
                st.blocked
            );
            if st.in_flight != b.records.len() as u64 {
                failures.push(format!(
                    "{what}: in_flight {} for {} records handed out",
                    st.in_flight,
                    b.records.len()
                ));
            }
            let rep = s.complete(&b.handle, &publish_outs(&b)).await.unwrap();
            assert_eq!(rep.applied, b.records.len(), "{what}");
            let st = s.stats().await.unwrap();
            assert_eq!(st.in_flight, 0, "{what}: after the completion");
            ctx.drop().await;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
