//! Adversarial checks of the claim and completion whose lists of rows and aggregates are
//! written as disjunctions of `IN` lists of at most 500 values (`head::in_list`, below
//! MariaDB's `in_predicate_conversion_threshold`), and whose lease end is read by the
//! candidates' statement, against the real server: batches whose candidates, aggregates and
//! claimed rows fall exactly at, one below and one above a list's length (with a duplicate
//! copy, a follower, a version gap, a stale copy, a version behind a parked row; with and
//! without `accept_first_version`); long lists while another transaction holds rows outside
//! them; a takeover at exactly the lease's end, then the old claim's release and completion; an
//! operator's release of a long batch between its claim and its completion; a claim whose
//! connection is dropped while it waits inside its transaction.
//!
//! Each test uses its own database. Needs MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::NaiveDateTime;
use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimRequest, ClaimedBatch, Envelope, Outcome};
use outbox_mysql::MySqlOutboxStore;
use uuid::Uuid;

use common::lease::{fence_of, frozen_at, status_of};
use common::{claim, event, lease, park, publish_all, published, retry, versions};

/// Rows per status.
async fn counts(ctx: &common::Ctx) -> Vec<(String, i64)> {
    sqlx::query_as(&format!(
        "SELECT CAST(status AS CHAR), COUNT(*) FROM {} GROUP BY status ORDER BY 1",
        ctx.table("outbox_events")
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Batches straddling a list's length. `n` aggregates `t0000..` with version 1, and beside
/// them, in the same first claim: a second copy of `t0000` version 1 (higher id), `t0001`
/// version 2 (a follower), `gap` version 3 (a version gap, or with `accept_first_version` the
/// aggregate's first version), a stale copy of `s` version 1 (`s` published up to 2), and `p`
/// version 2 behind its parked version 1 (the table's parked row). So the first claim reads
/// `n + 5` candidates of `n + 3` aggregates and claims `n` rows (`n + 1` with
/// `accept_first_version`). The completion publishes all but `t0002` (retried, due at once)
/// and `t0003` (parked); the second claim hands out `t0001` v2 and `t0002` v1 and parks the
/// copy of `t0000` v1. Every row ends where it must. Sizes: candidates 500 and 1,000 (n = 495,
/// 995), aggregates 500 and 1,000 (n = 497, 997), claimed rows 500/501 and 1,000/1,001.
///
/// (Seen failing with `in_list` joining its lists by `AND`: from n = 497, 502 candidates, the
/// first claim handed out nothing; n = 495, 500 candidates in one list, passed.)
#[tokio::test]
async fn batches_at_and_around_a_lists_length_claim_and_complete_exactly() {
    for afv in [false, true] {
        for mode in [lease(60.0), ClaimMode::LockedTransaction] {
            for n in [495usize, 497, 500, 501, 995, 997, 1000, 1001] {
                straddle(n, mode, afv).await;
            }
        }
    }
}

async fn straddle(n: usize, mode: ClaimMode, afv: bool) {
    let at = format!("n={n} {mode:?} accept_first_version={afv}");
    let ctx = ctx!(8);
    let s = ctx
        .builder(mode)
        .gap_timeout(Duration::from_secs(3600))
        .accept_first_version(afv)
        .build()
        .unwrap();
    s.migrate().await.unwrap();
    // Before: `s` published up to 2, `p` version 1 parked.
    let (s1, s2, p1) = (event("s", 1), event("s", 2), event("p", 1));
    common::append(&ctx, &s, &[s1.clone(), s2.clone(), p1.clone()]).await;
    let b = claim(&s, "pre", 10).await;
    let rep = s
        .complete(&b.handle, &[published(&s1, 1), park(&p1)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 2, "{at}");
    let b = claim(&s, "pre", 10).await;
    assert_eq!(versions(&b), vec![("s".to_string(), 2)], "{at}");
    publish_all(&s, &b).await;
    // The batch.
    let ts: Vec<Envelope> = (0..n).map(|i| event(&format!("t{i:04}"), 1)).collect();
    for chunk in ts.chunks(500) {
        common::append(&ctx, &s, chunk).await;
    }
    let (dup, follower, gap, stale, behind) = (
        event("t0000", 1),
        event("t0001", 2),
        event("gap", 3),
        event("s", 1),
        event("p", 2),
    );
    common::append(
        &ctx,
        &s,
        &[
            dup.clone(),
            follower.clone(),
            gap.clone(),
            stale.clone(),
            behind.clone(),
        ],
    )
    .await;
    let first = claim(&s, "relay", 10_000).await;
    let mut want: Vec<(String, i64)> = (0..n).map(|i| (format!("t{i:04}"), 1)).collect();
    if afv {
        want.push(("gap".into(), 3));
        want.sort();
    }
    assert_eq!(versions(&first), want, "{at}");
    let ids: BTreeSet<_> = first.records.iter().map(|r| r.envelope.event_id).collect();
    assert!(!ids.contains(&dup.event_id), "{at}: the copy handed out");
    assert_eq!(first.gaps_held, usize::from(!afv), "{at}");
    let parked: Vec<_> = first.parked.iter().map(|p| p.event_id).collect();
    assert_eq!(parked, vec![stale.event_id], "{at}");
    if let ClaimMode::Lease { .. } = mode {
        // One lease end on every claimed row: the lease row's, with the claim's token.
        let fences: Vec<(Uuid, NaiveDateTime, i64)> = sqlx::query_as(&format!(
            "SELECT e.claim_token, e.next_attempt_at, COUNT(*) FROM {} e \
             JOIN {} l ON l.token = e.claim_token AND l.until = e.next_attempt_at \
             WHERE e.status = 'pending' GROUP BY e.claim_token, e.next_attempt_at",
            ctx.table("outbox_events"),
            ctx.table("outbox_events_lease"),
        ))
        .fetch_all(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(fences.len(), 1, "{at}: {fences:?}");
        assert_eq!(fences[0].0, first.handle.token, "{at}");
        assert_eq!(fences[0].2 as usize, want.len(), "{at}");
    }
    let outs: Vec<Outcome> = first
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| match r.envelope.aggregate_id.as_str() {
            "t0002" => retry(&r.envelope, Duration::ZERO),
            "t0003" => park(&r.envelope),
            _ => published(&r.envelope, i as i64),
        })
        .collect();
    let rep = s.complete(&first.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, outs.len(), "{at}: {rep:?}");
    let second = claim(&s, "relay", 10_000).await;
    assert_eq!(
        versions(&second),
        vec![("t0001".to_string(), 2), ("t0002".to_string(), 1)],
        "{at}"
    );
    let parked: Vec<_> = second.parked.iter().map(|p| p.event_id).collect();
    assert_eq!(parked, vec![dup.event_id], "{at}");
    publish_all(&s, &second).await;
    assert_eq!(
        status_of(&ctx, &dup).await,
        ("parked".to_string(), Some("out_of_order".to_string())),
        "{at}"
    );
    assert_eq!(status_of(&ctx, &behind).await.0, "pending", "{at}");
    assert_eq!(status_of(&ctx, &follower).await.0, "published", "{at}");
    // Published: the t rows but t0003, t0001 v2, s v1 and v2 (and gap v3 when accepted);
    // parked: t0003, the two copies, p v1; pending: p v2 (and the held gap).
    let published_n = n as i64 - 1 + 1 + 2 + i64::from(afv);
    let want = vec![
        ("parked".to_string(), 4),
        ("pending".to_string(), 2 - i64::from(afv)),
        ("published".to_string(), published_n),
    ];
    assert_eq!(counts(&ctx).await, want, "{at}");
    let third = claim(&s, "relay", 10_000).await;
    assert!(third.records.is_empty(), "{at}: {:?}", versions(&third));
    ctx.drop().await;
}

/// Long lists (1,001 rows and aggregates) while another transaction holds, outside them, an
/// event row and its aggregate's state row (`FOR UPDATE`): the claim and its completion lock
/// only what their lists name, so neither waits for that transaction (a statement that scanned
/// past its list with locks would wait `innodb_lock_wait_timeout`). Both modes.
///
/// (Seen failing with `in_list` writing `CONCAT(column) IN (..)` past 500 values, a list no
/// index range serves: the completion waited for the held rows.)
#[tokio::test]
async fn long_lists_wait_for_no_row_outside_them() {
    for mode in [lease(60.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(8);
        let s = ctx.store(mode).await;
        // `busy` version 1: claimed, retried an hour later (not due), so no claim reads it.
        let busy = event("busy", 1);
        common::append(&ctx, &s, std::slice::from_ref(&busy)).await;
        let b = claim(&s, "pre", 10).await;
        let rep = s
            .complete(&b.handle, &[retry(&busy, Duration::from_secs(3600))])
            .await
            .unwrap();
        assert_eq!(rep.applied, 1);
        let (busy_id, busy_key): (i64, Vec<u8>) = sqlx::query_as(&format!(
            "SELECT id, aggregate_key FROM {} WHERE event_id = ?",
            ctx.table("outbox_events")
        ))
        .bind(busy.event_id.as_uuid())
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        let es: Vec<Envelope> = (0..1001).map(|i| event(&format!("l{i:04}"), 1)).collect();
        for chunk in es.chunks(500) {
            common::append(&ctx, &s, chunk).await;
        }
        // First claim and completion create the state rows; the second round runs beside the
        // held rows with every state row existing (the plain lock path).
        let more: Vec<Envelope> = (0..1001).map(|i| event(&format!("l{i:04}"), 2)).collect();
        for (round, batch_events) in [(1, &es), (2, &more)] {
            if round == 2 {
                for chunk in batch_events.chunks(500) {
                    common::append(&ctx, &s, chunk).await;
                }
            }
            // As a claim or a completion holds them: READ COMMITTED, by primary key.
            let mut held = ctx.pool.acquire().await.unwrap();
            sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                .execute(&mut *held)
                .await
                .unwrap();
            sqlx::query("BEGIN").execute(&mut *held).await.unwrap();
            let n = sqlx::query(&format!(
                "SELECT id FROM {} WHERE id = ? FOR UPDATE",
                ctx.table("outbox_events")
            ))
            .bind(busy_id)
            .fetch_all(&mut *held)
            .await
            .unwrap()
            .len();
            assert_eq!(n, 1);
            let n = sqlx::query(&format!(
                "SELECT aggregate_key FROM {} WHERE aggregate_key = ? FOR UPDATE",
                ctx.table("outbox_events_aggregate")
            ))
            .bind(&busy_key)
            .fetch_all(&mut *held)
            .await
            .unwrap()
            .len();
            assert_eq!(n, 1, "the busy aggregate's state row");
            let limit = Duration::from_secs(20);
            let b = tokio::time::timeout(limit, s.claim(&ClaimRequest::new("relay", 5000)))
                .await
                .unwrap_or_else(|_| panic!("{mode:?} round {round}: the claim waited"))
                .unwrap();
            assert_eq!(b.records.len(), 1001, "{mode:?} round {round}");
            let outs: Vec<Outcome> = b
                .records
                .iter()
                .enumerate()
                .map(|(i, r)| published(&r.envelope, i as i64))
                .collect();
            let rep = tokio::time::timeout(limit, s.complete(&b.handle, &outs))
                .await
                .unwrap_or_else(|_| panic!("{mode:?} round {round}: the completion waited"))
                .unwrap();
            assert_eq!(rep.applied, 1001, "{mode:?} round {round}");
            sqlx::query("ROLLBACK").execute(&mut *held).await.unwrap();
            held.detach();
        }
        assert_eq!(
            counts(&ctx).await,
            vec![("pending".to_string(), 1), ("published".to_string(), 2002)],
            "{mode:?}"
        );
        ctx.drop().await;
    }
}

/// A takeover at exactly the lease's end by a claim of this version (its database clock reads
/// the end `U` of the first claim's lease: the row is due, `next_attempt_at <= now`): the
/// second claim's lease end is its statement's reading plus the duration, `U + 30 s`, in its
/// lease row and the row. Then the first claim's release and completion change nothing (the
/// row carries the second claim's token and end) and the second claim's completion applies.
///
/// (Seen failing with the candidates' statement binding a lease of 0 µs: the second claim's
/// end read `U`.)
#[tokio::test]
async fn a_takeover_at_exactly_the_lease_end_then_the_old_release_and_completion() {
    let ctx = ctx!(6);
    let s1 = ctx.store(lease(30.0)).await;
    let e = event("a", 1);
    common::append(&ctx, &s1, std::slice::from_ref(&e)).await;
    let first = claim(&s1, "relay-1", 10).await;
    assert_eq!(first.records.len(), 1);
    let (t1, u1) = fence_of(&ctx, &e).await;
    assert_eq!(t1, first.handle.token);
    let lease_until: NaiveDateTime = sqlx::query_scalar(&format!(
        "SELECT until FROM {} WHERE token = ?",
        ctx.table("outbox_events_lease")
    ))
    .bind(t1)
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(lease_until, u1, "the lease row's end is the row's");
    let frozen = frozen_at(u1).await;
    let s2 = MySqlOutboxStore::builder(frozen.clone())
        .database(&ctx.database)
        .claim_mode(lease(30.0))
        .build()
        .unwrap();
    let second = claim(&s2, "relay-2", 10).await;
    assert_eq!(second.records.len(), 1, "the row is due at its lease's end");
    assert!(second.records[0].maybe_sent_before);
    let (t2, u2) = fence_of(&ctx, &e).await;
    assert_eq!(t2, second.handle.token);
    assert_eq!(
        u2,
        u1 + chrono::Duration::seconds(30),
        "the end is U + 30 s"
    );
    s1.release(&first.handle).await.unwrap();
    assert_eq!(
        fence_of(&ctx, &e).await,
        (t2, u2),
        "the old release moved it"
    );
    let rep = s1
        .complete(&first.handle, &[published(&e, 1)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 0, "the claim taken over completed: {rep:?}");
    assert_eq!(status_of(&ctx, &e).await.0, "pending");
    let rep = s2
        .complete(&second.handle, &[published(&e, 2)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 1, "{rep:?}");
    assert_eq!(status_of(&ctx, &e).await.0, "published");
    frozen.close().await;
    ctx.drop().await;
}

/// An operator releases a relay's claim of 1,001 rows (`release_claims_of`) between its claim
/// and its completion: the completion applies nothing, the next claim hands out every row
/// again (each possibly sent before) and its completion applies every row.
///
/// Lease mode (an operator does not release a locked claim: its transaction holds it).
///
/// (Seen failing with the completion's marking unfenced, its token and end conditions each
/// `OR 1`: the released claim's completion applied 1,001.)
#[tokio::test]
async fn an_operator_release_between_a_long_claim_and_its_completion() {
    for mode in [lease(60.0)] {
        let ctx = ctx!(8);
        let s = ctx.store(mode).await;
        let es: Vec<Envelope> = (0..1001).map(|i| event(&format!("r{i:04}"), 1)).collect();
        for chunk in es.chunks(500) {
            common::append(&ctx, &s, chunk).await;
        }
        let b = claim(&s, "relay-1", 5000).await;
        assert_eq!(b.records.len(), 1001, "{mode:?}");
        let released = s.release_claims_of("relay-1", "ops").await.unwrap();
        assert_eq!(released, 1001, "{mode:?}");
        let outs: Vec<Outcome> = b
            .records
            .iter()
            .enumerate()
            .map(|(i, r)| published(&r.envelope, i as i64))
            .collect();
        let rep = s.complete(&b.handle, &outs).await.unwrap();
        assert_eq!(
            rep.applied, 0,
            "{mode:?}: the released claim completed: {rep:?}"
        );
        assert_eq!(
            counts(&ctx).await,
            vec![("pending".to_string(), 1001)],
            "{mode:?}"
        );
        let again = claim(&s, "relay-2", 5000).await;
        assert_eq!(again.records.len(), 1001, "{mode:?}");
        assert!(
            again.records.iter().all(|r| r.maybe_sent_before),
            "{mode:?}"
        );
        publish_all(&s, &again).await;
        ctx.drop().await;
    }
}

/// A lease claim of 1,001 rows whose transaction waits (its lease row's insert, behind a
/// transaction holding the lease table's whole range) and whose task is dropped; the held
/// transaction then ends. Nothing of the dropped claim stays: no lease row, no row carrying its
/// token, every row due; the next claim hands out all 1,001 rows and its completion applies.
///
/// (Seen failing with the lease row inserted on another connection of the pool, outside the
/// claim's transaction: the dropped claim's lease row stayed.)
#[tokio::test]
async fn a_claim_dropped_while_it_waits_inside_its_transaction_leaves_nothing() {
    let ctx = ctx!(8);
    let s = ctx.store(lease(60.0)).await;
    let es: Vec<Envelope> = (0..1001).map(|i| event(&format!("c{i:04}"), 1)).collect();
    for chunk in es.chunks(500) {
        common::append(&ctx, &s, chunk).await;
    }
    let mut held = ctx.pool.begin().await.unwrap();
    sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *held)
        .await
        .ok();
    // A locking read of the whole (empty) lease table: a next-key lock on its supremum, so
    // any insert waits.
    sqlx::query(&format!(
        "SELECT * FROM {} FOR UPDATE",
        ctx.table("outbox_events_lease")
    ))
    .fetch_all(&mut *held)
    .await
    .unwrap();
    let s2 = s.clone();
    let task = tokio::spawn(async move { s2.claim(&ClaimRequest::new("relay-1", 5000)).await });
    // Wait until the claim has waited a second on its lease row's insert.
    let mut waited = false;
    for _ in 0..200 {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.processlist \
             WHERE command = 'Execute' AND time >= 1 AND info LIKE ?",
        )
        .bind(format!(
            "INSERT INTO `{}`.`outbox_events_lease`%",
            ctx.database
        ))
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        if n > 0 {
            waited = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(waited, "the claim never waited on its lease row's insert");
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    held.rollback().await.unwrap();
    // The server rolls the dropped connection's transaction back.
    let mut clean = false;
    for _ in 0..200 {
        let tokens: i64 = sqlx::query_scalar(&format!(
            "SELECT (SELECT COUNT(*) FROM {}) + (SELECT COUNT(*) FROM {} WHERE claim_token <> ?)",
            ctx.table("outbox_events_lease"),
            ctx.table("outbox_events")
        ))
        .bind(Uuid::nil())
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        // Its uncommitted writes are invisible to this read while its transaction still holds
        // the rows' locks (and a claim would skip them): wait for the transaction to end too.
        let open: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.innodb_trx t \
             JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id \
             WHERE p.db = ?",
        )
        .bind(&ctx.database)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        if tokens == 0 && open == 0 {
            clean = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(clean, "the dropped claim's lease stayed");
    // The next claims hand out all 1,001 rows, once each. (A claim right after the drop can
    // find the rows still locked for a moment, about 0.1 s here, after the checks above already
    // see them due and without a token, and then hands out nothing: a delay, not a loss.)
    let t0 = std::time::Instant::now();
    let mut batches: Vec<ClaimedBatch> = Vec::new();
    let mut got = 0;
    while got < 1001 && t0.elapsed() < Duration::from_secs(15) {
        let b: ClaimedBatch = claim(&s, "relay-2", 5000).await;
        got += b.records.len();
        if !b.records.is_empty() {
            batches.push(b);
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    eprintln!(
        "the dropped claim's rows were all claimed again after {:?} in {} claim(s)",
        t0.elapsed(),
        batches.len()
    );
    assert_eq!(
        got, 1001,
        "every row of the dropped claim is claimed again, once"
    );
    for b in &batches {
        publish_all(&s, b).await;
    }
    ctx.drop().await;
}
