//! Adversarial tests of completion's outcome matching (`OutcomeArrays::new`: by position when
//! the outcomes come back in claim order, by event id otherwise) through
//! `RelayStore::complete` against the real PostgreSQL, in both claim modes: duplicate event
//! ids, same length but permuted, outcomes of another claim's events, a superseded lease, an
//! empty list. Each row's status and ack offset are read back with SQL.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimedBatch, Envelope};
use outbox_postgres::PostgresOutboxStore;

use common::{claim, event, lease, published};

const MODES: [&str; 2] = ["lease", "locked"];

fn mode(name: &str) -> ClaimMode {
    match name {
        "lease" => lease(30.0),
        _ => ClaimMode::LockedTransaction,
    }
}

/// (status, ack_position) of the row of `e`.
async fn row(ctx: &common::Ctx, e: &Envelope) -> (String, Option<i64>) {
    sqlx::query_as(&format!(
        "SELECT status, ack_position FROM \"{}\".outbox_events WHERE event_id = $1",
        ctx.schema
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// Appends one event on each of `n` fresh aggregates and claims them all.
async fn claim_fresh(
    ctx: &common::Ctx,
    store: &PostgresOutboxStore,
    tag: &str,
    n: usize,
) -> (Vec<Envelope>, ClaimedBatch) {
    let evs: Vec<Envelope> = (0..n).map(|i| event(&format!("{tag}-{i}"), 1)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let b = claim(store, tag, 100).await;
    assert_eq!(b.records.len(), n, "{tag}: every fresh head is claimed");
    // In claim order.
    let evs = b.records.iter().map(|r| r.envelope.clone()).collect();
    (evs, b)
}

/// Completes what is left pending (so that later tests of the same schema start clean).
async fn drain(store: &PostgresOutboxStore) -> usize {
    let mut n = 0;
    loop {
        let b = claim(store, "drain", 100).await;
        if b.is_empty() {
            return n;
        }
        n += b.records.len();
        common::publish_all(store, &b).await;
    }
}

/// Same length, two outcomes for the first row's event and none for the second: the first
/// outcome wins on its row, the second row is released (never given the first row's ack).
#[tokio::test]
async fn duplicate_event_ids_do_not_reach_another_row() {
    let ctx = ctx!(6);
    for m in MODES {
        let store = ctx.store(mode(m)).await;
        let (evs, b) = claim_fresh(&ctx, &store, &format!("dup-{m}"), 3).await;
        let outs = vec![
            published(&evs[0], 10),
            published(&evs[0], 11),
            published(&evs[2], 12),
        ];
        let rep = store.complete(&b.handle, &outs).await.unwrap();
        assert_eq!(rep.applied, 2, "{m}: two rows recorded");
        assert_eq!(
            row(&ctx, &evs[0]).await,
            ("published".into(), Some(10)),
            "{m}"
        );
        assert_eq!(row(&ctx, &evs[1]).await, ("pending".into(), None), "{m}");
        assert_eq!(
            row(&ctx, &evs[2]).await,
            ("published".into(), Some(12)),
            "{m}"
        );
        // The released row is claimable at once (released, not left leased/locked).
        let again = claim(&store, "again", 100).await;
        assert_eq!(
            again.records.len(),
            1,
            "{m}: the row without outcome was released"
        );
        assert_eq!(again.records[0].envelope.event_id, evs[1].event_id);
        common::publish_all(&store, &again).await;
        assert_eq!(drain(&store).await, 0);
    }
    ctx.drop().await;
}

/// Same length, every permutation shape (reversed, rotated, one swap): each outcome lands on
/// its own event's row.
#[tokio::test]
async fn permuted_outcomes_of_the_same_length_land_on_their_rows() {
    let ctx = ctx!(6);
    for m in MODES {
        let store = ctx.store(mode(m)).await;
        let perms: [&[usize]; 4] = [&[3, 2, 1, 0], &[1, 2, 3, 0], &[1, 0, 2, 3], &[0, 1, 3, 2]];
        for (p, perm) in perms.iter().enumerate() {
            let (evs, b) = claim_fresh(&ctx, &store, &format!("perm-{m}-{p}"), 4).await;
            let outs: Vec<_> = perm
                .iter()
                .map(|&i| published(&evs[i], 100 + i as i64))
                .collect();
            let rep = store.complete(&b.handle, &outs).await.unwrap();
            assert_eq!(rep.applied, 4, "{m} {perm:?}");
            assert!(rep.superseded_events.is_empty(), "{m} {perm:?}");
            for (i, e) in evs.iter().enumerate() {
                assert_eq!(
                    row(&ctx, e).await,
                    ("published".into(), Some(100 + i as i64)),
                    "{m} {perm:?}: row {i}"
                );
            }
        }
        assert_eq!(drain(&store).await, 0);
    }
    ctx.drop().await;
}

/// Outcomes for the events of another live claim (whole list, and one slot of a same-length
/// list): refused, nothing recorded on the other claim's rows, which its own completion then
/// records with its own offsets.
#[tokio::test]
async fn outcomes_of_another_claim_are_refused() {
    let ctx = ctx!(8);
    for m in MODES {
        let store = ctx.store(mode(m)).await;
        let (mine, b1) = claim_fresh(&ctx, &store, &format!("mine-{m}"), 2).await;
        let (theirs, b2) = claim_fresh(&ctx, &store, &format!("theirs-{m}"), 2).await;
        // Same length as claim 1, only claim 2's events.
        let foreign = vec![published(&theirs[0], 900), published(&theirs[1], 901)];
        let rep = store.complete(&b1.handle, &foreign).await.unwrap();
        assert_eq!(rep.applied, 0, "{m}");
        assert_eq!(rep.superseded_events.len(), 2, "{m}: both refused");
        for e in mine.iter().chain(&theirs) {
            assert_eq!(row(&ctx, e).await, ("pending".into(), None), "{m}");
        }
        // Claim 2 still owns its rows and records its own outcomes.
        let own = vec![published(&theirs[1], 21), published(&theirs[0], 20)];
        let rep = store.complete(&b2.handle, &own).await.unwrap();
        assert_eq!(
            rep.applied, 2,
            "{m}: claim 2 untouched by claim 1's completion"
        );
        assert_eq!(row(&ctx, &theirs[0]).await, ("published".into(), Some(20)));
        assert_eq!(row(&ctx, &theirs[1]).await, ("published".into(), Some(21)));
        assert_eq!(drain(&store).await, 2, "{m}: claim 1's rows were released");

        // Same length, one slot foreign: the foreign one refused, its slot's row released.
        let (evs, b) = claim_fresh(&ctx, &store, &format!("mixed-{m}"), 2).await;
        let (other, b3) = claim_fresh(&ctx, &store, &format!("other-{m}"), 1).await;
        let outs = vec![published(&evs[0], 30), published(&other[0], 31)];
        let rep = store.complete(&b.handle, &outs).await.unwrap();
        assert_eq!(rep.applied, 1, "{m}");
        assert_eq!(rep.superseded_events, vec![other[0].event_id], "{m}");
        assert_eq!(row(&ctx, &evs[0]).await, ("published".into(), Some(30)));
        assert_eq!(row(&ctx, &evs[1]).await, ("pending".into(), None));
        assert_eq!(row(&ctx, &other[0]).await, ("pending".into(), None));
        let rep = store
            .complete(&b3.handle, &[published(&other[0], 32)])
            .await
            .unwrap();
        assert_eq!(rep.applied, 1, "{m}");
        assert_eq!(row(&ctx, &other[0]).await, ("published".into(), Some(32)));
        assert_eq!(drain(&store).await, 1, "{m}: the released row");
    }
    ctx.drop().await;
}

/// A completion of a claim that no longer owns its rows (lease expired and reclaimed; in locked
/// mode, a handle already completed) records nothing, in order or not; the new owner's
/// completion records its offsets.
#[tokio::test]
async fn outcomes_of_a_superseded_claim_record_nothing() {
    let ctx = ctx!(8);
    // Lease mode: a short lease, expired and reclaimed by another store instance.
    let short = ctx.store(lease(0.3)).await;
    let (evs, old) = claim_fresh(&ctx, &short, "superseded", 3).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let other = ctx.store(lease(30.0)).await;
    let new = claim(&other, "new", 100).await;
    assert_eq!(new.records.len(), 3, "the expired lease is reclaimed");
    for outs in [
        evs.iter().map(|e| published(e, 1)).collect::<Vec<_>>(),
        evs.iter().rev().map(|e| published(e, 2)).collect(),
    ] {
        let rep = short.complete(&old.handle, &outs).await.unwrap();
        assert_eq!(rep.applied, 0, "the superseded lease records nothing");
        assert_eq!(rep.superseded_events.len(), 3);
        for e in &evs {
            assert_eq!(row(&ctx, e).await, ("pending".into(), None));
        }
    }
    let outs: Vec<_> = new
        .records
        .iter()
        .map(|r| published(&r.envelope, 50))
        .collect();
    let rep = other.complete(&new.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, 3, "the new owner records");
    for e in &evs {
        assert_eq!(row(&ctx, e).await, ("published".into(), Some(50)));
    }
    // Locked mode: a handle completed twice (the second refused whole), and a handle whose
    // claim was released.
    let locked = ctx.store(ClaimMode::LockedTransaction).await;
    let (evs, b) = claim_fresh(&ctx, &locked, "twice", 2).await;
    let rep = locked
        .complete(&b.handle, &[published(&evs[0], 7)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 1);
    let rep = locked
        .complete(&b.handle, &[published(&evs[0], 8), published(&evs[1], 9)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 0, "a completed handle records nothing more");
    assert_eq!(row(&ctx, &evs[0]).await, ("published".into(), Some(7)));
    assert_eq!(row(&ctx, &evs[1]).await, ("pending".into(), None));
    assert_eq!(drain(&locked).await, 1);
    ctx.drop().await;
}

/// An empty outcome list releases every row of the claim (nothing recorded, all claimable
/// again at once); a second completion of the same handle records nothing.
#[tokio::test]
async fn an_empty_list_releases_the_whole_claim() {
    let ctx = ctx!(6);
    for m in MODES {
        let store = ctx.store(mode(m)).await;
        let (evs, b) = claim_fresh(&ctx, &store, &format!("empty-{m}"), 3).await;
        let rep = store.complete(&b.handle, &[]).await.unwrap();
        assert_eq!(rep.applied, 0, "{m}");
        for e in &evs {
            assert_eq!(row(&ctx, e).await, ("pending".into(), None), "{m}");
        }
        let outs: Vec<_> = evs.iter().map(|e| published(e, 5)).collect();
        let rep = store.complete(&b.handle, &outs).await.unwrap();
        assert_eq!(
            rep.applied, 0,
            "{m}: the handle ended with the empty completion"
        );
        for e in &evs {
            assert_eq!(row(&ctx, e).await, ("pending".into(), None), "{m}");
        }
        assert_eq!(drain(&store).await, 3, "{m}: released, claimable at once");
    }
    ctx.drop().await;
}
