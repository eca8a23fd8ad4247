//! Parked messages keep their transport's own position ([`NativePosition`]).

use outbox_core::{
    InboxParking, LogPosition, NativePosition, ParkAs, ParkKind, ParkedFilter, ParkedRecord,
    Parking, RecordHeader,
};

use super::{agg, consumer, event_of, park_one, record_of, InboxHarness};
use crate::conformance::unique;

/// A parked message reads back at the position it was parked with, the transport's own
/// identity included: a Kafka position as before, a JetStream delivery with its stream
/// sequence and consumer, a RabbitMQ delivery with its exchange, routing key and redelivered
/// flag (the default exchange's empty name kept empty); so is a message that cannot be
/// decoded, and its redelivery at the same position is recognised.
pub async fn parked_messages_keep_their_native_position<H: InboxHarness>(h: &H) {
    let s = h.store();
    let c = consumer("c");
    let positions = [
        LogPosition::new("orders", 3, 41),
        LogPosition::jetstream("ORDERS", 42, 3, "billing"),
        LogPosition::jetstream("ORDERS", u64::try_from(i64::MAX).unwrap(), 4, "billing"),
        LogPosition::rabbitmq("orders-q", 7, "outbox", "order.created", true),
        LogPosition::rabbitmq("orders-q", 8, "", "orders-q", false),
    ];
    let mut ids = Vec::new();
    for (i, p) in positions.iter().enumerate() {
        let e = event_of(&agg(&format!("n{i}")), 1);
        let mut rec = record_of(&e, 0);
        rec.position = p.clone();
        let Parking::Head(id) = park_one(s, &c, rec, ParkAs::Head(ParkKind::Unprocessable)).await
        else {
            panic!("{p} not parked as head")
        };
        let m = s
            .parked_message(&c, id)
            .await
            .expect("show")
            .expect("parked");
        assert_eq!(m.record.position, *p, "read back through show");
        ids.push(id);
    }
    let listed = s
        .list_parked(&c, &ParkedFilter::open())
        .await
        .expect("list");
    assert_eq!(
        listed.iter().map(|m| m.id).collect::<Vec<_>>(),
        ids,
        "list order"
    );
    for (m, p) in listed.iter().zip(&positions) {
        assert_eq!(&m.record.position, p, "read back through list");
    }
    // An undecodable record is parked once per position; its native identity is kept too.
    let raw = ParkedRecord::new(
        LogPosition::jetstream(format!("S{}", unique()), 9, 5, "d"),
        None,
        vec![RecordHeader::new("garbage", vec![0xff])],
        Some(vec![1, 2]),
    );
    assert!(raw.decode().is_err());
    let Parking::Head(id) =
        park_one(s, &c, raw.clone(), ParkAs::Head(ParkKind::Unprocessable)).await
    else {
        panic!("not parked")
    };
    let m = s
        .parked_message(&c, id)
        .await
        .expect("show")
        .expect("parked");
    assert!(matches!(
        m.record.position.native,
        NativePosition::JetStream {
            stream_sequence: 9,
            ..
        }
    ));
    assert_eq!(m.record.position, raw.position);
    assert_eq!(
        park_one(s, &c, raw, ParkAs::Head(ParkKind::Unprocessable)).await,
        Parking::AlreadyParked
    );
}
