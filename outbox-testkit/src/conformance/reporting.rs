//! The reporting checks, one per clause of [`ReportingStore`], each with the values a store
//! must answer. They run on any [`OutboxHarness`] whose store also implements
//! [`ReportingStore`]; the harness's [`OutboxHarness::now`] places the events in time on the
//! store's clock.

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::prelude::*;
use outbox_core::{
    AckMetadata, ClaimMode, ClaimRequest, ClaimedBatch, Envelope, ErrorClass, EventId,
    IntervalCount, LastError, Outcome, ParkKind, ParkReason, PublishedFilter, PublishedId,
    StoreErrorKind,
};

use super::{fresh_event_id, published_with_acks, OutboxHarness};

/// The topic the checks' acknowledgements name.
const TOPIC: &str = "reporting";

fn created(agg: &str, version: i64, event_type: &str, at: DateTime<Utc>) -> Envelope {
    Envelope::builder("order", agg, version, event_type)
        .event_id(fresh_event_id())
        .created_at(at)
        .build()
        .expect("valid envelope")
}

fn published(event_id: EventId, offset: i64) -> Outcome {
    Outcome::Published {
        event_id,
        ack: AckMetadata::kafka(TOPIC, 0, offset),
    }
}

fn park(event_id: EventId) -> Outcome {
    Outcome::Park {
        event_id,
        reason: ParkReason {
            kind: ParkKind::PermanentError,
            error: LastError {
                class: ErrorClass::Permanent,
                kind: "invalid_record".into(),
                message: "injected by the reporting checks".into(),
            },
        },
    }
}

async fn store<H: OutboxHarness>(h: &H) -> H::Store {
    let caps = h.capabilities();
    if caps.lease {
        h.store(caps.lease_mode()).await
    } else {
        h.store(ClaimMode::LockedTransaction).await
    }
}

async fn append<H: OutboxHarness>(h: &H, store: &H::Store, events: &[Envelope]) {
    let mut tx = h.begin().await;
    store.append(&mut tx, events).await.expect("append");
    h.commit(tx).await.expect("commit");
}

async fn claim<S: RelayStore>(store: &S, limit: usize) -> ClaimedBatch {
    store
        .claim(&ClaimRequest::new("reporting", limit))
        .await
        .expect("claim")
}

/// Claims and publishes until every event of `ids` is published, letting a time step pass
/// between empty rounds (a store may re-check a held gap only after a while). Panics after 40
/// rounds.
async fn drain<H: OutboxHarness>(h: &H, store: &H::Store, ids: &[EventId])
where
    H::Store: ReportingStore,
{
    let mut offset = 1_000;
    for _ in 0..40 {
        let b = claim(store, 100).await;
        if !b.records.is_empty() {
            let outs: Vec<Outcome> = b
                .records
                .iter()
                .map(|r| {
                    offset += 1;
                    published(r.envelope.event_id, offset)
                })
                .collect();
            store.complete(&b.handle, &outs).await.expect("complete");
        }
        let rows = store
            .published_events(&PublishedFilter::default(), None, 10_000)
            .await
            .expect("published events");
        if ids
            .iter()
            .all(|id| rows.iter().any(|r| r.envelope.event_id == *id))
        {
            return;
        }
        if b.records.is_empty() {
            h.advance(h.capabilities().time_step).await;
        }
    }
    panic!("events {ids:?} not published after 40 rounds");
}

/// Whole seconds: stores keep microseconds at most.
fn whole_seconds(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp(t.timestamp(), 0).expect("in range")
}

/// `backlog` is the monitoring snapshot: one pending, one parked, one published event.
pub async fn backlog_is_the_monitoring_snapshot<H: OutboxHarness>(h: &H)
where
    H::Store: ReportingStore,
{
    let store = store(h).await;
    let now = h.now().await;
    let (a, b, c) = (
        created("a", 1, "t", now),
        created("b", 1, "t", now),
        created("c", 1, "t", now),
    );
    append(h, &store, &[a.clone(), b.clone(), c.clone()]).await;
    let batch = claim(&store, 10).await;
    assert_eq!(batch.records.len(), 3);
    store
        .complete(&batch.handle, &[published(a.event_id, 1), park(b.event_id)])
        .await
        .expect("complete");
    let s = store.backlog().await.expect("backlog");
    assert_eq!(
        (s.unpublished, s.parked, s.published_retained, s.in_flight),
        (1, 1, 1, 0),
        "{s:?}"
    );
    assert!(s.oldest_claimable_age.is_some(), "{s:?}");
    assert!(s.oldest_parked_age.is_some(), "{s:?}");
}

/// Percentiles of the created-to-published latency, continuous as SQL's `percentile_cont`:
/// ten events created 10, 20, .., 100 s ago and published now have a median of 55 s, a 90th
/// percentile of 91 s, a 99th of 99.1 s and a largest of 100 s (plus the moments the check
/// takes on a real clock). An event created before the window is not counted as created in
/// it; a window that ends after the publications and starts after them holds none. Ten
/// publications are exact (no sample), and the flow counts what the latency counts; the
/// flows of several windows are each window's flow.
pub async fn publish_latency_percentiles_over_a_window<H: OutboxHarness>(h: &H)
where
    H::Store: ReportingStore,
{
    let store = store(h).await;
    let hour = Duration::from_secs(3600);
    let empty = store.publish_latency(hour).await.expect("latency");
    assert_eq!(
        (empty.count, empty.created, empty.p50, empty.max),
        (0, 0, None, None),
        "{empty:?}"
    );
    let now = h.now().await;
    let events: Vec<Envelope> = (1..=10)
        .map(|k| {
            created(
                &format!("a{k}"),
                1,
                "t",
                now - chrono::Duration::seconds(10 * k),
            )
        })
        .collect();
    let outside = created("old", 1, "t", now - chrono::Duration::hours(2));
    append(h, &store, &events).await;
    append(h, &store, std::slice::from_ref(&outside)).await;
    let b = claim(&store, 100).await;
    let outs: Vec<Outcome> = b
        .records
        .iter()
        .filter(|r| r.envelope.event_id != outside.event_id)
        .enumerate()
        .map(|(i, r)| published(r.envelope.event_id, i as i64))
        .collect();
    assert_eq!(outs.len(), 10, "every event claimed");
    store.complete(&b.handle, &outs).await.expect("complete");
    let s = store.publish_latency(hour).await.expect("latency");
    assert_eq!((s.count, s.created), (10, 10), "{s:?}");
    assert_eq!(
        s.sample, None,
        "ten publications are reported exactly: {s:?}"
    );
    let flow = store.flow(hour).await.expect("flow");
    assert_eq!(
        (flow.created, flow.finished),
        (s.created, s.count),
        "the flow counts what the latency counts: {flow:?}"
    );
    let near =
        |got: Option<f64>, want: f64| got.is_some_and(|g| g >= want - 1e-6 && g < want + 5.0);
    assert!(near(s.p50, 55.0), "{s:?}");
    assert!(near(s.p90, 91.0), "{s:?}");
    assert!(near(s.p99, 99.1), "{s:?}");
    assert!(near(s.max, 100.0), "{s:?}");
    h.advance(h.capabilities().time_step).await;
    let tiny = store
        .publish_latency(Duration::from_micros(1))
        .await
        .expect("latency");
    assert_eq!((tiny.count, tiny.p50), (0, None), "{tiny:?}");
    // Several windows at once, in the caller's order (repeats and a window nothing is in
    // included): each what `flow` counts. Created: ten within the hour, the six created
    // 10..60 s ago within 65 s, the outside one within three hours too; finished: the ten
    // publications in each window but the last.
    let windows = [
        hour,
        Duration::from_secs(65),
        3 * hour,
        Duration::from_secs(65),
        Duration::from_micros(1),
    ];
    let flows = store.flows(&windows).await.expect("flows");
    let got: Vec<(u64, u64)> = flows.iter().map(|f| (f.created, f.finished)).collect();
    assert_eq!(
        got,
        vec![(10, 10), (6, 10), (11, 10), (6, 10), (0, 0)],
        "the flows of {windows:?}"
    );
    assert!(store.flows(&[]).await.expect("no flows").is_empty());
}

/// Replay reads published events in publication order, not append order: version 2 of an
/// aggregate appended before version 1 (held as a gap until 1 arrived) comes after 1, as the
/// broker got them. Paging by position returns each once; filters by aggregate, event type
/// and creation time select; pending, parked and discarded events are never returned.
pub async fn published_events_come_in_publication_order_and_page_by_position<H: OutboxHarness>(
    h: &H,
) where
    H::Store: ReportingStore,
{
    let store = store(h).await;
    let now = h.now().await;
    let a2 = created("a", 2, "order.paid", now);
    append(h, &store, std::slice::from_ref(&a2)).await;
    let b = claim(&store, 10).await;
    assert!(b.records.is_empty(), "version 2 waits for version 1");
    let a1 = created("a", 1, "order.created", now - chrono::Duration::minutes(5));
    let (b1, b2) = (
        created("b", 1, "order.created", now),
        created("b", 2, "x", now),
    );
    append(h, &store, &[a1.clone(), b1.clone(), b2.clone()]).await;
    drain(
        h,
        &store,
        &[a1.event_id, a2.event_id, b1.event_id, b2.event_id],
    )
    .await;
    // Not published: pending, parked, discarded.
    let (p1, d1) = (created("p", 1, "t", now), created("d", 1, "t", now));
    append(h, &store, &[p1.clone(), d1.clone()]).await;
    let b = claim(&store, 10).await;
    store
        .complete(&b.handle, &[park(p1.event_id), park(d1.event_id)])
        .await
        .expect("complete");
    store
        .discard_parked(d1.event_id, "ops", "test")
        .await
        .expect("discard");
    append(h, &store, &[created("q", 1, "t", now)]).await;

    let all = PublishedFilter::default();
    assert_eq!(store.count_published(&all).await.expect("count"), 4);
    let mut filter = PublishedFilter::default();
    filter.aggregate_type = Some("order".into());
    filter.aggregate_id = Some("a".into());
    assert_eq!(store.count_published(&filter).await.expect("count"), 2);
    let rows = store
        .published_events(&filter, None, 10)
        .await
        .expect("published");
    let got: Vec<EventId> = rows.iter().map(|r| r.envelope.event_id).collect();
    assert_eq!(got, [a1.event_id, a2.event_id], "publication order");
    assert!(rows[0].position < rows[1].position, "{rows:?}");
    assert!(
        matches!(&rows[0].ack, AckMetadata::Kafka { topic, .. } if topic == TOPIC),
        "{rows:?}"
    );
    assert_eq!(rows[0].envelope, a1, "the event reads back whole");
    // Paging one at a time over everything: each published event once, in order.
    let (mut seen, mut after) = (Vec::new(), None);
    loop {
        let page = store
            .published_events(&all, after, 1)
            .await
            .expect("published");
        let Some(last) = page.last() else { break };
        assert_eq!(page.len(), 1, "the limit holds");
        after = Some(last.position);
        seen.extend(page.iter().map(|r| r.envelope.event_id));
        assert!(seen.len() <= 4, "paging repeats: {seen:?}");
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
    let pos = |id| seen.iter().position(|s| *s == id).expect("seen");
    assert!(pos(a1.event_id) < pos(a2.event_id));
    assert!(pos(b1.event_id) < pos(b2.event_id));
    // Event type and creation time.
    let mut by_type = PublishedFilter::default();
    by_type.event_type = Some("order.created".into());
    assert_eq!(store.count_published(&by_type).await.expect("count"), 2);
    let mut by_time = PublishedFilter::default();
    by_time.since = Some(now - chrono::Duration::minutes(10));
    by_time.until = Some(now - chrono::Duration::minutes(1));
    let rows = store
        .published_events(&by_time, None, 10)
        .await
        .expect("published");
    let got: Vec<EventId> = rows.iter().map(|r| r.envelope.event_id).collect();
    assert_eq!(got, [a1.event_id]);
    let mut only_id = PublishedFilter::default();
    only_id.aggregate_id = Some("b".into());
    assert_eq!(store.count_published(&only_id).await.expect("count"), 2);
}

/// Cleanup candidates are the published and discarded rows finished longer than the
/// retention ago: what a cleanup with that retention removes. Pending rows never count.
pub async fn cleanup_candidates_count_what_a_cleanup_removes<H: OutboxHarness>(h: &H)
where
    H::Store: ReportingStore,
{
    let store = store(h).await;
    let now = h.now().await;
    let (e1, e2, e3) = (
        created("a", 1, "t", now),
        created("b", 1, "t", now),
        created("c", 1, "t", now),
    );
    append(h, &store, &[e1.clone(), e2.clone(), e3]).await;
    let b = claim(&store, 10).await;
    store
        .complete(&b.handle, &[published(e1.event_id, 1), park(e2.event_id)])
        .await
        .expect("complete");
    store
        .discard_parked(e2.event_id, "ops", "test")
        .await
        .expect("discard");
    let hour = Duration::from_secs(3600);
    assert_eq!(store.cleanup_candidates(hour).await.expect("candidates"), 0);
    let step = h.capabilities().time_step;
    h.advance(step * 2).await;
    assert_eq!(store.cleanup_candidates(step).await.expect("candidates"), 2);
    assert_eq!(store.cleanup(step, 100).await.expect("cleanup").removed, 2);
    assert_eq!(
        store
            .cleanup_candidates(Duration::ZERO)
            .await
            .expect("candidates"),
        0
    );
}

/// Reconciliation counts per interval (from `since`, in whole intervals) and event type:
/// created, published with an acknowledgement, pending past the grace, parked, discarded;
/// events before `since` are left out; a zero interval is refused.
pub async fn interval_counts_per_interval_and_event_type<H: OutboxHarness>(h: &H)
where
    H::Store: ReportingStore,
{
    let store = store(h).await;
    let since = whole_seconds(h.now().await) - chrono::Duration::hours(1);
    let at = |min: i64| since + chrono::Duration::minutes(min);
    let events = [
        created("a", 1, "order.created", at(1)),  // published
        created("b", 1, "order.created", at(9)),  // parked
        created("c", 1, "order.paid", at(5)),     // discarded
        created("d", 1, "order.created", at(12)), // pending, overdue
        created("e", 1, "order.created", at(-1)), // before since
    ];
    append(h, &store, &events).await;
    let b = claim(&store, 10).await;
    assert_eq!(b.records.len(), 5);
    store
        .complete(
            &b.handle,
            &[
                published(events[0].event_id, 7),
                park(events[1].event_id),
                park(events[2].event_id),
            ],
        )
        .await
        .expect("complete");
    store
        .discard_parked(events[2].event_id, "ops", "test")
        .await
        .expect("discard");
    h.advance(h.capabilities().time_step).await;
    let ten_minutes = Duration::from_secs(600);
    let counts = store
        .interval_counts(since, ten_minutes, Duration::ZERO)
        .await
        .expect("counts");
    let row = |start: DateTime<Utc>, t: &str, c: [u64; 5]| {
        let mut r = IntervalCount::zero(start, t);
        [r.events, r.published, r.overdue, r.parked, r.discarded] = c;
        r
    };
    assert_eq!(
        counts,
        [
            row(since, "order.created", [2, 1, 0, 1, 0]),
            row(since, "order.paid", [1, 0, 0, 0, 1]),
            row(at(10), "order.created", [1, 0, 1, 0, 0]),
        ]
    );
    // A grace longer than the events' age: nothing overdue.
    let counts = store
        .interval_counts(since, ten_minutes, Duration::from_secs(3600 * 24 * 365))
        .await
        .expect("counts");
    assert_eq!(counts.len(), 3);
    assert_eq!(counts[2].overdue, 0);
    let err = store
        .interval_counts(since, Duration::ZERO, Duration::ZERO)
        .await
        .expect_err("zero interval");
    assert_eq!(err.kind, StoreErrorKind::Configuration);
}

/// What consumers should have applied: the published events of a type created in a range, on
/// the given topics, published more than the grace ago; a re-issued copy comes with the id of
/// its original (the header inboxes deduplicate by).
pub async fn published_ids_name_the_original_of_a_copy<H: OutboxHarness>(h: &H)
where
    H::Store: ReportingStore,
{
    let store = store(h).await;
    let now = h.now().await;
    let (x, y, other) = (
        created("x", 1, "order.created", now),
        created("y", 1, "order.created", now),
        created("z", 1, "order.paid", now),
    );
    append(h, &store, &[x.clone(), y.clone(), other.clone()]).await;
    let b = claim(&store, 10).await;
    store
        .complete(
            &b.handle,
            &[
                published(x.event_id, 1),
                park(y.event_id),
                published(other.event_id, 2),
            ],
        )
        .await
        .expect("complete");
    let copy = store
        .reissue_parked(y.event_id, "ops", "again")
        .await
        .expect("reissue");
    drain(h, &store, &[copy]).await;
    h.advance(h.capabilities().time_step).await;
    let (start, end) = (
        now - chrono::Duration::minutes(1),
        now + chrono::Duration::minutes(1),
    );
    let ids = |topics: Vec<String>, grace: Duration| {
        let store = &store;
        async move {
            let mut ids = store
                .published_ids("order.created", start, end, &topics, grace)
                .await
                .expect("published ids");
            ids.sort();
            ids
        }
    };
    let mut want = vec![
        PublishedId::new(x.event_id, None),
        PublishedId::new(copy, Some(y.event_id)),
    ];
    want.sort();
    assert_eq!(ids(vec![], Duration::ZERO).await, want);
    assert_eq!(PublishedId::new(x.event_id, None).dedup_id(), x.event_id);
    assert_eq!(
        PublishedId::new(copy, Some(y.event_id)).dedup_id(),
        y.event_id
    );
    assert_eq!(ids(vec![TOPIC.into()], Duration::ZERO).await, want);
    assert!(ids(vec!["elsewhere".into()], Duration::ZERO)
        .await
        .is_empty());
    let hour = Duration::from_secs(3600);
    assert!(
        ids(vec![], hour).await.is_empty(),
        "published less than the grace ago"
    );
    let outside = store
        .published_ids(
            "order.created",
            end,
            end + chrono::Duration::minutes(1),
            &[],
            Duration::ZERO,
        )
        .await
        .expect("published ids");
    assert!(outside.is_empty(), "created before the range");
}

/// A published row keeps its transport's own acknowledgement, whichever transport gave it:
/// a Kafka delivery report, a JetStream `PubAck` (with its subject and duplicate flag), a
/// RabbitMQ confirm (exchange and routing key, no position). Replay reads each back as it was
/// recorded, and `published_ids` filters by destination (topic, stream or exchange).
pub async fn published_events_keep_each_transport_acknowledgement<H: OutboxHarness>(h: &H)
where
    H::Store: ReportingStore,
{
    let store = store(h).await;
    let now = h.now().await;
    let acks = [
        AckMetadata::kafka("orders", 3, 41),
        AckMetadata::JetStream {
            stream: "ORDERS".into(),
            sequence: 9_007_199_254_740_993,
            subject: "outbox.order".into(),
            duplicate: true,
        },
        AckMetadata::JetStream {
            stream: "ORDERS".into(),
            sequence: 1,
            subject: "outbox.order".into(),
            duplicate: false,
        },
        AckMetadata::RabbitMq {
            exchange: "outbox".into(),
            routing_key: String::new(),
        },
        AckMetadata::RabbitMq {
            exchange: "outbox".into(),
            routing_key: "order.created".into(),
        },
    ];
    let events: Vec<Envelope> = (0..acks.len())
        .map(|k| created(&format!("t{k}"), 1, "order.created", now))
        .collect();
    append(h, &store, &events).await;
    let b = claim(&store, 100).await;
    assert_eq!(b.records.len(), events.len(), "every event claimed");
    let outs = published_with_acks(&b, &events, &acks);
    store.complete(&b.handle, &outs).await.expect("complete");
    let rows = store
        .published_events(&PublishedFilter::default(), None, 100)
        .await
        .expect("published");
    assert_eq!(rows.len(), events.len(), "{rows:?}");
    for row in &rows {
        let k = events
            .iter()
            .position(|e| e.event_id == row.envelope.event_id)
            .expect("a published event was appended");
        assert_eq!(row.ack, acks[k], "the acknowledgement of {:?}", events[k]);
    }
    h.advance(h.capabilities().time_step).await;
    let ids = |destination: &'static str| {
        let store = &store;
        async move {
            let mut ids: Vec<EventId> = store
                .published_ids(
                    "order.created",
                    now - chrono::Duration::minutes(1),
                    now + chrono::Duration::minutes(1),
                    &[destination.to_owned()],
                    Duration::ZERO,
                )
                .await
                .expect("published ids")
                .into_iter()
                .map(|p| p.event_id)
                .collect();
            ids.sort();
            ids
        }
    };
    let of = |idx: &[usize]| {
        let mut ids: Vec<EventId> = idx.iter().map(|k| events[*k].event_id).collect();
        ids.sort();
        ids
    };
    assert_eq!(ids("orders").await, of(&[0]), "a topic");
    assert_eq!(ids("ORDERS").await, of(&[1, 2]), "a stream");
    assert_eq!(ids("outbox").await, of(&[3, 4]), "an exchange");
    assert!(
        ids("outbox.order").await.is_empty(),
        "a subject is no destination"
    );
}
