//! Adversary pass (helper promote47) over the merged `mark_run` update of the claim decision:
//! the possibly-sent mark of an expired lease's run and the promotion after a parked stale or
//! bad-key head are written by one update driven by the per-aggregate `ag`.
//!
//! Attacked here:
//! 1. hand-built windows where one aggregate has at once a stale head (a late copy of a
//!    published version) parked, a claimed head whose expired lease covered a run, copies
//!    (followers) before, at and after the run, blocked rows around the first follower, and
//!    bad-key heads (names over `MAX_AGGREGATE_NAME_BYTES`, written by plain SQL) beside
//!    them; every configuration (claim mode, run 1 and 3, `accept_first_version`). Checked:
//!    every row the lease may have sent is flagged `maybe_sent_before` when handed out again,
//!    versions go out in order, nothing stays stuck, and the ledger of `common/ledger45.rs`;
//! 2. a randomized mix (seed `PRM47_SEED`, default 47; `PRM47_SECS`, default 25) of producers
//!    (lower versions committing after higher ones, late stale copies, gaps, bad-key rows),
//!    lease relays abandoning runs, locked relays, two relays at once, operator retries and
//!    discards; after each step the ledger and a stuck check (an aggregate whose lowest
//!    pending row is blocked with nothing ahead of it and nothing in flight).
#![allow(dead_code)]

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, ClaimedBatch, CompletionReport, Envelope, EventId, Outcome, StoreError,
    MAX_AGGREGATE_NAME_BYTES,
};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::claim_run;
use uuid::Uuid;

use common::{event, lease, published, retry, Ctx};

include!("common/ledger45.rs");

/// Writes an event of `agg` under an aggregate type longer than the bound (plain SQL), and
/// records it in the ledger.
async fn put_bad(ctx: &Ctx, l: &L, agg: &str, v: i64) -> Uuid {
    let e = event("raw", v);
    let ty = "t".repeat(MAX_AGGREGATE_NAME_BYTES + 1);
    sqlx::query(&format!(
        "INSERT INTO \"{}\".outbox_events (event_id, aggregate_type, aggregate_id, \
           aggregate_version, event_type, schema_version, content_type, payload, created_at) \
         VALUES ($1, $2, $3, $4, $5, 1, 'application/json', $6, now())",
        ctx.schema
    ))
    .bind(e.event_id.as_uuid())
    .bind(&ty)
    .bind(agg)
    .bind(v)
    .bind(&e.event_type)
    .bind(&e.payload.bytes)
    .execute(&ctx.pool)
    .await
    .unwrap();
    let s = l.tick();
    l.g().rows.insert(
        e.event_id.as_uuid(),
        Info {
            agg: agg.to_owned(),
            v,
            commit: Some(s),
            rolled_back: false,
        },
    );
    e.event_id.as_uuid()
}

/// Aggregates whose lowest pending row is blocked with nothing ahead of it: no parked row
/// above the last version before it, no live lease; `skip` aggregates are left out (an open
/// producer transaction, an open locked claim).
async fn stuck(ctx: &Ctx, skip: &HashSet<String>) -> Vec<String> {
    let got: Vec<(String, String)> = sqlx::query_as(&format!(
        "SELECT r.aggregate_id, format('%s v%s (row %s)', r.aggregate_id, r.aggregate_version, \
                r.id) \
         FROM (SELECT DISTINCT ON (aggregate_type, aggregate_id) * FROM {t} \
               WHERE status = 'pending' \
               ORDER BY aggregate_type, aggregate_id, aggregate_version, id) r \
         LEFT JOIN \"{s}\".outbox_events_aggregate a \
           ON a.aggregate_type = r.aggregate_type AND a.aggregate_id = r.aggregate_id \
         WHERE r.blocked AND NOT COALESCE(a.lease_until > clock_timestamp(), false) \
           AND NOT EXISTS (SELECT 1 FROM {t} u \
             WHERE u.aggregate_type = r.aggregate_type AND u.aggregate_id = r.aggregate_id \
               AND (u.aggregate_version, u.id) < (r.aggregate_version, r.id) \
               AND u.status = 'parked' \
               AND u.aggregate_version > COALESCE(a.last_version, 0)) \
         ORDER BY r.id",
        t = format!("\"{}\".outbox_events", ctx.schema),
        s = ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    got.into_iter()
        .filter(|(a, _)| !skip.contains(a))
        .map(|(_, m)| m)
        .collect()
}

/// Every record of `c` that an abandoned lease handed out (`unresolved`) is flagged.
fn flagged(c: &Claim, unresolved: &HashSet<Uuid>, what: &str) {
    for r in &c.b.records {
        assert!(
            !unresolved.contains(&r.envelope.event_id.as_uuid()) || r.maybe_sent_before,
            "{what}: {} v{} handed out again after a lease that ended without outcome, not \
             flagged maybe_sent_before",
            r.envelope.aggregate_id,
            r.envelope.aggregate_version
        );
    }
}

/// Claims and publishes until nothing is left to hand out; flags, order (each aggregate's
/// versions one after the other from `from`) and the ledger checked after each claim.
#[allow(clippy::too_many_arguments)]
async fn drain_checked(
    ctx: &Ctx,
    l: &L,
    store: &PostgresOutboxStore,
    run: usize,
    unresolved: &HashSet<Uuid>,
    last: &mut HashMap<String, i64>,
    what: &str,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c = claim(l, store, "drain", 7, run).await;
        flagged(&c, unresolved, what);
        for r in &c.b.records {
            let a = r.envelope.aggregate_id.clone();
            let v = r.envelope.aggregate_version;
            if let Some(p) = last.insert(a.clone(), v) {
                assert_eq!(v, p + 1, "{what}: {a} v{v} handed out after v{p}");
            }
        }
        if c.b.records.is_empty() {
            store.release(&c.b.handle).await.unwrap();
        } else {
            let outs = outcomes(&c.b, usize::MAX, None);
            complete(l, store, &c, &outs).await;
        }
        check(ctx, l, true, what).await;
        if c.b.records.is_empty() && c.b.parked.is_empty() && c.b.gaps_held == 0 {
            let left = stalled(ctx).await;
            let st = stuck(ctx, &HashSet::new()).await;
            if left.is_empty() && st.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: never handed out: {left:?}, stuck: {st:?}\nrows:{}",
                dump(&rows(ctx).await, &l.g())
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Hand-built windows.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct Shape {
    /// A late copy of v1 (published): a stale head, parked.
    stale: bool,
    /// A second late stale copy (two parked heads of one aggregate).
    stale2: bool,
    /// A copy of this version appended alone (unblocked) after x's claim: a follower.
    copy_at: Option<i64>,
    /// A bad-key head beside (another aggregate), and one of `e`'s id under a long type.
    bad_key: bool,
    /// x's lease covered its head's run (3 rows) or the head only.
    x_run: usize,
    /// v2..v6 appended in one batch (v3.. blocked at insert) or one by one.
    batch: bool,
}

fn shapes() -> Vec<Shape> {
    let mut v = Vec::new();
    for copy_at in [None, Some(2), Some(3), Some(4), Some(6)] {
        for (stale, stale2, bad_key) in [
            (true, false, false),
            (true, true, true),
            (false, false, true),
        ] {
            v.push(Shape {
                stale,
                stale2,
                copy_at,
                bad_key,
                x_run: 3,
                batch: true,
            });
        }
    }
    v.push(Shape {
        stale: true,
        stale2: false,
        copy_at: Some(3),
        bad_key: true,
        x_run: 3,
        batch: false,
    });
    v.push(Shape {
        stale: true,
        stale2: false,
        copy_at: Some(3),
        bad_key: false,
        x_run: 1,
        batch: true,
    });
    v
}

async fn window(mode: ClaimMode, accept_first: bool, run: usize, sh: Shape) {
    let ctx = ctx!(6);
    let what = format!("{mode:?} accept_first={accept_first} run={run} {sh:?}");
    let l = L::default();
    let x = store_with(&ctx, lease(0.2), accept_first, LONG_GAP);
    x.migrate().await.unwrap();
    let y = store_with(&ctx, mode, accept_first, LONG_GAP);
    append_now(&ctx, &x, &l, "e", &[1]).await;
    let c = claim(&l, &x, "x0", 10, 1).await;
    complete(&l, &x, &c, &outcomes(&c.b, usize::MAX, None)).await;
    if sh.batch {
        append_now(&ctx, &x, &l, "e", &[2, 3, 4, 5, 6]).await;
    } else {
        for v in 2..=6 {
            append_now(&ctx, &x, &l, "e", &[v]).await;
        }
    }
    let cx = claim(&l, &x, "x", 10, sh.x_run).await;
    assert_eq!(cx.b.records.len(), sh.x_run, "{what}");
    let unresolved: HashSet<Uuid> = cx.ids().into_iter().collect();
    tokio::time::sleep(Duration::from_millis(400)).await;
    if sh.stale {
        append_now(&ctx, &x, &l, "e", &[1]).await;
    }
    if let Some(v) = sh.copy_at {
        append_now(&ctx, &x, &l, "e", &[v]).await;
    }
    if sh.stale2 {
        append_now(&ctx, &x, &l, "e", &[1]).await;
    }
    if sh.bad_key {
        put_bad(&ctx, &l, &"b".repeat(MAX_AGGREGATE_NAME_BYTES + 1), 1).await;
        let v2 = put_bad(&ctx, &l, &"b".repeat(MAX_AGGREGATE_NAME_BYTES + 1), 2).await;
        put_bad(&ctx, &l, &"b".repeat(MAX_AGGREGATE_NAME_BYTES + 1), 3).await;
        // v2 and v3 blocked (as a batch of a writer without the bound): each parked head
        // promotes the next.
        sqlx::query(&format!(
            "UPDATE \"{}\".outbox_events SET blocked = true \
             WHERE aggregate_id = $1 AND aggregate_version > 1",
            ctx.schema
        ))
        .bind("b".repeat(MAX_AGGREGATE_NAME_BYTES + 1))
        .execute(&ctx.pool)
        .await
        .unwrap();
        let _ = v2;
    }
    let mut last = HashMap::from([("e".to_owned(), 1)]);
    // The decision under attack: one claim of the whole window.
    let c = claim(&l, &y, "y", 20, run).await;
    flagged(&c, &unresolved, &what);
    let marked: Vec<(i64, bool, bool, String)> = sqlx::query_as(&format!(
        "SELECT aggregate_version, maybe_delivered, blocked, status FROM \"{}\".outbox_events \
         WHERE event_id = ANY($1) ORDER BY aggregate_version",
        ctx.schema
    ))
    .bind(cx.ids())
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    for (v, md, _, st) in &marked {
        assert!(
            *md || *st != "pending",
            "{what}: x's v{v} not marked possibly sent after the takeover: {marked:?}\nrows:{}",
            dump(&rows(&ctx).await, &l.g())
        );
    }
    for r in &c.b.records {
        let a = r.envelope.aggregate_id.clone();
        let v = r.envelope.aggregate_version;
        if let Some(p) = last.insert(a.clone(), v) {
            assert_eq!(v, p + 1, "{what}: {a} v{v} after v{p}");
        }
    }
    // Sometimes the claim retries its last record: handed out again later, still flagged.
    let outs = outcomes(&c.b, usize::MAX, None);
    complete(&l, &y, &c, &outs).await;
    check(&ctx, &l, true, &what).await;
    drain_checked(&ctx, &l, &y, run, &unresolved, &mut last, &what).await;
    assert_eq!(last.get("e"), Some(&6), "{what}: e not drained: {last:?}");
    let left: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events WHERE status = 'pending'",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(
        left,
        0,
        "{what}: pending rows left\nrows:{}",
        dump(&rows(&ctx).await, &l.g())
    );
    ctx.drop().await;
}

async fn windows(mode: ClaimMode, accept_first: bool) {
    for run in [1, 3] {
        for sh in shapes() {
            window(mode, accept_first, run, sh).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_of_stale_heads_expired_runs_and_followers_lease() {
    windows(lease(30.0), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_of_stale_heads_expired_runs_and_followers_lease_accept_first() {
    windows(lease(30.0), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_of_stale_heads_expired_runs_and_followers_locked() {
    windows(ClaimMode::LockedTransaction, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_of_stale_heads_expired_runs_and_followers_locked_accept_first() {
    windows(ClaimMode::LockedTransaction, true).await;
}

// ---------------------------------------------------------------------------------------------
// 2. Randomized: producers, two relays, operators.
// ---------------------------------------------------------------------------------------------

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, pct: usize) -> bool {
        self.below(100) < pct
    }
}

const AGGS: [&str; 3] = ["a", "b", "c"];

struct World {
    ctx: Ctx,
    l: L,
    short: PostgresOutboxStore,
    long: PostgresOutboxStore,
    locked: PostgresOutboxStore,
    unresolved: HashSet<Uuid>,
    abandoned_long: Vec<String>,
    locked_open_until: Option<Instant>,
    next: HashMap<String, i64>,
    open: Vec<(Tx, Vec<String>)>,
    bad: String,
    bad_next: i64,
    handouts: usize,
    resends: usize,
    takeovers: usize,
    both_in_one: usize,
}

impl World {
    fn seen(&mut self, c: &Claim, what: &str) {
        self.handouts += c.b.records.len();
        for r in &c.b.records {
            if r.maybe_sent_before {
                self.resends += 1;
            }
            if self.unresolved.contains(&r.envelope.event_id.as_uuid()) {
                self.takeovers += 1;
                // The window under attack: a takeover and a park in one aggregate.
                if c.b
                    .parked
                    .iter()
                    .any(|p| p.aggregate_id == r.envelope.aggregate_id)
                {
                    self.both_in_one += 1;
                }
            }
        }
        flagged(c, &self.unresolved, what);
    }

    async fn lease_claim(&mut self, rng: &mut Rng, step: usize, what: &str) {
        let use_short = rng.chance(75);
        let owner = format!("r{step}");
        let run = [1, 3, 3][rng.below(3)];
        let limit = 2 + rng.below(10);
        let c = {
            let store = if use_short { &self.short } else { &self.long };
            claim(&self.l, store, &owner, limit, run).await
        };
        self.seen(&c, what);
        let store = if use_short { &self.short } else { &self.long };
        if c.b.records.is_empty() {
            store.release(&c.b.handle).await.unwrap();
            return;
        }
        match rng.below(10) {
            0..=2 => {
                let outs = outcomes(&c.b, usize::MAX, None);
                complete(&self.l, store, &c, &outs).await;
            }
            3 | 4 => {
                let outs = outcomes(&c.b, rng.below(2), Some(retry));
                complete(&self.l, store, &c, &outs).await;
            }
            5 => {
                let outs = outcomes(&c.b, rng.below(2), Some(common::park));
                complete(&self.l, store, &c, &outs).await;
            }
            6 => store.release(&c.b.handle).await.unwrap(),
            _ => {
                self.unresolved.extend(c.ids());
                if !use_short {
                    self.abandoned_long.push(owner);
                }
            }
        }
    }

    async fn locked_claim(&mut self, rng: &mut Rng, step: usize, what: &str) {
        let run = [1, 3][rng.below(2)];
        let limit = 2 + rng.below(10);
        let c = claim(&self.l, &self.locked, &format!("k{step}"), limit, run).await;
        self.seen(&c, what);
        if c.b.records.is_empty() {
            self.locked.release(&c.b.handle).await.unwrap();
            return;
        }
        match rng.below(10) {
            0..=5 => {
                let outs = outcomes(&c.b, usize::MAX, None);
                complete(&self.l, &self.locked, &c, &outs).await;
            }
            6 => {
                let outs = outcomes(&c.b, rng.below(2), Some(retry));
                complete(&self.l, &self.locked, &c, &outs).await;
            }
            7 => {
                let outs = outcomes(&c.b, rng.below(2), Some(common::park));
                complete(&self.l, &self.locked, &c, &outs).await;
            }
            8 => self.locked.release(&c.b.handle).await.unwrap(),
            _ => {
                // Abandoned: ended by `locked_max_hold` (1 s); the claim is dropped.
                self.locked_open_until = Some(Instant::now() + Duration::from_millis(1_600));
            }
        }
    }

    /// A lease claim and a locked claim at once; both publish everything.
    async fn both(&mut self, step: usize, what: &str) {
        let (p, q) = (format!("p{step}"), format!("q{step}"));
        let (a, b) = tokio::join!(
            claim(&self.l, &self.short, &p, 6, 3),
            claim(&self.l, &self.locked, &q, 6, 3)
        );
        self.seen(&a, what);
        self.seen(&b, what);
        let oa = outcomes(&a.b, usize::MAX, None);
        let ob = outcomes(&b.b, usize::MAX, None);
        let (ra, rb) = tokio::join!(
            try_complete(&self.l, &self.short, &a, &oa),
            try_complete(&self.l, &self.locked, &b, &ob)
        );
        assert_eq!(ra.unwrap().superseded, 0, "{what}");
        assert_eq!(rb.unwrap().superseded, 0, "{what}");
    }

    async fn append(&mut self, rng: &mut Rng) {
        if rng.chance(6) {
            let v = if rng.chance(30) {
                self.bad_next.max(2) - 1
            } else {
                self.bad_next += 1;
                self.bad_next - 1
            };
            put_bad(&self.ctx, &self.l, &self.bad, v).await;
            return;
        }
        let agg = AGGS[rng.below(AGGS.len())].to_owned();
        let v0 = *self.next.get(&agg).unwrap_or(&1);
        let mut vs = vec![v0];
        while vs.len() < 4 && rng.chance(35) {
            vs.push(v0 + vs.len() as i64);
        }
        if v0 > 1 && rng.chance(25) {
            // A late copy of an earlier version (stale once that version went out).
            vs = vec![1 + rng.below((v0 - 1) as usize) as i64];
        } else if rng.chance(4) {
            // A gap: a version skipped for good.
            vs = vec![v0 + 1];
            self.next.insert(agg.clone(), v0 + 2);
        } else {
            self.next.insert(agg.clone(), v0 + vs.len() as i64);
        }
        let mut t = open(&self.ctx).await;
        t.put(&self.short, &self.l, &agg, &vs).await;
        if self.open.len() < 3 && rng.chance(40) {
            self.open.push((t, vec![agg]));
        } else {
            t.commit(&self.l).await;
        }
    }

    async fn end_open(&mut self, rng: &mut Rng) {
        if self.open.is_empty() {
            return;
        }
        let (t, _) = self.open.remove(rng.below(self.open.len()));
        if rng.chance(10) {
            t.rollback(&self.l).await;
        } else {
            t.commit(&self.l).await;
        }
    }

    async fn operator_step(&mut self, rng: &mut Rng) {
        let parked: Vec<Row> = rows(&self.ctx)
            .await
            .into_iter()
            .filter(|r| r.status == "parked")
            .collect();
        match rng.below(4) {
            0 | 1 if !parked.is_empty() => {
                let r = &parked[rng.below(parked.len())];
                let s = self.l.tick();
                match self
                    .short
                    .retry_parked(EventId::from_uuid(r.event_id), "op")
                    .await
                {
                    Ok(()) => {
                        self.l
                            .g()
                            .retried
                            .push((r.aggregate_id.clone(), r.aggregate_version, s))
                    }
                    // A bad-key row cannot be retried (Validation).
                    Err(e) => assert!(
                        e.kind == outbox_core::StoreErrorKind::Conflict
                            || r.aggregate_id == self.bad
                                && e.kind == outbox_core::StoreErrorKind::Validation,
                        "{e:?}"
                    ),
                }
            }
            2 if !parked.is_empty() => {
                let r = &parked[rng.below(parked.len())];
                let done = self
                    .short
                    .discard_parked(EventId::from_uuid(r.event_id), "op", "gone")
                    .await;
                if let Err(e) = done {
                    assert_eq!(e.kind, outbox_core::StoreErrorKind::Conflict, "{e:?}");
                }
            }
            _ => {
                if !self.abandoned_long.is_empty() {
                    let o = self
                        .abandoned_long
                        .remove(rng.below(self.abandoned_long.len()));
                    self.short.release_claims_of(&o, "op").await.unwrap();
                }
            }
        }
    }

    async fn check_stuck(&self, what: &str) {
        if self.locked_open_until.is_some_and(|t| Instant::now() <= t) {
            return;
        }
        let skip: HashSet<String> = self.open.iter().flat_map(|(_, a)| a.clone()).collect();
        let st = stuck(&self.ctx, &skip).await;
        assert!(
            st.is_empty(),
            "{what}: stuck: {st:?}\nrows:{}",
            dump(&rows(&self.ctx).await, &self.l.g())
        );
    }
}

/// Operator at the end: bad-key rows discarded, the rest as `operator` (ledger45).
async fn final_operator(w: &World) {
    for r in rows(&w.ctx).await {
        if r.status == "parked" && r.aggregate_id == w.bad {
            w.short
                .discard_parked(EventId::from_uuid(r.event_id), "op", "bad key")
                .await
                .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_stale_heads_expired_runs_and_operators() {
    let seed = common::env_seed("PRM47_SEED").unwrap_or(47);
    let secs = std::env::var("PRM47_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(25u64);
    eprintln!(
        "randomized_stale_heads_expired_runs_and_operators: PRM47_SEED={seed} PRM47_SECS={secs}"
    );
    let mut rng = Rng(seed);
    let ctx = ctx!(12);
    let gap = Duration::from_millis(800);
    let accept_first = seed % 2 == 1;
    let short = store_with(&ctx, lease(0.3), accept_first, gap);
    short.migrate().await.unwrap();
    let long = store_with(&ctx, lease(30.0), accept_first, gap);
    let locked = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(ClaimMode::LockedTransaction)
        .accept_first_version(accept_first)
        .gap_timeout(gap)
        .locked_max_hold(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut w = World {
        ctx,
        l: L::default(),
        short,
        long,
        locked,
        unresolved: HashSet::new(),
        abandoned_long: Vec::new(),
        locked_open_until: None,
        next: HashMap::new(),
        open: Vec::new(),
        bad: "z".repeat(MAX_AGGREGATE_NAME_BYTES + 1),
        bad_next: 1,
        handouts: 0,
        resends: 0,
        takeovers: 0,
        both_in_one: 0,
    };
    let start = Instant::now();
    let mut step = 0;
    while start.elapsed() < Duration::from_secs(secs) && step < 3_000 {
        step += 1;
        let what = format!("seed {seed} step {step}");
        match rng.below(100) {
            0..=29 => w.append(&mut rng).await,
            30..=39 => w.end_open(&mut rng).await,
            40..=61 => w.lease_claim(&mut rng, step, &what).await,
            62..=75 => w.locked_claim(&mut rng, step, &what).await,
            76..=81 => w.both(step, &what).await,
            82..=91 => w.operator_step(&mut rng).await,
            _ => tokio::time::sleep(Duration::from_millis(350)).await,
        }
        check(&w.ctx, &w.l, true, &what).await;
        w.check_stuck(&what).await;
    }
    while !w.open.is_empty() {
        let (t, _) = w.open.remove(0);
        t.commit(&w.l).await;
    }
    for o in std::mem::take(&mut w.abandoned_long) {
        w.short.release_claims_of(&o, "op").await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    let what = format!("seed {seed} settle");
    let mut last = HashMap::new();
    drain_checked(&w.ctx, &w.l, &w.short, 3, &w.unresolved, &mut last, &what).await;
    final_operator(&w).await;
    settle(&w.ctx, &w.l, &w.short, 1, &what).await;
    eprintln!(
        "seed {seed} accept_first={accept_first}: {step} steps, {} handed out ({} possibly \
         sent, {} re-handouts of abandoned leases' rows, {} of them beside a park of their \
         aggregate)",
        w.handouts, w.resends, w.takeovers, w.both_in_one
    );
    assert!(w.handouts > 0 && w.takeovers > 0);
    w.ctx.drop().await;
}
