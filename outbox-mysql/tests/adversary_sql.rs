//! Adversarial checks of the batch SQL of the MySQL/MariaDB store's claim and completion
//! (`JSON_TABLE` joins: the publications marked by one joined `UPDATE` after a plain read of
//! their status, the last versions written by one joined `UPDATE` (in lease mode the one that
//! also ends the leases; since then one multi-row upsert of the state rows), the head probe
//! over a JSON table of (key, last version), the lease write (since then one multi-row upsert
//! of the state rows and one `UPDATE` of the event rows)).
//!
//! Each test uses its own database. Needs MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{AckMetadata, ClaimMode, Envelope, Outcome};

use common::{claim, event, lease, park, published, retry, versions};

fn named(agg: &str, version: i64) -> Envelope {
    Envelope::builder("order", agg, version, "order.changed")
        .json(&serde_json::json!({ "v": version }))
        .unwrap()
        .build()
        .unwrap()
}

async fn last_version(ctx: &common::Ctx, agg_id: &str) -> Option<i64> {
    sqlx::query_scalar::<_, Option<i64>>(&format!(
        "SELECT last_version FROM {} WHERE aggregate_type = 'order' \
         AND HEX(aggregate_id) = HEX(?)",
        ctx.table("outbox_events_aggregate")
    ))
    .bind(agg_id)
    .fetch_optional(&ctx.pool)
    .await
    .unwrap()
    .flatten()
}

/// (status, ack topic, partition, offset) of an event.
async fn row(
    ctx: &common::Ctx,
    e: &Envelope,
) -> (String, Option<String>, Option<i32>, Option<i64>) {
    sqlx::query_as(&format!(
        "SELECT CAST(status AS CHAR), CAST(ack_destination AS CHAR), ack_partition, ack_position \
         FROM {} WHERE event_id = ?",
        ctx.table("outbox_events")
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

fn ack(e: &Envelope, topic: &str, partition: i32, offset: i64) -> Outcome {
    Outcome::Published {
        event_id: e.event_id,
        ack: AckMetadata::kafka(topic, partition, offset),
    }
}

/// A stale lease holder's batch completion after another relay took the aggregates over and
/// published some of them: every outcome of the stale holder is refused, no row it names is
/// marked, no last version moves twice or backwards; the new holder's completion applies.
#[tokio::test]
async fn stale_batch_completion_after_takeover_marks_nothing() {
    for mode_lease in [0.3_f64] {
        let ctx = ctx!(8);
        let a = ctx.store(lease(mode_lease)).await;
        let b = ctx.store(lease(30.0)).await;
        let firsts: Vec<Envelope> = (0..20).map(|i| event(&format!("agg{i:02}"), 1)).collect();
        let seconds: Vec<Envelope> = (0..20).map(|i| event(&format!("agg{i:02}"), 2)).collect();
        common::append(&ctx, &a, &firsts).await;
        common::append(&ctx, &a, &seconds).await;
        let stale = claim(&a, "relay-a", 100).await;
        assert_eq!(stale.records.len(), 20);
        tokio::time::sleep(Duration::from_millis(500)).await; // A's leases expired
        let taken = claim(&b, "relay-b", 100).await;
        assert_eq!(taken.records.len(), 20, "B takes every expired lease over");
        // B publishes the first half (offsets 100+), leaves the rest claimed.
        let half: Vec<Outcome> = taken.records[..10]
            .iter()
            .map(|r| published(&r.envelope, 100))
            .collect();
        let rep = b.complete(&taken.handle, &half).await.unwrap();
        assert_eq!(rep.applied, 10);
        // A completes everything late, with other acks.
        let late: Vec<Outcome> = stale
            .records
            .iter()
            .map(|r| ack(&r.envelope, "stale", 9, 9))
            .collect();
        let rep = a.complete(&stale.handle, &late).await.unwrap();
        assert_eq!(
            (rep.applied, rep.superseded),
            (0, 20),
            "stale completion applied"
        );
        for r in &taken.records[..10] {
            let (status, topic, _, off) = row(&ctx, &r.envelope).await;
            assert_eq!(
                (status.as_str(), topic.as_deref(), off),
                ("published", Some("orders"), Some(100))
            );
            assert_eq!(last_version(&ctx, &r.envelope.aggregate_id).await, Some(1));
        }
        for r in &taken.records[10..] {
            let (status, topic, ..) = row(&ctx, &r.envelope).await;
            assert_eq!((status.as_str(), topic), ("pending", None));
            assert_eq!(last_version(&ctx, &r.envelope.aggregate_id).await, None);
        }
        let rest: Vec<Outcome> = taken.records[10..]
            .iter()
            .map(|r| published(&r.envelope, 200))
            .collect();
        let rep = b.complete(&taken.handle, &rest).await;
        // B's claim handle after its first completion: the rest are no longer leased to it
        // (a completion ends the claim's leases); they come back to a new claim instead.
        let rep = rep.unwrap();
        let next = claim(&b, "relay-b", 100).await;
        if rep.applied == 0 {
            assert_eq!(next.records.len(), 20, "{:?}", versions(&next));
        } else {
            assert_eq!(rep.applied, 10);
            assert_eq!(
                next.records.len(),
                20,
                "every v2 next: {:?}",
                versions(&next)
            );
            assert!(next
                .records
                .iter()
                .all(|r| r.envelope.aggregate_version == 2));
        }
        ctx.drop().await;
    }
}

/// One completion mixing publications (with Unicode, escapes and extreme acks), retries,
/// parks, duplicate event ids (the first outcome of an event counts) and outcomes of events
/// outside the claim, over many aggregates, in both claim modes: each row gets exactly its
/// outcome and each aggregate's last version moves to its published version only.
#[tokio::test]
async fn mixed_batch_with_duplicates_applies_exactly_the_first_outcome_of_each_event() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(8);
        let s = ctx.store(mode).await;
        let n = 60;
        let firsts: Vec<Envelope> = (0..n).map(|i| event(&format!("m{i:02}"), 1)).collect();
        let seconds: Vec<Envelope> = (0..n).map(|i| event(&format!("m{i:02}"), 2)).collect();
        common::append(&ctx, &s, &firsts).await;
        common::append(&ctx, &s, &seconds).await;
        let batch = claim(&s, "relay", 1000).await;
        assert_eq!(batch.records.len(), n);
        let topic = "tøpic-😀-\"q\"-\\-\u{0}-\t-é";
        let outsider = event("outsider", 1);
        let mut outs = Vec::new();
        for (i, r) in batch.records.iter().enumerate() {
            let e = &r.envelope;
            match i % 3 {
                0 => {
                    outs.push(ack(e, topic, i32::MIN + i as i32, i64::MAX - i as i64));
                    outs.push(park(e)); // duplicate: ignored
                }
                1 => {
                    outs.push(retry(e, Duration::from_secs(60)));
                    outs.push(ack(e, "dup", 1, 1)); // duplicate: ignored
                }
                _ => outs.push(park(e)),
            }
        }
        outs.push(ack(&outsider, "x", 1, 1));
        let rep = s.complete(&batch.handle, &outs).await.unwrap();
        assert_eq!(rep.applied, n, "one outcome per claimed row");
        for (i, r) in batch.records.iter().enumerate() {
            let e = &r.envelope;
            let (status, t, p, o) = row(&ctx, e).await;
            let last = last_version(&ctx, &e.aggregate_id).await;
            match i % 3 {
                0 => {
                    assert_eq!(status, "published", "row {i}");
                    assert_eq!(t.as_deref(), Some(topic), "row {i}");
                    assert_eq!(p, Some(i32::MIN + i as i32), "row {i}");
                    assert_eq!(o, Some(i64::MAX - i as i64), "row {i}");
                    assert_eq!(last, Some(1), "row {i}");
                }
                1 => {
                    assert_eq!((status.as_str(), t), ("pending", None), "row {i}");
                    assert_eq!(last, None, "row {i}");
                }
                _ => {
                    assert_eq!((status.as_str(), t), ("parked", None), "row {i}");
                    assert_eq!(last, None, "row {i}");
                }
            }
        }
        // Next: v2 of each published aggregate only (retried ones wait 60 s, parked ones
        // hold their aggregate).
        let next = claim(&s, "relay", 1000).await;
        let mut want: Vec<(String, i64)> = (0..n)
            .filter(|i| i % 3 == 0)
            .map(|i| (format!("m{i:02}"), 2))
            .collect();
        want.sort();
        assert_eq!(versions(&next), want);
        s.release(&next.handle).await.unwrap();
        ctx.drop().await;
    }
}

/// Aggregates whose ids differ only by case, trailing spaces, accents or Unicode
/// normalisation, and 255-byte ids, claimed and published in one batch, in both modes:
/// the joins by key never mix them up (each aggregate's last version moves alone and each
/// one's next version follows).
#[tokio::test]
async fn look_alike_and_long_names_stay_apart_through_the_joins() {
    // The envelope's longest aggregate id (255 bytes).
    let long_a = format!("{}a", "é".repeat(127));
    let long_b = format!("{}b", "é".repeat(127));
    let names: Vec<String> = vec![
        "abc".into(),
        "ABC".into(),
        "abc ".into(),
        "abc  ".into(),
        "ábc".into(),
        "a\u{301}bc".into(),
        "ß".into(),
        "ss".into(),
        long_a,
        long_b,
    ];
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(8);
        let s = ctx.store(mode).await;
        let v1: Vec<Envelope> = names.iter().map(|n| named(n, 1)).collect();
        let v2: Vec<Envelope> = names.iter().map(|n| named(n, 2)).collect();
        let v3: Vec<Envelope> = names.iter().map(|n| named(n, 3)).collect();
        common::append(&ctx, &s, &v1).await;
        common::append(&ctx, &s, &v2).await;
        common::append(&ctx, &s, &v3).await;
        // Round 1: everything's v1; publish only the even-indexed names.
        let b1 = claim(&s, "relay", 100).await;
        assert_eq!(b1.records.len(), names.len(), "{:?}", versions(&b1));
        assert!(b1.records.iter().all(|r| r.envelope.aggregate_version == 1));
        let outs: Vec<Outcome> = b1
            .records
            .iter()
            .filter(|r| {
                names
                    .iter()
                    .position(|n| *n == r.envelope.aggregate_id)
                    .unwrap()
                    % 2
                    == 0
            })
            .map(|r| published(&r.envelope, 1))
            .collect();
        let rep = s.complete(&b1.handle, &outs).await.unwrap();
        assert_eq!(rep.applied, names.len() / 2);
        for (i, n) in names.iter().enumerate() {
            let want = if i % 2 == 0 { Some(1) } else { None };
            assert_eq!(last_version(&ctx, n).await, want, "name #{i} {:?}", n.len());
        }
        // Round 2: even names give v2, odd names v1 again.
        let b2 = claim(&s, "relay", 100).await;
        let mut got: Vec<(usize, i64)> = b2
            .records
            .iter()
            .map(|r| {
                (
                    names
                        .iter()
                        .position(|n| *n == r.envelope.aggregate_id)
                        .unwrap(),
                    r.envelope.aggregate_version,
                )
            })
            .collect();
        got.sort();
        let want: Vec<(usize, i64)> = (0..names.len())
            .map(|i| (i, if i % 2 == 0 { 2 } else { 1 }))
            .collect();
        assert_eq!(got, want);
        common::publish_all(&s, &b2).await;
        for (i, n) in names.iter().enumerate() {
            let want = if i % 2 == 0 { 2 } else { 1 };
            assert_eq!(last_version(&ctx, n).await, Some(want), "name #{i}");
        }
        ctx.drop().await;
    }
}

/// A completion's joined statements touch only its own rows: with another transaction
/// holding the event rows and state rows of other aggregates (ids just below and just after
/// the claim's, and the whole rest of the table), a lease completion of publications, and the
/// next claim, finish without waiting on them.
#[tokio::test]
async fn joined_updates_never_wait_on_other_aggregates_rows() {
    let ctx = ctx!(8);
    let s = ctx.store(lease(30.0)).await;
    // The other aggregates get state rows (claimed and published once).
    let others: Vec<Envelope> = (0..40).map(|i| event(&format!("other{i:02}"), 1)).collect();
    common::append(&ctx, &s, &others).await;
    let first = claim(&s, "relay", 1000).await;
    assert_eq!(first.records.len(), 40);
    common::publish_all(&s, &first).await;
    // Interleaved ids: the others' next rows before, between and after the claimed ones.
    let mut evs = Vec::new();
    for i in 0..40 {
        evs.push(event(&format!("other{i:02}"), 2));
        evs.push(event(&format!("mine{i:02}"), 1));
    }
    evs.push(event("other00", 3));
    common::append(&ctx, &s, &evs).await;
    // Another transaction holds every row of the others, events and state, each locked by
    // its primary key (so that nothing else is locked).
    let mut blocker = ctx.pool.begin().await.unwrap();
    for (table, col) in [
        ("outbox_events", "id"),
        ("outbox_events_aggregate", "aggregate_key"),
    ] {
        let keys: Vec<Vec<u8>> = sqlx::query_scalar(&format!(
            "SELECT CAST({col} AS BINARY) FROM {} WHERE aggregate_id LIKE 'other%'",
            ctx.table(table)
        ))
        .fetch_all(&ctx.pool)
        .await
        .unwrap();
        assert!(keys.len() >= 40, "{table}: {}", keys.len());
        for k in keys {
            let locked = if col == "id" {
                let id: i64 = std::str::from_utf8(&k).unwrap().parse().unwrap();
                sqlx::query(&format!(
                    "SELECT 1 FROM {} WHERE id = ? FOR UPDATE",
                    ctx.table(table)
                ))
                .bind(id)
                .fetch_all(&mut *blocker)
                .await
            } else {
                sqlx::query(&format!(
                    "SELECT 1 FROM {} WHERE aggregate_key = ? FOR UPDATE",
                    ctx.table(table)
                ))
                .bind(k)
                .fetch_all(&mut *blocker)
                .await
            };
            assert_eq!(locked.unwrap().len(), 1, "{table}");
        }
    }
    let batch = tokio::time::timeout(Duration::from_secs(20), claim(&s, "relay", 1000))
        .await
        .expect("the claim waited on other aggregates' rows");
    assert_eq!(batch.records.len(), 40, "{:?}", versions(&batch));
    assert!(batch
        .records
        .iter()
        .all(|r| r.envelope.aggregate_id.starts_with("mine")));
    let outs: Vec<Outcome> = batch
        .records
        .iter()
        .map(|r| published(&r.envelope, 7))
        .collect();
    let rep = tokio::time::timeout(Duration::from_secs(20), s.complete(&batch.handle, &outs))
        .await
        .expect("the completion waited on other aggregates' rows")
        .unwrap();
    assert_eq!(rep.applied, 40);
    blocker.rollback().await.unwrap();
    ctx.drop().await;
}

/// An acknowledgement is recorded as given or not at all. A topic longer than the column
/// (`ack_topic TEXT`: 65,535 bytes) was refused by the server (strict mode: "Data too long")
/// when each row had its own `UPDATE`; through a `JSON_TABLE` column it was cut to 65,535
/// bytes without an error (a warning only), so the store reported a publication whose
/// recorded acknowledgement differs from the broker's.
#[tokio::test]
async fn an_overlong_ack_topic_is_never_recorded_truncated() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(8);
        let s = ctx.store(mode).await;
        let (x1, y1) = (event("x", 1), event("y", 1));
        common::append(&ctx, &s, &[x1.clone(), y1.clone()]).await;
        let batch = claim(&s, "relay", 10).await;
        assert_eq!(batch.records.len(), 2);
        let long = "t".repeat(70_000);
        let outs = vec![ack(&x1, &long, 1, 1), ack(&y1, "short", 1, 2)];
        match s.complete(&batch.handle, &outs).await {
            Ok(rep) => {
                let (status, topic, ..) = row(&ctx, &x1).await;
                if status == "published" {
                    assert_eq!(
                        topic.as_ref().map(String::len),
                        Some(long.len()),
                        "the recorded topic differs from the acknowledged one ({} applied)",
                        rep.applied
                    );
                }
            }
            Err(e) => {
                // Refused: nothing recorded.
                assert_eq!(row(&ctx, &x1).await.0, "pending", "{e}");
                assert_eq!(row(&ctx, &y1).await.0, "pending", "{e}");
            }
        }
        ctx.drop().await;
    }
}

/// Waits until an `UPDATE` of this test's database is held up in the server (as
/// `information_schema.PROCESSLIST` shows it), like `tests/order.rs`.
async fn wait_until_update_waits(ctx: &common::Ctx) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
             WHERE ID <> CONNECTION_ID() AND INSTR(INFO, ?) > 0 AND INFO LIKE 'UPDATE%'",
        )
        .bind(&ctx.database)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nothing on {} ever waited for a lock",
            ctx.database
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A batch of publications held up between its plain status read and its joined `UPDATE`
/// (a test transaction holds one of the rows), while its leases expire: another relay's claim
/// meanwhile gets none of the aggregates (their state rows are the completion's), and once
/// the completion finishes every row is published once, each last version is 1, and the next
/// claim hands out the versions 2.
#[tokio::test]
async fn a_publication_held_up_past_its_lease_is_never_overtaken() {
    let ctx = ctx!(8);
    let a = ctx.store(lease(0.3)).await;
    let b = ctx.store(lease(30.0)).await;
    let v1: Vec<Envelope> = (0..5).map(|i| event(&format!("p{i}"), 1)).collect();
    let v2: Vec<Envelope> = (0..5).map(|i| event(&format!("p{i}"), 2)).collect();
    common::append(&ctx, &a, &v1).await;
    common::append(&ctx, &a, &v2).await;
    let claimed = claim(&a, "relay-a", 100).await;
    assert_eq!(claimed.records.len(), 5);
    let mut blocker = ctx.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {} WHERE event_id = ? FOR UPDATE",
        ctx.table("outbox_events")
    ))
    .bind(v1[4].event_id.as_uuid())
    .execute(&mut *blocker)
    .await
    .unwrap();
    let completing = {
        let (a, handle) = (a.clone(), claimed.handle.clone());
        let outs: Vec<Outcome> = claimed
            .records
            .iter()
            .map(|r| published(&r.envelope, 5))
            .collect();
        tokio::spawn(async move { a.complete(&handle, &outs).await })
    };
    wait_until_update_waits(&ctx).await;
    tokio::time::sleep(Duration::from_millis(500)).await; // A's leases have expired
    let during = claim(&b, "relay-b", 100).await;
    assert!(
        during.is_empty(),
        "relay B was handed {:?} while A's completion was in progress",
        versions(&during)
    );
    blocker.commit().await.unwrap();
    let rep = completing.await.unwrap().unwrap();
    assert_eq!((rep.applied, rep.superseded), (5, 0));
    for e in &v1 {
        assert_eq!(row(&ctx, e).await.0, "published");
        assert_eq!(last_version(&ctx, &e.aggregate_id).await, Some(1));
    }
    let next = claim(&b, "relay-b", 100).await;
    let mut want: Vec<(String, i64)> = (0..5).map(|i| (format!("p{i}"), 2)).collect();
    want.sort();
    assert_eq!(versions(&next), want);
    ctx.drop().await;
}

/// Two locked relays: B holds a locked claim (its transaction keeps the event and state rows
/// of its aggregates) while A claims the other aggregates, whose rows lie before, between and
/// after B's next rows, and completes them with publications, retries and parks. Neither A's
/// claim (joined head probe) nor its completion (joined `UPDATE`s) waits on B's rows.
#[tokio::test]
async fn a_locked_completion_never_waits_on_another_locked_claim() {
    let ctx = ctx!(10);
    let a = ctx.store(ClaimMode::LockedTransaction).await;
    let b = ctx.store(ClaimMode::LockedTransaction).await;
    let others: Vec<Envelope> = (0..30).map(|i| event(&format!("other{i:02}"), 1)).collect();
    common::append(&ctx, &a, &others).await;
    let held = claim(&b, "relay-b", 30).await;
    assert_eq!(held.records.len(), 30);
    let mut evs = Vec::new();
    for i in 0..30 {
        evs.push(event(&format!("other{i:02}"), 2));
        evs.push(event(&format!("mine{i:02}"), 1));
    }
    common::append(&ctx, &a, &evs).await;
    let batch = tokio::time::timeout(Duration::from_secs(20), claim(&a, "relay-a", 1000))
        .await
        .expect("A's claim waited on B's locked claim");
    assert_eq!(batch.records.len(), 30, "{:?}", versions(&batch));
    assert!(batch
        .records
        .iter()
        .all(|r| r.envelope.aggregate_id.starts_with("mine")));
    let outs: Vec<Outcome> = batch
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| match i % 3 {
            0 | 1 => published(&r.envelope, i as i64),
            _ => park(&r.envelope),
        })
        .collect();
    let rep = tokio::time::timeout(Duration::from_secs(20), a.complete(&batch.handle, &outs))
        .await
        .expect("A's completion waited on B's locked claim")
        .unwrap();
    assert_eq!(rep.applied, 30);
    common::publish_all(&b, &held).await;
    let next = claim(&a, "relay-a", 1000).await;
    assert_eq!(
        next.records.len(),
        30,
        "the others' versions 2: {:?}",
        versions(&next)
    );
    assert!(next
        .records
        .iter()
        .all(|r| r.envelope.aggregate_version == 2));
    a.release(&next.handle).await.unwrap();
    ctx.drop().await;
}

/// A batch whose acknowledgements together exceed the server's `max_allowed_packet` (16 MiB
/// by default; 2,000 publications with 9,000-byte topics: 18 MB) completes: the per-row
/// statements never came near the limit, a single JSON document of them all would be
/// refused by the server on every attempt (the batch could never complete, and its events
/// would be claimed and sent again forever).
#[tokio::test]
async fn a_batch_of_acks_larger_than_a_packet_completes() {
    let ctx = ctx!(8);
    let s = ctx.store(lease(120.0)).await;
    let n = 2_000;
    let evs: Vec<Envelope> = (0..n).map(|i| event(&format!("big{i:04}"), 1)).collect();
    common::append(&ctx, &s, &evs).await;
    let batch = claim(&s, "relay", n).await;
    assert_eq!(batch.records.len(), n);
    let topic = "t".repeat(9_000);
    let outs: Vec<Outcome> = batch
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| ack(&r.envelope, &topic, 0, i as i64))
        .collect();
    let rep = s.complete(&batch.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, n);
    let (published, shortest): (i64, Option<i64>) = sqlx::query_as(&format!(
        "SELECT COUNT(*), MIN(LENGTH(ack_destination)) FROM {} WHERE status = 'published'",
        ctx.table("outbox_events")
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!((published, shortest), (n as i64, Some(9_000)));
    ctx.drop().await;
}

/// A duplicate version appended while the original is in flight, over many aggregates in one
/// batch (the stale rows come from the join of the JSON table with the events): once the
/// originals are published, every duplicate is parked as out of order by the next claim,
/// never handed out, and the versions 2 follow; in both modes.
#[tokio::test]
async fn duplicates_below_the_last_version_are_parked_never_published() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(8);
        let s = ctx.store(mode).await;
        let n = 12;
        let v1: Vec<Envelope> = (0..n).map(|i| event(&format!("d{i:02}"), 1)).collect();
        let v2: Vec<Envelope> = (0..n).map(|i| event(&format!("d{i:02}"), 2)).collect();
        common::append(&ctx, &s, &v1).await;
        let first = claim(&s, "relay", 100).await;
        assert_eq!(first.records.len(), n);
        let dups: Vec<Envelope> = (0..n).map(|i| event(&format!("d{i:02}"), 1)).collect();
        common::append(&ctx, &s, &dups).await;
        common::append(&ctx, &s, &v2).await;
        common::publish_all(&s, &first).await;
        let next = claim(&s, "relay", 100).await;
        let mut want: Vec<(String, i64)> = (0..n).map(|i| (format!("d{i:02}"), 2)).collect();
        want.sort();
        assert_eq!(versions(&next), want, "parked: {}", next.parked.len());
        s.release(&next.handle).await.unwrap();
        for d in &dups {
            assert_eq!(
                row(&ctx, d).await.0,
                "parked",
                "duplicate of {}",
                d.aggregate_id
            );
        }
        ctx.drop().await;
    }
}

/// A lease claim completed through another store instance (its rows read back by the lease
/// token) with mixed outcomes applies them exactly; the same completion sent again, through
/// either instance, applies nothing and moves no last version again.
#[tokio::test]
async fn a_completion_through_another_instance_and_its_replay() {
    let ctx = ctx!(8);
    let a = ctx.store(lease(30.0)).await;
    let c = ctx.store(lease(30.0)).await;
    let v1: Vec<Envelope> = (0..9).map(|i| event(&format!("c{i}"), 1)).collect();
    let v2: Vec<Envelope> = (0..9).map(|i| event(&format!("c{i}"), 2)).collect();
    common::append(&ctx, &a, &v1).await;
    common::append(&ctx, &a, &v2).await;
    let batch = claim(&a, "relay-a", 100).await;
    assert_eq!(batch.records.len(), 9);
    let outs: Vec<Outcome> = batch
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| match i % 3 {
            0 => published(&r.envelope, i as i64),
            1 => retry(&r.envelope, Duration::from_secs(60)),
            _ => park(&r.envelope),
        })
        .collect();
    let rep = c.complete(&batch.handle, &outs).await.unwrap();
    assert_eq!((rep.applied, rep.superseded), (9, 0));
    for again in [&c, &a] {
        let rep = again.complete(&batch.handle, &outs).await.unwrap();
        assert_eq!((rep.applied, rep.superseded), (0, 9));
    }
    for (i, r) in batch.records.iter().enumerate() {
        let want = ["published", "pending", "parked"][i % 3];
        assert_eq!(row(&ctx, &r.envelope).await.0, want, "row {i}");
        let last = last_version(&ctx, &r.envelope.aggregate_id).await;
        assert_eq!(last, if i % 3 == 0 { Some(1) } else { None }, "row {i}");
    }
    let next = claim(&a, "relay-a", 100).await;
    assert_eq!(next.records.len(), 3, "{:?}", versions(&next));
    assert!(next
        .records
        .iter()
        .all(|r| r.envelope.aggregate_version == 2));
    ctx.drop().await;
}
