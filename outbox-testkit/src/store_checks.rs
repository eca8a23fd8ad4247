//! Checks that the server stores' own tests share beyond the conformance suite: parts of their
//! upgrade and bound tests that read the same through the contract on each store (the
//! server-specific setup, SQL written by hand, stays in each store's tests).

use outbox_core::prelude::*;
use outbox_core::{
    AckMetadata, ClaimRequest, Envelope, EventId, Outcome, PublishedFilter, ReportingStore,
    StoreErrorKind,
};

use crate::conformance::published_with_acks;

async fn claim<S: RelayStore>(store: &S, limit: usize) -> outbox_core::ClaimedBatch {
    store
        .claim(&ClaimRequest::new("r", limit))
        .await
        .expect("claim")
}

async fn published<S: ReportingStore>(store: &S) -> Vec<outbox_core::PublishedRow> {
    store
        .published_events(&PublishedFilter::default(), None, 100)
        .await
        .expect("published events")
}

/// One acknowledgement per transport: Kafka, JetStream (at the largest sequence a store
/// keeps) and RabbitMQ.
pub fn transport_acks() -> [AckMetadata; 3] {
    [
        AckMetadata::kafka("orders", 2, 5),
        AckMetadata::JetStream {
            stream: "ORDERS".into(),
            sequence: u64::try_from(i64::MAX).expect("i64::MAX fits"),
            subject: "outbox.order".into(),
            duplicate: false,
        },
        AckMetadata::RabbitMq {
            exchange: "outbox".into(),
            routing_key: "order".into(),
        },
    ]
}

/// Claims `events` (appended, pending, the only claimable rows), publishes each with the
/// acknowledgement at its index in `acks`, and reads every acknowledgement back as written.
pub async fn acks_read_back<S: RelayStore + ReportingStore>(
    store: &S,
    events: &[Envelope],
    acks: &[AckMetadata],
    what: &str,
) {
    let batch = claim(store, 10).await;
    let outcomes = published_with_acks(&batch, events, acks);
    let report = store
        .complete(&batch.handle, &outcomes)
        .await
        .expect("complete");
    assert_eq!(report.applied, acks.len(), "{what}");
    let rows = published(store).await;
    for (e, ack) in events.iter().zip(acks) {
        let row = rows
            .iter()
            .find(|r| r.envelope.event_id == e.event_id)
            .expect("the published row");
        assert_eq!(&row.ack, ack, "{what}");
    }
}

/// The one pending row is claimed, published over JetStream and reads back as such (the last
/// published row).
pub async fn pending_row_reads_back_a_jetstream_ack<S: RelayStore + ReportingStore>(store: &S) {
    let batch = claim(store, 10).await;
    assert_eq!(batch.records.len(), 1);
    let jet = AckMetadata::JetStream {
        stream: "ORDERS".into(),
        sequence: 7,
        subject: "outbox.order".into(),
        duplicate: true,
    };
    store
        .complete(
            &batch.handle,
            &[Outcome::Published {
                event_id: batch.records[0].envelope.event_id,
                ack: jet.clone(),
            }],
        )
        .await
        .expect("complete");
    let rows = store
        .published_events(&PublishedFilter::default(), None, 10)
        .await
        .expect("published events");
    assert_eq!(rows.last().expect("a published row").ack, jet);
}

/// A published row of a transport no store knows (`pulsar`, written by hand) is refused on
/// read with a `Schema` error naming it.
pub async fn unknown_transport_is_refused_on_read<S: ReportingStore>(store: &S) {
    let err = store
        .published_events(&PublishedFilter::default(), None, 10)
        .await
        .expect_err("an unknown transport");
    assert_eq!(err.kind, StoreErrorKind::Schema);
    assert!(
        err.message.contains("unknown transport \"pulsar\""),
        "{err}"
    );
}

/// `pair`, two versions of one aggregate parked because the aggregate cannot be keyed (its id
/// past `bound` bytes), are the only parked events, listed in order, the first's reason naming
/// the bound; neither can be sent again (retry and reissue refused with `Validation`); both can
/// be discarded, and then nothing is parked or unpublished.
pub async fn unkeyable_pair_can_only_be_discarded<S: OutboxStore>(
    store: &S,
    pair: [EventId; 2],
    bound: usize,
    what: &str,
) {
    let parked = store.list_parked(10).await.expect("list parked");
    let ids: Vec<_> = parked.iter().map(|p| p.envelope.event_id).collect();
    assert_eq!(ids, pair, "{what}");
    assert!(
        parked[0].reason.error.message.contains(&bound.to_string()),
        "{what}: the reason names the bound: {}",
        parked[0].reason.error.message
    );
    for refused in [
        store.retry_parked(pair[0], "ops").await,
        store
            .reissue_parked(pair[0], "ops", "again")
            .await
            .map(|_| ()),
    ] {
        let err = refused.expect_err("an event past the bound cannot be sent again");
        assert_eq!(err.kind, StoreErrorKind::Validation, "{what}: {err}");
    }
    for id in pair {
        store
            .discard_parked(id, "ops", "aggregate id too long")
            .await
            .expect("discard");
    }
    let s = store.stats().await.expect("stats");
    assert_eq!((s.parked, s.unpublished), (0, 0), "{what}");
}
