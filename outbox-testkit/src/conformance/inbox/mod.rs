//! The inbox checks, one per contract clause of [`InboxStore`] and [`InboxParking`]. Each takes
//! a fresh [`InboxHarness`].

use std::time::Duration;

use outbox_core::{
    wire, AggregateKey, AggregateState, Classify, Envelope, InboxAction, InboxAuditEntry,
    InboxParking, InboxStore, InboxStoreExt, LogPosition, NewParkedMessage, ParkAs, ParkKind,
    ParkedChange, ParkedFilter, ParkedRecord, ParkedStatus, Parking, RecordHeader, Registration,
    StoreError, StoreErrorKind, VersionAdvance,
};

use super::{event, fresh_event_id, unique, InboxHarness};

mod identity;
mod positions;
pub use identity::{
    a_crafted_event_id_does_not_hide_an_undecodable_message,
    an_undecodable_jetstream_message_is_parked_once_per_stream_sequence,
};
pub use positions::{
    a_message_parked_before_the_native_columns_reads_back_as_its_kafka_position,
    native_columns_that_describe_no_position_are_refused,
    parked_messages_keep_their_native_position,
};

fn consumer(name: &str) -> String {
    format!("{name}-{}", unique())
}

fn conflict_or_transient(e: &StoreError) -> bool {
    e.is_transient() && e.kind == StoreErrorKind::Conflict
}

/// A first registration is fresh; after it committed, the same pair is a duplicate.
pub async fn first_registration_is_fresh_then_duplicate<H: InboxHarness>(h: &H) {
    let s = h.store();
    let (c, id) = (consumer("c"), fresh_event_id());
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_one(&mut tx, &c, id).await.expect("register"),
        Registration::Fresh
    );
    s.commit(tx).await.expect("commit");
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_one(&mut tx, &c, id).await.expect("register"),
        Registration::Duplicate
    );
    s.rollback(tx).await.expect("rollback");
}

/// A batch registration answers per id, in order: repeats inside the batch and ids committed
/// before are duplicates.
pub async fn batch_registration_answers_each_id_in_order<H: InboxHarness>(h: &H) {
    let s = h.store();
    let c = consumer("c");
    let (old, a, b) = (fresh_event_id(), fresh_event_id(), fresh_event_id());
    let mut tx = s.begin().await.expect("begin");
    s.register_one(&mut tx, &c, old).await.expect("register");
    s.commit(tx).await.expect("commit");
    let mut tx = s.begin().await.expect("begin");
    let got = s
        .register(&mut tx, &c, &[a, old, b, a])
        .await
        .expect("register");
    use Registration::*;
    assert_eq!(got, vec![Fresh, Duplicate, Fresh, Duplicate]);
    assert_eq!(s.register(&mut tx, &c, &[]).await.expect("empty"), vec![]);
    s.commit(tx).await.expect("commit");
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register(&mut tx, &c, &[b, a]).await.expect("register"),
        vec![Duplicate, Duplicate]
    );
    s.rollback(tx).await.expect("rollback");
}

/// A re-issued copy of an event (header [`wire::ORIGINAL_EVENT_ID`]) and its original are one
/// event to the inbox, whichever arrives first.
pub async fn reissued_copy_and_original_are_one_event<H: InboxHarness>(h: &H) {
    let s = h.store();
    let c = consumer("c");
    let copy_of = |original: &Envelope| -> Envelope {
        Envelope::builder(
            original.aggregate_type.clone(),
            original.aggregate_id.clone(),
            original.aggregate_version,
            original.event_type.clone(),
        )
        .event_id(fresh_event_id())
        .header(wire::ORIGINAL_EVENT_ID, original.event_id.to_string())
        .build()
        .expect("valid copy")
    };
    // Original first, then the copy.
    let original = event(&format!("a-{}", unique()), 1);
    let copy = copy_of(&original);
    assert_ne!(copy.event_id, original.event_id);
    assert_eq!(copy.dedup_id(), original.event_id);
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_event(&mut tx, &c, &original)
            .await
            .expect("register"),
        Registration::Fresh
    );
    s.commit(tx).await.expect("commit");
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_event(&mut tx, &c, &copy)
            .await
            .expect("register"),
        Registration::Duplicate,
        "the copy of an applied event was fresh: its effect would be applied twice"
    );
    s.rollback(tx).await.expect("rollback");
    // The copy first, then the original (the original was in the log after all).
    let original = event(&format!("b-{}", unique()), 1);
    let copy = copy_of(&original);
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_event(&mut tx, &c, &copy)
            .await
            .expect("register"),
        Registration::Fresh
    );
    s.commit(tx).await.expect("commit");
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_event(&mut tx, &c, &original)
            .await
            .expect("register"),
        Registration::Duplicate
    );
    s.rollback(tx).await.expect("rollback");
}

/// A rolled-back registration leaves the event fresh.
pub async fn rolled_back_registration_is_fresh_again<H: InboxHarness>(h: &H) {
    let s = h.store();
    let (c, id) = (consumer("c"), fresh_event_id());
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_one(&mut tx, &c, id).await.expect("register"),
        Registration::Fresh
    );
    s.rollback(tx).await.expect("rollback");
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_one(&mut tx, &c, id).await.expect("register"),
        Registration::Fresh,
        "a rolled-back registration counted as processed"
    );
    s.commit(tx).await.expect("commit");
}

/// Registrations are per consumer.
pub async fn consumers_deduplicate_independently<H: InboxHarness>(h: &H) {
    let s = h.store();
    let (c1, c2, id) = (consumer("c1"), consumer("c2"), fresh_event_id());
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_one(&mut tx, &c1, id).await.expect("register"),
        Registration::Fresh
    );
    s.commit(tx).await.expect("commit");
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_one(&mut tx, &c2, id).await.expect("register"),
        Registration::Fresh
    );
    assert_eq!(
        s.register_one(&mut tx, &c1, fresh_event_id())
            .await
            .expect("register"),
        Registration::Fresh
    );
    s.commit(tx).await.expect("commit");
}

/// Two concurrent transactions registering the same pair never both commit as fresh: exactly
/// one commits; the other blocks and sees a duplicate, or fails with a transient conflict (at
/// registration or at commit).
pub async fn concurrent_registrations_cannot_both_commit<H: InboxHarness>(h: &H) {
    let s = h.store();
    let (c, id) = (consumer("c"), fresh_event_id());
    let mut first = s.begin().await.expect("begin");
    assert_eq!(
        s.register_one(&mut first, &c, id).await.expect("register"),
        Registration::Fresh
    );
    let step = h.capabilities().time_step;
    let second = async {
        let mut tx = s.begin().await?;
        match s.register_one(&mut tx, &c, id).await? {
            Registration::Duplicate => {
                s.rollback(tx).await?;
                Ok(Registration::Duplicate)
            }
            Registration::Fresh => s.commit(tx).await.map(|()| Registration::Fresh),
        }
    };
    let commit_first = async {
        // Let the second transaction reach its registration (it may block on ours).
        tokio::time::sleep(step.min(Duration::from_millis(200))).await;
        s.commit(first).await
    };
    let (second, first) = tokio::join!(second, commit_first);
    let mut fresh_commits = 0;
    let check_loser = |e: StoreError| {
        assert!(
            conflict_or_transient(&e),
            "the loser must fail with a transient conflict: {e}"
        );
    };
    match first {
        Ok(()) => fresh_commits += 1,
        Err(e) => check_loser(e),
    }
    match second {
        Ok(Registration::Fresh) => fresh_commits += 1,
        Ok(Registration::Duplicate) => {}
        Err(e) => check_loser(e),
    }
    assert_eq!(
        fresh_commits, 1,
        "exactly one of two concurrent registrations may commit as fresh"
    );
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_one(&mut tx, &c, id).await.expect("register"),
        Registration::Duplicate
    );
    s.rollback(tx).await.expect("rollback");
}

/// Cleanup forgets the cleaning consumer's registrations older than the retention, and only
/// those, one bounded batch per call; another consumer's registrations (sharing the store,
/// with a longer window) stay, however old.
pub async fn cleanup_forgets_registrations_past_retention<H: InboxHarness>(h: &H) {
    let s = h.store();
    let step = h.capabilities().time_step;
    let c = consumer("c");
    let other = consumer("other");
    let old = [fresh_event_id(), fresh_event_id(), fresh_event_id()];
    let new = fresh_event_id();
    let mut tx = s.begin().await.expect("begin");
    s.register(&mut tx, &c, &old).await.expect("register");
    s.register(&mut tx, &other, &old).await.expect("register");
    s.commit(tx).await.expect("commit");
    h.advance(step * 4).await;
    let mut tx = s.begin().await.expect("begin");
    s.register_one(&mut tx, &c, new).await.expect("register");
    s.commit(tx).await.expect("commit");
    assert_eq!(
        s.cleanup(&c, step * 2, 2).await.expect("cleanup"),
        2,
        "one call removes at most one batch"
    );
    assert_eq!(
        s.cleanup_batches(&c, step * 2, 2, 10)
            .await
            .expect("cleanup"),
        1,
        "exactly the consumer's old registrations are past retention"
    );
    assert_eq!(s.cleanup(&c, step * 2, 2).await.expect("cleanup"), 0);
    let mut tx = s.begin().await.expect("begin");
    use Registration::*;
    assert_eq!(
        s.register(&mut tx, &c, &[old[0], old[1], old[2], new])
            .await
            .expect("register"),
        vec![Fresh, Fresh, Fresh, Duplicate]
    );
    assert_eq!(
        s.register(&mut tx, &other, &old).await.expect("register"),
        vec![Duplicate, Duplicate, Duplicate],
        "another consumer's registrations survive this consumer's cleanup"
    );
    s.rollback(tx).await.expect("rollback");
    assert_eq!(
        s.cleanup(&other, step * 8, 10).await.expect("cleanup"),
        0,
        "the other consumer's own, longer window keeps them"
    );
    assert_eq!(
        s.cleanup(&other, step * 2, 10).await.expect("cleanup"),
        3,
        "its own cleanup removes them"
    );
}

/// An aggregate never written has no applied version and is not blocked; an advance is
/// visible in its transaction, durable after commit, and refused when another transaction
/// moved the version first.
pub async fn versions_advance_and_conflict_when_moved<H: InboxHarness>(h: &H) {
    let s = h.store();
    let c = consumer("c");
    let (a, b) = (agg("a"), agg("b"));
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.aggregates(&mut tx, &c, &[a.clone(), b.clone()])
            .await
            .expect("aggregates"),
        vec![AggregateState::default(); 2]
    );
    s.advance_versions(&mut tx, &c, &[advance(&a, None, 1), advance(&b, None, 4)])
        .await
        .expect("advance");
    assert_eq!(
        s.aggregates(&mut tx, &c, std::slice::from_ref(&a))
            .await
            .expect("aggregates")[0]
            .applied_version,
        Some(1),
        "an advance is visible in its own transaction"
    );
    s.commit(tx).await.expect("commit");
    // A rolled-back advance leaves nothing.
    let mut tx = s.begin().await.expect("begin");
    s.advance_versions(&mut tx, &c, &[advance(&a, Some(1), 2)])
        .await
        .expect("advance");
    s.rollback(tx).await.expect("rollback");
    // Another consumer does not see them.
    let mut tx = s.begin().await.expect("begin");
    let other = s
        .aggregates(&mut tx, &consumer("other"), std::slice::from_ref(&a))
        .await
        .expect("aggregates");
    assert_eq!(other[0].applied_version, None);
    s.rollback(tx).await.expect("rollback");

    // Two transactions read version 1; the first moves it to 2; the second's advance from 1
    // fails with a transient conflict (at the advance or at commit).
    let mut late = s.begin().await.expect("begin");
    let seen = s
        .aggregates(&mut late, &c, std::slice::from_ref(&a))
        .await
        .expect("aggregates");
    assert_eq!(seen[0], AggregateState::new(Some(1), false));
    let mut first = s.begin().await.expect("begin");
    s.advance_versions(&mut first, &c, &[advance(&a, Some(1), 2)])
        .await
        .expect("advance");
    s.commit(first).await.expect("commit");
    let r = match s
        .advance_versions(&mut late, &c, &[advance(&a, Some(1), 2)])
        .await
    {
        Ok(()) => s.commit(late).await,
        Err(e) => {
            let _ = s.rollback(late).await;
            Err(e)
        }
    };
    let e = r.expect_err("an advance from a version that moved must fail");
    assert!(conflict_or_transient(&e), "{e}");
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.aggregates(&mut tx, &c, &[a, b])
            .await
            .expect("aggregates"),
        vec![
            AggregateState::new(Some(2), false),
            AggregateState::new(Some(4), false)
        ]
    );
    s.rollback(tx).await.expect("rollback");
}

/// Parking a head stores the raw record durably with its reason and attempts and blocks its
/// aggregate only; a rolled-back park leaves nothing.
pub async fn park_head_blocks_its_aggregate_only<H: InboxHarness>(h: &H) {
    let s = h.store();
    let c = consumer("c");
    let (a, b) = (agg("a"), agg("b"));
    let e = event_of(&a, 3);
    let rec = record_of(&e, 7);
    let mut tx = s.begin().await.expect("begin");
    let parked = s
        .park(
            &mut tx,
            &c,
            &[NewParkedMessage::new(
                rec.clone(),
                ParkAs::Head(ParkKind::Unprocessable),
                "schema violation",
                4,
            )],
        )
        .await
        .expect("park");
    s.rollback(tx).await.expect("rollback");
    assert!(matches!(parked[..], [Parking::Head(_)]), "{parked:?}");
    assert!(s
        .list_parked(&c, &ParkedFilter::open())
        .await
        .expect("list")
        .is_empty());
    assert!(!state(s, &c, &a).await.blocked, "a rolled-back park blocks");

    let mut tx = s.begin().await.expect("begin");
    let mut r = s
        .park(
            &mut tx,
            &c,
            &[NewParkedMessage::new(
                rec.clone(),
                ParkAs::Head(ParkKind::Unprocessable),
                "schema violation",
                4,
            )],
        )
        .await
        .expect("park");
    s.commit(tx).await.expect("commit");
    let id = r.pop().expect("one");
    let Parking::Head(id) = id else {
        panic!("{id:?}")
    };
    assert!(state(s, &c, &a).await.blocked);
    assert!(
        !state(s, &c, &b).await.blocked,
        "another aggregate was blocked"
    );
    assert!(
        !state(s, &consumer("other"), &a).await.blocked,
        "another consumer's aggregate was blocked"
    );
    let m = s
        .parked_message(&c, id)
        .await
        .expect("show")
        .expect("parked");
    assert_eq!(m.status, ParkedStatus::Parked);
    assert_eq!(m.kind, Some(ParkKind::Unprocessable));
    assert_eq!(m.reason, "schema violation");
    assert_eq!(m.attempts, 4);
    assert_eq!(m.record, rec, "the raw record comes back unchanged");
    assert_eq!(m.record.decode().expect("decodes"), e);
    assert!(m.resolved_at.is_none());
    let stats = s.parked_stats(&c).await.expect("stats");
    assert_eq!((stats.parked, stats.waiting), (1, 0));
    assert!(stats.oldest_parked_at.is_some());
}

/// A waiting message needs a blocked aggregate; a head for an aggregate that is blocked already
/// is stored as waiting; the same message parked twice is reported, not stored twice.
pub async fn waiting_messages_queue_behind_the_head<H: InboxHarness>(h: &H) {
    let s = h.store();
    let c = consumer("c");
    let a = agg("a");
    let v4 = record_of(&event_of(&a, 4), 11);
    let mut tx = s.begin().await.expect("begin");
    let e = s
        .park(
            &mut tx,
            &c,
            &[NewParkedMessage::new(
                v4.clone(),
                ParkAs::Waiting,
                "behind",
                0,
            )],
        )
        .await;
    let r = match e {
        Ok(_) => s.commit(tx).await,
        Err(e) => {
            let _ = s.rollback(tx).await;
            Err(e)
        }
    };
    let e = r.expect_err("waiting behind nothing");
    assert!(conflict_or_transient(&e), "{e}");

    let v3 = record_of(&event_of(&a, 3), 10);
    park_one(s, &c, v3.clone(), ParkAs::Head(ParkKind::VersionGap)).await;
    assert!(matches!(
        park_one(s, &c, v4.clone(), ParkAs::Waiting).await,
        Parking::Waiting(_)
    ));
    let v5 = record_of(&event_of(&a, 5), 12);
    assert!(
        matches!(
            park_one(s, &c, v5, ParkAs::Head(ParkKind::Unprocessable)).await,
            Parking::Waiting(_)
        ),
        "a second head of a blocked aggregate waits"
    );
    assert_eq!(
        park_one(s, &c, v4, ParkAs::Waiting).await,
        Parking::AlreadyParked
    );
    let stats = s.parked_stats(&c).await.expect("stats");
    assert_eq!((stats.parked, stats.waiting), (1, 2));
}

/// A message that cannot be decoded parks with its raw headers (null values kept) and value;
/// without a known aggregate it blocks nothing, and the same position parked twice is reported.
pub async fn undecodable_messages_park_raw<H: InboxHarness>(h: &H) {
    let s = h.store();
    let c = consumer("c");
    let headers = vec![
        RecordHeader::new("garbage", vec![0xff, 0x00, 0xfe]),
        RecordHeader::null("nothing"),
        RecordHeader::new("empty", Vec::new()),
    ];
    let pos = LogPosition::new(format!("t-{}", unique()), 2, 99);
    let rec = ParkedRecord::new(
        pos.clone(),
        Some(b"k".to_vec()),
        headers.clone(),
        Some(vec![1, 2, 3]),
    );
    assert!(rec.decode().is_err());
    let Parking::Head(id) =
        park_one(s, &c, rec.clone(), ParkAs::Head(ParkKind::Unprocessable)).await
    else {
        panic!("not parked as head")
    };
    let m = s
        .parked_message(&c, id)
        .await
        .expect("show")
        .expect("parked");
    assert_eq!(m.record.headers, headers);
    assert_eq!(m.record.value.as_deref(), Some([1u8, 2, 3].as_slice()));
    assert_eq!(m.record.key.as_deref(), Some(b"k".as_slice()));
    assert_eq!(m.record.position, pos);
    assert_eq!(m.record.aggregate, None);
    assert_eq!(
        park_one(s, &c, rec, ParkAs::Head(ParkKind::Unprocessable)).await,
        Parking::AlreadyParked
    );
    // A null value stays null.
    let null = ParkedRecord::new(
        LogPosition::new(pos.topic.clone(), 2, 100),
        None,
        vec![],
        None,
    );
    let Parking::Head(id) = park_one(s, &c, null, ParkAs::Head(ParkKind::Unprocessable)).await
    else {
        panic!("not parked")
    };
    let m = s
        .parked_message(&c, id)
        .await
        .expect("show")
        .expect("parked");
    assert_eq!((m.record.value, m.record.key), (None, None));
}

/// The operator's view: open messages of an aggregate in release order; resolutions and new
/// failures are recorded; the aggregate can be unblocked only when nothing is open; audit
/// entries come back oldest first.
pub async fn parked_messages_resolve_in_release_order_and_are_audited<H: InboxHarness>(h: &H) {
    let s = h.store();
    let c = consumer("c");
    let a = agg("a");
    // Parked out of version order: v3 heads, then v5, then v4 arrives.
    let v3 = record_of(&event_of(&a, 3), 20);
    let v5 = record_of(&event_of(&a, 5), 21);
    let v4 = record_of(&event_of(&a, 4), 22);
    park_one(s, &c, v3, ParkAs::Head(ParkKind::VersionGap)).await;
    park_one(s, &c, v5, ParkAs::Waiting).await;
    park_one(s, &c, v4, ParkAs::Waiting).await;
    let mut tx = s.begin().await.expect("begin");
    let open = s.open_parked_of(&mut tx, &c, &a).await.expect("open");
    let versions: Vec<_> = open.iter().map(|m| m.record.aggregate_version).collect();
    assert_eq!(versions, vec![Some(3), Some(4), Some(5)]);
    assert_eq!(open[0].status, ParkedStatus::Parked);
    assert_eq!(open[0].kind, Some(ParkKind::VersionGap));
    let e = s.unblock(&mut tx, &c, &a).await;
    let e = match e {
        Ok(()) => {
            let r = s.commit(tx).await;
            tx = s.begin().await.expect("begin");
            r.expect_err("unblocked with open messages")
        }
        Err(e) => e,
    };
    assert_eq!(e.kind, StoreErrorKind::Conflict, "{e}");
    s.rollback(tx).await.expect("rollback");

    // v3 applied, v4 fails again and becomes the head.
    let mut tx = s.begin().await.expect("begin");
    let open = s.open_parked_of(&mut tx, &c, &a).await.expect("open");
    s.change_parked(
        &mut tx,
        &c,
        open[0].id,
        &ParkedChange::Resolved(ParkedStatus::Applied),
    )
    .await
    .expect("resolve");
    s.change_parked(
        &mut tx,
        &c,
        open[1].id,
        &ParkedChange::Failed {
            kind: ParkKind::Unprocessable,
            reason: "still broken".into(),
            attempts: 2,
        },
    )
    .await
    .expect("fail");
    let at = chrono::Utc::now();
    s.audit(
        &mut tx,
        &InboxAuditEntry::new(
            &c,
            open[0].id,
            InboxAction::Retry,
            "ops",
            "fixed",
            "applied 1",
            at,
        ),
    )
    .await
    .expect("audit");
    s.commit(tx).await.expect("commit");
    let first = s
        .parked_message(&c, open[0].id)
        .await
        .expect("show")
        .expect("kept");
    assert_eq!(first.status, ParkedStatus::Applied);
    assert!(first.resolved_at.is_some());
    let head = s
        .parked_message(&c, open[1].id)
        .await
        .expect("show")
        .expect("kept");
    assert_eq!(
        (head.status, head.kind, head.attempts, head.reason.as_str()),
        (
            ParkedStatus::Parked,
            Some(ParkKind::Unprocessable),
            2,
            "still broken"
        )
    );
    let listed = s
        .list_parked(&c, &ParkedFilter::open())
        .await
        .expect("list");
    assert_eq!(listed.len(), 2);
    let all = s
        .list_parked(&c, &ParkedFilter::open().all().aggregate(a.clone()))
        .await
        .expect("list");
    assert_eq!(all.len(), 3);
    assert_eq!(
        s.list_parked(&c, &ParkedFilter::open().limit(1))
            .await
            .expect("list")
            .len(),
        1
    );

    // Resolving a resolved message is refused.
    let mut tx = s.begin().await.expect("begin");
    let e = s
        .change_parked(
            &mut tx,
            &c,
            open[0].id,
            &ParkedChange::Resolved(ParkedStatus::Discarded),
        )
        .await;
    let e = match e {
        Ok(()) => s.commit(tx).await.expect_err("resolved twice"),
        Err(e) => {
            let _ = s.rollback(tx).await;
            e
        }
    };
    assert!(
        matches!(e.kind, StoreErrorKind::NotFound | StoreErrorKind::Conflict),
        "{e}"
    );

    // Both remaining resolved: now the aggregate can be unblocked.
    let mut tx = s.begin().await.expect("begin");
    for m in s.open_parked_of(&mut tx, &c, &a).await.expect("open") {
        s.change_parked(
            &mut tx,
            &c,
            m.id,
            &ParkedChange::Resolved(ParkedStatus::Discarded),
        )
        .await
        .expect("discard");
    }
    s.unblock(&mut tx, &c, &a).await.expect("unblock");
    s.commit(tx).await.expect("commit");
    assert!(!state(s, &c, &a).await.blocked);
    let trail = s.audit_trail(&c, None).await.expect("trail");
    assert_eq!(trail.len(), 1);
    assert_eq!(
        (
            trail[0].action,
            trail[0].actor.as_str(),
            trail[0].reason.as_str(),
            trail[0].outcome.as_str()
        ),
        (InboxAction::Retry, "ops", "fixed", "applied 1")
    );
    assert_eq!(
        s.audit_trail(&c, Some(open[0].id))
            .await
            .expect("trail")
            .len(),
        1
    );
    assert!(s
        .audit_trail(&c, Some(open[1].id))
        .await
        .expect("trail")
        .is_empty());
    let stats = s.parked_stats(&c).await.expect("stats");
    assert_eq!(
        (stats.parked, stats.waiting, stats.oldest_parked_at),
        (0, 0, None)
    );
}

/// An operator releasing an aggregate and the engine parking a message behind it at the same
/// time never leave a waiting message behind an unblocked aggregate.
pub async fn release_and_waiting_park_serialize<H: InboxHarness>(h: &H) {
    let s = h.store();
    let c = consumer("c");
    let a = agg("a");
    park_one(
        s,
        &c,
        record_of(&event_of(&a, 2), 30),
        ParkAs::Head(ParkKind::Unprocessable),
    )
    .await;
    // The operator's transaction: locks the aggregate, resolves its last message, unblocks.
    let mut op = s.begin().await.expect("begin");
    let open = s.open_parked_of(&mut op, &c, &a).await.expect("open");
    s.change_parked(
        &mut op,
        &c,
        open[0].id,
        &ParkedChange::Resolved(ParkedStatus::Applied),
    )
    .await
    .expect("resolve");
    s.unblock(&mut op, &c, &a).await.expect("unblock");
    let step = h.capabilities().time_step;
    // The engine's transaction: parks v3 as waiting (the aggregate looked blocked to it).
    let engine = async {
        let mut tx = s.begin().await?;
        let r = s
            .park(
                &mut tx,
                &c,
                &[NewParkedMessage::new(
                    record_of(&event_of(&a, 3), 31),
                    ParkAs::Waiting,
                    "behind",
                    0,
                )],
            )
            .await;
        match r {
            Ok(_) => s.commit(tx).await,
            Err(e) => {
                let _ = s.rollback(tx).await;
                Err(e)
            }
        }
    };
    let operator = async {
        tokio::time::sleep(step.min(Duration::from_millis(200))).await;
        s.commit(op).await
    };
    let (engine, operator) = tokio::join!(engine, operator);
    if let Err(e) = &operator {
        assert!(conflict_or_transient(e), "{e}");
    }
    if let Err(e) = &engine {
        assert!(conflict_or_transient(e), "{e}");
    }
    assert!(
        operator.is_err() || engine.is_err(),
        "both committed: a message waits behind a released aggregate"
    );
    let blocked = state(s, &c, &a).await.blocked;
    let open = s
        .list_parked(&c, &ParkedFilter::open().aggregate(a.clone()))
        .await
        .expect("list");
    assert_eq!(
        blocked,
        !open.is_empty(),
        "blocked = {blocked} but open = {open:?}"
    );
}

// ---------------------------------------------------------------------------------------------

fn agg(name: &str) -> AggregateKey {
    AggregateKey::new("conformance", format!("{name}-{}", unique()))
}

fn advance(a: &AggregateKey, expected: Option<i64>, version: i64) -> VersionAdvance {
    VersionAdvance {
        aggregate: a.clone(),
        expected,
        version,
    }
}

fn event_of(a: &AggregateKey, version: i64) -> Envelope {
    Envelope::builder(
        a.aggregate_type.clone(),
        a.aggregate_id.clone(),
        version,
        "conformance.happened",
    )
    .event_id(fresh_event_id())
    .header(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )
    .json(&serde_json::json!({ "v": version }))
    .expect("json")
    .build()
    .expect("valid")
}

fn record_of(e: &Envelope, offset: i64) -> ParkedRecord {
    ParkedRecord::new(
        LogPosition::new("conformance", 0, offset),
        Some(e.aggregate_id.clone().into_bytes()),
        wire::encode_headers(e)
            .into_iter()
            .map(|(k, v)| RecordHeader::new(k, v))
            .collect(),
        Some(e.payload.bytes.clone()),
    )
}

async fn park_one<S: InboxParking>(s: &S, c: &str, rec: ParkedRecord, park_as: ParkAs) -> Parking {
    let mut tx = s.begin().await.expect("begin");
    let mut r = s
        .park(
            &mut tx,
            c,
            &[NewParkedMessage::new(rec, park_as, "test", 1)],
        )
        .await
        .expect("park");
    s.commit(tx).await.expect("commit");
    r.pop().expect("one result")
}

async fn state<S: InboxStore>(s: &S, c: &str, a: &AggregateKey) -> AggregateState {
    let mut tx = s.begin().await.expect("begin");
    let st = s
        .aggregates(&mut tx, c, std::slice::from_ref(a))
        .await
        .expect("aggregates");
    s.rollback(tx).await.expect("rollback");
    st[0]
}

/// The original-id dedupe is scoped to the aggregate ([`InboxStore::register_for`]): an id
/// registered for one aggregate is a duplicate for that aggregate (and for one registered
/// without an aggregate), and [`outbox_core::AggregateRegistration::OtherAggregate`] for
/// another, with nothing written. Through [`InboxStoreExt::register_events`], a record naming
/// another aggregate's event as its original is fresh once (under its scoped id) and then a
/// duplicate of itself, and the named event stays a duplicate of itself only.
pub async fn original_id_dedupe_is_scoped_to_the_aggregate<H: InboxHarness>(h: &H) {
    use outbox_core::AggregateRegistration as R;
    let s = h.store();
    let c = consumer("c");
    let (a, b) = (
        AggregateKey::new("order", format!("a-{}", unique())),
        AggregateKey::new("order", format!("b-{}", unique())),
    );
    let (x, y) = (fresh_event_id(), fresh_event_id());
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_for(
            &mut tx,
            &c,
            &[(x, a.clone()), (x, b.clone()), (x, a.clone())]
        )
        .await
        .expect("register_for"),
        vec![R::Fresh, R::OtherAggregate, R::Duplicate],
        "repeats inside one call answer as if registered one after the other"
    );
    s.register_one(&mut tx, &c, y).await.expect("register");
    s.commit(tx).await.expect("commit");
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register_for(
            &mut tx,
            &c,
            &[(x, b.clone()), (x, a.clone()), (y, b.clone())]
        )
        .await
        .expect("register_for"),
        vec![R::OtherAggregate, R::Duplicate, R::Duplicate],
        "an id held by another aggregate is not a duplicate; one registered without an \
         aggregate is a duplicate of any"
    );
    s.rollback(tx).await.expect("rollback");
    // Through the extension: the real event of `a`, and a foreign record of `b` naming it.
    let real = Envelope::builder(
        a.aggregate_type.clone(),
        a.aggregate_id.clone(),
        1,
        "order.changed",
    )
    .event_id(fresh_event_id())
    .build()
    .expect("valid");
    let foreign = Envelope::builder(
        b.aggregate_type.clone(),
        b.aggregate_id.clone(),
        2,
        "order.changed",
    )
    .event_id(fresh_event_id())
    .header(wire::ORIGINAL_EVENT_ID, real.event_id.to_string())
    .build()
    .expect("valid");
    for (first, second) in [(&real, &foreign), (&foreign, &real)] {
        let c = consumer("c");
        let mut tx = s.begin().await.expect("begin");
        assert_eq!(
            s.register_event(&mut tx, &c, first)
                .await
                .expect("register"),
            Registration::Fresh
        );
        s.commit(tx).await.expect("commit");
        let mut tx = s.begin().await.expect("begin");
        assert_eq!(
            s.register_event(&mut tx, &c, second)
                .await
                .expect("register"),
            Registration::Fresh,
            "a record of another aggregate was deduplicated against it: its effect would be \
             applied zero times"
        );
        s.commit(tx).await.expect("commit");
        let mut tx = s.begin().await.expect("begin");
        assert_eq!(
            s.register_events(&mut tx, &c, &[first, second])
                .await
                .expect("register"),
            vec![Registration::Duplicate, Registration::Duplicate],
            "each is a duplicate of itself"
        );
        s.rollback(tx).await.expect("rollback");
    }
}

/// A record whose dedup id and aggregate-scoped id are both held by parked messages of other
/// aggregates (a record naming another aggregate's parked event, after a record whose event id
/// was made to be that scoped id was parked) is still parked, never taken for parked already
/// (its offset would be final and nothing of it kept: lost); its redelivery at the same
/// position is parked already.
pub async fn park_keeps_a_crafted_scoped_id_collision<H: InboxHarness>(h: &H) {
    let s = h.store();
    let (a, b, c) = (agg("a"), agg("b"), agg("c"));
    let real = event_of(&a, 1);
    let foreign = Envelope::builder(
        b.aggregate_type.clone(),
        b.aggregate_id.clone(),
        1,
        "conformance.happened",
    )
    .event_id(fresh_event_id())
    .header(wire::ORIGINAL_EVENT_ID, real.event_id.to_string())
    .build()
    .expect("valid");
    let crafted = Envelope::builder(
        c.aggregate_type.clone(),
        c.aggregate_id.clone(),
        1,
        "conformance.happened",
    )
    .event_id(outbox_core::inbox::scoped_dedup_id(&b, real.event_id))
    .build()
    .expect("valid");
    let con = consumer("c");
    let head = || ParkAs::Head(ParkKind::Unprocessable);
    for (e, offset) in [(&crafted, 1), (&real, 2)] {
        let p = park_one(s, &con, record_of(e, offset), head()).await;
        assert!(matches!(p, Parking::Head(_)), "{p:?}");
    }
    let p = park_one(s, &con, record_of(&foreign, 3), head()).await;
    assert!(
        matches!(p, Parking::Head(_)),
        "the record whose dedup id and scoped id other aggregates hold was taken for parked \
         already (it would be lost): {p:?}"
    );
    assert_eq!(
        park_one(s, &con, record_of(&foreign, 3), head()).await,
        Parking::AlreadyParked,
        "its redelivery at the same position"
    );
    let open = s
        .list_parked(&con, &ParkedFilter::open())
        .await
        .expect("list");
    assert_eq!(open.len(), 3, "{open:?}");
    for key in [&a, &b, &c] {
        assert_eq!(
            open.iter()
                .filter(|m| m.record.aggregate.as_ref() == Some(key))
                .count(),
            1,
            "one parked message of {key}"
        );
    }
}

/// Parking is deduplicated per aggregate too: a message parked before with the same dedup id
/// (a redelivery, a re-issued copy) is [`Parking::AlreadyParked`] only when it is of the same
/// aggregate. A record of another aggregate whose original-id header names a parked event (or
/// whose event a parked foreign record names) is a different message: it is parked (under
/// [`outbox_core::inbox::scoped_dedup_id`]), whichever of the two was parked first, and its own
/// redeliveries are then parked already.
pub async fn park_dedupe_is_scoped_to_the_aggregate<H: InboxHarness>(h: &H) {
    let s = h.store();
    let (a, b) = (agg("a"), agg("b"));
    let real = event_of(&a, 1);
    let foreign = Envelope::builder(
        b.aggregate_type.clone(),
        b.aggregate_id.clone(),
        1,
        "conformance.happened",
    )
    .event_id(fresh_event_id())
    .header(wire::ORIGINAL_EVENT_ID, real.event_id.to_string())
    .build()
    .expect("valid");
    assert_eq!(foreign.dedup_id(), real.dedup_id());
    let head = || ParkAs::Head(ParkKind::Unprocessable);
    for (first, second) in [(&foreign, &real), (&real, &foreign)] {
        let c = consumer("c");
        let p1 = park_one(s, &c, record_of(first, 1), head()).await;
        assert!(matches!(p1, Parking::Head(_)), "{p1:?}");
        let p2 = park_one(s, &c, record_of(second, 2), head()).await;
        assert!(
            matches!(p2, Parking::Head(_)),
            "a message of another aggregate sharing the dedup id was taken for parked already \
             (it would be lost): {p2:?}"
        );
        for (e, offset) in [(first, 3), (second, 4)] {
            assert_eq!(
                park_one(s, &c, record_of(e, offset), head()).await,
                Parking::AlreadyParked,
                "a redelivery of {}",
                e.aggregate_id
            );
        }
        let open = s
            .list_parked(&c, &ParkedFilter::open())
            .await
            .expect("list");
        assert_eq!(open.len(), 2, "{open:?}");
        for key in [&a, &b] {
            assert_eq!(
                open.iter()
                    .filter(|m| m.record.aggregate.as_ref() == Some(key))
                    .count(),
                1,
                "one parked message of {key}"
            );
        }
    }
}
