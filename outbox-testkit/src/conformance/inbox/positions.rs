//! Parked messages keep their transport's own position ([`NativePosition`]), in the columns
//! a store keeps it in ([`NativeColumns`]), rows of the version before those columns included.

use outbox_core::{
    InboxParking, InboxStore, LogPosition, NativeColumns, NativePosition, NewParkedMessage, ParkAs,
    ParkKind, ParkedFilter, ParkedRecord, Parking, RecordHeader, StoreErrorKind,
};

use super::{agg, consumer, event_of, park_one, record_of, InboxHarness};
use crate::conformance::{not_applicable, unique};

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

/// The inbox of the version before the native-position columns, holding a message that
/// version parked, is migrated by this one: the columns' migration alone, once. The message
/// reads back as the Kafka position it was read as then (its row not rewritten: no transport
/// in it). Messages parked afterwards name their transport in its own columns and read back
/// at their positions.
pub async fn a_message_parked_before_the_native_columns_reads_back_as_its_kafka_position<
    H: InboxHarness,
>(
    h: &H,
) {
    let check = "a_message_parked_before_the_native_columns_reads_back_as_its_kafka_position";
    let (old, at, reason) = (
        consumer("old"),
        LogPosition::new("orders", 2, 41),
        "parked by the previous version",
    );
    if !h.before_native_columns(&old, &at, reason).await {
        return not_applicable(
            check,
            "the harness has no inbox version before the native columns \
             (InboxHarness::before_native_columns)",
        );
    }
    assert_eq!(
        h.migrate().await,
        Some(1),
        "the native columns' migration alone"
    );
    assert_eq!(h.migrate().await, Some(0), "applied once");
    let s = h.store();
    let back = s
        .list_parked(&old, &ParkedFilter::open())
        .await
        .expect("list");
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].record.position, at);
    assert_eq!(back[0].record.position.native, NativePosition::Log);
    assert_eq!(back[0].reason, reason);
    assert_eq!(
        h.native_columns(&old).await,
        Some(vec![NativeColumns::default()]),
        "the row was not rewritten"
    );

    // New rows name their transport in typed columns.
    let new = consumer("new");
    let positions = [
        LogPosition::new("orders", 1, 7),
        LogPosition::jetstream("ORDERS", 42, 3, "billing"),
        LogPosition::rabbitmq("orders-q", 9, "outbox", "order.created", true),
    ];
    let mut tx = s.begin().await.expect("begin");
    let parked = s
        .park(
            &mut tx,
            &new,
            &positions
                .iter()
                .map(|p| {
                    NewParkedMessage::new(
                        ParkedRecord::new(p.clone(), None, vec![], Some(vec![0xff])),
                        ParkAs::Head(ParkKind::Unprocessable),
                        "test",
                        1,
                    )
                })
                .collect::<Vec<_>>(),
        )
        .await
        .expect("park");
    s.commit(tx).await.expect("commit");
    assert!(
        parked.iter().all(|p| matches!(p, Parking::Head(_))),
        "{parked:?}"
    );
    let text = |x: &str| Some(x.to_owned());
    assert_eq!(
        h.native_columns(&new).await,
        Some(vec![
            NativeColumns::new(text("kafka"), None, None, None, None, None),
            NativeColumns::new(text("nats"), Some(42), text("billing"), None, None, None),
            NativeColumns::new(
                text("rabbitmq"),
                None,
                None,
                text("outbox"),
                text("order.created"),
                Some(true)
            ),
        ])
    );
    let back = s
        .list_parked(&new, &ParkedFilter::open())
        .await
        .expect("list");
    assert_eq!(
        back.iter()
            .map(|m| m.record.position.clone())
            .collect::<Vec<_>>(),
        positions
    );
}

/// Columns a transport needs that are missing, or a transport this version does not know,
/// are a schema error naming the problem, never a position guessed from the rest.
pub async fn native_columns_that_describe_no_position_are_refused<H: InboxHarness>(h: &H) {
    let s = h.store();
    let text = |x: &str| Some(x.to_owned());
    let cases = [
        (
            NativeColumns::new(text("mqtt"), None, None, None, None, None),
            "unknown transport",
        ),
        (
            NativeColumns::new(text("nats"), None, text("d"), None, None, None),
            "stream sequence",
        ),
        (
            NativeColumns::new(text("nats"), Some(-1), text("d"), None, None, None),
            "negative stream sequence",
        ),
        (
            NativeColumns::new(text("rabbitmq"), None, None, text("x"), None, Some(false)),
            "routing key",
        ),
    ];
    for (columns, expected) in cases {
        let c = consumer("bad");
        let rec = ParkedRecord::new(LogPosition::new("t", 0, 1), None, vec![], None);
        park_one(s, &c, rec, ParkAs::Head(ParkKind::Unprocessable)).await;
        if !h.write_native_columns(&c, &columns).await {
            return not_applicable(
                "native_columns_that_describe_no_position_are_refused",
                "the store keeps no native-position columns (InboxHarness::write_native_columns)",
            );
        }
        let err = s
            .list_parked(&c, &ParkedFilter::open())
            .await
            .expect_err(expected);
        assert_eq!(err.kind, StoreErrorKind::Schema, "{err}");
        assert!(err.to_string().contains(expected), "{expected}: {err}");
    }
}
