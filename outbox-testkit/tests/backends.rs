//! Unit tests of the in-memory backends' own features (the trait contracts are covered again by
//! the conformance suite in `conformance.rs`).

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{
    AckMetadata, ClaimMode, ClaimRequest, DeliveryStatus, Envelope, ErrorClass, EventId,
    InboxStore, InboxStoreExt, LastError, MessageSource, OperatorAction, Outcome, ParkKind,
    ParkReason, PublishErrorKind, Publisher, Registration, StoreErrorKind,
};
use outbox_testkit::{
    FaultAction, FaultMatch, LogFault, ManualClock, MemoryDb, MemoryInboxStore, MemoryLog,
    MemoryOutboxStore,
};

fn ev(agg: &str, v: i64, n: u64) -> Envelope {
    Envelope::builder("order", agg, v, "order.changed")
        .event_id(outbox_testkit::deterministic_event_id(
            ManualClock::epoch(),
            n,
        ))
        .created_at(ManualClock::epoch())
        .build()
        .unwrap()
}

fn ack(n: i64) -> AckMetadata {
    AckMetadata::kafka("t", 0, n)
}

fn lease() -> ClaimMode {
    ClaimMode::lease(Duration::from_secs(30)).unwrap()
}

async fn append(store: &MemoryOutboxStore, events: &[Envelope]) {
    let mut tx = store.db().begin();
    store.append(&mut tx, events).await.unwrap();
    tx.commit().unwrap();
}

fn ids(batch: &outbox_core::ClaimedBatch) -> Vec<EventId> {
    batch.records.iter().map(|r| r.envelope.event_id).collect()
}

/// Issue 20, item 6: the memory store accepts what the PostgreSQL store accepts. With a raised
/// name limit, aggregate names of exactly `MAX_AGGREGATE_NAME_BYTES` go in and one byte more is
/// a validation error; limits above that bound make every append a configuration error (the
/// PostgreSQL store refuses to be built with them).
#[tokio::test]
async fn aggregate_names_are_bounded_as_in_every_store() {
    use outbox_core::{EnvelopeLimits, MAX_AGGREGATE_NAME_BYTES};
    let db = MemoryDb::default();
    let raised = EnvelopeLimits::default().with_max_name_len(8192);
    let store = MemoryOutboxStore::new(&db, lease()).limits(raised.clone());
    let named = |id: String, n: u64| {
        let mut e = ev("a", 1, n);
        e.aggregate_id = id;
        e
    };
    append(&store, &[named("x".repeat(MAX_AGGREGATE_NAME_BYTES), 1)]).await;
    let mut tx = db.begin();
    let err = store
        .append(
            &mut tx,
            &[named("x".repeat(MAX_AGGREGATE_NAME_BYTES + 1), 2)],
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Validation, "{err}");
    let mut above = raised;
    above.max_aggregate_name_bytes = MAX_AGGREGATE_NAME_BYTES + 1;
    let store = MemoryOutboxStore::new(&db, lease()).limits(above);
    let err = store.append(&mut tx, &[ev("b", 1, 3)]).await.unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Configuration, "{err}");
}

#[tokio::test]
async fn append_validates_and_rejects_duplicates() {
    let db = MemoryDb::default();
    let store = MemoryOutboxStore::new(&db, lease());
    let mut bad = ev("a", 1, 1);
    bad.event_type = String::new();
    let mut tx = db.begin();
    let err = store
        .append(&mut tx, &[ev("a", 1, 2), bad])
        .await
        .unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Validation);
    assert_eq!(
        tx.staged_events(),
        0,
        "nothing written on a validation error"
    );
    store.append(&mut tx, &[ev("a", 1, 3)]).await.unwrap();
    let err = store.append(&mut tx, &[ev("b", 1, 3)]).await.unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Constraint);
    tx.commit().unwrap();
    let mut tx = db.begin();
    let err = store.append(&mut tx, &[ev("c", 1, 3)]).await.unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Constraint);
    // Two open transactions with the same id: the second commit fails.
    let (mut t1, mut t2) = (db.begin(), db.begin());
    store.append(&mut t1, &[ev("d", 1, 9)]).await.unwrap();
    store.append(&mut t2, &[ev("e", 1, 9)]).await.unwrap();
    t1.commit().unwrap();
    assert_eq!(t2.commit().unwrap_err().kind, StoreErrorKind::Constraint);
    // A rolled-back append leaves nothing.
    let mut tx = db.begin();
    store.append(&mut tx, &[ev("f", 1, 10)]).await.unwrap();
    drop(tx);
    assert!(store.row(ev("f", 1, 10).event_id).is_none());
    assert_eq!(store.snapshot().len(), 2);
}

#[tokio::test]
async fn sequence_is_assigned_at_append_and_late_commits_are_claimed() {
    let db = MemoryDb::default();
    let store = MemoryOutboxStore::new(&db, lease());
    let mut early = db.begin();
    store.append(&mut early, &[ev("a", 1, 1)]).await.unwrap();
    append(&store, &[ev("b", 1, 2)]).await;
    let b = store.claim(&ClaimRequest::new("r", 10)).await.unwrap();
    assert_eq!(ids(&b), vec![ev("b", 1, 2).event_id]);
    early.commit().unwrap();
    let snap = store.snapshot();
    assert!(snap[0].seq < snap[1].seq && snap[0].envelope.aggregate_id == "a");
    let a = store.claim(&ClaimRequest::new("r", 10)).await.unwrap();
    assert_eq!(ids(&a), vec![ev("a", 1, 1).event_id]);
}

#[tokio::test]
async fn claim_hands_out_heads_oldest_first_within_limit() {
    let db = MemoryDb::default();
    let store = MemoryOutboxStore::new(&db, lease());
    append(
        &store,
        &[ev("a", 2, 2), ev("a", 1, 1), ev("b", 1, 3), ev("c", 1, 4)],
    )
    .await;
    let batch = store.claim(&ClaimRequest::new("r1", 2)).await.unwrap();
    // a's head is version 1 even though version 2 was appended first.
    assert_eq!(
        ids(&batch),
        vec![ev("a", 1, 1).event_id, ev("b", 1, 3).event_id]
    );
    assert_eq!(batch.lease_remaining, Some(Duration::from_secs(30)));
    let other = store.claim(&ClaimRequest::new("r2", 10)).await.unwrap();
    assert_eq!(ids(&other), vec![ev("c", 1, 4).event_id]);
    let outcomes = vec![Outcome::Published {
        event_id: ev("a", 1, 1).event_id,
        ack: ack(0),
    }];
    let rep = store.complete(&batch.handle, &outcomes).await.unwrap();
    assert_eq!((rep.applied, rep.superseded), (1, 0));
    // b was released unchanged by complete (no outcome): claimable again, attempts unchanged.
    let next = store.claim(&ClaimRequest::new("r1", 10)).await.unwrap();
    assert_eq!(
        ids(&next),
        vec![ev("a", 2, 2).event_id, ev("b", 1, 3).event_id]
    );
    assert!(next.records.iter().all(|r| r.attempts == 0));
    let row = store.row(ev("a", 1, 1).event_id).unwrap();
    assert_eq!(row.status, DeliveryStatus::Published);
    assert_eq!(row.ack, Some(ack(0)));
}

#[tokio::test]
async fn lease_expiry_fencing_and_superseded_count() {
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let store = MemoryOutboxStore::new(&db, lease());
    append(&store, &[ev("a", 1, 1)]).await;
    let first = store.claim(&ClaimRequest::new("r1", 10)).await.unwrap();
    assert_eq!(first.records.len(), 1);
    clock.advance(Duration::from_secs(29));
    assert!(store
        .claim(&ClaimRequest::new("r2", 10))
        .await
        .unwrap()
        .is_empty());
    assert_eq!(db_stats(&store).await.in_flight, 1);
    clock.advance(Duration::from_secs(2));
    let second = store.claim(&ClaimRequest::new("r2", 10)).await.unwrap();
    assert_eq!(ids(&second), ids(&first));
    let publish = |n| {
        vec![Outcome::Published {
            event_id: ev("a", 1, 1).event_id,
            ack: ack(n),
        }]
    };
    let stale = store.complete(&first.handle, &publish(1)).await.unwrap();
    assert_eq!((stale.applied, stale.superseded), (0, 1));
    let fresh = store.complete(&second.handle, &publish(2)).await.unwrap();
    assert_eq!((fresh.applied, fresh.superseded), (1, 0));
    assert_eq!(store.row(ev("a", 1, 1).event_id).unwrap().ack, Some(ack(2)));
    assert_eq!(store.superseded_total(), 1);
    // Idempotent: completing again changes nothing.
    let again = store.complete(&second.handle, &publish(3)).await.unwrap();
    assert_eq!((again.applied, again.superseded), (0, 1));
    assert_eq!(store.row(ev("a", 1, 1).event_id).unwrap().ack, Some(ack(2)));
}

async fn db_stats(store: &MemoryOutboxStore) -> outbox_core::OutboxStats {
    store.stats().await.unwrap()
}

#[tokio::test]
async fn locked_transaction_holds_until_complete_or_abandon() {
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let store = MemoryOutboxStore::new(&db, ClaimMode::LockedTransaction);
    append(&store, &[ev("a", 1, 1), ev("b", 1, 2)]).await;
    let batch = store.claim(&ClaimRequest::new("r1", 10)).await.unwrap();
    assert_eq!(batch.records.len(), 2);
    assert_eq!(batch.lease_remaining, None);
    clock.advance(Duration::from_secs(3600));
    assert!(store
        .claim(&ClaimRequest::new("r2", 10))
        .await
        .unwrap()
        .is_empty());
    assert_eq!(store.open_claims(), 1);
    store.abandon(&batch.handle);
    assert_eq!(store.open_claims(), 0);
    let again = store.claim(&ClaimRequest::new("r2", 10)).await.unwrap();
    assert_eq!(again.records.len(), 2);
    let late = store
        .complete(
            &batch.handle,
            &[Outcome::Published {
                event_id: ev("a", 1, 1).event_id,
                ack: ack(0),
            }],
        )
        .await
        .unwrap();
    assert_eq!(
        late.superseded, 1,
        "the dropped connection's outcome is refused"
    );
    store.release(&again.handle).await.unwrap();
    assert_eq!(
        store
            .claim(&ClaimRequest::new("r3", 10))
            .await
            .unwrap()
            .records
            .len(),
        2
    );
}

#[tokio::test]
async fn abandon_in_lease_mode_waits_for_expiry() {
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let store = MemoryOutboxStore::new(&db, lease());
    append(&store, &[ev("a", 1, 1)]).await;
    let batch = store.claim(&ClaimRequest::new("r1", 10)).await.unwrap();
    store.abandon(&batch.handle);
    assert!(store
        .claim(&ClaimRequest::new("r2", 10))
        .await
        .unwrap()
        .is_empty());
    clock.advance(Duration::from_secs(30));
    assert_eq!(
        store
            .claim(&ClaimRequest::new("r2", 10))
            .await
            .unwrap()
            .records
            .len(),
        1
    );
}

fn park_reason() -> ParkReason {
    ParkReason {
        kind: ParkKind::PermanentError,
        error: LastError {
            class: ErrorClass::Permanent,
            kind: "record_too_large".into(),
            message: "too big".into(),
        },
    }
}

#[tokio::test]
async fn retry_delay_parking_and_operator_actions() {
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let store = MemoryOutboxStore::new(&db, lease());
    append(&store, &[ev("a", 1, 1), ev("a", 2, 2), ev("b", 1, 3)]).await;
    let batch = store.claim(&ClaimRequest::new("r", 10)).await.unwrap();
    let outcomes = vec![
        Outcome::Park {
            event_id: ev("a", 1, 1).event_id,
            reason: park_reason(),
        },
        Outcome::Retry {
            event_id: ev("b", 1, 3).event_id,
            delay: Duration::from_secs(5),
            error: park_reason().error,
        },
    ];
    store.complete(&batch.handle, &outcomes).await.unwrap();
    assert!(store
        .claim(&ClaimRequest::new("r", 10))
        .await
        .unwrap()
        .is_empty());
    clock.advance(Duration::from_secs(5));
    let b = store.claim(&ClaimRequest::new("r", 10)).await.unwrap();
    assert_eq!(ids(&b), vec![ev("b", 1, 3).event_id]);
    assert_eq!(b.records[0].attempts, 1);
    store.release(&b.handle).await.unwrap();

    let stats = store.stats().await.unwrap();
    assert_eq!((stats.parked, stats.unpublished), (1, 2));
    assert_eq!(stats.oldest_parked_age, Some(Duration::from_secs(5)));
    let parked = store.list_parked(10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].reason, park_reason());

    let a1 = ev("a", 1, 1).event_id;
    assert_eq!(
        store.discard_parked(a1, "op", " ").await.unwrap_err().kind,
        StoreErrorKind::Validation
    );
    assert_eq!(
        store
            .retry_parked(ev("b", 1, 3).event_id, "op")
            .await
            .unwrap_err()
            .kind,
        StoreErrorKind::NotFound
    );
    let new_id = store
        .reissue_parked(a1, "op", "fixed the size")
        .await
        .unwrap();
    assert_ne!(new_id, a1);
    assert_eq!(store.row(a1).unwrap().status, DeliveryStatus::Discarded);
    let copy = store.row(new_id).unwrap();
    assert_eq!(copy.envelope.aggregate_version, 1);
    assert_eq!(copy.status, DeliveryStatus::Pending);
    let trail = store.audit_trail(Some(a1)).await.unwrap();
    assert_eq!(trail.len(), 1);
    assert_eq!(trail[0].action, OperatorAction::Reissue);
    assert_eq!(trail[0].new_event_id, Some(new_id));
    let batch = store.claim(&ClaimRequest::new("r", 10)).await.unwrap();
    assert!(ids(&batch).contains(&new_id));
}

#[tokio::test]
async fn cleanup_in_batches_and_stats_ages() {
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let store = MemoryOutboxStore::new(&db, lease());
    let events: Vec<Envelope> = (1..=5).map(|i| ev(&format!("a{i}"), 1, i as u64)).collect();
    append(&store, &events).await;
    append(&store, &[ev("z", 1, 99)]).await;
    clock.advance(Duration::from_secs(10));
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.oldest_claimable_age, Some(Duration::from_secs(10)));
    let batch = store.claim(&ClaimRequest::new("r", 5)).await.unwrap();
    let outcomes: Vec<Outcome> = batch
        .records
        .iter()
        .map(|r| Outcome::Published {
            event_id: r.envelope.event_id,
            ack: ack(0),
        })
        .collect();
    store.complete(&batch.handle, &outcomes).await.unwrap();
    let rep = store.cleanup(Duration::from_secs(60), 2).await.unwrap();
    assert_eq!(rep.removed, 0);
    clock.advance(Duration::from_secs(60));
    let rep = store.cleanup(Duration::from_secs(60), 2).await.unwrap();
    assert_eq!((rep.removed, rep.batches), (5, 3));
    let snap = store.snapshot();
    assert_eq!(snap.len(), 1);
    assert_eq!(snap[0].status, DeliveryStatus::Pending);
    assert!(store.cleanup(Duration::ZERO, 0).await.is_err());
}

#[tokio::test]
async fn log_routes_partitions_and_faults() {
    let log = MemoryLog::builder()
        .topic("orders", 3)
        .topic("payments", 2)
        .default_topic("orders")
        .route("payment.captured", "payments")
        .route("ghost.event", "nowhere")
        .max_record_bytes(600)
        .build();
    let e1 = ev("a", 1, 1);
    let pay = Envelope::builder("payment", "p-1", 1, "payment.captured")
        .build()
        .unwrap();
    let ghost = Envelope::builder("g", "g", 1, "ghost.event")
        .build()
        .unwrap();
    let big = Envelope::builder("o", "o", 1, "big")
        .payload(outbox_core::Payload::new(
            "application/octet-stream",
            vec![0u8; 700],
        ))
        .build()
        .unwrap();
    let res = log.publish(&[&e1, &pay, &ghost, &big]).await;
    let kafka = |i: usize| res[i].as_ref().unwrap().as_kafka().unwrap();
    assert_eq!(kafka(0).0, "orders");
    assert_eq!(kafka(0).1, MemoryLog::partition_for("a", 3));
    assert_eq!(kafka(1).0, "payments");
    assert_eq!(
        res[2].as_ref().unwrap_err().kind,
        PublishErrorKind::UnknownTopic
    );
    assert_eq!(
        res[3].as_ref().unwrap_err().kind,
        PublishErrorKind::RecordTooLarge
    );
    assert_eq!(res[3].as_ref().unwrap_err().class, ErrorClass::Permanent);

    // Same key, same partition, increasing offsets.
    let e2 = ev("a", 2, 2);
    let r2 = log.publish(&[&e2]).await.remove(0).unwrap();
    let r2 = r2.as_kafka().unwrap();
    assert_eq!(r2.1, kafka(0).1);
    assert_eq!(r2.2, kafka(0).2 + 1);

    log.fail_next(2, PublishErrorKind::NotEnoughReplicas);
    let r = log.publish(&[&e1, &e1, &e1]).await;
    assert!(r[0].is_err() && r[1].is_err() && r[2].is_ok());

    let before = log.all_records().len();
    log.lose_ack_next(1);
    let r = log.publish(&[&e1]).await;
    let err = r[0].as_ref().unwrap_err();
    assert_eq!(
        (err.kind, err.class),
        (PublishErrorKind::Timeout, ErrorClass::Transient)
    );
    assert_eq!(
        log.all_records().len(),
        before + 1,
        "stored despite the lost ack"
    );

    log.fail_event(e2.event_id, PublishErrorKind::Authorization);
    log.inject(LogFault::new(FaultMatch::Aggregate("zz".into()), FaultAction::LoseAck).times(1));
    let r = log.publish(&[&e2, &e1]).await;
    assert_eq!(
        r[0].as_ref().unwrap_err().kind,
        PublishErrorKind::Authorization
    );
    assert!(r[1].is_ok());
    log.clear_faults();
    assert!(log.publish(&[&e2]).await[0].is_ok());
    assert_eq!(log.delivery_timeout(), Duration::from_secs(5));
}

#[tokio::test]
async fn poll_waits_for_a_publish_and_malformed_records_are_errors() {
    let log = MemoryLog::new("orders", 1);
    let consumer = log.consumer("g", &["orders"]);
    assert!(consumer
        .poll(Duration::from_millis(5))
        .await
        .unwrap()
        .is_none());
    let publisher = log.clone();
    let task = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        publisher
            .append_raw(
                "orders",
                0,
                None,
                vec![("event_id".into(), b"nope".to_vec())],
                b"x".to_vec(),
            )
            .unwrap()
    });
    let m = consumer
        .poll(Duration::from_secs(5))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(task.await.unwrap(), 0);
    assert!(m.envelope.is_err());
    assert!(log.append_raw("missing", 0, None, vec![], vec![]).is_err());
    assert!(log.append_raw("orders", 7, None, vec![], vec![]).is_err());
}

#[tokio::test]
async fn inbox_fresh_duplicate_rollback_and_conflict() {
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let inbox = MemoryInboxStore::new(&db);
    let id = ev("a", 1, 1).event_id;
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox.register_one(&mut tx, "c", id).await.unwrap(),
        Registration::Fresh
    );
    assert_eq!(
        inbox.register_one(&mut tx, "c", id).await.unwrap(),
        Registration::Duplicate
    );
    tx.put("proj", "a", serde_json::json!(1));
    inbox.rollback(tx).await.unwrap();
    assert_eq!(db.read("proj", "a"), None);
    let (mut t1, mut t2) = (inbox.begin().await.unwrap(), inbox.begin().await.unwrap());
    assert_eq!(
        inbox.register_one(&mut t1, "c", id).await.unwrap(),
        Registration::Fresh
    );
    assert_eq!(
        inbox.register_one(&mut t2, "c", id).await.unwrap(),
        Registration::Fresh
    );
    assert_eq!(
        inbox.register_one(&mut t2, "other", id).await.unwrap(),
        Registration::Fresh
    );
    inbox.commit(t1).await.unwrap();
    let err = inbox.commit(t2).await.unwrap_err();
    assert_eq!(
        (err.kind, err.class),
        (StoreErrorKind::Conflict, ErrorClass::Transient)
    );
    assert!(inbox.is_registered("c", id) && !inbox.is_registered("other", id));
    assert_eq!(inbox.registrations("c"), vec![id]);
    clock.advance(Duration::from_secs(100));
    assert_eq!(
        inbox
            .cleanup("c", Duration::from_secs(200), 10)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        inbox
            .cleanup("other", Duration::from_secs(50), 10)
            .await
            .unwrap(),
        0,
        "another consumer's cleanup keeps c's registration"
    );
    assert_eq!(
        inbox
            .cleanup("c", Duration::from_secs(50), 10)
            .await
            .unwrap(),
        1
    );
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox.register_one(&mut tx, "c", id).await.unwrap(),
        Registration::Fresh
    );
    assert!(inbox.register_one(&mut tx, "", id).await.is_err());
}
