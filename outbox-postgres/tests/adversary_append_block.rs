//! Adversary pass on append-time blocking: one append statement carrying several events of one
//! aggregate (every one but its lowest (version, order) may be written blocked at once, instead
//! of by the claim that meets it as a follower). What must hold whichever way a row got
//! blocked: nothing committed is left blocked with no unfinished version before it (a silent
//! stall), first deliveries go out in version order, nothing is published twice, parked rows are
//! where the contract puts them (duplicates and stale versions out of order, the first version
//! after a hole as a gap), and the operator's actions and views stay truthful.
//!
//! Each test appends several versions of an aggregate in ONE `append_many` call (duplicates,
//! versions out of order, holes, a stale or gapped lowest version; behind a version that is
//! pending, claimed, in a run or parked; from two transactions committing against version
//! order; beside the SQL append function), drives claims and completions (both claim modes,
//! runs of 1 and of several, two store instances, expired leases, the relay's early claim) and
//! checks, after every round, that no pending blocked row lacks an unfinished predecessor, and
//! at the end every event's status and the broker's first deliveries. The last tests do the
//! same over seeded random batches drained by two relays (seed printed; replay with
//! `OUTBOX_PG_APPEND_BLOCK_SEED=<seed>`).
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimRequest, ClaimedBatch, Envelope, EventId};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::log::MemoryLog;
use outbox_testkit::scenarios::early_claim::early_claim_config;
use outbox_testkit::scenarios::seeded_relay;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use common::{event, lease, park, published, Ctx};

/// The stores' gap timeout: a head that skips a version is parked this long after a claim
/// first held it.
const GAP: Duration = Duration::from_millis(300);

fn modes() -> [ClaimMode; 2] {
    [lease(30.0), ClaimMode::LockedTransaction]
}

async fn store_with(ctx: &Ctx, mode: ClaimMode, first: bool) -> PostgresOutboxStore {
    let store = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .gap_timeout(GAP)
        .accept_first_version(first)
        .build()
        .expect("build");
    store.migrate().await.expect("migrate");
    store
}

/// Appends `events` in one statement, in a transaction of its own.
async fn append(ctx: &Ctx, store: &PostgresOutboxStore, events: &[Envelope]) {
    let mut tx = ctx.pool.begin().await.unwrap();
    store.append_many(&mut *tx, events).await.unwrap();
    tx.commit().await.unwrap();
}

/// Appends `e` through the SQL append function (`<schema>.outbox_events_append`) on `conn`.
async fn sql_append(schema: &str, conn: &mut sqlx::PgConnection, e: &Envelope) {
    let id: uuid::Uuid = sqlx::query_scalar(&format!(
        "SELECT \"{schema}\".outbox_events_append(aggregate_type => $1, aggregate_id => $2, \
           aggregate_version => $3, event_type => $4, payload => $5, event_id => $6)"
    ))
    .bind(&e.aggregate_type)
    .bind(&e.aggregate_id)
    .bind(e.aggregate_version)
    .bind(&e.event_type)
    .bind(&e.payload.bytes)
    .bind(e.event_id.as_uuid())
    .fetch_one(conn)
    .await
    .unwrap();
    assert_eq!(id, e.event_id.as_uuid());
}

fn evs(agg: &str, versions: &[i64]) -> Vec<Envelope> {
    versions.iter().map(|v| event(agg, *v)).collect()
}

/// What the broker saw, shared by the relays of a test.
#[derive(Default)]
struct Broker {
    /// Every hand-over, in order: (event, aggregate, version).
    sent: Vec<(EventId, String, i64)>,
    /// Publications the store applied.
    applied: Vec<EventId>,
    /// Events the broker refuses for good at their next hand-over (the completion parks them).
    refuse: HashSet<EventId>,
}

impl Broker {
    fn refusing(ids: &[EventId]) -> Mutex<Self> {
        Mutex::new(Self {
            refuse: ids.iter().copied().collect(),
            ..Self::default()
        })
    }
}

/// Hands `batch` to the broker: every record is sent and acknowledged, except one the broker
/// refuses (parked; the rows of its aggregate after it in the batch are not sent and get no
/// outcome: released). Returns the outcomes for the completion.
fn hand_over(batch: &ClaimedBatch, broker: &Mutex<Broker>) -> Vec<outbox_core::Outcome> {
    let mut br = broker.lock().unwrap();
    let mut stopped: HashSet<String> = HashSet::new();
    let mut outs = Vec::new();
    for r in &batch.records {
        let e = &r.envelope;
        if stopped.contains(&e.aggregate_id) {
            continue;
        }
        if br.refuse.remove(&e.event_id) {
            outs.push(park(e));
            stopped.insert(e.aggregate_id.clone());
            continue;
        }
        br.sent
            .push((e.event_id, e.aggregate_id.clone(), e.aggregate_version));
        let offset = br.sent.len() as i64;
        outs.push(published(e, offset));
    }
    outs
}

/// One claim of `owner` (limit 10, runs of `run`), handed over and completed; every outcome
/// must apply. Returns the number of records claimed.
async fn step(
    store: &PostgresOutboxStore,
    owner: &str,
    run: usize,
    broker: &Mutex<Broker>,
) -> usize {
    let batch = store
        .claim(&ClaimRequest::new(owner, 10).with_run(run))
        .await
        .expect("claim");
    let outs = hand_over(&batch, broker);
    let rep = store
        .complete(&batch.handle, &outs)
        .await
        .expect("complete");
    assert_eq!(
        (rep.applied, rep.superseded),
        (outs.len(), 0),
        "every outcome of a live claim applies"
    );
    let mut br = broker.lock().unwrap();
    for o in &outs {
        if let outbox_core::Outcome::Published { event_id, .. } = o {
            br.applied.push(*event_id);
        }
    }
    batch.records.len()
}

fn table(ctx: &Ctx) -> String {
    format!("\"{}\".outbox_events", ctx.schema)
}

/// Pending rows that nothing holds back for good: not behind a parked version above the
/// aggregate's last. Each must be published in the end (else: a silent stall).
async fn movable(ctx: &Ctx) -> Vec<String> {
    let t = table(ctx);
    sqlx::query_scalar(&format!(
        "SELECT format('%s v%s%s', r.aggregate_id, r.aggregate_version, \
                       CASE WHEN r.blocked THEN ' (blocked)' ELSE '' END) \
         FROM {t} r WHERE r.status = 'pending' AND NOT EXISTS ( \
           SELECT 1 FROM {t} p \
           LEFT JOIN \"{s}\".outbox_events_aggregate a \
             ON a.aggregate_type = p.aggregate_type AND a.aggregate_id = p.aggregate_id \
           WHERE p.status = 'parked' AND p.aggregate_type = r.aggregate_type \
             AND p.aggregate_id = r.aggregate_id \
             AND (p.aggregate_version, p.id) < (r.aggregate_version, r.id) \
             AND p.aggregate_version > COALESCE(a.last_version, 0)) \
         ORDER BY r.id",
        s = ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Claims and completes with every store in turn until nothing movable is left (15 s at most:
/// longer is a stall), checking for orphaned blocked rows after every round.
async fn drain(ctx: &Ctx, stores: &[&PostgresOutboxStore], run: usize, broker: &Mutex<Broker>) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut got = 0;
        for (i, s) in stores.iter().enumerate() {
            got += step(s, &format!("relay-{i}"), run, broker).await;
        }
        common::no_orphans(ctx).await;
        if got == 0 {
            let left = movable(ctx).await;
            if left.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "stalled: committed events neither published nor behind a parked event: {left:?}"
            );
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    }
}

/// Every event's status, `parked:<kind>` for a parked one.
async fn statuses(ctx: &Ctx) -> HashMap<EventId, String> {
    let rows: Vec<(uuid::Uuid, String)> = sqlx::query_as(&format!(
        "SELECT event_id, \
                status || CASE WHEN status = 'parked' THEN ':' || park_kind ELSE '' END FROM {}",
        table(ctx)
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(id, s)| (EventId::from_uuid(id), s))
        .collect()
}

/// Each listed event has the status given (`published`, `parked:out_of_order`, ...).
async fn expect(ctx: &Ctx, want: &[(&Envelope, &str)], what: &str) {
    let got = statuses(ctx).await;
    let mut wrong = Vec::new();
    for (e, status) in want {
        let s = got
            .get(&e.event_id)
            .map(String::as_str)
            .unwrap_or("missing");
        if s != *status {
            wrong.push(format!(
                "{} v{}: {s}, expected {status}",
                e.aggregate_id, e.aggregate_version
            ));
        }
    }
    assert!(wrong.is_empty(), "{what}: {wrong:#?}");
}

/// No publication applied twice; per aggregate, first deliveries in strictly increasing
/// version order.
fn check_order(broker: &Mutex<Broker>) {
    let br = broker.lock().unwrap();
    let mut once = HashSet::new();
    for id in &br.applied {
        assert!(once.insert(*id), "publication of {id} applied twice");
    }
    let mut first = HashSet::new();
    let mut last: HashMap<&str, i64> = HashMap::new();
    for (id, agg, v) in &br.sent {
        if !first.insert(*id) {
            continue;
        }
        if let Some(prev) = last.insert(agg.as_str(), *v) {
            assert!(
                *v > prev,
                "aggregate {agg}: version {v} first delivered after {prev}: {:?}",
                br.sent
                    .iter()
                    .filter(|s| s.1 == *agg)
                    .map(|s| s.2)
                    .collect::<Vec<_>>()
            );
        }
    }
}

fn runs() -> [usize; 2] {
    [1, 4]
}

/// Duplicates of a version, versions in reverse order and a hole, all in one statement and
/// interleaved across three aggregates: the lowest row of each version goes out, in version
/// order; the other rows of a published version are parked out of order; the first version
/// after the hole is parked as a gap, the version after it waits behind it and goes out once
/// the operator discards the gap.
#[tokio::test]
async fn one_batch_with_duplicates_reversed_versions_and_a_hole() {
    for mode in modes() {
        for run in runs() {
            let ctx = ctx!(6);
            let store = store_with(&ctx, mode, false).await;
            let d = evs("dup", &[1, 1, 2, 3, 3]);
            let r = evs("rev", &[3, 1, 2]);
            let g = evs("gap", &[1, 3, 4]);
            let batch = vec![
                d[0].clone(),
                r[0].clone(),
                g[0].clone(),
                d[1].clone(),
                r[1].clone(),
                g[1].clone(),
                d[2].clone(),
                r[2].clone(),
                g[2].clone(),
                d[3].clone(),
                d[4].clone(),
            ];
            append(&ctx, &store, &batch).await;
            let broker = Mutex::default();
            drain(&ctx, &[&store], run, &broker).await;
            let what = format!("{mode:?} run {run}");
            expect(
                &ctx,
                &[
                    (&d[0], "published"),
                    (&d[1], "parked:out_of_order"),
                    (&d[2], "published"),
                    (&d[3], "published"),
                    (&d[4], "parked:out_of_order"),
                    (&r[0], "published"),
                    (&r[1], "published"),
                    (&r[2], "published"),
                    (&g[0], "published"),
                    (&g[1], "parked:version_gap"),
                    (&g[2], "pending"),
                ],
                &what,
            )
            .await;
            store
                .discard_parked(g[1].event_id, "ops", "the gap stays")
                .await
                .unwrap();
            drain(&ctx, &[&store], run, &broker).await;
            expect(&ctx, &[(&g[1], "discarded"), (&g[2], "published")], &what).await;
            check_order(&broker);
            ctx.drop().await;
        }
    }
}

/// The operator's actions on a batch's rows: a gap parked and retried, a head parked by the
/// broker then discarded, retried or re-issued, a row in the middle of the batch parked then
/// discarded. The rows after each wait (reported as blocked) and all go out, in order, after
/// the action.
#[tokio::test]
async fn operator_actions_on_a_batchs_rows_move_the_aggregate_on() {
    for mode in modes() {
        for run in runs() {
            let ctx = ctx!(6);
            let store = store_with(&ctx, mode, false).await;
            let gr = evs("gap-retried", &[1, 3, 4, 5]);
            let hd = evs("head-discarded", &[1, 2, 3]);
            let hr = evs("head-retried", &[1, 2, 3]);
            let hi = evs("head-reissued", &[1, 2, 3]);
            let mid = evs("middle-discarded", &[1, 2, 3, 4]);
            let all: Vec<Envelope> = [&gr, &hd, &hr, &hi, &mid]
                .iter()
                .flat_map(|v| v.iter().cloned())
                .collect();
            append(&ctx, &store, &all).await;
            let broker = Broker::refusing(&[
                hd[0].event_id,
                hr[0].event_id,
                hi[0].event_id,
                mid[1].event_id,
            ]);
            drain(&ctx, &[&store], run, &broker).await;
            let what = format!("{mode:?} run {run}");
            expect(
                &ctx,
                &[
                    (&gr[0], "published"),
                    (&gr[1], "parked:version_gap"),
                    (&gr[2], "pending"),
                    (&gr[3], "pending"),
                    (&hd[0], "parked:permanent_error"),
                    (&hd[1], "pending"),
                    (&hd[2], "pending"),
                    (&hr[0], "parked:permanent_error"),
                    (&hr[1], "pending"),
                    (&hi[0], "parked:permanent_error"),
                    (&hi[2], "pending"),
                    (&mid[0], "published"),
                    (&mid[1], "parked:permanent_error"),
                    (&mid[2], "pending"),
                    (&mid[3], "pending"),
                ],
                &what,
            )
            .await;
            let stats = store.stats().await.unwrap();
            assert_eq!(
                (
                    stats.parked,
                    stats.blocked,
                    stats.gap_held,
                    stats.unpublished
                ),
                (5, 10, 0, 10),
                "{what}: parked, blocked behind them, gap-held, unpublished: {stats:?}"
            );
            let parked: HashSet<EventId> = store
                .list_parked(100)
                .await
                .unwrap()
                .iter()
                .map(|p| p.envelope.event_id)
                .collect();
            let want: HashSet<EventId> = [&gr[1], &hd[0], &hr[0], &hi[0], &mid[1]]
                .iter()
                .map(|e| e.event_id)
                .collect();
            assert_eq!(parked, want, "{what}: parked list");

            store.retry_parked(gr[1].event_id, "ops").await.unwrap();
            store
                .discard_parked(hd[0].event_id, "ops", "dropped")
                .await
                .unwrap();
            store.retry_parked(hr[0].event_id, "ops").await.unwrap();
            let copy = store
                .reissue_parked(hi[0].event_id, "ops", "fixed")
                .await
                .unwrap();
            store
                .discard_parked(mid[1].event_id, "ops", "dropped")
                .await
                .unwrap();
            drain(&ctx, &[&store], run, &broker).await;
            let mut want: Vec<(&Envelope, &str)> = Vec::new();
            for e in gr.iter().chain(&hr).chain(&hd[1..]).chain(&hi[1..]) {
                want.push((e, "published"));
            }
            want.extend([
                (&hd[0], "discarded"),
                (&hi[0], "discarded"),
                (&mid[0], "published"),
                (&mid[1], "discarded"),
                (&mid[2], "published"),
                (&mid[3], "published"),
            ]);
            expect(&ctx, &want, &what).await;
            assert_eq!(
                statuses(&ctx).await.get(&copy).map(String::as_str),
                Some("published"),
                "{what}: the re-issued copy"
            );
            let stats = store.stats().await.unwrap();
            assert_eq!(
                (stats.parked, stats.blocked, stats.unpublished),
                (0, 0, 0),
                "{what}: {stats:?}"
            );
            check_order(&broker);
            ctx.drop().await;
        }
    }
}

/// A batch whose lowest version is stale (at or below the last published) or skips a version,
/// with and without `accept_first_version`; a hole filled while the head is held; a late fill
/// after the gap was parked; a fresh aggregate whose first version is not 1.
#[tokio::test]
async fn a_batch_whose_lowest_version_is_stale_or_a_gap() {
    for mode in modes() {
        for first in [false, true] {
            let ctx = ctx!(6);
            let store = store_with(&ctx, mode, first).await;
            let what = format!("{mode:?} accept_first_version {first}");
            let broker = Mutex::default();
            let s = evs("stale", &[1, 2, 3, 2, 4, 5]);
            let g = evs("gap", &[1, 3, 4, 2]);
            let f = evs("filled", &[1, 3, 4, 2]);
            let n = evs("new", &[5, 7, 6, 6, 8]);
            // Phase A: histories, and a fresh aggregate starting at 5, versions reversed.
            append(
                &ctx,
                &store,
                &[
                    s[0].clone(),
                    s[1].clone(),
                    s[2].clone(),
                    g[0].clone(),
                    f[0].clone(),
                ],
            )
            .await;
            append(&ctx, &store, &n[..3]).await;
            drain(&ctx, &[&store], 1, &broker).await;
            if first {
                expect(&ctx, &[(&n[0], "published"), (&n[2], "published")], &what).await;
            } else {
                expect(
                    &ctx,
                    &[
                        (&n[0], "parked:version_gap"),
                        (&n[1], "pending"),
                        (&n[2], "pending"),
                    ],
                    &what,
                )
                .await;
                store.retry_parked(n[0].event_id, "ops").await.unwrap();
            }
            // Phase B: stale and gapped lowest versions in one statement; one claim holds
            // the gaps, then the hole of `filled` is filled.
            append(
                &ctx,
                &store,
                &[
                    s[3].clone(),
                    g[1].clone(),
                    s[4].clone(),
                    f[1].clone(),
                    g[2].clone(),
                    s[5].clone(),
                    f[2].clone(),
                ],
            )
            .await;
            step(&store, "relay", 1, &broker).await;
            append(&ctx, &store, &f[3..]).await;
            drain(&ctx, &[&store], 3, &broker).await;
            expect(
                &ctx,
                &[
                    (&s[3], "parked:out_of_order"),
                    (&s[4], "published"),
                    (&s[5], "published"),
                    (&g[1], "parked:version_gap"),
                    (&g[2], "pending"),
                    (&f[1], "published"),
                    (&f[2], "published"),
                    (&f[3], "published"),
                    (&n[0], "published"),
                    (&n[1], "published"),
                    (&n[2], "published"),
                ],
                &what,
            )
            .await;
            // Phase C: the late fill of `gap` (its gap stays parked until retried); a stale
            // duplicate as the lowest of a new batch of `new`.
            append(&ctx, &store, &g[3..]).await;
            append(&ctx, &store, &n[3..]).await;
            drain(&ctx, &[&store], 3, &broker).await;
            expect(
                &ctx,
                &[
                    (&g[3], "published"),
                    (&g[1], "parked:version_gap"),
                    (&g[2], "pending"),
                    (&n[3], "parked:out_of_order"),
                    (&n[4], "published"),
                ],
                &what,
            )
            .await;
            store.retry_parked(g[1].event_id, "ops").await.unwrap();
            drain(&ctx, &[&store], 3, &broker).await;
            expect(&ctx, &[(&g[1], "published"), (&g[2], "published")], &what).await;
            check_order(&broker);
            ctx.drop().await;
        }
    }
}

/// A batch appended while an earlier version of its aggregate is pending, claimed (and
/// handed over), in a claimed run, or handed to a broker that refuses it: a second store
/// instance gets nothing of an aggregate in flight, the first one's completion (a run's
/// prefix published, its last row released; the refused head parked) leaves every batch row
/// to go out after it, in order.
#[tokio::test]
async fn a_batch_behind_a_version_pending_claimed_in_a_run_or_parked() {
    for mode in modes() {
        for run in runs() {
            let ctx = ctx!(8);
            let a = store_with(&ctx, mode, false).await;
            let b = store_with(&ctx, mode, false).await;
            let what = format!("{mode:?} run {run}");
            let c = evs("claimed", &[1, 2, 3]);
            // A batch whose lowest row duplicates the version in flight.
            let cd = evs("claimed-dup", &[1, 1, 2, 3]);
            let r = evs("run", &[1, 2, 3, 4, 5, 6]);
            let k = evs("parked", &[1, 2, 3]);
            let p = evs("pending", &[1, 2, 3]);
            append(&ctx, &a, &c[..1]).await;
            append(&ctx, &a, &cd[..1]).await;
            append(&ctx, &a, &r[..3]).await;
            append(&ctx, &a, &k[..1]).await;
            let broker = Broker::refusing(&[k[0].event_id]);
            let held = a
                .claim(&ClaimRequest::new("relay-a", 10).with_run(run))
                .await
                .unwrap();
            let outs = hand_over(&held, &broker);
            // Appended while those are in flight: the rest of each aggregate, and a pending
            // head with a batch behind it.
            append(
                &ctx,
                &a,
                &[
                    c[1].clone(),
                    r[3].clone(),
                    k[1].clone(),
                    c[2].clone(),
                    r[4].clone(),
                    k[2].clone(),
                    r[5].clone(),
                ],
            )
            .await;
            append(&ctx, &a, &cd[1..]).await;
            append(&ctx, &a, &p[..1]).await;
            append(&ctx, &a, &p[1..]).await;
            common::no_orphans(&ctx).await;
            let other = b
                .claim(&ClaimRequest::new("relay-b", 10).with_run(run))
                .await
                .unwrap();
            let got: Vec<(String, i64)> = other
                .records
                .iter()
                .map(|x| {
                    (
                        x.envelope.aggregate_id.clone(),
                        x.envelope.aggregate_version,
                    )
                })
                .collect();
            let want: Vec<(String, i64)> = (1..=run.min(3) as i64)
                .map(|v| ("pending".to_owned(), v))
                .collect();
            assert_eq!(got, want, "{what}: only the free aggregate, from its head");
            let outs_b = hand_over(&other, &broker);
            b.complete(&other.handle, &outs_b).await.unwrap();
            // The first claim's completion: a run's last row gets no outcome (released), and
            // was not delivered after all (its hand-over forgotten).
            let run_rows: Vec<EventId> = held
                .records
                .iter()
                .filter(|x| x.envelope.aggregate_id == "run")
                .map(|x| x.envelope.event_id)
                .collect();
            let released = (run_rows.len() >= 2).then(|| run_rows[run_rows.len() - 1]);
            let keep: Vec<_> = outs
                .into_iter()
                .filter(|o| Some(o.event_id()) != released)
                .collect();
            broker
                .lock()
                .unwrap()
                .sent
                .retain(|s| Some(s.0) != released);
            let rep = a.complete(&held.handle, &keep).await.unwrap();
            assert_eq!(rep.applied, keep.len(), "{what}");
            {
                let mut br = broker.lock().unwrap();
                for o in keep.iter().chain(&outs_b) {
                    if let outbox_core::Outcome::Published { event_id, .. } = o {
                        br.applied.push(*event_id);
                    }
                }
            }
            common::no_orphans(&ctx).await;
            drain(&ctx, &[&a, &b], run, &broker).await;
            let mut want: Vec<(&Envelope, &str)> = c
                .iter()
                .chain(&r)
                .chain(&p)
                .chain([&cd[0], &cd[2], &cd[3]])
                .map(|e| (e, "published"))
                .collect();
            want.extend([
                (&cd[1], "parked:out_of_order"),
                (&k[0], "parked:permanent_error"),
                (&k[1], "pending"),
                (&k[2], "pending"),
            ]);
            expect(&ctx, &want, &what).await;
            assert_eq!(a.stats().await.unwrap().blocked, 2, "{what}");
            a.retry_parked(k[0].event_id, "ops").await.unwrap();
            drain(&ctx, &[&b, &a], run, &broker).await;
            expect(
                &ctx,
                &k.iter().map(|e| (e, "published")).collect::<Vec<_>>(),
                &what,
            )
            .await;
            check_order(&broker);
            ctx.drop().await;
        }
    }
}

/// A claim (head, or head and run) of one version is handed over and then its claim ends
/// without a completion (lease expired; locked: the server ends the stalled transaction) while
/// a batch of later versions is appended: another store instance re-sends the claimed rows
/// first, then the batch, in order; the stalled relay's late completion applies nothing.
#[tokio::test]
async fn a_claim_that_ends_without_completion_before_a_batch_behind_it() {
    for mode in [lease(0.4), ClaimMode::LockedTransaction] {
        for run in [1, 3] {
            let ctx = ctx!(8);
            let build = || {
                PostgresOutboxStore::builder(ctx.pool.clone())
                    .schema(&ctx.schema)
                    .claim_mode(mode)
                    .locked_max_hold(Duration::from_millis(300))
                    .gap_timeout(GAP)
                    .build()
                    .unwrap()
            };
            let (a, b) = (build(), build());
            a.migrate().await.unwrap();
            let what = format!("{mode:?} run {run}");
            let e = evs("expired", &[1, 2, 3, 4, 5]);
            append(&ctx, &a, &e[..2]).await;
            let broker = Mutex::default();
            let held = a
                .claim(&ClaimRequest::new("stalled", 10).with_run(run))
                .await
                .unwrap();
            assert_eq!(held.records.len(), run.min(2), "{what}");
            let outs = hand_over(&held, &broker);
            append(&ctx, &a, &e[2..]).await;
            tokio::time::sleep(Duration::from_millis(900)).await;
            drain(&ctx, &[&b], run, &broker).await;
            match a.complete(&held.handle, &outs).await {
                Ok(rep) => assert_eq!(rep.applied, 0, "{what}: a late completion applied"),
                Err(err) => assert_eq!(
                    err.kind,
                    outbox_core::StoreErrorKind::LeaseLost,
                    "{what}: {err}"
                ),
            }
            expect(
                &ctx,
                &e.iter().map(|x| (x, "published")).collect::<Vec<_>>(),
                &what,
            )
            .await;
            check_order(&broker);
            ctx.drop().await;
        }
    }
}

/// Two transactions append batches of one aggregate and commit against version order (the
/// higher batch first): with the hole filled while the higher head is held, everything goes
/// out in order; with the higher head parked as a gap before the lower batch commits, the
/// lower batch goes out and the gap waits for the operator; with `accept_first_version`, the
/// higher batch is the aggregate's start and the lower one is parked out of order, head and
/// the blocked row behind it alike.
#[tokio::test]
async fn batches_of_two_transactions_commit_against_version_order() {
    for mode in modes() {
        for first in [false, true] {
            let ctx = ctx!(8);
            let store = store_with(&ctx, mode, first).await;
            let what = format!("{mode:?} accept_first_version {first}");
            let broker = Mutex::default();
            let x = evs("x", &[1, 2, 3, 4]);
            let y = evs("y", &[1, 2, 3, 4]);
            let mut low_x = ctx.pool.begin().await.unwrap();
            store.append_many(&mut *low_x, &x[..2]).await.unwrap();
            let mut low_y = ctx.pool.begin().await.unwrap();
            store.append_many(&mut *low_y, &y[..2]).await.unwrap();
            append(&ctx, &store, &y[2..]).await;
            step(&store, "relay", 3, &broker).await;
            tokio::time::sleep(GAP + Duration::from_millis(100)).await;
            step(&store, "relay", 3, &broker).await;
            append(&ctx, &store, &x[2..]).await;
            step(&store, "relay", 3, &broker).await;
            common::no_orphans(&ctx).await;
            low_x.commit().await.unwrap();
            low_y.commit().await.unwrap();
            drain(&ctx, &[&store], 3, &broker).await;
            if first {
                expect(
                    &ctx,
                    &[
                        (&x[0], "parked:out_of_order"),
                        (&x[1], "parked:out_of_order"),
                        (&x[2], "published"),
                        (&x[3], "published"),
                        (&y[0], "parked:out_of_order"),
                        (&y[1], "parked:out_of_order"),
                        (&y[2], "published"),
                        (&y[3], "published"),
                    ],
                    &what,
                )
                .await;
            } else {
                expect(
                    &ctx,
                    &[
                        (&x[0], "published"),
                        (&x[1], "published"),
                        (&x[2], "published"),
                        (&x[3], "published"),
                        (&y[0], "published"),
                        (&y[1], "published"),
                        (&y[2], "parked:version_gap"),
                        (&y[3], "pending"),
                    ],
                    &what,
                )
                .await;
                store.retry_parked(y[2].event_id, "ops").await.unwrap();
                drain(&ctx, &[&store], 1, &broker).await;
                expect(&ctx, &[(&y[2], "published"), (&y[3], "published")], &what).await;
            }
            check_order(&broker);
            ctx.drop().await;
        }
    }
}

/// The SQL append function (one event per call, other languages) beside Rust batches of the
/// same aggregate, in one transaction and across two: a duplicate through SQL, a hole of a
/// Rust batch filled through SQL, a SQL version committed before the Rust batch holding the
/// version below it.
#[tokio::test]
async fn sql_function_appends_beside_rust_batches_of_one_aggregate() {
    for mode in modes() {
        for run in runs() {
            let ctx = ctx!(6);
            let store = store_with(&ctx, mode, false).await;
            let what = format!("{mode:?} run {run}");
            let q = evs("q", &[1, 2, 3, 3, 5, 4, 6]);
            let z = evs("z", &[1, 3, 2]);
            let mut tx = ctx.pool.begin().await.unwrap();
            sql_append(&ctx.schema, &mut tx, &q[0]).await;
            store.append_many(&mut *tx, &q[1..3]).await.unwrap();
            sql_append(&ctx.schema, &mut tx, &q[3]).await;
            sql_append(&ctx.schema, &mut tx, &q[4]).await;
            store.append_many(&mut *tx, &z[..2]).await.unwrap();
            sql_append(&ctx.schema, &mut tx, &z[2]).await;
            tx.commit().await.unwrap();
            append(&ctx, &store, &q[5..]).await;
            let broker = Mutex::default();
            drain(&ctx, &[&store], run, &broker).await;
            let mut want: Vec<(&Envelope, &str)> =
                q.iter().chain(&z).map(|e| (e, "published")).collect();
            want[3].1 = "parked:out_of_order";
            expect(&ctx, &want, &what).await;
            check_order(&broker);
            ctx.drop().await;
        }
    }
}

/// What `stats` (the `status` command's figures) and the parked list report for fresh
/// multi-version batches: every row unpublished, none "blocked" (that is: behind a parked
/// event) before anything is parked, the rows queued behind a lower version (`queued_rows`)
/// exactly the blocked rows of the table, each with an unfinished version before it; after the
/// head is parked, the rows behind it blocked; a held gap counts its head and the rows after
/// it as gap-held and none as claimable.
#[tokio::test]
async fn stats_of_fresh_multi_version_batches_tell_the_truth() {
    for mode in modes() {
        let ctx = ctx!(6);
        let store = store_with(&ctx, mode, false).await;
        let what = format!("{mode:?}");
        let a = evs("a", &[1, 2, 3]);
        let b = evs("b", &[1]);
        append(
            &ctx,
            &store,
            &[a[0].clone(), b[0].clone(), a[1].clone(), a[2].clone()],
        )
        .await;
        let queued = |s: &outbox_core::OutboxStats| {
            s.extra
                .iter()
                .find(|(k, _)| k == "queued_rows")
                .map(|(_, v)| *v as i64)
                .expect("queued_rows")
        };
        let blocked_rows = || async {
            sqlx::query_scalar::<_, i64>(&format!(
                "SELECT count(*) FROM {} WHERE status = 'pending' AND blocked",
                table(&ctx)
            ))
            .fetch_one(&ctx.pool)
            .await
            .unwrap()
        };
        let s = store.stats().await.unwrap();
        eprintln!(
            "{what}: fresh batch a1..a3 + b1: unpublished {} blocked {} queued_rows {} \
             gap_held {} in_flight {}",
            s.unpublished,
            s.blocked,
            queued(&s),
            s.gap_held,
            s.in_flight
        );
        assert_eq!(
            (s.unpublished, s.blocked, s.gap_held, s.parked, s.in_flight),
            (4, 0, 0, 0, 0),
            "{what}: {s:?}"
        );
        assert!(s.oldest_claimable_age.is_some() && s.oldest_blocked_age.is_none());
        assert_eq!(queued(&s), blocked_rows().await, "{what}: queued_rows");
        assert!(
            [0, 2].contains(&queued(&s)),
            "{what}: only a2 and a3 may be queued: {}",
            queued(&s)
        );
        common::no_orphans(&ctx).await;

        // The heads claimed (lease mode: leased; locked: the claim's locks).
        let held = store.claim(&ClaimRequest::new("relay", 10)).await.unwrap();
        assert_eq!(held.records.len(), 2, "{what}: the heads a1, b1");
        let s = store.stats().await.unwrap();
        assert_eq!((s.unpublished, s.in_flight), (4, 2), "{what}: {s:?}");
        let broker = Broker::refusing(&[a[0].event_id]);
        let outs = hand_over(&held, &broker);
        store.complete(&held.handle, &outs).await.unwrap();
        let s = store.stats().await.unwrap();
        eprintln!(
            "{what}: a1 parked: unpublished {} blocked {} queued_rows {} parked {}",
            s.unpublished,
            s.blocked,
            queued(&s),
            s.parked
        );
        assert_eq!(
            (s.unpublished, s.blocked, s.parked, s.in_flight),
            (2, 2, 1, 0),
            "{what}: a2, a3 blocked behind the parked a1: {s:?}"
        );
        assert!(s.oldest_blocked_age.is_some(), "{what}");
        assert_eq!(queued(&s), blocked_rows().await, "{what}: queued_rows");
        let parked = store.list_parked(10).await.unwrap();
        assert_eq!(parked.len(), 1, "{what}");
        assert_eq!(parked[0].envelope.event_id, a[0].event_id, "{what}");
        assert!(store.parked_event(a[1].event_id).await.is_err(), "{what}");
        common::no_orphans(&ctx).await;
        store
            .discard_parked(a[0].event_id, "ops", "dropped")
            .await
            .unwrap();
        let s = store.stats().await.unwrap();
        assert_eq!((s.unpublished, s.blocked, s.parked), (2, 0, 0), "{what}");
        drain(&ctx, &[&store], 1, &broker).await;
        let s = store.stats().await.unwrap();
        assert_eq!((s.unpublished, queued(&s)), (0, 0), "{what}: {s:?}");

        // A fresh batch that starts with a hole: its head held, the batch gap-held.
        let g = evs("g", &[2, 3, 4]);
        append(&ctx, &store, &g).await;
        assert_eq!(step(&store, "relay", 1, &broker).await, 0, "{what}");
        let s = store.stats().await.unwrap();
        eprintln!(
            "{what}: gap batch g2..g4 held: gap_held {} gaps {} blocked {} queued_rows {}",
            s.gap_held,
            s.version_gaps_held,
            s.blocked,
            queued(&s)
        );
        assert_eq!(
            (s.unpublished, s.gap_held, s.version_gaps_held, s.blocked),
            (3, 3, 1, 0),
            "{what}: {s:?}"
        );
        assert!(s.oldest_claimable_age.is_none(), "{what}: {s:?}");
        assert_eq!(queued(&s), blocked_rows().await, "{what}: queued_rows");
        common::no_orphans(&ctx).await;
        check_order(&broker);
        ctx.drop().await;
    }
}

/// Two relays with the early claim and runs of 3 over batches of eight aggregates (each
/// aggregate's versions reversed within its batch, a duplicate of version 2 in a later
/// batch): every distinct version reaches the broker, first deliveries in version order, the
/// duplicates parked at claim, never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_claim_relays_drain_batches_in_version_order() {
    for mode in modes() {
        let ctx = ctx!(16);
        let store = store_with(&ctx, mode, false).await;
        let mut events = Vec::new();
        let mut dups = Vec::new();
        for a in 0..8 {
            let agg = format!("ec-{a}");
            let mut vs = evs(&agg, &[6, 5, 4, 3, 2, 1]);
            vs.rotate_left(a % 3);
            events.push(vs);
            dups.push(event(&agg, 2));
        }
        for chunk in events.chunks(3) {
            let batch: Vec<Envelope> = chunk.iter().flatten().cloned().collect();
            append(&ctx, &store, &batch).await;
        }
        append(&ctx, &store, &dups).await;
        let log = MemoryLog::builder()
            .topic("orders", 3)
            .default_topic("orders")
            .delivery_timeout(Duration::from_millis(300))
            .build();
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for i in 0..2u64 {
            let config = early_claim_config(format!("early-{i}"), 5)
                .run(3)
                .build()
                .unwrap();
            let mut relay =
                seeded_relay(store_with(&ctx, mode, false).await, log.clone(), config, i);
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                while !stop.load(Ordering::Acquire) {
                    match relay.run_once().await {
                        Ok(r) if r.is_idle() => tokio::time::sleep(relay.idle_delay()).await,
                        Ok(_) => relay.reset_idle(),
                        Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
                let _ = relay.release_prefetched().await;
            }));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = movable(&ctx).await;
            if left.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "{mode:?}: stalled: {left:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop.store(true, Ordering::Release);
        for t in tasks {
            t.await.unwrap();
        }
        common::no_orphans(&ctx).await;
        let mut first: HashMap<String, Vec<i64>> = HashMap::new();
        let mut seen = HashSet::new();
        for rec in log.all_records() {
            let e = rec.decode().unwrap();
            if seen.insert(e.event_id) {
                first
                    .entry(e.aggregate_id.clone())
                    .or_default()
                    .push(e.aggregate_version);
            }
        }
        for (i, d) in dups.iter().enumerate() {
            assert!(
                !seen.contains(&d.event_id),
                "{mode:?}: a duplicate was sent"
            );
            let agg = format!("ec-{i}");
            assert_eq!(
                first.get(&agg),
                Some(&(1..=6).collect::<Vec<_>>()),
                "{mode:?}: {agg}"
            );
        }
        let mut want: Vec<(&Envelope, &str)> =
            events.iter().flatten().map(|e| (e, "published")).collect();
        want.extend(dups.iter().map(|e| (e, "parked:out_of_order")));
        expect(&ctx, &want, &format!("{mode:?}")).await;
        ctx.drop().await;
    }
}

/// The seed of the randomized tests: `OUTBOX_PG_APPEND_BLOCK_SEED`, else drawn and printed.
fn seed() -> u64 {
    let seed = common::env_seed("OUTBOX_PG_APPEND_BLOCK_SEED").unwrap_or_else(common::clock_seed);
    eprintln!("OUTBOX_PG_APPEND_BLOCK_SEED={seed}");
    seed
}

/// Seeded random batches: six aggregates of versions 1..=10, some with a version missing (the
/// first one included), some versions appended twice, all shuffled and cut into batches of 1
/// to 8 (each its own transaction, committed in that order). Two relays (store instances)
/// drain them concurrently, each claim asking for runs of 1, 3 or 100; an operator retries
/// every gap parked. In the end every distinct version is published once, from its lowest
/// row, in version order; every other row of a version parked out of order; nothing pending.
async fn random_batches(mode: ClaimMode) {
    let seed = seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let ctx = ctx!(12);
    let store = store_with(&ctx, mode, false).await;
    let mut all: Vec<Envelope> = Vec::new();
    for a in 0..6 {
        let agg = format!("rnd-{a}");
        let hole = rng.random_bool(0.5).then(|| rng.random_range(1..=10));
        for v in 1..=10 {
            if Some(v) == hole {
                continue;
            }
            all.push(event(&agg, v));
            if rng.random_bool(0.15) {
                all.push(event(&agg, v));
            }
        }
    }
    all.shuffle(&mut rng);
    let mut rest = &all[..];
    let mut appended: Vec<Envelope> = Vec::new();
    while !rest.is_empty() {
        let n = rng.random_range(1..=8).min(rest.len());
        append(&ctx, &store, &rest[..n]).await;
        appended.extend_from_slice(&rest[..n]);
        rest = &rest[n..];
    }
    // The row of each (aggregate, version) that must go out: the first appended (lowest id).
    let mut winner: BTreeMap<(String, i64), EventId> = BTreeMap::new();
    for e in &appended {
        winner
            .entry((e.aggregate_id.clone(), e.aggregate_version))
            .or_insert(e.event_id);
    }
    let broker = Arc::new(Mutex::new(Broker::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut relays = Vec::new();
    for i in 0..2u64 {
        let store = store_with(&ctx, mode, false).await;
        let (broker, stop) = (broker.clone(), stop.clone());
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (i + 1));
        relays.push(tokio::spawn(async move {
            while !stop.load(Ordering::Acquire) {
                let run = [1, 3, 100][rng.random_range(0..3)];
                if step(&store, &format!("relay-{i}"), run, &broker).await == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if relays.iter().any(|r| r.is_finished()) {
            break; // a relay failed: its panic is reported below
        }
        for p in store.list_parked(100).await.unwrap() {
            if p.reason.kind == outbox_core::ParkKind::VersionGap {
                let _ = store.retry_parked(p.envelope.event_id, "ops").await;
            }
        }
        // Every committed state keeps the invariant (each check is one statement: one
        // snapshot of committed claims and completions).
        common::no_orphans(&ctx).await;
        let left = movable(&ctx).await;
        let gaps = store
            .list_parked(100)
            .await
            .unwrap()
            .iter()
            .filter(|p| p.reason.kind == outbox_core::ParkKind::VersionGap)
            .count();
        if left.is_empty() && gaps == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: stalled: {left:?}, {gaps} gaps parked"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Release);
    for r in relays {
        r.await.unwrap();
    }
    common::no_orphans(&ctx).await;
    let want: Vec<(&Envelope, &str)> = appended
        .iter()
        .map(|e| {
            let w = winner[&(e.aggregate_id.clone(), e.aggregate_version)] == e.event_id;
            (
                e,
                if w {
                    "published"
                } else {
                    "parked:out_of_order"
                },
            )
        })
        .collect();
    expect(&ctx, &want, &format!("seed {seed} {mode:?}")).await;
    check_order(&broker);
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_batches_drained_by_two_lease_relays() {
    random_batches(lease(30.0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_batches_drained_by_two_locked_relays() {
    random_batches(ClaimMode::LockedTransaction).await;
}
