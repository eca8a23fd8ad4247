//! Adversary pass (helper adv43) over three claim changes: the follower rule that counts a
//! blocked earlier copy of the candidate's version (f30d801), lease runs handed out unjoined and
//! kept by the store when their head's lease was won (ffb24b9), and the held gaps a locked claim
//! reports over its decisions (c016168).
//!
//! Every test checks, after each step, what the store contract promises about duplicates and
//! order: the first appended copy of each version is the one published, versions go out in
//! order per aggregate, nothing stalls (every pending row is claimed or waits behind a parked
//! row above `last`), and `common::no_orphans`.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimedBatch, Envelope, EventId, Outcome};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::{batch_layout as layout, claim_run, run_layout as run_of};

use common::{event, lease, park, published, retry, Ctx};

fn modes() -> [ClaimMode; 2] {
    [lease(30.0), ClaimMode::LockedTransaction]
}

fn store_with(ctx: &Ctx, mode: ClaimMode, accept_first: bool) -> PostgresOutboxStore {
    PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .accept_first_version(accept_first)
        .gap_timeout(Duration::from_millis(300))
        .build()
        .expect("build")
}

async fn exec(ctx: &Ctx, sql: &str) {
    sqlx::query(&sql.replace("{s}", &ctx.schema))
        .execute(&ctx.pool)
        .await
        .unwrap();
}

/// What the test appended (in append order) and published (in completion order).
#[derive(Default)]
struct Model {
    /// (aggregate, version, event id), in append order (one append at a time: id order).
    appended: Vec<(String, i64, EventId)>,
    /// (aggregate, version, event id) of every applied publication, in completion order.
    published: Vec<(String, i64, EventId)>,
}

impl Model {
    async fn batch(&mut self, ctx: &Ctx, store: &PostgresOutboxStore, agg: &str, vs: &[i64]) {
        let evs: Vec<Envelope> = vs.iter().map(|v| event(agg, *v)).collect();
        store.append_many(&ctx.pool, &evs).await.unwrap();
        for e in evs {
            self.appended
                .push((agg.to_owned(), e.aggregate_version, e.event_id));
        }
    }

    /// One event alone (a single append: never blocked at insert).
    async fn one(&mut self, ctx: &Ctx, store: &PostgresOutboxStore, agg: &str, v: i64) {
        self.batch(ctx, store, agg, &[v]).await;
    }

    /// The event id of the `nth` (0-based) copy of `agg` at `v`, in append order.
    fn copy(&self, agg: &str, v: i64, nth: usize) -> EventId {
        self.appended
            .iter()
            .filter(|(a, x, _)| a == agg && *x == v)
            .nth(nth)
            .expect("copy")
            .2
    }

    /// Completes `batch` publishing a prefix of each run of `n` records (all with `usize::MAX`),
    /// then `tail` for the record after it; logs what applied.
    async fn complete(
        &mut self,
        store: &PostgresOutboxStore,
        batch: &ClaimedBatch,
        n: usize,
        tail: Option<fn(&Envelope) -> Outcome>,
    ) {
        let mut outs = Vec::new();
        let mut logged = Vec::new();
        let mut i = 0;
        while i < batch.records.len() {
            // One aggregate's run: its records are adjacent, head first.
            let mut j = i + 1;
            while j < batch.records.len() && batch.records[j].run_position > 0 {
                j += 1;
            }
            for (k, r) in batch.records[i..j].iter().enumerate() {
                if k < n {
                    outs.push(published(&r.envelope, k as i64));
                    logged.push(r.envelope.clone());
                } else {
                    if let Some(t) = tail {
                        outs.push(t(&r.envelope));
                    }
                    break;
                }
            }
            i = j;
        }
        let rep = store.complete(&batch.handle, &outs).await.unwrap();
        assert_eq!(
            rep.superseded, 0,
            "a live claim's prefix is refused: {rep:?}"
        );
        for e in logged {
            self.published
                .push((e.aggregate_id.clone(), e.aggregate_version, e.event_id));
        }
    }
}

/// The contract's order properties over the database and the model; panics on the first
/// broken one.
async fn check(ctx: &Ctx, m: &Model) {
    common::no_orphans(ctx).await;
    let t = format!("\"{}\".outbox_events", ctx.schema);
    // One publication per version of an aggregate.
    let twice: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT format('%s v%s', aggregate_id, aggregate_version) FROM {t} \
         WHERE status = 'published' GROUP BY aggregate_id, aggregate_version HAVING count(*) > 1"
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert!(twice.is_empty(), "versions published twice: {twice:?}");
    // The first appended copy of a version is the one published (an earlier copy can only
    // have been discarded by an operator).
    let later: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT format('%s v%s: row %s published, earlier row %s is %s', p.aggregate_id, \
                       p.aggregate_version, p.id, e.id, e.status) \
         FROM {t} p JOIN {t} e ON e.aggregate_type = p.aggregate_type \
           AND e.aggregate_id = p.aggregate_id AND e.aggregate_version = p.aggregate_version \
           AND e.id < p.id \
         WHERE p.status = 'published' AND e.status <> 'discarded'"
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert!(
        later.is_empty(),
        "a later copy of a version went out: {later:?}"
    );
    // The database's publications are the model's, in increasing versions per aggregate.
    let db: HashSet<uuid::Uuid> = sqlx::query_scalar(&format!(
        "SELECT event_id FROM {t} WHERE status = 'published'"
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let logged: HashSet<uuid::Uuid> = m.published.iter().map(|p| p.2.as_uuid()).collect();
    assert_eq!(db, logged, "published rows and applied publications differ");
    let mut last: HashMap<&str, i64> = HashMap::new();
    for (a, v, _) in &m.published {
        if let Some(l) = last.get(a.as_str()) {
            assert!(v > l, "{a}: v{v} published after v{l}: {:?}", m.published);
        }
        last.insert(a, *v);
    }
}

/// Pending rows that nothing will hand out: no parked row of their aggregate above `last`
/// precedes them in (version, id). After a drain there must be none.
async fn stalled(ctx: &Ctx) -> Vec<String> {
    sqlx::query_scalar(&format!(
        "SELECT format('%s v%s (row %s, blocked %s, due %s)', r.aggregate_id, \
                       r.aggregate_version, r.id, r.blocked, r.next_attempt_at <= now()) \
         FROM {t} r WHERE r.status = 'pending' AND NOT EXISTS ( \
           SELECT 1 FROM {t} u \
           LEFT JOIN \"{s}\".outbox_events_aggregate a \
             ON a.aggregate_type = u.aggregate_type AND a.aggregate_id = u.aggregate_id \
           WHERE u.aggregate_type = r.aggregate_type AND u.aggregate_id = r.aggregate_id \
             AND (u.aggregate_version, u.id) < (r.aggregate_version, r.id) \
             AND u.status = 'parked' AND u.aggregate_version > COALESCE(a.last_version, 0)) \
         ORDER BY r.id",
        t = format!("\"{}\".outbox_events", ctx.schema),
        s = ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Claims (runs of `run`) and publishes everything claimable until no pending row is left
/// outside a parked aggregate, checking after each step; panics after 10 s.
async fn drain(ctx: &Ctx, store: &PostgresOutboxStore, m: &mut Model, run: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let b = claim_run(store, "drain", 7, run).await;
        check_lease_upto(ctx, &b, "drain").await;
        if !b.records.is_empty() {
            m.complete(store, &b, usize::MAX, None).await;
        } else {
            store.release(&b.handle).await.unwrap();
        }
        check(ctx, m).await;
        if b.records.is_empty() && b.parked.is_empty() && b.gaps_held == 0 {
            let left = stalled(ctx).await;
            if left.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "pending rows never handed out: {left:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Lease mode: the state row of every aggregate of `b` carries this claim's lease, its head as
/// `lease_row` and the last handed-out version as `lease_upto`.
async fn check_lease_upto(ctx: &Ctx, b: &ClaimedBatch, owner: &str) {
    let mut upto: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for r in &b.records {
        let e = &r.envelope;
        let entry = upto
            .entry(e.aggregate_id.clone())
            .or_insert((e.aggregate_version, e.aggregate_version));
        entry.1 = entry.1.max(e.aggregate_version);
    }
    type Lease = (String, Option<i64>, Option<i64>, Option<uuid::Uuid>);
    let rows: Vec<Lease> = sqlx::query_as(&format!(
        "SELECT a.aggregate_id, a.lease_upto, \
                    (SELECT r.aggregate_version FROM \"{0}\".outbox_events r \
                     WHERE r.id = a.lease_row), a.lease_token \
             FROM \"{0}\".outbox_events_aggregate a \
             WHERE a.lease_owner = $1 AND a.lease_until > clock_timestamp()",
        ctx.schema
    ))
    .bind(owner)
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    let mut held: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for (agg, upto_v, head_v, token) in rows {
        if token != Some(b.handle.token) {
            continue;
        }
        held.insert(agg, (head_v.unwrap(), upto_v.unwrap()));
    }
    let leased = sqlx::query_scalar::<_, Option<i64>>(&format!(
        "SELECT 1::int8 FROM \"{}\".outbox_events_aggregate WHERE lease_token = $1 LIMIT 1",
        ctx.schema
    ))
    .bind(b.handle.token)
    .fetch_optional(&ctx.pool)
    .await
    .unwrap()
    .is_some();
    if leased || !held.is_empty() {
        assert_eq!(
            held, upto,
            "leases (head version, lease_upto) of the claim against what it handed out"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Duplicate versions in every shape.
// ---------------------------------------------------------------------------------------------

/// Every configuration: claim mode, `accept_first_version`, run length.
async fn each_config<F, Fut>(body: F)
where
    F: Fn(Ctx, PostgresOutboxStore, usize, String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for mode in modes() {
        for accept_first in [false, true] {
            for run in [1, 3] {
                let ctx = match Ctx::new(4).await {
                    Some(c) => c,
                    None => return,
                };
                let store = store_with(&ctx, mode, accept_first);
                store.migrate().await.unwrap();
                let what = format!("{mode:?} accept_first={accept_first} run={run}");
                body(ctx, store, run, what).await;
            }
        }
    }
}

/// Copies in one batch and alone, of the versions before, at and after the head, some
/// blocked at insert and some not: the first copy of each version goes out, in order, the
/// others are parked out of order, nothing stalls.
#[tokio::test]
async fn copies_in_batches_and_alone_publish_the_first_copy() {
    each_config(|ctx, store, run, what| async move {
        let mut m = Model::default();
        m.batch(&ctx, &store, "a", &[1, 2, 3]).await;
        m.one(&ctx, &store, "a", 2).await;
        m.one(&ctx, &store, "a", 3).await;
        m.batch(&ctx, &store, "a", &[3, 4]).await;
        m.one(&ctx, &store, "a", 1).await;
        m.batch(&ctx, &store, "b", &[1, 1, 2, 2]).await;
        check(&ctx, &m).await;
        drain(&ctx, &store, &mut m, run).await;
        let a: Vec<EventId> = m
            .published
            .iter()
            .filter(|p| p.0 == "a")
            .map(|p| p.2)
            .collect();
        let want: Vec<EventId> = (1..=4).map(|v| m.copy("a", v, 0)).collect();
        assert_eq!(a, want, "{what}");
        let b: Vec<EventId> = m
            .published
            .iter()
            .filter(|p| p.0 == "b")
            .map(|p| p.2)
            .collect();
        assert_eq!(b, vec![m.copy("b", 1, 0), m.copy("b", 2, 0)], "{what}");
        ctx.drop().await;
    })
    .await;
}

/// The shape f30d801 fixed, and longer chains of it: stale rows (at or below `last`) in front
/// of the first copy of the next version, blocked behind them, with later copies appended
/// alone, and a missing version appended last.
#[tokio::test]
async fn stale_rows_before_the_first_copy_do_not_let_a_later_copy_out() {
    each_config(|ctx, store, run, what| async move {
        let mut m = Model::default();
        m.one(&ctx, &store, "a", 1).await;
        m.one(&ctx, &store, "a", 2).await;
        drain(&ctx, &store, &mut m, run).await;
        // last = 2: stale 1 and 2 in front of 3 (blocked), 4 (blocked); copies of 3 and 4
        // alone; then the two stale versions again, blocked behind a first copy of 5.
        m.batch(&ctx, &store, "a", &[1, 2, 3, 4]).await;
        m.one(&ctx, &store, "a", 3).await;
        m.one(&ctx, &store, "a", 4).await;
        m.batch(&ctx, &store, "a", &[2, 5]).await;
        m.one(&ctx, &store, "a", 5).await;
        check(&ctx, &m).await;
        drain(&ctx, &store, &mut m, run).await;
        let a: Vec<EventId> = m.published.iter().map(|p| p.2).collect();
        let want: Vec<EventId> = (1..=5).map(|v| m.copy("a", v, 0)).collect();
        assert_eq!(a, want, "{what}");
        ctx.drop().await;
    })
    .await;
}

/// A stale row in front of a gap: the first copy of version 3 (blocked behind a stale 1),
/// a second copy of 3 alone, then version 2 alone. 2 goes out, then the first copy of 3.
#[tokio::test]
async fn a_stale_row_and_a_gap_before_two_copies() {
    each_config(|ctx, store, run, what| async move {
        let mut m = Model::default();
        m.one(&ctx, &store, "a", 1).await;
        drain(&ctx, &store, &mut m, run).await;
        m.batch(&ctx, &store, "a", &[1, 3]).await;
        m.one(&ctx, &store, "a", 3).await;
        // A claim meets the stale row and the second copy of 3 (held or blocked).
        let b = claim_run(&store, "relay", 10, run).await;
        assert!(b.records.is_empty(), "{what}: {:?}", layout(&b));
        store.release(&b.handle).await.unwrap();
        check(&ctx, &m).await;
        m.one(&ctx, &store, "a", 2).await;
        drain(&ctx, &store, &mut m, run).await;
        let a: Vec<EventId> = m.published.iter().map(|p| p.2).collect();
        assert_eq!(
            a,
            vec![m.copy("a", 1, 0), m.copy("a", 2, 0), m.copy("a", 3, 0)],
            "{what}"
        );
        ctx.drop().await;
    })
    .await;
}

/// The first copy of a version parked by the relay, a second copy appended while it is
/// parked: the second copy waits (blocked behind the parked head) until an operator acts.
/// retry: the first copy goes out, the second is parked out of order; discard: the second is
/// parked out of order (its version is the last now) and the next version flows; re-issue:
/// the second copy, appended before the re-issued one, is the head and goes out.
#[tokio::test]
async fn an_operator_acts_on_a_parked_first_copy_with_a_second_copy_waiting() {
    for action in ["retry", "discard", "reissue"] {
        each_config(|ctx, store, run, what| async move {
            let mut m = Model::default();
            m.batch(&ctx, &store, "a", &[1, 2]).await;
            let b = claim_run(&store, "relay", 10, run).await;
            // Publish version 1, park version 2 (as the head or as the run's second row).
            m.complete(&store, &b, 1, Some(park)).await;
            if run == 1 {
                let b = claim_run(&store, "relay", 10, run).await;
                assert_eq!(layout(&b), run_of("a", 2..=2), "{what}");
                m.complete(&store, &b, 0, Some(park)).await;
            }
            let parked = m.copy("a", 2, 0);
            assert_eq!(
                store.parked_event(parked).await.unwrap().envelope.event_id,
                parked
            );
            m.one(&ctx, &store, "a", 2).await;
            m.one(&ctx, &store, "a", 3).await;
            for _ in 0..3 {
                let b = claim_run(&store, "relay", 10, run).await;
                assert!(b.records.is_empty(), "{what}: {:?}", layout(&b));
                store.release(&b.handle).await.unwrap();
                check(&ctx, &m).await;
            }
            match action {
                "retry" => store.retry_parked(parked, "op").await.unwrap(),
                "discard" => store.discard_parked(parked, "op", "gone").await.unwrap(),
                _ => {
                    store.reissue_parked(parked, "op", "again").await.unwrap();
                }
            }
            check(&ctx, &m).await;
            drain(&ctx, &store, &mut m, run).await;
            let a: Vec<EventId> = m.published.iter().map(|p| p.2).collect();
            let second = m.copy("a", 2, 1);
            let want = match action {
                "retry" => vec![m.copy("a", 1, 0), parked, m.copy("a", 3, 0)],
                "discard" => vec![m.copy("a", 1, 0), m.copy("a", 3, 0)],
                _ => vec![m.copy("a", 1, 0), second, m.copy("a", 3, 0)],
            };
            assert_eq!(a, want, "{action} {what}");
            ctx.drop().await;
        })
        .await;
    }
}

// ---------------------------------------------------------------------------------------------
// Lease runs (ffb24b9) beside duplicates, expiry and undecodable rows.
// ---------------------------------------------------------------------------------------------

/// A run's lease expires while a second copy of its second version waits: the claim that
/// takes the lease over hands out the head alone (the duplicate ends the run), marks the
/// first copy of version 2 possibly sent (the expired run covered it), and after the head's
/// publication the first copy goes out, flagged, the second is parked out of order.
#[tokio::test]
async fn an_expired_run_covering_a_version_with_a_later_copy() {
    let ctx = ctx!(4);
    let store = store_with(&ctx, lease(1.0), false);
    store.migrate().await.unwrap();
    let mut m = Model::default();
    m.batch(&ctx, &store, "a", &[1, 2, 3]).await;
    let x = claim_run(&store, "x", 10, 3).await;
    assert_eq!(layout(&x), run_of("a", 1..=3));
    check_lease_upto(&ctx, &x, "x").await;
    m.one(&ctx, &store, "a", 2).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let y = claim_run(&store, "y", 10, 3).await;
    assert_eq!(layout(&y), run_of("a", 1..=1), "the copy of 2 ends the run");
    assert!(y.records[0].maybe_sent_before);
    check_lease_upto(&ctx, &y, "y").await;
    // The expired claim's late completion is fenced.
    let late: Vec<Outcome> = x
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| published(&r.envelope, i as i64))
        .collect();
    let rep = store.complete(&x.handle, &late).await.unwrap();
    assert_eq!(rep.applied, 0, "{rep:?}");
    m.complete(&store, &y, usize::MAX, None).await;
    check(&ctx, &m).await;
    // The first copy of 2 is the head; the second copy, still pending, ends its run.
    let z = claim_run(&store, "z", 10, 3).await;
    assert_eq!(layout(&z), run_of("a", 2..=2));
    assert_eq!(z.records[0].envelope.event_id, m.copy("a", 2, 0));
    assert!(z.records[0].maybe_sent_before, "the expired run covered it");
    check_lease_upto(&ctx, &z, "z").await;
    m.complete(&store, &z, usize::MAX, None).await;
    let w = claim_run(&store, "w", 10, 3).await;
    assert_eq!(w.parked.len(), 1, "the copy of 2 is parked out of order");
    assert!(w.records.is_empty());
    store.release(&w.handle).await.unwrap();
    check(&ctx, &m).await;
    let w = claim_run(&store, "w", 10, 3).await;
    assert_eq!(layout(&w), run_of("a", 3..=3));
    assert!(w.records[0].maybe_sent_before, "the expired run covered it");
    m.complete(&store, &w, usize::MAX, None).await;
    drain(&ctx, &store, &mut m, 3).await;
    let a: Vec<EventId> = m.published.iter().map(|p| p.2).collect();
    assert_eq!(a, (1..=3).map(|v| m.copy("a", v, 0)).collect::<Vec<_>>());
    ctx.drop().await;
}

/// A run row that does not decode is parked and the run ends before it; the lease's
/// `lease_upto` is the last version handed out, so nothing after the cut counts as sent: once
/// an operator retries the parked row after the lease expired, neither it nor the rows after
/// it are flagged as possibly sent.
#[tokio::test]
async fn an_undecodable_run_row_cuts_the_run_and_its_lease() {
    let ctx = ctx!(4);
    let store = store_with(&ctx, lease(1.0), false);
    store.migrate().await.unwrap();
    let mut m = Model::default();
    m.batch(&ctx, &store, "a", &[1, 2, 3, 4, 5]).await;
    exec(
        &ctx,
        "UPDATE \"{s}\".outbox_events SET event_type = '' \
         WHERE aggregate_id = 'a' AND aggregate_version = 3",
    )
    .await;
    let b = claim_run(&store, "x", 10, 5).await;
    assert_eq!(layout(&b), run_of("a", 1..=2));
    assert_eq!(b.parked.len(), 1, "{:?}", b.parked);
    let (upto, row_v): (Option<i64>, Option<i64>) = sqlx::query_as(&format!(
        "SELECT a.lease_upto, (SELECT aggregate_version FROM \"{0}\".outbox_events \
         WHERE id = a.lease_row) FROM \"{0}\".outbox_events_aggregate a \
         WHERE aggregate_id = 'a'",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(row_v, Some(1));
    let stats = store.stats().await.unwrap();
    // The claim ends without an outcome (a crash): its lease expires. Once an operator
    // retried the parked row, nothing after version 2 was ever handed out.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let again = claim_run(&store, "y", 10, 2).await;
    assert_eq!(layout(&again), run_of("a", 1..=2));
    m.complete(&store, &again, usize::MAX, None).await;
    // The operator repairs the row and retries it.
    exec(
        &ctx,
        "UPDATE \"{s}\".outbox_events SET event_type = 'order.changed' \
         WHERE aggregate_id = 'a' AND aggregate_version = 3",
    )
    .await;
    store.retry_parked(m.copy("a", 3, 0), "op").await.unwrap();
    let rest = claim_run(&store, "y", 10, 5).await;
    assert_eq!(layout(&rest), run_of("a", 3..=5));
    let flags: Vec<bool> = rest.records.iter().map(|r| r.maybe_sent_before).collect();
    m.complete(&store, &rest, usize::MAX, None).await;
    check(&ctx, &m).await;
    assert_eq!(
        (upto, stats.in_flight, flags),
        (Some(2), 2, vec![false; 3]),
        "lease_upto, the stats' in flight and the flags of versions 3 to 5, which no claim \
         handed out before"
    );
    ctx.drop().await;
}

/// Several relays (store instances, run lengths 1, 3 and 6) claim concurrently while a
/// producer appends versions, copies and stale rows: no aggregate is in two claims at once,
/// each claim's leases cover exactly what it handed out, the first copy of each version goes
/// out, in order, and everything drains.
#[tokio::test]
async fn concurrent_relays_with_runs_and_duplicates() {
    concurrent_relays(30.0).await;
}

/// The same with leases of one second that relays sometimes outlive (a stall before the
/// completion): runs expire mid-way and are taken over; late completions are fenced. Versions
/// still go out once each, in order, the first copy first, and everything drains.
#[tokio::test]
async fn concurrent_relays_whose_runs_expire() {
    concurrent_relays(1.0).await;
}

async fn concurrent_relays(lease_secs: f64) {
    let short = lease_secs < 5.0;
    let ctx = ctx!(12);
    let store = store_with(&ctx, lease(lease_secs), false);
    store.migrate().await.unwrap();
    let seed = common::env_seed("ADV43_SEED").unwrap_or_else(common::clock_seed);
    println!("concurrent_relays(lease {lease_secs} s) seed {seed} (ADV43_SEED)");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // In flight: aggregate -> owner; a claim that hands out an aggregate in flight elsewhere
    // breaks the one-claim-per-aggregate rule.
    let inflight = std::sync::Arc::new(std::sync::Mutex::new(HashMap::<String, String>::new()));
    let mut relays = Vec::new();
    for (i, run) in [1usize, 3, 6].into_iter().enumerate() {
        let s = store_with(&ctx, lease(lease_secs), false);
        let schema = ctx.schema.clone();
        let pool = ctx.pool.clone();
        let stop = stop.clone();
        let inflight = inflight.clone();
        relays.push(tokio::spawn(async move {
            let owner = format!("relay{i}");
            let mut rng = Rng(seed ^ ((i as u64 + 1) * 0x9e37_79b9));
            let mut sent = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let b = claim_run(&s, &owner, 5, run).await;
                let aggs: HashSet<String> = b
                    .records
                    .iter()
                    .map(|r| r.envelope.aggregate_id.clone())
                    .collect();
                if !short {
                    let mut f = inflight.lock().unwrap();
                    for a in &aggs {
                        if let Some(o) = f.insert(a.clone(), owner.clone()) {
                            panic!("{a} handed to {owner} while {o} holds it");
                        }
                    }
                }
                // The leases of this claim cover what it handed out (read by another
                // connection: the claim committed).
                let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
                    "SELECT aggregate_id, lease_upto FROM \"{schema}\".outbox_events_aggregate \
                     WHERE lease_token = $1"
                ))
                .bind(b.handle.token)
                .fetch_all(&pool)
                .await
                .unwrap();
                let mut want: BTreeMap<String, i64> = BTreeMap::new();
                for r in &b.records {
                    let v = want.entry(r.envelope.aggregate_id.clone()).or_insert(0);
                    *v = (*v).max(r.envelope.aggregate_version);
                }
                assert_eq!(
                    rows.into_iter().collect::<BTreeMap<_, _>>(),
                    want,
                    "{owner}"
                );
                if rng.below(4) == 0 {
                    tokio::time::sleep(Duration::from_millis(rng.below(5))).await;
                }
                if short && !b.records.is_empty() && rng.below(6) == 0 {
                    // Outlive the lease: another relay may take the run over.
                    tokio::time::sleep(Duration::from_millis(1100)).await;
                }
                // Publish a prefix of each run (all of it mostly), retry or release the rest.
                let mut outs = Vec::new();
                let mut logged = Vec::new();
                let mut cut = false;
                for r in &b.records {
                    if r.run_position == 0 {
                        cut = rng.below(5) == 0;
                    }
                    if cut {
                        continue;
                    }
                    if rng.below(8) == 0 {
                        outs.push(retry(&r.envelope));
                        cut = true;
                    } else {
                        outs.push(published(&r.envelope, 0));
                        logged.push(r.envelope.clone());
                    }
                }
                {
                    let mut f = inflight.lock().unwrap();
                    for a in &aggs {
                        f.remove(a);
                    }
                }
                let rep = s.complete(&b.handle, &outs).await.unwrap();
                if !short {
                    assert_eq!(rep.superseded, 0, "{owner}: {rep:?}");
                } else if rep.superseded > 0 {
                    println!(
                        "{owner}: {} outcomes fenced after the lease expired",
                        rep.superseded
                    );
                }
                sent.extend(
                    logged
                        .into_iter()
                        .filter(|e| !rep.superseded_events.contains(&e.event_id)),
                );
                if b.records.is_empty() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            sent
        }));
    }
    let mut m = Model::default();
    let mut rng = Rng(seed);
    let mut next: HashMap<String, i64> = HashMap::new();
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let agg = format!("c{}", rng.below(4));
        let n = next.entry(agg.clone()).or_insert(1);
        let shape = rng.below(7);
        let vs: Vec<i64> = match shape {
            // A stale copy before a blocked first copy, then a second copy alone.
            6 => {
                let v = *n;
                *n += 2;
                m.batch(&ctx, &store, &agg, &[(v - 1).max(1), v, v + 1])
                    .await;
                vec![v]
            }
            // New versions in one batch.
            0 | 1 => {
                let k = 1 + rng.below(4) as i64;
                let vs = (*n..*n + k).collect();
                *n += k;
                vs
            }
            // A copy of a recent version alone (or of a stale one).
            2 => vec![(*n - 1 - rng.below(3) as i64).max(1)],
            // A stale copy in front of new versions in one batch.
            3 => {
                let vs = vec![(*n - 1).max(1), *n, *n + 1];
                *n += 2;
                vs
            }
            // New versions with a copy of the last one in the same batch.
            4 => {
                let vs = vec![*n, *n + 1, *n + 1];
                *n += 2;
                vs
            }
            _ => {
                let vs = vec![*n];
                *n += 1;
                vs
            }
        };
        m.batch(&ctx, &store, &agg, &vs).await;
        tokio::time::sleep(Duration::from_millis(rng.below(20))).await;
    }
    // Let the relays drain, then stop them.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM \"{}\".outbox_events WHERE status = 'pending'",
            ctx.schema
        ))
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        if left == 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for r in relays {
        for e in r.await.unwrap() {
            m.published
                .push((e.aggregate_id.clone(), e.aggregate_version, e.event_id));
        }
    }
    // The log is not in publication order across relays: the order comes from the database.
    m.published.sort_by_key(|p| (p.0.clone(), p.1));
    check(&ctx, &m).await;
    check_published_order(&ctx).await;
    drain(&ctx, &store, &mut m, 3).await;
    assert!(stalled(&ctx).await.is_empty());
    ctx.drop().await;
}

/// Publication times per aggregate increase with versions (a later claim of an aggregate
/// starts after the completion before it committed).
async fn check_published_order(ctx: &Ctx) {
    let bad: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT format('%s v%s at %s after v%s at %s', p.aggregate_id, p.aggregate_version, \
                       p.published_at, q.aggregate_version, q.published_at) \
         FROM {t} p JOIN {t} q ON q.aggregate_id = p.aggregate_id \
           AND q.aggregate_version > p.aggregate_version AND q.published_at < p.published_at \
         WHERE p.status = 'published' AND q.status = 'published'",
        t = format!("\"{}\".outbox_events", ctx.schema)
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert!(bad.is_empty(), "published out of order: {bad:?}");
}

/// xorshift64*: a small seeded generator.
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

// ---------------------------------------------------------------------------------------------
// Held gaps over a locked claim's decisions (c016168).
// ---------------------------------------------------------------------------------------------

/// One claim meets two gap heads, a stale row and a claimable head: both modes report both
/// gaps held, the stale row parked, the head claimed (a locked claim decides twice).
#[tokio::test]
async fn every_held_gap_is_reported_beside_a_park_and_a_claim() {
    for mode in modes() {
        let ctx = ctx!(4);
        let store = store_with(&ctx, mode, false);
        store.migrate().await.unwrap();
        let mut m = Model::default();
        m.one(&ctx, &store, "s", 1).await;
        drain(&ctx, &store, &mut m, 1).await;
        m.one(&ctx, &store, "s", 1).await;
        m.one(&ctx, &store, "g1", 2).await;
        m.one(&ctx, &store, "g2", 3).await;
        m.one(&ctx, &store, "h", 1).await;
        let b = claim_run(&store, "relay", 10, 3).await;
        assert_eq!(layout(&b), run_of("h", 1..=1), "{mode:?}");
        assert_eq!(b.parked.len(), 1, "{mode:?}");
        assert_eq!(b.gaps_held, 2, "{mode:?}");
        m.complete(&store, &b, usize::MAX, None).await;
        check(&ctx, &m).await;
        ctx.drop().await;
    }
}

// ---------------------------------------------------------------------------------------------
// Randomized: appends with copies and stale rows, two relays of different run lengths,
// publish / retry / park / release outcomes, claims held open, operator actions.
// ---------------------------------------------------------------------------------------------

/// The versions of one random append to `agg` (new versions, copies, stale rows).
fn shape(rng: &mut Rng, next: &mut i64) -> Vec<i64> {
    let n = *next;
    match rng.below(7) {
        0 | 1 => {
            let k = 1 + rng.below(4) as i64;
            *next += k;
            (n..n + k).collect()
        }
        2 => vec![(n - 1 - rng.below(3) as i64).max(1)],
        3 => {
            *next += 2;
            vec![(n - 1).max(1), n, n + 1]
        }
        4 => {
            *next += 2;
            vec![n, n + 1, n + 1]
        }
        5 => {
            // A copy of the next version alone, then the rest in one batch (its lowest
            // version a second copy, unblocked at insert).
            *next += 2;
            vec![n, n, n + 1]
        }
        _ => {
            *next += 1;
            vec![n]
        }
    }
}

async fn randomized(locked: bool) {
    let seed = common::env_seed("ADV43_SEED").unwrap_or_else(common::clock_seed);
    println!("randomized(locked = {locked}) seed {seed} (set ADV43_SEED to replay)");
    let mut rng = Rng(seed);
    let accept_first = rng.below(2) == 0;
    let mode = if locked {
        ClaimMode::LockedTransaction
    } else {
        lease(30.0)
    };
    let ctx = ctx!(10);
    let stores = [
        store_with(&ctx, mode, accept_first),
        store_with(&ctx, mode, accept_first),
    ];
    stores[0].migrate().await.unwrap();
    let runs = [1 + rng.below(2) as usize, 2 + rng.below(5) as usize];
    let owners = ["r0", "r1"];
    println!("accept_first {accept_first}, runs {runs:?}");
    let mut m = Model::default();
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut open: Vec<(usize, ClaimedBatch)> = Vec::new();
    let until = Instant::now() + Duration::from_secs(10);
    let mut steps = 0;
    while Instant::now() < until && steps < 400 {
        steps += 1;
        let roll = rng.below(20);
        if roll < 6 {
            let agg = format!("x{}", rng.below(2));
            let n = next.entry(agg.clone()).or_insert(1);
            if rng.below(4) == 0 {
                // A copy of the last version in front of the next ones (stale once the last
                // is published, the first of them blocked behind it), then a second copy of
                // the first new version alone.
                let v = *n;
                *n += 2;
                m.batch(&ctx, &stores[0], &agg, &[(v - 1).max(1), v, v + 1])
                    .await;
                m.one(&ctx, &stores[0], &agg, v).await;
                check(&ctx, &m).await;
                continue;
            }
            let vs = shape(&mut rng, n);
            if vs.len() > 1 && rng.below(3) == 0 {
                for v in vs {
                    m.one(&ctx, &stores[0], &agg, v).await;
                }
            } else {
                m.batch(&ctx, &stores[0], &agg, &vs).await;
            }
        } else if roll < 14 {
            let i = rng.below(2) as usize;
            let limit = 1 + rng.below(6) as usize;
            let b = claim_run(&stores[i], owners[i], limit, runs[i]).await;
            for (_, o) in &open {
                for r in &b.records {
                    assert!(
                        o.records
                            .iter()
                            .all(|x| x.envelope.aggregate_id != r.envelope.aggregate_id),
                        "seed {seed}: {} handed out while an open claim holds it",
                        r.envelope.aggregate_id
                    );
                }
            }
            if !locked {
                check_lease_upto(&ctx, &b, owners[i]).await;
            }
            let k = rng.below(3) as usize;
            match rng.below(10) {
                0..=4 => m.complete(&stores[i], &b, usize::MAX, None).await,
                5 => m.complete(&stores[i], &b, k, Some(retry)).await,
                6 => m.complete(&stores[i], &b, k, None).await,
                7 => m.complete(&stores[i], &b, k, Some(park)).await,
                8 => stores[i].release(&b.handle).await.unwrap(),
                _ if open.len() < 2 && !b.records.is_empty() => open.push((i, b)),
                _ => m.complete(&stores[i], &b, usize::MAX, None).await,
            }
        } else if roll < 16 {
            if !open.is_empty() {
                let (i, b) = open.remove(rng.below(open.len() as u64) as usize);
                m.complete(&stores[i], &b, usize::MAX, None).await;
            }
        } else {
            // An operator (in locked mode after the open claims ended: its actions wait for
            // their aggregate locks).
            if locked {
                for (i, b) in std::mem::take(&mut open) {
                    m.complete(&stores[i], &b, usize::MAX, None).await;
                }
            }
            let parked = stores[0].list_parked(50).await.unwrap();
            if !parked.is_empty() {
                let p = &parked[rng.below(parked.len() as u64) as usize];
                let id = p.envelope.event_id;
                let r = match rng.below(3) {
                    0 => stores[0].retry_parked(id, "op").await,
                    1 => stores[0].discard_parked(id, "op", "test").await,
                    _ => stores[0].reissue_parked(id, "op", "test").await.map(|_| ()),
                };
                if let Err(e) = r {
                    assert_eq!(
                        e.kind,
                        outbox_core::StoreErrorKind::Conflict,
                        "seed {seed}: {e:?}"
                    );
                }
            }
        }
        check(&ctx, &m).await;
    }
    for (i, b) in std::mem::take(&mut open) {
        m.complete(&stores[i], &b, usize::MAX, None).await;
    }
    // Drain; an operator discards what is parked until nothing is left.
    for _ in 0..20 {
        drain(&ctx, &stores[1], &mut m, runs[1]).await;
        let parked = stores[0].list_parked(100).await.unwrap();
        if parked.is_empty() {
            break;
        }
        for p in parked {
            let _ = stores[0]
                .discard_parked(p.envelope.event_id, "op", "end")
                .await;
        }
        check(&ctx, &m).await;
    }
    let left: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events WHERE status IN ('pending', 'parked')",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(left, 0, "seed {seed}: rows left after the drain");
    println!(
        "seed {seed}: {steps} steps, {} published",
        m.published.len()
    );
    ctx.drop().await;
}

#[tokio::test]
async fn randomized_lease_relays_with_copies() {
    randomized(false).await;
}

#[tokio::test]
async fn randomized_locked_relays_with_copies() {
    randomized(true).await;
}

/// The blocked first copy of version 2 behind a head in flight; a second copy of 2 appended
/// alone while the head is claimed. The head's claim ends in every way (published, retried,
/// released, parked and then retried, discarded or re-issued by an operator): the second copy
/// never goes before the first, and nothing stalls.
#[tokio::test]
async fn a_second_copy_appended_while_the_head_is_in_flight() {
    for end in [
        "publish",
        "retry",
        "release",
        "park-retry",
        "park-discard",
        "park-reissue",
    ] {
        each_config(|ctx, store, run, what| async move {
            let mut m = Model::default();
            m.batch(&ctx, &store, "a", &[1, 2]).await;
            // Heads only, so that the first copy of 2 stays blocked behind the head.
            let b = claim_run(&store, "x", 10, 1).await;
            assert_eq!(layout(&b), run_of("a", 1..=1), "{what}");
            m.one(&ctx, &store, "a", 2).await;
            if let ClaimMode::Lease { .. } = store.claim_mode() {
                // Another relay meets the second copy while the head is leased.
                let other = claim_run(&store, "y", 10, run).await;
                assert!(other.records.is_empty(), "{end} {what}");
                store.release(&other.handle).await.unwrap();
            }
            match end {
                "publish" => m.complete(&store, &b, usize::MAX, None).await,
                "retry" => m.complete(&store, &b, 0, Some(retry)).await,
                "release" => store.release(&b.handle).await.unwrap(),
                _ => m.complete(&store, &b, 0, Some(park)).await,
            }
            check(&ctx, &m).await;
            if end.starts_with("park") {
                // Claims meet the second copy: it waits behind the parked head.
                for _ in 0..2 {
                    let b = claim_run(&store, "y", 10, run).await;
                    assert!(b.records.is_empty(), "{end} {what}: {:?}", layout(&b));
                    store.release(&b.handle).await.unwrap();
                    check(&ctx, &m).await;
                }
                let head = m.copy("a", 1, 0);
                match end {
                    "park-retry" => store.retry_parked(head, "op").await.unwrap(),
                    "park-discard" => store.discard_parked(head, "op", "x").await.unwrap(),
                    _ => {
                        store.reissue_parked(head, "op", "x").await.unwrap();
                    }
                }
                check(&ctx, &m).await;
            }
            drain(&ctx, &store, &mut m, run).await;
            let vs: Vec<i64> = m.published.iter().map(|p| p.1).collect();
            let want = if end == "park-discard" {
                vec![2]
            } else {
                vec![1, 2]
            };
            assert_eq!(vs, want, "{end} {what}");
            let two = m.published.iter().find(|p| p.1 == 2).unwrap().2;
            assert_eq!(two, m.copy("a", 2, 0), "{end} {what}");
            ctx.drop().await;
        })
        .await;
    }
}
