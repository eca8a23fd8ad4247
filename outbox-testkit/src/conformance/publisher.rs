//! The publisher checks, one per contract clause of [`Publisher`]. Each takes a fresh
//! [`PublisherHarness`].

use std::collections::BTreeMap;

use outbox_core::{
    AckMetadata, Classify, Envelope, ErrorClass, Payload, PublishErrorKind, Publisher,
};

use super::{not_applicable, unique, PublisherHarness};

fn agg(name: &str) -> String {
    format!("{name}-{}", unique())
}

/// The record acknowledged as `ack` is `e` (when the harness can read records back): the
/// acknowledgement metadata points at the record, not at a neighbour.
async fn assert_ack_points_at<H: PublisherHarness>(h: &H, e: &Envelope, ack: &AckMetadata) -> bool {
    let Some((key, headers, value)) = h.read_back(ack).await else {
        return false;
    };
    assert_eq!(
        key.as_deref(),
        Some(e.aggregate_id.as_bytes()),
        "record key at {ack:?}"
    );
    let decoded = outbox_core::wire::decode(&headers, &value)
        .unwrap_or_else(|err| panic!("the record at {ack:?} does not decode: {err}"));
    assert_eq!(
        decoded.event_id, e.event_id,
        "the acknowledgement of {} points at another record ({ack:?})",
        e.event_id
    );
    true
}

/// One result per event, in input order; only acknowledged records are `Ok`; one aggregate's
/// records land in one partition, in order; each acknowledgement points at its record.
pub async fn publish_returns_one_result_per_event_in_order<H: PublisherHarness>(h: &H) {
    let aggs: Vec<String> = (0..3).map(|_| agg("pub")).collect();
    let batch: Vec<Envelope> = (1..=2)
        .flat_map(|v| aggs.iter().map(move |a| (a.clone(), v)))
        .map(|(a, v)| h.event(&a, v))
        .collect();
    let results = h
        .publisher()
        .publish(&batch.iter().collect::<Vec<_>>())
        .await;
    assert_eq!(results.len(), batch.len(), "one result per event");
    // Where the transport has a stored position (Kafka, JetStream), an aggregate's records
    // are in one partition (or stream), in order; RabbitMQ's confirm names no position.
    let mut last: BTreeMap<&str, (String, Option<i32>, Option<i64>)> = BTreeMap::new();
    for (e, r) in batch.iter().zip(&results) {
        let ack = r
            .as_ref()
            .unwrap_or_else(|err| panic!("publishing {} failed: {err}", e.event_id));
        let position = ack.position();
        let (partition, offset) = (
            position.and_then(|p| p.partition),
            position.map(|p| p.offset),
        );
        if let Some((destination, last_partition, last_offset)) = last.get(e.aggregate_id.as_str())
        {
            assert_eq!(
                (destination.as_str(), last_partition),
                (ack.destination(), &partition),
                "one aggregate, one destination and partition"
            );
            if let (Some(before), Some(now)) = (last_offset, offset) {
                assert!(now > *before, "an aggregate's records are stored in order");
            }
        }
        last.insert(
            &e.aggregate_id,
            (ack.destination().to_owned(), partition, offset),
        );
    }
    let mut read = 0;
    for (e, r) in batch.iter().zip(&results) {
        read += usize::from(assert_ack_points_at(h, e, r.as_ref().expect("published")).await);
    }
    if read == 0 {
        not_applicable(
            "publish_returns_one_result_per_event_in_order (read-back)",
            "the harness cannot read records back",
        );
    }
}

/// A batch in which some records fail and others succeed: each result belongs to its own
/// record (the failures at their places with their own kind and class, the successes
/// acknowledged at their own records), and a failure does not fail its neighbours.
pub async fn mixed_outcomes_in_one_batch_map_to_their_records<H: PublisherHarness>(h: &H) {
    let Some(max) = h.max_record_bytes() else {
        return not_applicable(
            "mixed_outcomes_in_one_batch_map_to_their_records",
            "the harness declares no record size limit, so no record can be made to fail",
        );
    };
    let oversize = |name: &str| {
        let mut e = h.event(&agg(name), 1);
        e.payload = Payload::new("application/octet-stream", vec![1u8; max + 1]);
        e
    };
    // Every record its own aggregate: a failure holds back only its aggregate's later records.
    let mut batch = vec![
        h.event(&agg("mixed-ok"), 1),
        oversize("mixed-big"),
        h.event(&agg("mixed-ok"), 1),
        h.event(&agg("mixed-ok"), 1),
        oversize("mixed-big"),
    ];
    let unroutable = h.unroutable_event();
    if let Some(e) = unroutable.clone() {
        batch.insert(3, e);
    }
    batch.push(h.event(&agg("mixed-ok"), 1));
    let results = h
        .publisher()
        .publish(&batch.iter().collect::<Vec<_>>())
        .await;
    assert_eq!(results.len(), batch.len(), "one result per record");
    let mut read = 0;
    for (i, (e, r)) in batch.iter().zip(&results).enumerate() {
        let big = e.payload.bytes.len() > max;
        let missing = unroutable
            .as_ref()
            .is_some_and(|u| u.event_id == e.event_id);
        match r {
            Ok(ack) if !big && !missing => {
                read += usize::from(assert_ack_points_at(h, e, ack).await);
            }
            Ok(ack) => panic!("record {i} should have failed, was acknowledged at {ack:?}"),
            Err(err) if big => {
                assert_eq!(
                    err.kind,
                    PublishErrorKind::RecordTooLarge,
                    "record {i}: {err}"
                );
                assert_eq!(err.class(), ErrorClass::Permanent, "record {i}: {err}");
            }
            Err(err) if missing => {
                assert_eq!(err.class(), ErrorClass::Permanent, "record {i}: {err}");
            }
            Err(err) => panic!("record {i} failed with its neighbours: {err}"),
        }
    }
    if read == 0 {
        not_applicable(
            "mixed_outcomes_in_one_batch_map_to_their_records (read-back)",
            "the harness cannot read records back",
        );
    }
}

/// An empty batch gives no results.
pub async fn empty_batch_returns_no_results<H: PublisherHarness>(h: &H) {
    assert!(h.publisher().publish(&[]).await.is_empty());
}

/// The stored record is the wire mapping of the envelope, keyed by the aggregate id.
pub async fn records_follow_the_wire_mapping<H: PublisherHarness>(h: &H) {
    let e = h.event(&agg("wire"), 1);
    let ack = h
        .publisher()
        .publish(&[&e])
        .await
        .remove(0)
        .expect("published");
    let Some((key, headers, value)) = h.read_back(&ack).await else {
        return not_applicable(
            "records_follow_the_wire_mapping",
            "the harness cannot read records back",
        );
    };
    assert_eq!(
        key.as_deref(),
        Some(e.aggregate_id.as_bytes()),
        "record key"
    );
    let decoded = outbox_core::wire::decode(&headers, &value).expect("decodable record");
    assert_eq!(decoded, e, "the record decodes to the published envelope");
}

/// A record over the broker's size limit fails permanently (it is parked, never retried in a
/// loop), and does not fail the rest of the batch.
pub async fn oversize_record_is_a_permanent_error<H: PublisherHarness>(h: &H) {
    let Some(max) = h.max_record_bytes() else {
        return not_applicable(
            "oversize_record_is_a_permanent_error",
            "the harness declares no record size limit",
        );
    };
    let mut big = h.event(&agg("big"), 1);
    big.payload = Payload::new("application/octet-stream", vec![7u8; max + 1]);
    let small = h.event(&agg("small"), 1);
    let results = h.publisher().publish(&[&big, &small]).await;
    assert_eq!(results.len(), 2);
    let err = results[0]
        .as_ref()
        .expect_err("an oversize record was acknowledged");
    assert_eq!(err.class(), ErrorClass::Permanent, "{err}");
    assert_eq!(err.kind, PublishErrorKind::RecordTooLarge, "{err}");
    assert!(results[1].is_ok(), "the rest of the batch is unaffected");
}

/// A record for a topic that does not exist fails permanently.
pub async fn unknown_topic_is_a_permanent_error<H: PublisherHarness>(h: &H) {
    let Some(e) = h.unroutable_event() else {
        return not_applicable(
            "unknown_topic_is_a_permanent_error",
            "the harness cannot route an event to a missing topic",
        );
    };
    let results = h.publisher().publish(&[&e]).await;
    let err = results[0]
        .as_ref()
        .expect_err("a record for a missing topic was acknowledged");
    assert_eq!(err.class(), ErrorClass::Permanent, "{err}");
}

/// The delivery timeout is a real bound.
pub async fn delivery_timeout_is_positive<H: PublisherHarness>(h: &H) {
    assert!(!h.publisher().delivery_timeout().is_zero());
}
