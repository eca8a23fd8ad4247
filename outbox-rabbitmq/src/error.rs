//! Mapping of lapin's typed errors and AMQP reply codes onto [`PublishErrorKind`],
//! [`ErrorClass`] and [`FailureScope`](outbox_core::FailureScope), from error kinds and reply codes only, never text.
//!
//! | signal | kind | class | scope |
//! |---|---|---|---|
//! | confirm `ack` after a `basic.return` 312 NO_ROUTE (mandatory: no queue bound for the routing key) | `unknown_topic` | permanent | transport |
//! | confirm `nack` (the broker could not store it: a queue process failed, a quorum queue without a majority, `x-overflow = reject-publish`) | `broker_unavailable` | transient | transport |
//! | no confirm within the delivery timeout | `timeout` | transient | transport |
//! | connection refused or lost, channel or connection closed, missed heartbeats | `broker_unavailable` | transient | transport |
//! | 320 CONNECTION_FORCED, 405 RESOURCE_LOCKED, 506 RESOURCE_ERROR, 541 INTERNAL_ERROR | `broker_unavailable` | transient | transport |
//! | 404 NOT_FOUND (the exchange is missing) | `unknown_topic` | permanent | transport |
//! | 403 ACCESS_REFUSED, 402 INVALID_PATH, 530 NOT_ALLOWED | `authorization` | permanent | transport |
//! | 311 CONTENT_TOO_LARGE, a message over `max_message_bytes` (checked before sending: the broker closes the channel on it) | `record_too_large` | permanent | record |
//! | 406 PRECONDITION_FAILED on a publish | `invalid_record` | permanent | record |
//! | 501–505 frame, syntax, command, channel and unexpected-frame errors | `fatal` (the channel is replaced) | transient | transport |
//! | 540 NOT_IMPLEMENTED, a client without executor or reactor | `other` | permanent | record |
//! | the channel limit reached | `queue_full` | transient | transport |
//! | anything else | `other` | transient | record |

use lapin::ErrorKind;
use outbox_core::{ErrorClass, PublishError, PublishErrorKind, SourceError};

/// Kind and class of an AMQP reply code.
pub fn classify_reply_code(code: u16) -> (PublishErrorKind, ErrorClass) {
    use PublishErrorKind as P;
    let kind = match code {
        312 | 404 => P::UnknownTopic,
        311 => P::RecordTooLarge,
        403 | 402 | 530 => P::Authorization,
        406 => P::InvalidRecord,
        320 | 405 | 506 | 541 => P::BrokerUnavailable,
        501..=505 => P::Fatal,
        540 => return (P::Other, ErrorClass::Permanent),
        _ => P::Other,
    };
    (kind, kind.default_class())
}

/// Kind and class of a lapin error.
pub fn classify(err: &lapin::Error) -> (PublishErrorKind, ErrorClass) {
    use PublishErrorKind as P;
    match err.kind() {
        ErrorKind::ProtocolError(e) => classify_reply_code(e.get_id()),
        ErrorKind::IOError(_)
        | ErrorKind::InvalidConnectionState(_)
        | ErrorKind::InvalidChannelState(..)
        | ErrorKind::MissingHeartbeatError => (P::BrokerUnavailable, ErrorClass::Transient),
        ErrorKind::InvalidChannel(_) => (P::Fatal, ErrorClass::Transient),
        ErrorKind::ChannelsLimitReached => (P::QueueFull, ErrorClass::Transient),
        ErrorKind::NoConfiguredExecutor | ErrorKind::NoConfiguredReactor => {
            (P::Other, ErrorClass::Permanent)
        }
        _ => (P::Other, ErrorClass::Transient),
    }
}

/// The outbox error of a lapin error on the way to `exchange`.
pub fn publish_error(exchange: &str, err: &lapin::Error) -> PublishError {
    let (kind, class) = classify(err);
    PublishError::new(kind, format!("exchange {exchange:?}: {err}")).with_class(class)
}

/// The outbox error of a message the broker returned (`basic.return`) for `routing_key`.
pub fn returned(
    exchange: &str,
    routing_key: &str,
    reply_code: u16,
    reply_text: &str,
) -> PublishError {
    let (kind, class) = classify_reply_code(reply_code);
    PublishError::new(
        kind,
        format!(
            "exchange {exchange:?} returned the message for routing key {routing_key:?} \
             ({reply_code} {reply_text}): no queue is bound for it, so it would have been \
             dropped; bind a queue or route the aggregate type elsewhere"
        ),
    )
    .with_class(class)
}

/// The outbox error of a negative confirm.
pub fn nacked(exchange: &str) -> PublishError {
    PublishError::new(
        PublishErrorKind::BrokerUnavailable,
        format!(
            "exchange {exchange:?}: the broker refused to store the message (basic.nack: a \
             queue could not accept it)"
        ),
    )
}

/// A [`SourceError`] of a lapin error on the consuming side: permanent for missing queues,
/// refused access and unsupported arguments, transient otherwise.
pub(crate) fn source_error(context: &str, err: lapin::Error) -> SourceError {
    let class = match classify(&err) {
        (PublishErrorKind::UnknownTopic | PublishErrorKind::Authorization, _) => {
            ErrorClass::Permanent
        }
        (PublishErrorKind::InvalidRecord, _) => ErrorClass::Permanent,
        (_, class) => class,
    };
    SourceError::new(class, format!("{context}: {err}")).with_source(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPHardError, AMQPSoftError};
    use outbox_core::FailureScope::{self, Record, Transport};
    use ErrorClass::{Permanent, Transient};
    use PublishErrorKind as P;

    #[test]
    fn reply_code_table() {
        let table: &[(u16, PublishErrorKind, ErrorClass, FailureScope)] = &[
            (312, P::UnknownTopic, Permanent, Transport),
            (404, P::UnknownTopic, Permanent, Transport),
            (311, P::RecordTooLarge, Permanent, Record),
            (403, P::Authorization, Permanent, Transport),
            (402, P::Authorization, Permanent, Transport),
            (530, P::Authorization, Permanent, Transport),
            (406, P::InvalidRecord, Permanent, Record),
            (320, P::BrokerUnavailable, Transient, Transport),
            (405, P::BrokerUnavailable, Transient, Transport),
            (506, P::BrokerUnavailable, Transient, Transport),
            (541, P::BrokerUnavailable, Transient, Transport),
            (501, P::Fatal, Transient, Transport),
            (502, P::Fatal, Transient, Transport),
            (503, P::Fatal, Transient, Transport),
            (504, P::Fatal, Transient, Transport),
            (505, P::Fatal, Transient, Transport),
            (540, P::Other, Permanent, Record),
            (313, P::Other, Transient, Record),
            (999, P::Other, Transient, Record),
        ];
        for &(code, kind, class, scope) in table {
            assert_eq!(classify_reply_code(code), (kind, class), "{code}");
            assert_eq!(kind.default_scope(), scope, "{code}");
        }
    }

    fn protocol(kind: AMQPErrorKind) -> lapin::Error {
        ErrorKind::ProtocolError(AMQPError::new(kind, "from the broker".into())).into()
    }

    #[test]
    fn lapin_error_table() {
        let io = |k| -> lapin::Error {
            ErrorKind::IOError(std::sync::Arc::new(std::io::Error::from(k))).into()
        };
        let table: Vec<(lapin::Error, PublishErrorKind, ErrorClass, FailureScope)> = vec![
            (
                io(std::io::ErrorKind::ConnectionRefused),
                P::BrokerUnavailable,
                Transient,
                Transport,
            ),
            (
                io(std::io::ErrorKind::ConnectionReset),
                P::BrokerUnavailable,
                Transient,
                Transport,
            ),
            (
                ErrorKind::MissingHeartbeatError.into(),
                P::BrokerUnavailable,
                Transient,
                Transport,
            ),
            (
                ErrorKind::InvalidConnectionState(lapin::ConnectionState::Closed).into(),
                P::BrokerUnavailable,
                Transient,
                Transport,
            ),
            (
                ErrorKind::InvalidChannelState(lapin::ChannelState::Closed, "basic.publish").into(),
                P::BrokerUnavailable,
                Transient,
                Transport,
            ),
            (
                ErrorKind::ChannelsLimitReached.into(),
                P::QueueFull,
                Transient,
                Transport,
            ),
            (
                ErrorKind::InvalidChannel(3).into(),
                P::Fatal,
                Transient,
                Transport,
            ),
            (
                ErrorKind::NoConfiguredExecutor.into(),
                P::Other,
                Permanent,
                Record,
            ),
            (
                protocol(AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)),
                P::UnknownTopic,
                Permanent,
                Transport,
            ),
            (
                protocol(AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)),
                P::Authorization,
                Permanent,
                Transport,
            ),
            (
                protocol(AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)),
                P::InvalidRecord,
                Permanent,
                Record,
            ),
            (
                protocol(AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED)),
                P::BrokerUnavailable,
                Transient,
                Transport,
            ),
            (
                protocol(AMQPErrorKind::Hard(AMQPHardError::CHANNELERROR)),
                P::Fatal,
                Transient,
                Transport,
            ),
        ];
        for (err, kind, class, scope) in table {
            let e = publish_error("orders", &err);
            assert_eq!((e.kind, e.class, e.scope), (kind, class, scope), "{err:?}");
            assert!(e.message.contains("\"orders\""), "{}", e.message);
        }
    }

    #[test]
    fn returns_and_nacks() {
        let e = returned("orders", "order", 312, "NO_ROUTE");
        assert_eq!(
            (e.kind, e.class, e.scope),
            (P::UnknownTopic, Permanent, Transport)
        );
        assert!(e.message.contains("\"order\"") && e.message.contains("NO_ROUTE"));
        assert!(
            !e.kind.delivery_uncertain(),
            "a returned message was not stored"
        );
        let e = nacked("orders");
        assert_eq!(
            (e.kind, e.class, e.scope),
            (P::BrokerUnavailable, Transient, Transport)
        );
    }

    #[test]
    fn consumer_side_classes() {
        let missing = source_error(
            "consume",
            protocol(AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)),
        );
        assert_eq!(missing.class, Permanent);
        let lost = source_error("consume", ErrorKind::MissingHeartbeatError.into());
        assert_eq!(lost.class, Transient);
    }
}
