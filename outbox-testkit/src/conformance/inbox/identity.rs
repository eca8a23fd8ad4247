//! An undecodable message is parked once per its transport's message identity
//! ([`LogPosition::message_identity`]: a JetStream stream sequence), not once per delivery,
//! and a record whose event id was made to be that identity's id does not hide it.

use outbox_core::{
    Envelope, InboxParking, LogPosition, ParkAs, ParkKind, ParkedFilter, ParkedMessage,
    ParkedRecord, Parking, ReceivedMessage,
};

use super::{consumer, park_one, InboxHarness};

/// An undecodable record at `position` holding `value`.
fn junk(position: LogPosition, value: &[u8]) -> ParkedRecord {
    ParkedRecord::new(position, None, vec![], Some(value.to_vec()))
}

/// Every message `consumer` parked, open or resolved.
async fn all_parked<S: InboxParking>(s: &S, consumer: &str) -> Vec<ParkedMessage> {
    s.list_parked(consumer, &ParkedFilter::open().all())
        .await
        .expect("list")
}

fn head() -> ParkAs {
    ParkAs::Head(ParkKind::Unprocessable)
}

/// JetStream redelivers a message at a new delivery sequence (the position's offset) with the
/// same stream sequence: an undecodable message is parked once per stream sequence, not once
/// per delivery. Another stream sequence is another message; so is other content under the
/// same stream sequence (the stream deleted and created again). Kafka keeps parking once per
/// position.
pub async fn an_undecodable_jetstream_message_is_parked_once_per_stream_sequence<
    H: InboxHarness,
>(
    h: &H,
) {
    let s = h.store();
    let c = consumer("identity");
    let first = park_one(
        s,
        &c,
        junk(LogPosition::jetstream("S", 42, 3, "d"), b"x"),
        head(),
    )
    .await;
    assert!(matches!(first, Parking::Head(_)), "{first:?}");
    let again = park_one(
        s,
        &c,
        junk(LogPosition::jetstream("S", 42, 9, "d"), b"x"),
        head(),
    )
    .await;
    assert_eq!(again, Parking::AlreadyParked, "a redelivery");
    for other in [
        junk(LogPosition::jetstream("S", 43, 10, "d"), b"x"),
        junk(LogPosition::jetstream("S", 42, 11, "d"), b"y"),
    ] {
        let p = park_one(s, &c, other, head()).await;
        assert!(matches!(p, Parking::Head(_)), "another message: {p:?}");
    }
    let k = park_one(s, &c, junk(LogPosition::new("t", 0, 5), b"x"), head()).await;
    assert!(matches!(k, Parking::Head(_)), "{k:?}");
    let k = park_one(s, &c, junk(LogPosition::new("t", 0, 5), b"x"), head()).await;
    assert_eq!(k, Parking::AlreadyParked);
    let all = all_parked(s, &c).await;
    assert_eq!(all.len(), 4, "{all:#?}");
}

/// A decodable record whose event id was made to be the id an undecodable record is parked
/// by (its stream sequence's derived id), parked first, does not make the undecodable record
/// "parked already": it is parked too, and its redelivery at the same delivery is recognised.
pub async fn a_crafted_event_id_does_not_hide_an_undecodable_message<H: InboxHarness>(h: &H) {
    let s = h.store();
    let c = consumer("crafted");
    let target = junk(LogPosition::jetstream("S", 7, 2, "d"), b"x");
    let derived = target.dedup_id.expect("derived from the stream sequence");
    let crafted = Envelope::builder("order", "o-1", 1, "order.placed")
        .event_id(derived)
        .build()
        .expect("valid");
    let holder =
        ReceivedMessage::new(LogPosition::jetstream("S", 6, 1, "d"), None, Ok(crafted)).to_record();
    assert_eq!(holder.dedup_id, Some(derived));
    let p = park_one(s, &c, holder, head()).await;
    assert!(matches!(p, Parking::Head(_)), "{p:?}");
    let p = park_one(s, &c, target.clone(), head()).await;
    assert!(matches!(p, Parking::Head(_)), "kept, not hidden: {p:?}");
    let p = park_one(s, &c, target, head()).await;
    assert_eq!(p, Parking::AlreadyParked);
    let all = all_parked(s, &c).await;
    assert_eq!(all.len(), 2, "{all:#?}");
}
