//! Consumer-side traits: [`InboxStore`] (deduplication, version tracking and parking in the
//! effect's transaction), [`InboxParking`] (the operator's view of parked messages) and
//! [`MessageSource`] (where messages come from and where offsets are committed), with the typed
//! values they exchange.

mod parking;
mod position;
mod record;
mod registration;
mod source;

pub use parking::{
    InboxAction, InboxAuditEntry, InboxParking, NewParkedMessage, ParkAs, ParkedChange,
    ParkedFilter, ParkedId, ParkedMessage, ParkedStats, ParkedStatus, Parking, RetryRequest,
};
pub use position::{
    CommitOffset, LogPosition, NativeColumns, NativeColumnsError, NativePosition, TopicPartition,
};
pub use record::{AggregateKey, ParkedRecord, ReceivedMessage, RecordHeader};
pub use registration::{
    scoped_dedup_id, AggregateRegistration, AggregateState, InboxStore, InboxStoreExt,
    Registration, VersionAdvance,
};
pub use source::{AckModel, MessageSource, PartitionLag};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::Envelope;
    use crate::wire;

    #[test]
    fn positions_and_commits_are_distinct_and_display() {
        let p = LogPosition::new("orders", 2, 41);
        assert_eq!(p.next(), CommitOffset::new("orders", 2, 42));
        assert_eq!(p.to_string(), "orders/2@41");
        assert_eq!(p.next().to_string(), "orders/2 next 42");
        assert_eq!(p.topic_partition().at_next(7).next_offset, 7);
        assert_eq!(p.next().topic_partition(), TopicPartition::new("orders", 2));
    }

    #[test]
    fn lag_and_retention_gap() {
        let tp = TopicPartition::new("t", 0);
        let table = [
            (Some(10), 0, 15, 5, None),
            (None, 3, 15, 12, None),
            (Some(2), 5, 15, 10, Some(3)),
            (Some(15), 0, 15, 0, None),
        ];
        for (committed, earliest, end, lag, lost) in table {
            let l = PartitionLag::new(tp.clone(), committed, earliest, end);
            assert_eq!(l.lag(), lag, "{l:?}");
            assert_eq!(l.lost_to_retention(), lost, "{l:?}");
        }
    }

    #[test]
    fn received_message_keeps_raw_value_only_when_undecodable() {
        let e = Envelope::builder("order", "o-1", 3, "order.paid")
            .build()
            .unwrap();
        let headers: Vec<RecordHeader> = wire::encode_headers(&e)
            .into_iter()
            .map(|(k, v)| RecordHeader::new(k, v))
            .collect();
        let m = ReceivedMessage::from_record(
            LogPosition::new("t", 0, 1),
            Some(b"o-1".to_vec()),
            headers.clone(),
            Some(e.payload.bytes.clone()),
            None,
        );
        assert_eq!(m.envelope.as_ref().unwrap(), &e);
        assert_eq!(m.value(), Some(e.payload.bytes.as_slice()));
        let r = m.to_record();
        assert_eq!(r.dedup_id, Some(e.event_id));
        assert_eq!(r.aggregate_version, Some(3));
        assert_eq!(r.decode().unwrap(), e);

        let mut bad = headers;
        bad.retain(|h| h.name != wire::EVENT_ID);
        let m = ReceivedMessage::from_record(
            LogPosition::new("t", 0, 2),
            None,
            bad,
            Some(b"raw".to_vec()),
            None,
        );
        assert!(m.envelope.is_err());
        assert_eq!(m.value(), Some(b"raw".as_slice()));
        // The aggregate is still known from its headers.
        assert_eq!(m.aggregate(), Some(AggregateKey::new("order", "o-1")));
        let r = m.to_record();
        assert_eq!(
            (r.event_id, r.dedup_id, r.aggregate_version),
            (None, None, None)
        );
    }

    /// An undecodable record is parked once per the transport's identity of the message: a
    /// JetStream redelivery (new delivery sequence, same stream sequence) has the same dedup
    /// id; another stream sequence, another stream or other content has another; Kafka (whose
    /// position is the identity) and RabbitMQ (no identity) have none.
    #[test]
    fn an_undecodable_record_is_identified_by_its_transports_message_identity() {
        let id = |p: LogPosition, value: &[u8]| {
            ReceivedMessage::from_record(p, None, Vec::new(), Some(value.to_vec()), None)
                .to_record()
                .dedup_id
        };
        let first = id(LogPosition::jetstream("S", 7, 3, "d"), b"junk");
        assert!(first.is_some());
        assert_eq!(first, id(LogPosition::jetstream("S", 7, 9, "d"), b"junk"));
        assert_eq!(
            first,
            id(LogPosition::jetstream("S", 7, 9, "other"), b"junk")
        );
        for other in [
            id(LogPosition::jetstream("S", 8, 3, "d"), b"junk"),
            id(LogPosition::jetstream("T", 7, 3, "d"), b"junk"),
            id(LogPosition::jetstream("S", 7, 3, "d"), b"junk2"),
        ] {
            assert!(other.is_some());
            assert_ne!(other, first);
        }
        assert_eq!(id(LogPosition::new("t", 0, 7), b"junk"), None);
        assert_eq!(
            id(LogPosition::rabbitmq("q", 7, "x", "k", true), b"junk"),
            None,
            "a RabbitMQ message without message_id: once per position"
        );
        // RabbitMQ: the message id within the queue, whatever the tag or redelivered flag.
        let amqp = |p: LogPosition, mid: &str, value: &[u8]| {
            ReceivedMessage::from_record(p, None, Vec::new(), Some(value.to_vec()), None)
                .with_message_id(mid)
                .to_record()
                .dedup_id
        };
        let a = amqp(
            LogPosition::rabbitmq("q", 2, "x", "k", false),
            "m-1",
            b"junk",
        );
        assert!(a.is_some());
        assert_eq!(
            a,
            amqp(
                LogPosition::rabbitmq("q", 1, "x", "k", true),
                "m-1",
                b"junk"
            )
        );
        for other in [
            amqp(
                LogPosition::rabbitmq("q", 2, "x", "k", false),
                "m-2",
                b"junk",
            ),
            amqp(
                LogPosition::rabbitmq("r", 2, "x", "k", false),
                "m-1",
                b"junk",
            ),
            amqp(
                LogPosition::rabbitmq("q", 2, "x", "k", false),
                "m-1",
                b"junk2",
            ),
        ] {
            assert!(other.is_some());
            assert_ne!(other, a);
        }
        // Read back from a store (ParkedRecord::new), the id is the same.
        let p = LogPosition::jetstream("S", 7, 3, "d");
        assert_eq!(
            ParkedRecord::new(p, None, Vec::new(), Some(b"junk".to_vec())).dedup_id,
            first
        );
    }

    #[test]
    fn committed_offset_at_the_log_start_lost_nothing() {
        let tp = TopicPartition::new("t", 0);
        assert_eq!(
            PartitionLag::new(tp.clone(), Some(5), 5, 9).lost_to_retention(),
            None
        );
        assert_eq!(
            PartitionLag::new(tp.clone(), Some(4), 5, 9).lost_to_retention(),
            Some(1)
        );
        assert_eq!(PartitionLag::new(tp, None, 5, 9).lost_to_retention(), None);
    }

    #[test]
    fn keys_ids_and_values_display_and_carry_their_fields() {
        let key = AggregateKey::new("order", "o-1");
        assert_eq!(key.to_string(), "order/o-1");
        let e = Envelope::builder("order", "o-1", 2, "order.paid")
            .build()
            .unwrap();
        assert_eq!(AggregateKey::of(&e), key);
        let m = ReceivedMessage::new(LogPosition::new("t", 1, 7), None, Ok(e.clone()));
        assert_eq!(m.aggregate(), Some(key));
        // The headers are the envelope's wire mapping, so the record decodes back.
        assert_eq!(m.to_record().decode(), Ok(e));
        assert_eq!(TopicPartition::new("t", 3).to_string(), "t/3");
        assert_eq!(ParkedId(12).to_string(), "12");
        assert_eq!(
            AggregateState::new(Some(3), true),
            AggregateState {
                applied_version: Some(3),
                blocked: true
            }
        );
        assert_eq!(
            ParkedStats::new(2, 5, None),
            ParkedStats {
                parked: 2,
                waiting: 5,
                oldest_parked_at: None
            }
        );
        assert_eq!(RecordHeader::null("h").value, None);
    }

    #[test]
    fn parked_filter_builder() {
        let open = ParkedFilter::open();
        assert_eq!(
            (open.open_only, open.aggregate.clone(), open.limit),
            (true, None, 100)
        );
        let key = AggregateKey::new("order", "o-1");
        let f = ParkedFilter::open().all().aggregate(key.clone()).limit(5);
        assert_eq!((f.open_only, f.aggregate, f.limit), (false, Some(key), 5));
    }

    #[test]
    fn names_round_trip() {
        for s in [
            ParkedStatus::Parked,
            ParkedStatus::Waiting,
            ParkedStatus::Applied,
            ParkedStatus::Skipped,
            ParkedStatus::Discarded,
        ] {
            assert_eq!(ParkedStatus::parse(s.as_str()), Some(s));
        }
        assert!(ParkedStatus::Parked.is_open() && !ParkedStatus::Applied.is_open());
        assert_eq!(ParkedStatus::parse("x"), None);
        for a in [
            InboxAction::Retry,
            InboxAction::Discard,
            InboxAction::RequestRetry,
        ] {
            assert_eq!(InboxAction::parse(a.as_str()), Some(a));
        }
        assert_eq!(InboxAction::parse("x"), None);
        assert_eq!("17".parse::<ParkedId>().unwrap(), ParkedId(17));
    }
}
