//! Adversarial checks of the claim's candidate scan of issue 21's seventh pass (a plain read of
//! the candidates, then their lock by primary key with each checked again; a locking scan that
//! fills the batch up when other claims took some meanwhile; the ranges of this instance's own
//! claims in flight passed over; the claimed rows named as ranges of consecutive ids) against
//! the real server.
//!
//! The window between the plain read and the lock has no lock wait of the store's in it, so a
//! proxy of the test's own ([`common::proxy`]) holds the claim's locking read back while the
//! test changes the candidates on other connections: another relay claims one, the old relay
//! completes (publishes, parks) the rows of its expired lease. Then: the fill-up scan with a
//! follower right after the rows another claim took; a claim of this instance released
//! elsewhere, and a locked claim whose connection was cut, while the instance still counts
//! them in flight; a row between two runs of claimed ids; a completion of the batch in flight
//! while a claim of another instance has scanned past it on a big table.
//!
//! Each test uses its own database. Needs MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, Envelope};
use outbox_mysql::MySqlOutboxStore;
use uuid::Uuid;

use common::proxy::Proxy;
use common::race::{claim_nonempty, published_versions, row, statuses};
use common::{claim, event, lease, park, publish_all, published, versions};

/// The scan's locking read by primary key (the candidates the plain read found), and no other
/// statement of the store: the fill-up scan has `LIMIT ?` before its `FOR UPDATE`, the state
/// rows' lock orders by `aggregate_key`, the locked claim's second lock reads only `id`.
const LOCK_BY_ID: &[&str] = &["unkeyable", "ORDER BY id FOR UPDATE SKIP LOCKED"];

/// A store instance whose connections go through `proxy` (the schema is migrated already).
fn proxied(ctx: &common::Ctx, proxy: &Proxy, mode: ClaimMode) -> MySqlOutboxStore {
    MySqlOutboxStore::builder(proxy.pool.clone())
        .database(&ctx.database)
        .claim_mode(mode)
        .build()
        .expect("build")
}

fn pairs(v: &[(&str, i64)]) -> Vec<(String, i64)> {
    v.iter().map(|(a, n)| (a.to_string(), *n)).collect()
}

/// Another relay claims a candidate between the plain read that found it and its lock: the
/// claim leaves it (lease mode: it is under the other relay's lease, committed; locked mode:
/// the other claim's transaction holds it) and takes the others; each event is published once.
/// (Seen failing in lease mode with the check again at the lock removed from the locking read
/// by primary key and the live-lease test removed from the decision: both relays held `a`.)
#[tokio::test]
async fn a_candidate_claimed_elsewhere_before_its_lock_is_not_handed_out() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(8);
        let other = ctx.store(mode).await;
        let proxy = Proxy::start(4).await;
        let s = proxied(&ctx, &proxy, mode);
        let events = [event("a", 1), event("b", 1), event("c", 1)];
        common::append(&ctx, &other, &events).await;
        let mut held = proxy.hold_next(LOCK_BY_ID);
        let claiming = {
            let s = s.clone();
            tokio::spawn(async move { claim(&s, "relay-c", 10).await })
        };
        held.reached().await;
        let taken = claim(&other, "relay-o", 1).await;
        assert_eq!(versions(&taken), pairs(&[("a", 1)]), "{mode:?}");
        held.resume();
        let got = claiming.await.unwrap();
        assert_eq!(versions(&got), pairs(&[("b", 1), ("c", 1)]), "{mode:?}");
        publish_all(&other, &taken).await;
        publish_all(&s, &got).await;
        assert!(
            claim(&s, "relay-c", 10).await.records.is_empty(),
            "{mode:?}"
        );
        assert_eq!(statuses(&ctx).await, vec![("published".to_string(), 3)]);
        proxy.pool.close().await;
        ctx.drop().await;
    }
}

/// The old relay's lease has ended, and its rows are candidates again; a claim's plain read
/// finds them, and before its lock the old relay completes: one row published, the other
/// parked. The claim hands out neither (a published row would go out twice, a parked one
/// without the operator), and the next version of the published aggregate goes out once,
/// after it. (Seen failing with the check again at the lock removed from the locking read by
/// primary key and the `open` test removed from the decision: the parked row was handed out.)
#[tokio::test]
async fn rows_completed_by_an_expired_lease_before_their_lock_are_not_handed_out() {
    let ctx = ctx!(8);
    let old = ctx.store(lease(0.3)).await;
    let proxy = Proxy::start(4).await;
    let s = proxied(&ctx, &proxy, lease(30.0));
    let (a1, a2, p1) = (event("a", 1), event("a", 2), event("p", 1));
    common::append(&ctx, &old, &[a1.clone(), a2.clone(), p1.clone()]).await;
    let first = claim(&old, "relay-old", 10).await;
    assert_eq!(versions(&first), pairs(&[("a", 1), ("p", 1)]));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut held = proxy.hold_next(LOCK_BY_ID);
    let claiming = {
        let s = s.clone();
        tokio::spawn(async move { claim(&s, "relay-new", 10).await })
    };
    held.reached().await;
    let rep = old
        .complete(&first.handle, &[published(&a1, 1), park(&p1)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 2, "{rep:?}");
    held.resume();
    let got = claiming.await.unwrap();
    assert!(
        got.records.is_empty(),
        "handed out {:?} after the old relay completed it",
        versions(&got)
    );
    assert_eq!(row(&ctx, &a1).await.0, "published");
    assert_eq!(row(&ctx, &p1).await.0, "parked");
    let next = claim_nonempty(&s, "relay-new", 10).await;
    assert_eq!(versions(&next), pairs(&[("a", 2)]));
    publish_all(&s, &next).await;
    assert_eq!(published_versions(&ctx, "a").await, vec![1, 2]);
    assert!(claim(&s, "relay-new", 10).await.records.is_empty());
    proxy.pool.close().await;
    ctx.drop().await;
}

/// The plain read finds a full batch and another claim takes the first three meanwhile,
/// among them `m` v1, whose v2 comes right after the batch: the fill-up scan takes the rows
/// after the batch, but never `m` v2 while v1 is in flight; after the other claim's
/// publication, v2 goes out, once, after v1. (Seen failing without the fill-up scan: the
/// claim took `r` alone.)
#[tokio::test]
async fn the_fill_up_scan_fills_the_batch_and_keeps_a_follower_back() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(8);
        let other = ctx.store(mode).await;
        let proxy = Proxy::start(4).await;
        let s = proxied(&ctx, &proxy, mode);
        let events: Vec<Envelope> = [
            ("p", 1),
            ("q", 1),
            ("m", 1),
            ("r", 1),
            ("m", 2),
            ("s", 1),
            ("t", 1),
            ("u", 1),
        ]
        .iter()
        .map(|(a, v)| event(a, *v))
        .collect();
        common::append(&ctx, &other, &events).await;
        let mut held = proxy.hold_next(LOCK_BY_ID);
        let claiming = {
            let s = s.clone();
            tokio::spawn(async move { claim(&s, "relay-c", 4).await })
        };
        held.reached().await;
        let taken = claim(&other, "relay-o", 3).await;
        assert_eq!(
            versions(&taken),
            pairs(&[("m", 1), ("p", 1), ("q", 1)]),
            "{mode:?}"
        );
        held.resume();
        let got = claiming.await.unwrap();
        assert_eq!(
            versions(&got),
            pairs(&[("r", 1), ("s", 1), ("t", 1)]),
            "{mode:?}"
        );
        publish_all(&other, &taken).await;
        publish_all(&s, &got).await;
        let rest = claim_nonempty(&s, "relay-c", 10).await;
        assert_eq!(versions(&rest), pairs(&[("m", 2), ("u", 1)]), "{mode:?}");
        publish_all(&s, &rest).await;
        assert_eq!(published_versions(&ctx, "m").await, vec![1, 2]);
        assert_eq!(statuses(&ctx).await, vec![("published".to_string(), 8)]);
        proxy.pool.close().await;
        ctx.drop().await;
    }
}

/// A lease claim of this instance ends elsewhere while the instance still counts it in flight
/// (its scan passes over the claim's ids): released through another store instance with the
/// claim's handle, or by the operator's release of the relay's claims. Its rows are due again
/// and must come back to this instance too, not stay hidden: within half the lease, the bound
/// of the passing over. (Seen failing with the passing over kept for as long as the claim is
/// remembered: nothing came back within 10 s.)
#[tokio::test]
async fn a_claim_ended_elsewhere_comes_back_to_the_instance_that_made_it() {
    for by_operator in [false, true] {
        let ctx = ctx!(8);
        let a = ctx.store(lease(2.0)).await;
        let b = ctx.store(lease(2.0)).await;
        let events: Vec<Envelope> = (0..20).map(|i| event(&format!("agg{i}"), 1)).collect();
        common::append(&ctx, &a, &events).await;
        let first = claim(&a, "relay", 20).await;
        assert_eq!(first.records.len(), 20);
        if by_operator {
            assert_eq!(a.release_claims_of("relay", "ops").await.unwrap(), 20);
        } else {
            b.release(&first.handle).await.unwrap();
        }
        assert!(row(&ctx, &events[0]).await.1.is_nil(), "released");
        let again = claim_nonempty(&a, "relay", 20).await;
        assert_eq!(again.records.len(), 20, "by operator: {by_operator}");
        publish_all(&a, &again).await;
        assert_eq!(statuses(&ctx).await, vec![("published".to_string(), 20)]);
        ctx.drop().await;
    }
}

/// A locked claim whose connection is cut (a network failure; the server rolls it back) while
/// the instance still counts it in flight: its rows come back to this instance before the
/// claim's hold ends (the bound of the passing over is half the hold, at most 5 s), and are
/// published once. (Seen failing with the passing over kept for as long as the claim is held:
/// nothing came back before the hold ended; and, for the 120 s hold, without the 5 s cap:
/// nothing claimable within 10 s.)
#[tokio::test]
async fn a_locked_claim_whose_connection_was_cut_comes_back_to_its_instance() {
    locked_claim_cut_comes_back(Duration::from_secs(8)).await;
}

/// The same under a long hold (the default is 300 s): the rows come back within the 5 s cap,
/// not after half the hold.
#[tokio::test]
async fn a_locked_claim_cut_under_a_long_hold_comes_back_within_the_cap() {
    locked_claim_cut_comes_back(Duration::from_secs(120)).await;
}

async fn locked_claim_cut_comes_back(hold: Duration) {
    let ctx = ctx!(8);
    let base = ctx.store(ClaimMode::LockedTransaction).await;
    let proxy = Proxy::start(4).await;
    let s = MySqlOutboxStore::builder(proxy.pool.clone())
        .database(&ctx.database)
        .claim_mode(ClaimMode::LockedTransaction)
        .locked_max_hold(hold)
        .build()
        .expect("build");
    let events: Vec<Envelope> = (0..20).map(|i| event(&format!("agg{i}"), 1)).collect();
    common::append(&ctx, &base, &events).await;
    let started = Instant::now();
    let first = claim(&s, "relay", 20).await;
    assert_eq!(first.records.len(), 20);
    proxy.cut_all();
    let again = claim_nonempty(&s, "relay", 20).await;
    let took = started.elapsed();
    assert_eq!(again.records.len(), 20);
    assert!(
        took < (hold / 2).min(Duration::from_secs(5)) + Duration::from_secs(2),
        "the rows came back only after {took:?}"
    );
    // The cut claim's completion applies nothing; the new claim's publishes each row once.
    let rep = s.complete(&first.handle, &[published(&events[0], 1)]).await;
    assert!(
        rep.as_ref().map_or(true, |r| r.applied == 0),
        "the cut claim applied {rep:?}"
    );
    publish_all(&s, &again).await;
    assert_eq!(statuses(&ctx).await, vec![("published".to_string(), 20)]);
    proxy.pool.close().await;
    ctx.drop().await;
}

/// The claimed rows are named as ranges of consecutive ids in the candidates' read and the
/// lease `UPDATE`; a row between two runs (a follower of the run before it) is not one of
/// them and gets neither the token nor the lease. (Seen failing with runs joined across a gap
/// of one id: the follower carried the batch's token.)
#[tokio::test]
async fn a_row_between_two_runs_of_claimed_ids_gets_no_token() {
    let ctx = ctx!(8);
    let s = ctx.store(lease(30.0)).await;
    let events: Vec<Envelope> = [
        ("a", 1),
        ("b", 1),
        ("c", 1),
        ("c", 2),
        ("d", 1),
        ("e", 1),
        ("f", 1),
    ]
    .iter()
    .map(|(a, v)| event(a, *v))
    .collect();
    common::append(&ctx, &s, &events).await;
    let got = claim(&s, "relay", 10).await;
    assert_eq!(
        versions(&got),
        pairs(&[("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1), ("f", 1)])
    );
    let (status, token, leased, ..) = row(&ctx, &events[3]).await;
    assert_eq!(
        (status.as_str(), token, leased),
        ("pending", Uuid::nil(), false),
        "the follower between the runs"
    );
    let tokened: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {} WHERE claim_token = ?",
        ctx.table("outbox_events")
    ))
    .bind(got.handle.token)
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(tokened, 6);
    publish_all(&s, &got).await;
    let next = claim_nonempty(&s, "relay", 10).await;
    assert_eq!(versions(&next), pairs(&[("c", 2)]));
    ctx.drop().await;
}

/// On a table of 50,000 pending rows, a relay's batch of 1,000 is in flight and another
/// instance's claim has scanned past it (its candidates are the next 1,000) and is held
/// before its decision: the batch's completion does not wait for that claim (its scan locked
/// none of the rows it passed over). (Seen failing with the single locking scan in place of
/// the plain read: the completion waited until the claim went on.)
#[tokio::test]
async fn a_claim_that_scanned_past_the_batch_in_flight_does_not_hold_up_its_completion() {
    let ctx = ctx!(8);
    let a = ctx.store(lease(60.0)).await;
    let proxy = Proxy::start(4).await;
    let b = proxied(&ctx, &proxy, lease(60.0));
    for chunk in 0..50 {
        let events: Vec<Envelope> = (0..1000)
            .map(|i| event(&format!("agg{}", chunk * 1000 + i), 1))
            .collect();
        common::append(&ctx, &a, &events).await;
    }
    let batch = claim(&a, "relay-a", 1000).await;
    assert_eq!(batch.records.len(), 1000);
    // Held at the candidates' read, after the scan and the state rows' lock.
    let mut held = proxy.hold_next(&["AS lease_end"]);
    let claiming = {
        let b = b.clone();
        tokio::spawn(async move { claim(&b, "relay-b", 1000).await })
    };
    held.reached().await;
    let completing = {
        let (a, batch) = (a.clone(), batch.clone());
        tokio::spawn(async move { publish_all(&a, &batch).await })
    };
    let done = tokio::time::timeout(Duration::from_secs(20), completing).await;
    held.resume();
    assert!(
        done.is_ok(),
        "the completion waited for the claim that scanned past its rows"
    );
    done.unwrap().unwrap();
    let next = claiming.await.unwrap();
    assert_eq!(next.records.len(), 1000);
    let batch_ids: std::collections::HashSet<_> =
        batch.records.iter().map(|r| r.envelope.event_id).collect();
    assert!(next
        .records
        .iter()
        .all(|r| !batch_ids.contains(&r.envelope.event_id)));
    proxy.pool.close().await;
    ctx.drop().await;
}

/// Two claims whose rows interleave as runs of ids (one holds 1..10 and 21..30, the other
/// 11..20, found by its fill-up scan) write their leases at the same time: the lease `UPDATE`
/// of each names its runs as ranges and touches no row past a range's end, so neither waits on
/// the other (no deadlock, no lock wait), and each row is leased once. (Seen failing with each
/// range one id longer at its end: the second claim's `UPDATE` waited on the first claim's
/// row 21 until the test let the first claim go on.)
#[tokio::test]
async fn lease_updates_of_interleaved_runs_do_not_wait_on_each_other() {
    let ctx = ctx!(8);
    let y = ctx.store(lease(30.0)).await;
    let proxy = Proxy::start(4).await;
    let x = proxied(&ctx, &proxy, lease(30.0));
    let events: Vec<Envelope> = (0..30).map(|i| event(&format!("agg{i:02}"), 1)).collect();
    common::append(&ctx, &y, &events).await;
    let ids: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT id FROM {} ORDER BY id",
        ctx.table("outbox_events")
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    // Rows 11..20 not due while `x` claims (its plain read passes over them, no lock): it
    // takes 1..10 and 21..30. Each row written by its id alone (a statement over a range of
    // ids could wait on the row after it).
    let set_due = |when: &'static str| {
        let (pool, sql) = (
            ctx.pool.clone(),
            format!(
                "UPDATE {} SET next_attempt_at = {when} WHERE id = ?",
                ctx.table("outbox_events")
            ),
        );
        let ids = ids[10..20].to_vec();
        async move {
            for id in ids {
                sqlx::query(&sql).bind(id).execute(&pool).await.unwrap();
            }
        }
    };
    set_due("UTC_TIMESTAMP(6) + INTERVAL 1 HOUR").await;
    let mut held = proxy.hold_next(&["SET next_attempt_at = ?, claim_token = ?"]);
    let claiming = {
        let x = x.clone();
        tokio::spawn(async move { claim(&x, "relay-x", 20).await })
    };
    held.reached().await;
    set_due("'1000-01-01'").await;
    // `y` meets `x`'s rows first (not committed: due as far as its plain read sees), skips
    // them at the lock and fills up with 11..20.
    let other = tokio::time::timeout(Duration::from_secs(20), claim(&y, "relay-y", 10)).await;
    held.resume();
    let other = other.expect("the second claim waited on the first");
    let first = claiming.await.unwrap();
    let mut want_x: Vec<String> = (0..10)
        .chain(20..30)
        .map(|i| format!("agg{i:02}"))
        .collect();
    want_x.sort();
    let got_x: Vec<String> = versions(&first).into_iter().map(|(a, _)| a).collect();
    assert_eq!(got_x, want_x);
    let got_y: Vec<String> = versions(&other).into_iter().map(|(a, _)| a).collect();
    let want_y: Vec<String> = (10..20).map(|i| format!("agg{i:02}")).collect();
    assert_eq!(got_y, want_y);
    for (batch, n) in [(&first, 20), (&other, 10)] {
        let tokened: i64 = sqlx::query_scalar(&format!(
            "SELECT COUNT(*) FROM {} WHERE claim_token = ?",
            ctx.table("outbox_events")
        ))
        .bind(batch.handle.token)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(tokened, n);
    }
    publish_all(&x, &first).await;
    publish_all(&y, &other).await;
    assert_eq!(statuses(&ctx).await, vec![("published".to_string(), 30)]);
    proxy.pool.close().await;
    ctx.drop().await;
}
