//! An undecodable message is parked once per its transport's message identity
//! (`LogPosition::message_identity`: a JetStream stream sequence), not once per delivery, and a
//! record whose event id was made to be that identity's id does not hide it.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use outbox_core::{
    Envelope, InboxParking, LogPosition, NewParkedMessage, ParkAs, ParkKind, ParkedFilter,
    ParkedRecord, Parking, ReceivedMessage,
};

#[tokio::test]
async fn an_undecodable_jetstream_message_is_parked_once_per_stream_sequence() {
    let ctx = ctx!(2);
    let inbox = ctx.inbox().await;
    undecodable_jetstream_record_is_parked_once_per_stream_sequence(&inbox).await;
    ctx.drop().await;
}

#[tokio::test]
async fn a_crafted_event_id_does_not_hide_an_undecodable_message() {
    let ctx = ctx!(2);
    let inbox = ctx.inbox().await;
    a_record_holding_the_derived_id_does_not_hide_an_undecodable_one(&inbox).await;
    ctx.drop().await;
}

/// Parks `record` as an unprocessable head in its own transaction.
async fn park_one<S: InboxParking>(inbox: &S, consumer: &str, record: ParkedRecord) -> Parking {
    let mut tx = inbox.begin().await.unwrap();
    let parked = inbox
        .park(
            &mut tx,
            consumer,
            &[NewParkedMessage::new(
                record,
                ParkAs::Head(ParkKind::Unprocessable),
                "test",
                1,
            )],
        )
        .await
        .unwrap();
    inbox.commit(tx).await.unwrap();
    parked[0]
}

fn junk(position: LogPosition, value: &[u8]) -> ParkedRecord {
    ParkedRecord::new(position, None, vec![], Some(value.to_vec()))
}

/// JetStream redelivers a message at a new delivery sequence (the position's offset) with the
/// same stream sequence: an undecodable message is parked once per stream sequence, not once
/// per delivery. Another stream sequence is another message; so is other content under the
/// same stream sequence (the stream deleted and created again).
async fn undecodable_jetstream_record_is_parked_once_per_stream_sequence<S: InboxParking>(
    inbox: &S,
) {
    let c = "identity";
    let first = park_one(
        inbox,
        c,
        junk(LogPosition::jetstream("S", 42, 3, "d"), b"x"),
    )
    .await;
    assert!(matches!(first, Parking::Head(_)), "{first:?}");
    let again = park_one(
        inbox,
        c,
        junk(LogPosition::jetstream("S", 42, 9, "d"), b"x"),
    )
    .await;
    assert_eq!(again, Parking::AlreadyParked, "a redelivery");
    for other in [
        junk(LogPosition::jetstream("S", 43, 10, "d"), b"x"),
        junk(LogPosition::jetstream("S", 42, 11, "d"), b"y"),
    ] {
        let p = park_one(inbox, c, other).await;
        assert!(matches!(p, Parking::Head(_)), "another message: {p:?}");
    }
    // Kafka keeps parking once per position.
    let k = park_one(inbox, c, junk(LogPosition::new("t", 0, 5), b"x")).await;
    assert!(matches!(k, Parking::Head(_)), "{k:?}");
    let k = park_one(inbox, c, junk(LogPosition::new("t", 0, 5), b"x")).await;
    assert_eq!(k, Parking::AlreadyParked);
    let all = inbox
        .list_parked(c, &ParkedFilter::open().all())
        .await
        .unwrap();
    assert_eq!(all.len(), 4, "{all:#?}");
}

/// A decodable record whose event id was made to be the id an undecodable record is parked
/// by (its stream sequence's derived id), parked first, does not make the undecodable record
/// "parked already": it is parked too, and its redelivery at the same delivery is recognised.
async fn a_record_holding_the_derived_id_does_not_hide_an_undecodable_one<S: InboxParking>(
    inbox: &S,
) {
    let c = "crafted";
    let target = junk(LogPosition::jetstream("S", 7, 2, "d"), b"x");
    let derived = target.dedup_id.expect("derived from the stream sequence");
    let crafted = Envelope::builder("order", "o-1", 1, "order.placed")
        .event_id(derived)
        .build()
        .unwrap();
    let holder =
        ReceivedMessage::new(LogPosition::jetstream("S", 6, 1, "d"), None, Ok(crafted)).to_record();
    assert_eq!(holder.dedup_id, Some(derived));
    let p = park_one(inbox, c, holder).await;
    assert!(matches!(p, Parking::Head(_)), "{p:?}");
    let p = park_one(inbox, c, target.clone()).await;
    assert!(matches!(p, Parking::Head(_)), "kept, not hidden: {p:?}");
    let p = park_one(inbox, c, target).await;
    assert_eq!(p, Parking::AlreadyParked);
    let all = inbox
        .list_parked(c, &ParkedFilter::open().all())
        .await
        .unwrap();
    assert_eq!(all.len(), 2, "{all:#?}");
}
