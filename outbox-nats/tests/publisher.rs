//! [`NatsPublisher`] against a real NATS server with JetStream: duplicate suppression by
//! `Nats-Msg-Id`, the start-up stream check, and the error classes the server really produces.

mod common;

use std::time::{Duration, Instant};

use common::{event, require, unique, TestStream};
use outbox_core::{AckMetadata, ErrorClass, FailureScope, Payload, PublishErrorKind, Publisher};
use outbox_nats::{
    NatsPublisher, Retention, Storage, StreamCheckError, StreamWarning, SubjectMapping,
};

/// The relay re-sends an event whose outcome it did not learn (a lost `PubAck`, an expired
/// lease): inside the stream's duplicate window the server drops the copy, answers with a
/// duplicate `PubAck` for the stored one, and the publisher reports that as an
/// acknowledgement at the same place, flagged a duplicate. Each acknowledgement names the
/// stream, the stream sequence and the subject the server stored the message under.
#[tokio::test]
async fn a_resend_within_the_duplicate_window_is_dropped_and_still_acknowledged() {
    let url = require!(common::nats_url("duplicate_window"));
    let prefix = unique("dup");
    let stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;
    let publisher = NatsPublisher::builder(&url, &prefix)
        .start()
        .await
        .expect("start");
    let e = event("order", "o-1", 1);
    let other = event("order", "o-2", 1);
    let first = publisher
        .publish(&[&e])
        .await
        .remove(0)
        .expect("first send");
    // The same event again, beside a new one, as a relay re-sending a batch would.
    let again = publisher.publish(&[&e, &other]).await;
    let resent = again[0]
        .as_ref()
        .expect("a duplicate PubAck is an acknowledgement");
    let AckMetadata::JetStream {
        stream: stored_in,
        sequence,
        subject,
        duplicate,
    } = &first
    else {
        panic!("not a JetStream acknowledgement: {first:?}");
    };
    assert_eq!(
        (stored_in, *duplicate),
        (&stream.name, false),
        "the first send stored it"
    );
    assert_eq!(first.to_string(), format!("{}#{sequence}", stream.name));
    assert_eq!(
        resent,
        &AckMetadata::JetStream {
            stream: stream.name.clone(),
            sequence: *sequence,
            subject: subject.clone(),
            duplicate: true,
        },
        "acknowledged at the stored copy, as a duplicate"
    );
    let new = again[1].as_ref().expect("the new event");
    assert!(
        matches!(new, AckMetadata::JetStream { sequence: s, duplicate: false, .. } if s > sequence),
        "{new:?}"
    );
    assert_eq!(stream.count().await, 2, "the copy was not stored");
    // The server holds the event at that sequence, under that subject.
    let (stored_subject, headers, _) = stream.read(*sequence).await;
    assert_eq!(&stored_subject, subject);
    assert_eq!(stored_subject, format!("{prefix}.order"));
    let id = headers.iter().find(|(k, _)| k == "Nats-Msg-Id").unwrap();
    assert_eq!(id.1, e.event_id.to_string().into_bytes());
}

/// Outside the window (a stream without deduplication) the copy is stored: the inbox absorbs
/// it. The publisher still reports what the server said, a second acknowledgement elsewhere.
#[tokio::test]
async fn without_a_duplicate_window_a_resend_is_stored_again() {
    let url = require!(common::nats_url("no_duplicate_window"));
    let prefix = unique("nodup");
    let stream = TestStream::create(
        &url,
        &prefix,
        &[format!("{prefix}.>")],
        Some(Duration::from_millis(100)),
        None,
    )
    .await;
    let publisher = NatsPublisher::builder(&url, &prefix)
        .start()
        .await
        .expect("start");
    let e = event("order", "o-1", 1);
    let first = publisher.publish(&[&e]).await.remove(0).expect("first");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let second = publisher.publish(&[&e]).await.remove(0).expect("second");
    assert_ne!(first.position(), second.position());
    assert_eq!(
        second.duplicate(),
        Some(false),
        "stored again, not a duplicate"
    );
    assert_eq!(stream.count().await, 2);
}

#[tokio::test]
async fn start_fails_permanently_when_no_stream_captures_the_subjects() {
    let url = require!(common::nats_url("start_without_stream"));
    let prefix = unique("nostream");
    let err = NatsPublisher::builder(&url, &prefix)
        .start()
        .await
        .expect_err("no stream");
    assert!(!err.is_transient(), "{err}");
    let shown = err.to_string();
    assert!(shown.contains(&format!("{prefix}.>")), "{shown}");
    assert!(shown.contains("nats stream add"), "{shown}");

    // A stream that captures one aggregate type only leaves the others without a stream.
    let _stream = TestStream::create(&url, &prefix, &[format!("{prefix}.order")], None, None).await;
    let err = NatsPublisher::builder(&url, &prefix)
        .start()
        .await
        .expect_err("partial stream");
    match err {
        outbox_nats::StartError::Streams(StreamCheckError::MissingStream {
            partial: Some(s),
            ..
        }) => assert_eq!(s, prefix.to_uppercase()),
        other => panic!("{other}"),
    }
}

#[tokio::test]
async fn start_reports_the_streams_and_warns_about_a_short_duplicate_window() {
    let url = require!(common::nats_url("stream_report"));
    let prefix = unique("report");
    let routed = unique("payments");
    let main = TestStream::create(
        &url,
        &prefix,
        &[format!("{prefix}.>")],
        Some(Duration::from_secs(10)),
        Some(4096),
    )
    .await;
    let other = TestStream::create(&url, &routed, &[format!("{routed}.>")], None, None).await;
    let publisher = NatsPublisher::builder(&url, &prefix)
        .route_aggregate("payment", format!("{routed}.events"))
        .relay_lease(Duration::from_secs(60))
        .delivery_timeout(Duration::from_secs(5))
        .start()
        .await
        .expect("start");
    let report = publisher.stream_report().expect("checked at start");
    let s = report
        .stream_of(&format!("{prefix}.>"))
        .expect("main stream");
    assert_eq!(s.name, main.name);
    assert_eq!(
        (s.duplicate_window, s.storage, s.replicas, s.retention),
        (Duration::from_secs(10), Storage::File, 1, Retention::Limits)
    );
    assert_eq!(s.max_message_size, Some(4096));
    let r = report
        .stream_of(&format!("{routed}.events"))
        .expect("routed stream");
    assert_eq!(r.name, other.name);
    assert_eq!(
        report.warnings,
        vec![StreamWarning::DuplicateWindowShorterThanLease {
            stream: main.name.clone(),
            window: Duration::from_secs(10),
            lease: Duration::from_secs(60),
        }],
        "the routed stream's 2 min window covers the lease"
    );
}

#[tokio::test]
async fn an_unreachable_server_is_a_transient_start_error_within_the_timeout() {
    common::init_tracing();
    let port = outbox_test_support::free_port();
    let started = Instant::now();
    let err = NatsPublisher::builder(format!("nats://127.0.0.1:{port}"), "outbox")
        .connect_timeout(Duration::from_millis(500))
        .start()
        .await
        .expect_err("nothing listens there");
    assert!(err.is_transient(), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

/// The server's `max_payload` (1 MiB by default) would close the connection on a bigger
/// message; the publisher refuses it before sending, as a permanent error of that record, and
/// the rest of the batch goes through on the same connection.
#[tokio::test]
async fn a_message_over_max_payload_fails_alone_before_it_is_sent() {
    let url = require!(common::nats_url("max_payload"));
    let prefix = unique("maxpayload");
    let stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;
    let publisher = NatsPublisher::builder(&url, &prefix)
        .start()
        .await
        .expect("start");
    let max = publisher.client().server_info().max_payload;
    assert!(max > 0);
    let mut big = event("order", "o-big", 1);
    big.payload = Payload::new("application/octet-stream", vec![1u8; max]);
    let small = event("order", "o-small", 1);
    let results = publisher.publish(&[&big, &small]).await;
    let err = results[0].as_ref().expect_err("oversize");
    assert_eq!(
        (err.kind, err.class, err.scope),
        (
            PublishErrorKind::RecordTooLarge,
            ErrorClass::Permanent,
            FailureScope::Record
        ),
        "{err}"
    );
    assert!(results[1].is_ok(), "{:?}", results[1]);
    let later = publisher.publish(&[&event("order", "o-3", 1)]).await;
    assert!(later[0].is_ok(), "the connection survived: {:?}", later[0]);
    assert_eq!(stream.count().await, 2);
}

/// A subject no stream captures is `unknown_topic`, permanent, once the server confirms it
/// (no responders alone does not decide it); the other records of the batch are acknowledged.
#[tokio::test]
async fn a_subject_without_a_stream_is_a_confirmed_permanent_error() {
    let url = require!(common::nats_url("subject_without_stream"));
    let prefix = unique("withstream");
    let nowhere = unique("nowhere");
    let _stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;
    let publisher = NatsPublisher::builder(&url, &prefix)
        .route_aggregate("lost", &nowhere)
        .connect()
        .await
        .expect("connect");
    let lost = event("lost", "l-1", 1);
    let fine = event("order", "o-1", 1);
    let results = publisher.publish(&[&lost, &fine]).await;
    let err = results[0].as_ref().expect_err("no stream");
    assert_eq!(
        (err.kind, err.class, err.scope),
        (
            PublishErrorKind::UnknownTopic,
            ErrorClass::Permanent,
            FailureScope::Transport
        ),
        "{err}"
    );
    assert!(err.message.contains(&nowhere), "{}", err.message);
    assert!(results[1].is_ok());
}

/// With the aggregate id in the subject, an id that is not a subject token cannot be sent: a
/// permanent error of that record (parked for an operator), never a silent rename.
#[tokio::test]
async fn an_id_that_is_not_a_subject_token_is_a_serialization_error() {
    let url = require!(common::nats_url("bad_subject_token"));
    let prefix = unique("tokens");
    let stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;
    let publisher = NatsPublisher::builder(&url, &prefix)
        .subject_mapping(SubjectMapping::AggregateTypeAndId)
        .start()
        .await
        .expect("start");
    let bad = event("order", "o 1", 1);
    let good = event("order", "o-2", 1);
    let results = publisher.publish(&[&bad, &good]).await;
    let err = results[0].as_ref().expect_err("bad token");
    assert_eq!(
        (err.kind, err.class, err.scope),
        (
            PublishErrorKind::Serialization,
            ErrorClass::Permanent,
            FailureScope::Record
        ),
        "{err}"
    );
    let ack = results[1].as_ref().expect("good id");
    let AckMetadata::JetStream {
        sequence,
        subject: acked,
        ..
    } = ack
    else {
        panic!("not a JetStream acknowledgement: {ack:?}");
    };
    let (subject, _, _) = stream.read(*sequence).await;
    assert_eq!(&subject, acked);
    assert_eq!(subject, format!("{prefix}.order.o-2"));
}
