//! Adversary pass (helper atk45): does the MariaDB/MySQL store have the hole ad32f9d closed on
//! PostgreSQL? A Lease-mode store and a LockedTransaction-mode store on the same tables: a
//! lease relay x holds the head H of version 1 (lease 0.3 s) while a lower-id copy A of
//! version 1, appended before H in a transaction held open, commits; the lease expires; the
//! locked relay y claims (A, the first appended copy committed) and publishes (or retries) it;
//! then x completes late with H published. x's claim no longer owns the aggregate: its late
//! completion must apply nothing (fencing), and version 1 must never be published twice.
//! Also without the copy (y takes H itself over), with runs of 3 for x, and x completing
//! late while y still holds its claim.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimedBatch, Envelope, Outcome};
use outbox_mysql::MySqlOutboxStore;
use outbox_testkit::{batch_layout as layout, claim_run};
use uuid::Uuid;

use common::{event, lease, park, published, retry, Ctx};

#[derive(Debug, sqlx::FromRow)]
struct Row {
    id: i64,
    event_id: Uuid,
    aggregate_version: i64,
    status: String,
    blocked: bool,
    maybe_delivered: bool,
    park_kind: Option<String>,
}

async fn rows(ctx: &Ctx) -> Vec<Row> {
    sqlx::query_as(&format!(
        "SELECT id, event_id, aggregate_version, CAST(status AS CHAR) AS status, \
                blocked <> 0 AS blocked, maybe_delivered <> 0 AS maybe_delivered, \
                CAST(park_kind AS CHAR) AS park_kind \
         FROM {} WHERE aggregate_id = 'a' ORDER BY id",
        ctx.table("outbox_events")
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

fn dump(rs: &[Row], names: &[(Uuid, &str)]) -> String {
    rs.iter()
        .map(|r| {
            let n = names
                .iter()
                .find(|(u, _)| *u == r.event_id)
                .map_or("?", |(_, n)| *n);
            format!(
                "\n  row {} ({n}) v{} {} blocked={} maybe_delivered={} park={:?}",
                r.id, r.aggregate_version, r.status, r.blocked, r.maybe_delivered, r.park_kind
            )
        })
        .collect()
}

/// No version of `a` is published twice.
fn once(rs: &[Row], what: &str, names: &[(Uuid, &str)]) {
    for v in 1..=5 {
        let n = rs
            .iter()
            .filter(|r| r.aggregate_version == v && r.status == "published")
            .count();
        assert!(
            n <= 1,
            "{what}: a v{v} published {n} times; rows:{}",
            dump(rs, names)
        );
    }
}

fn outs(b: &ClaimedBatch, kind: &str) -> Vec<Outcome> {
    match kind {
        "publish" => b
            .records
            .iter()
            .enumerate()
            .map(|(i, r)| published(&r.envelope, i as i64))
            .collect(),
        "retry" => vec![retry(&b.records[0].envelope, Duration::ZERO)],
        _ => vec![park(&b.records[0].envelope)],
    }
}

fn ids(b: &ClaimedBatch) -> Vec<Uuid> {
    b.records
        .iter()
        .map(|r| r.envelope.event_id.as_uuid())
        .collect()
}

struct Setup {
    ctx: Ctx,
    xs: MySqlOutboxStore,
    ys: MySqlOutboxStore,
    x: ClaimedBatch,
    a: Option<Envelope>,
    h: Vec<Envelope>,
}

/// x (lease 0.3 s, runs of `x_run`) holds H = a v1 (and v2, v3 committed with it); with
/// `copy`, the lower-id copy A committed during the lease. Returns after the lease expired.
async fn setup(copy: bool, x_run: usize, accept_first: bool, what: &str) -> Option<Setup> {
    setup_with(
        ClaimMode::LockedTransaction,
        copy,
        x_run,
        accept_first,
        what,
    )
    .await
}

async fn setup_with(
    y_mode: ClaimMode,
    copy: bool,
    x_run: usize,
    accept_first: bool,
    what: &str,
) -> Option<Setup> {
    let ctx = Ctx::new(8).await?;
    let xs = ctx
        .builder(lease(0.3))
        .accept_first_version(accept_first)
        .gap_timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    xs.migrate().await.unwrap();
    let ys = ctx
        .builder(y_mode)
        .accept_first_version(accept_first)
        .gap_timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut t1 = None;
    let mut a = None;
    if copy {
        let e = event("a", 1);
        let mut t = ctx.pool.begin().await.unwrap();
        xs.append_many_in(&mut t, std::slice::from_ref(&e))
            .await
            .unwrap();
        a = Some(e);
        t1 = Some(t);
    }
    let h: Vec<Envelope> = (1..=3).map(|v| event("a", v)).collect();
    tokio::time::timeout(Duration::from_secs(10), common::append(&ctx, &xs, &h))
        .await
        .expect("append beside the open copy");
    let x = claim_run(&xs, "x", 10, x_run).await;
    // (MariaDB hands out no run here: v2 and v3 were blocked at insert.)
    assert_eq!(
        ids(&x).first(),
        Some(&h[0].event_id.as_uuid()),
        "{what}: x's claim {:?}",
        layout(&x)
    );
    if let Some(t) = t1 {
        t.commit().await.unwrap();
    }
    let y0 = claim_run(&ys, "y", 10, 1).await;
    assert!(
        y0.records.is_empty(),
        "{what}: the lease holds: {:?}",
        layout(&y0)
    );
    ys.release(&y0.handle).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    Some(Setup {
        ctx,
        xs,
        ys,
        x,
        a,
        h,
    })
}

/// The steps of `a_lease_lost_to_a_locked_relay_with_a_lower_copy` (PostgreSQL), on MariaDB.
///
/// FINDING (atk45, fixed in stop 45: a lease completion refuses a row at or below its
/// aggregate's last version, `owned_rows` in `src/outbox/complete.rs`; the retry variant is
/// judged by `settle_after_retry`): MariaDB had the hole ad32f9d closed on PostgreSQL. Lease fencing is per
/// row (`claim_token` + `next_attempt_at` = the lease's end): the locked claim of A writes
/// nothing on H's row, so x's token and lease end still match there and x's late completion
/// is applied. Reproduction (x_run 1, accept_first off, y_end=publish): T1 `BEGIN; append
/// a v1` (row 1, A, left open); `append_many_in [a v1, a v2, a v3]` committed (rows 2 H, 3,
/// 4); x (Lease 0.3 s) claims row 2; T1 commits; a LockedTransaction store's claim gets
/// nothing (the lease holds); after 0.4 s its claim hands out row 1 (A) and publishes it;
/// x completes row 2 as published: CompletionReport { applied: 1, superseded: 0 }, and rows 1
/// and 2 are both `published` at version 1. With y_end=retry, H (row 2) is published while A
/// (row 1) is pending with maybe_delivered, after y handed A out. Every variant with the copy
/// (x_run 1/3, accept_first off/on) fails; without the copy y's writes on H's row (status, or
/// `next_attempt_at` on a retry) break x's fence and it is refused (test below passes).
#[tokio::test]
async fn a_lease_lost_to_a_locked_relay_with_a_lower_copy() {
    cases(true).await;
}

/// Same without the lower copy: the locked relay takes H itself over.
#[tokio::test]
async fn a_lease_lost_to_a_locked_relay_without_a_copy() {
    cases(false).await;
}

async fn cases(copy: bool) {
    let only = std::env::var("ATK45_Y_END").ok();
    let mut failures = Vec::new();
    for y_end in ["publish", "retry"] {
        if only.as_deref().is_some_and(|o| o != y_end) {
            continue;
        }
        for x_run in [1, 3] {
            for accept_first in [false, true] {
                let what =
                    format!("copy={copy} y_end={y_end} x_run={x_run} accept_first={accept_first}");
                let Some(s) = setup(copy, x_run, accept_first, &what).await else {
                    return;
                };
                let mut names: Vec<(Uuid, &str)> = vec![
                    (s.h[0].event_id.as_uuid(), "H v1"),
                    (s.h[1].event_id.as_uuid(), "v2"),
                    (s.h[2].event_id.as_uuid(), "v3"),
                ];
                if let Some(a) = &s.a {
                    names.push((a.event_id.as_uuid(), "A v1 copy"));
                }
                let y = claim_run(&s.ys, "y", 10, 1).await;
                let head = s.a.as_ref().unwrap_or(&s.h[0]).event_id.as_uuid();
                println!("{what}: y's claim {:?} parked {:?}", layout(&y), y.parked);
                assert_eq!(ids(&y), vec![head], "{what}: {:?}", layout(&y));
                let rep = s.ys.complete(&y.handle, &outs(&y, y_end)).await.unwrap();
                assert_eq!(rep.superseded, 0, "{what}: y's live claim: {rep:?}");
                let before = rows(&s.ctx).await;
                println!(
                    "{what}: rows before x's late completion:{}",
                    dump(&before, &names)
                );
                once(&before, &what, &names);
                let late = outs(&s.x, "publish");
                let rep = s.xs.complete(&s.x.handle, &late).await.unwrap();
                let after = rows(&s.ctx).await;
                println!(
                    "{what}: x's late completion {rep:?}; rows:{}",
                    dump(&after, &names)
                );
                let h_row = after
                    .iter()
                    .find(|r| r.event_id == s.h[0].event_id.as_uuid())
                    .unwrap();
                let bad_double = after
                    .iter()
                    .filter(|r| r.aggregate_version == 1 && r.status == "published")
                    .count()
                    > 1;
                // After y's publication of A (or H), or its retry of H itself, x's claim no
                // longer owns version 1: nothing of its completion for H applies. After y's
                // retry of A, x still owns H (below): `settle_after_retry`.
                let h_applied = h_row.status == "published"
                    && (copy && y_end == "publish" || !copy && y_end == "retry");
                if copy && y_end == "retry" {
                    if let Err(e) = settle_after_retry(&s, &rep, &what).await {
                        failures.push(e);
                    }
                } else if bad_double || h_applied {
                    failures.push(format!(
                        "{what}: x's late completion {rep:?} applied after the takeover; rows:{}",
                        dump(&after, &names)
                    ));
                }
                let _ = &s.xs;
                s.ctx.drop().await;
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// x completes late while y's locked claim (the takeover) is still open: x's completion must
/// not apply beside y's live claim (it waits for the aggregate, and is refused once y has
/// published or retried).
#[tokio::test]
async fn a_late_completion_during_the_locked_takeover() {
    let mut failures = Vec::new();
    for copy in [true, false] {
        for y_end in ["publish", "retry"] {
            let what = format!("copy={copy} y_end={y_end}");
            let Some(s) = setup(copy, 1, false, &what).await else {
                return;
            };
            let y = claim_run(&s.ys, "y", 10, 1).await;
            let head = s.a.as_ref().unwrap_or(&s.h[0]).event_id.as_uuid();
            assert_eq!(ids(&y), vec![head], "{what}: {:?}", layout(&y));
            let task = {
                let (xs, x) = (s.xs.clone(), s.x.clone());
                tokio::spawn(async move {
                    let late = outs(&x, "publish");
                    xs.complete(&x.handle, &late).await
                })
            };
            tokio::time::sleep(Duration::from_millis(300)).await;
            let waited = !task.is_finished();
            let rep = s.ys.complete(&y.handle, &outs(&y, y_end)).await.unwrap();
            assert_eq!(rep.superseded, 0, "{what}: {rep:?}");
            let xr = task.await.unwrap();
            let after = rows(&s.ctx).await;
            println!(
                "{what}: x waited={waited} x's completion {xr:?}; rows:{}",
                dump(&after, &[])
            );
            let h_row = after
                .iter()
                .find(|r| r.event_id == s.h[0].event_id.as_uuid())
                .unwrap();
            let twice = after
                .iter()
                .filter(|r| r.aggregate_version == 1 && r.status == "published")
                .count()
                > 1;
            if copy && y_end == "retry" {
                let rep = xr.expect("x's completion");
                if let Err(e) = settle_after_retry(&s, &rep, &what).await {
                    failures.push(e);
                }
            } else if twice || (copy || y_end == "retry") && h_row.status == "published" {
                failures.push(format!(
                    "{what}: x's completion {xr:?} applied beside the takeover; rows:{}",
                    dump(&after, &[])
                ));
            }
            s.ctx.drop().await;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Beside the brief: the same steps with y a second Lease-mode relay (lease 30 s) instead of a
/// locked one: y's lease claim of A writes A's row only, so H still carries x's token and
/// lease end.
#[tokio::test]
async fn a_lease_lost_to_another_lease_relay_with_a_lower_copy() {
    let mut failures = Vec::new();
    for y_end in ["publish", "retry"] {
        let what = format!("y=lease y_end={y_end}");
        let Some(s) = setup_with(lease(30.0), true, 1, false, &what).await else {
            return;
        };
        let y = claim_run(&s.ys, "y", 10, 1).await;
        let a = s.a.as_ref().unwrap().event_id.as_uuid();
        assert_eq!(ids(&y), vec![a], "{what}: {:?}", layout(&y));
        let rep = s.ys.complete(&y.handle, &outs(&y, y_end)).await.unwrap();
        assert_eq!(rep.superseded, 0, "{what}: {rep:?}");
        let rep =
            s.xs.complete(&s.x.handle, &outs(&s.x, "publish"))
                .await
                .unwrap();
        let after = rows(&s.ctx).await;
        println!(
            "{what}: x's late completion {rep:?}; rows:{}",
            dump(&after, &[])
        );
        if y_end == "retry" {
            if let Err(e) = settle_after_retry(&s, &rep, &what).await {
                failures.push(e);
            }
        } else if rep.applied > 0 {
            failures.push(format!(
                "{what}: x's late completion {rep:?} applied after y's takeover; rows:{}",
                dump(&after, &[])
            ));
        }
        s.ctx.drop().await;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// After y's claim of the lower copy A ended in a retry (version 1 not published), x's late
/// publication of H: MariaDB fences a lease per row (`claim_token` and the lease's end on the
/// row), and no claim took H's row over, so x still owns it and its publication applies
/// (PostgreSQL fences per aggregate and refuses it: `outbox-postgres/tests/adversary_claim45.rs`).
/// Both conform to the store contract's fencing ("only while the claim still owns the row")
/// and to the copy rule: H was the first copy committed when version 1 went out (x's claim,
/// before A committed). What must hold: H is the one copy of version 1 published; the next
/// claim parks A as out of order (below the last version) and hands out version 2.
async fn settle_after_retry(
    s: &Setup,
    rep: &outbox_core::CompletionReport,
    what: &str,
) -> Result<(), String> {
    let after = rows(&s.ctx).await;
    let published: Vec<Uuid> = after
        .iter()
        .filter(|r| r.aggregate_version == 1 && r.status == "published")
        .map(|r| r.event_id)
        .collect();
    if published != vec![s.h[0].event_id.as_uuid()] || rep.applied != 1 {
        return Err(format!(
            "{what}: after y's retry of A, x's publication of H must be the one copy of v1 \
             published ({rep:?}); rows:{}",
            dump(&after, &[])
        ));
    }
    let z = claim_run(&s.ys, "z", 10, 1).await;
    let a = s.a.as_ref().expect("the copy").event_id.as_uuid();
    let a_row = rows(&s.ctx)
        .await
        .into_iter()
        .find(|r| r.event_id == a)
        .expect("A's row");
    let ok = ids(&z) == vec![s.h[1].event_id.as_uuid()]
        && a_row.status == "parked"
        && a_row.park_kind.as_deref() == Some("out_of_order");
    s.ys.release(&z.handle).await.map_err(|e| e.to_string())?;
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what}: the claim after x's publication must park A out of order and hand out \
             v2: {:?}, A {:?}",
            layout(&z),
            a_row
        ))
    }
}
