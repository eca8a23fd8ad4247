//! Mapping of async-nats' typed errors onto [`PublishErrorKind`], [`ErrorClass`] and
//! [`FailureScope`](outbox_core::FailureScope), from error kinds and JetStream API error codes only, never message text.
//!
//! | async-nats signal | kind | class | scope |
//! |---|---|---|---|
//! | publish `TimedOut` (no `PubAck` within the delivery timeout) | `timeout` | transient | transport |
//! | publish `BrokenPipe` (the connection dropped the request) | `broker_unavailable` | transient | transport |
//! | publish `MaxAckPending` (the client's in-flight limit) | `queue_full` | transient | transport |
//! | publish `StreamNotFound` (no responders), the server says no stream has the subject | `unknown_topic` | permanent | transport |
//! | publish `StreamNotFound` while the JetStream API itself does not answer (a server starting) | `broker_unavailable` | transient | transport |
//! | API 10054 message exceeds maximum, 10097 header exceeds maximum | `record_too_large` | permanent | record |
//! | API 10059 stream not found, 10060 stream does not match | `unknown_topic` | permanent | transport |
//! | API 10077 store failed, 10047/10028 storage/memory exceeded, 10023 insufficient resources, 10002 account resources exceeded | `broker_unavailable` | transient | transport |
//! | API 10008 cluster not available, 10004/10005/10006 cluster incomplete/no peers/not active, 10076/10039 JetStream not enabled | `broker_unavailable` | transient | transport |
//! | API 10009 not leader | `leader_moved` | transient | transport |
//! | any other API code, an unreadable `PubAck` | `other` | transient | record |
//! | payload and headers over the server's `max_payload` (checked before sending: the server would close the connection) | `record_too_large` | permanent | record |
//! | an aggregate type or id that is not a subject token, a header NATS cannot carry | `serialization` | permanent | record |
//!
//! A record whose outcome is unknown (a timeout, a dropped connection) may have been stored:
//! the relay re-sends it with the same `Nats-Msg-Id`, which the stream's duplicate window drops
//! ([`crate::StreamReport`] warns when that window is shorter than the relay's lease).

use async_nats::jetstream::context::{PublishError as NatsPublishError, PublishErrorKind as K};
use outbox_core::{ErrorClass, PublishError, PublishErrorKind, SourceError};

/// Kind and class of a JetStream API error code returned in place of a `PubAck`.
pub fn classify_api_code(code: u64) -> (PublishErrorKind, ErrorClass) {
    use PublishErrorKind as P;
    let kind = match code {
        10054 | 10097 => P::RecordTooLarge,
        10059 | 10060 => P::UnknownTopic,
        10077 | 10047 | 10028 | 10023 | 10002 => P::BrokerUnavailable,
        10008 | 10004 | 10005 | 10006 | 10076 | 10039 => P::BrokerUnavailable,
        10009 => P::LeaderMoved,
        _ => P::Other,
    };
    (kind, kind.default_class())
}

/// A [`PublishError`] of `kind` with its default class and scope, naming `subject`.
pub(crate) fn error_on(subject: &str, kind: PublishErrorKind, detail: &str) -> PublishError {
    PublishError::new(kind, format!("subject {subject:?}: {detail}"))
}

/// The outbox error of a failed JetStream publish to `subject`. `StreamNotFound` (no
/// responders) is reported as a missing stream here; the publisher asks the server before it
/// reports that (see [`crate::NatsPublisher`]), since a server that is starting answers a
/// publish the same way.
pub fn publish_error(subject: &str, err: &NatsPublishError) -> PublishError {
    let (kind, class) = match err.kind() {
        K::TimedOut => (PublishErrorKind::Timeout, ErrorClass::Transient),
        K::BrokenPipe => (PublishErrorKind::BrokerUnavailable, ErrorClass::Transient),
        K::MaxAckPending => (PublishErrorKind::QueueFull, ErrorClass::Transient),
        K::StreamNotFound => (PublishErrorKind::UnknownTopic, ErrorClass::Permanent),
        K::WrongLastMessageId | K::WrongLastSequence => {
            (PublishErrorKind::Other, ErrorClass::Transient)
        }
        K::Other => match api_code(err) {
            Some(code) => classify_api_code(code),
            // The request could not be handed to the connection (the client is closed) or the
            // answer was unreadable.
            None => (PublishErrorKind::Other, ErrorClass::Transient),
        },
        // A kind added by a later async-nats: retried (at worst a bounded number of attempts).
        #[allow(unreachable_patterns)]
        _ => (PublishErrorKind::Other, ErrorClass::Transient),
    };
    let detail = match err.kind() {
        K::StreamNotFound => "no JetStream stream captures this subject".to_owned(),
        _ => err.to_string(),
    };
    error_on(subject, kind, &detail).with_class(class)
}

/// The JetStream API error code behind a failed publish, if the server sent one.
pub fn api_code(err: &NatsPublishError) -> Option<u64> {
    let source = std::error::Error::source(err)?;
    source
        .downcast_ref::<async_nats::jetstream::Error>()
        .map(|e| e.error_code().0)
}

/// A [`SourceError`] for a consumer-side failure: transient unless `permanent`.
pub(crate) fn source_error(
    context: &str,
    err: impl std::error::Error + Send + Sync + 'static,
    permanent: bool,
) -> SourceError {
    let class = if permanent {
        ErrorClass::Permanent
    } else {
        ErrorClass::Transient
    };
    SourceError::new(class, format!("{context}: {err}")).with_source(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::FailureScope;
    use ErrorClass::{Permanent, Transient};
    use FailureScope::{Record, Transport};
    use PublishErrorKind as P;

    #[test]
    fn api_code_table() {
        let table: &[(u64, PublishErrorKind, ErrorClass, FailureScope)] = &[
            (10054, P::RecordTooLarge, Permanent, Record),
            (10097, P::RecordTooLarge, Permanent, Record),
            (10059, P::UnknownTopic, Permanent, Transport),
            (10060, P::UnknownTopic, Permanent, Transport),
            (10077, P::BrokerUnavailable, Transient, Transport),
            (10047, P::BrokerUnavailable, Transient, Transport),
            (10028, P::BrokerUnavailable, Transient, Transport),
            (10023, P::BrokerUnavailable, Transient, Transport),
            (10002, P::BrokerUnavailable, Transient, Transport),
            (10008, P::BrokerUnavailable, Transient, Transport),
            (10004, P::BrokerUnavailable, Transient, Transport),
            (10005, P::BrokerUnavailable, Transient, Transport),
            (10006, P::BrokerUnavailable, Transient, Transport),
            (10076, P::BrokerUnavailable, Transient, Transport),
            (10039, P::BrokerUnavailable, Transient, Transport),
            (10009, P::LeaderMoved, Transient, Transport),
            (10070, P::Other, Transient, Record),
            (10071, P::Other, Transient, Record),
            (1, P::Other, Transient, Record),
        ];
        for &(code, kind, class, scope) in table {
            assert_eq!(classify_api_code(code), (kind, class), "{code}");
            assert_eq!(kind.default_scope(), scope, "{code}");
        }
    }

    fn api_error(code: u64) -> async_nats::jetstream::Error {
        serde_json::from_value(serde_json::json!({
            "code": 400, "err_code": code, "description": "from the server"
        }))
        .expect("a JetStream API error")
    }

    #[test]
    fn publish_error_kind_table() {
        let table: Vec<(NatsPublishError, PublishErrorKind, ErrorClass, FailureScope)> = vec![
            (
                NatsPublishError::new(K::TimedOut),
                P::Timeout,
                Transient,
                Transport,
            ),
            (
                NatsPublishError::new(K::BrokenPipe),
                P::BrokerUnavailable,
                Transient,
                Transport,
            ),
            (
                NatsPublishError::new(K::MaxAckPending),
                P::QueueFull,
                Transient,
                Transport,
            ),
            (
                NatsPublishError::new(K::StreamNotFound),
                P::UnknownTopic,
                Permanent,
                Transport,
            ),
            (
                NatsPublishError::new(K::WrongLastSequence),
                P::Other,
                Transient,
                Record,
            ),
            (NatsPublishError::new(K::Other), P::Other, Transient, Record),
            (
                NatsPublishError::with_source(K::Other, api_error(10054)),
                P::RecordTooLarge,
                Permanent,
                Record,
            ),
            (
                NatsPublishError::with_source(K::Other, api_error(10077)),
                P::BrokerUnavailable,
                Transient,
                Transport,
            ),
            (
                NatsPublishError::with_source(K::Other, api_error(10060)),
                P::UnknownTopic,
                Permanent,
                Transport,
            ),
        ];
        for (err, kind, class, scope) in table {
            let e = publish_error("outbox.order", &err);
            assert_eq!((e.kind, e.class, e.scope), (kind, class, scope), "{err:?}");
            assert!(e.message.contains("\"outbox.order\""), "{}", e.message);
        }
        assert_eq!(
            api_code(&NatsPublishError::with_source(K::Other, api_error(10054))),
            Some(10054)
        );
        assert_eq!(api_code(&NatsPublishError::new(K::TimedOut)), None);
    }

    /// The outage errors are the transport's and transient, and leave the delivery open
    /// (the relay re-sends; the duplicate window drops a copy the server already stored).
    #[test]
    fn outage_errors_are_transient_transport_errors() {
        for kind in [K::TimedOut, K::BrokenPipe] {
            let e = publish_error("s", &NatsPublishError::new(kind));
            assert_eq!((e.class, e.scope), (Transient, Transport), "{kind:?}");
            assert!(e.kind.delivery_uncertain(), "{kind:?}");
        }
    }
}
