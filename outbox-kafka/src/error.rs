//! Mapping of rdkafka's typed errors onto [`PublishErrorKind`] and [`ErrorClass`].
//!
//! The mapping reads [`RDKafkaErrorCode`] values and [`KafkaError`] variants only, never message
//! text. Every code is covered by the table test in this module; codes that librdkafka adds later
//! fall into [`PublishErrorKind::Other`] (transient), which at worst costs a bounded number of
//! retries before the relay parks the event.
//!
//! | class | kinds and typical codes |
//! |---|---|
//! | permanent | `record_too_large` (`MSG_SIZE_TOO_LARGE`, `MESSAGE_BATCH_TOO_LARGE`), `unknown_topic` (`UNKNOWN_TOPIC_OR_PART`, `_UNKNOWN_TOPIC`, `_UNKNOWN_PARTITION`, `TOPIC_EXCEPTION`), `authorization` (`*_AUTHORIZATION_FAILED`, `_AUTHENTICATION`, `SASL_AUTHENTICATION_FAILED`), `invalid_record` (`INVALID_RECORD`, `INVALID_TIMESTAMP`, `POLICY_VIOLATION`, `_BAD_MSG`), `serialization` (`_KEY_SERIALIZATION`, `_VALUE_SERIALIZATION`), configuration errors (`other`, permanent) |
//! | transient | `timeout` (`_MSG_TIMED_OUT`, `REQUEST_TIMED_OUT`, `_TIMED_OUT`), `broker_unavailable` (`_TRANSPORT`, `_ALL_BROKERS_DOWN`, `NETWORK_EXCEPTION`, ...), `not_enough_replicas` (`NOT_ENOUGH_REPLICAS*`, `_ISR_INSUFF`), `leader_moved` (`NOT_LEADER_OR_FOLLOWER`, `LEADER_NOT_AVAILABLE`, fenced/unknown leader epoch), `queue_full`, `fatal` (the idempotent producer is in a fatal state; [`crate::KafkaPublisher`] rebuilds it), `other` |
//!
//! Besides its class, every error has a [`FailureScope`]: whose failure it is. **Transport**
//! (the broker's, not the record's; the relay spends no attempt and pauses as a whole):
//! timeouts (a record or a whole batch without a delivery report), transport failures and all
//! brokers down, missing leaders and replicas, a missing topic (also when it goes missing while
//! the publisher runs, see [`crate::KafkaPublisher`]), authorization, a full local queue, a
//! fatal producer state, a report lost because the producer went away (`Canceled`), and a
//! record held back behind its aggregate's failed predecessor. **Record** (the record's own;
//! it spends an attempt and is parked when permanent or past the limit): too large, invalid,
//! not serializable, configuration errors and anything unknown.
//!
//! "Too large" in a **delivery report** (`MSG_SIZE_TOO_LARGE`, `MESSAGE_BATCH_TOO_LARGE`) may be
//! the record's batch rather than the record: librdkafka fails every record of a batch the
//! broker refuses. [`crate::KafkaPublisher`] classes those by the record's own size against the
//! topic's `max.message.bytes` instead of by this table ([`crate::size`]); the table's
//! permanent class stays for a record librdkafka refuses before sending (over the producer's
//! `message.max.bytes`).

use outbox_core::{ErrorClass, FailureScope, PublishError, PublishErrorKind, SourceError};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// Kind and class of one librdkafka error code.
///
/// The class is usually `kind.default_class()`; configuration and protocol-level codes that no
/// retry can fix are [`PublishErrorKind::Other`] with a permanent class, and corrupt-message
/// codes are invalid records that stay transient (librdkafka retries them; a CRC error on the
/// wire does not make the record itself bad).
pub fn classify_code(code: RDKafkaErrorCode) -> (PublishErrorKind, ErrorClass) {
    use PublishErrorKind as K;
    use RDKafkaErrorCode as C;
    let kind = match code {
        // Deadlines.
        C::MessageTimedOut | C::OperationTimedOut | C::RequestTimedOut | C::TimedOutQueue => {
            K::Timeout
        }
        // The connection or the broker's availability.
        C::BrokerTransportFailure
        | C::AllBrokersDown
        | C::Resolve
        | C::BrokerDestroy
        | C::DestroyBroker
        | C::BrokerNotAvailable
        | C::NetworkException
        | C::CoordinatorLoadInProgress
        | C::CoordinatorNotAvailable
        | C::NotCoordinator
        | C::KafkaStorageError
        | C::ThrottlingQuotaExceeded
        | C::UnknownBroker
        | C::NodeUpdate
        | C::WaitCache
        | C::Retry
        | C::SSL
        | C::RebootstrapRequired
        | C::CriticalSystemResource => K::BrokerUnavailable,
        C::NotEnoughReplicas | C::NotEnoughReplicasAfterAppend | C::ISRInsufficient => {
            K::NotEnoughReplicas
        }
        C::LeaderNotAvailable
        | C::NotLeaderForPartition
        | C::FencedLeaderEpoch
        | C::UnknownLeaderEpoch
        | C::ReplicaNotAvailable
        | C::PreferredLeaderNotAvailable
        | C::EligibleLeadersNotAvailable
        | C::ReassignmentInProgress
        | C::StaleControllerEpoch
        | C::NotController
        | C::OffsetNotAvailable => K::LeaderMoved,
        C::QueueFull => K::QueueFull,
        C::MessageSizeTooLarge | C::MessageBatchTooLarge => K::RecordTooLarge,
        C::UnknownTopicOrPartition
        | C::UnknownTopic
        | C::UnknownPartition
        | C::UnknownTopicId
        | C::InvalidTopic => K::UnknownTopic,
        C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::GroupAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed
        | C::DelegationTokenAuthorizationFailed
        | C::Authentication
        | C::SaslAuthenticationFailed
        | C::UnsupportedSASLMechanism
        | C::IllegalSASLState => K::Authorization,
        C::InvalidRecord
        | C::InvalidTimestamp
        | C::PolicyViolation
        | C::BadMessage
        | C::BadCompression
        | C::UnsupportedCompressionType
        | C::UnsupportedForMessageFormat
        | C::InvalidMessageSize => K::InvalidRecord,
        // Corrupt on the wire: the record may be fine; librdkafka retried and gave up.
        C::InvalidMessage => return (K::InvalidRecord, ErrorClass::Transient),
        C::KeySerialization | C::ValueSerialization => K::Serialization,
        // The idempotent producer lost its guarantees and must be rebuilt.
        C::Fatal
        | C::OutOfOrderSequenceNumber
        | C::InvalidProducerEpoch
        | C::InvalidProducerIdMapping
        | C::ProducerFenced
        | C::Fenced
        | C::GaplessGuarantee
        | C::UnknownProducerId
        | C::InvalidTransactionalState => K::Fatal,
        // Configuration or protocol problems: retrying the same record cannot help.
        C::InvalidArgument
        | C::InvalidConfig
        | C::InvalidRequiredAcks
        | C::InvalidRequest
        | C::UnsupportedVersion
        | C::UnsupportedFeature
        | C::NotImplemented
        | C::UnknownProtocol
        | C::SecurityDisabled
        | C::NotConfigured => return (K::Other, ErrorClass::Permanent),
        // Another record of the same produce request was invalid; this one was fine.
        C::InvalidDifferentRecord => K::Other,
        // Purged by the client (shutdown or deadline): never written by this attempt.
        C::PurgeQueue | C::PurgeInflight => K::Timeout,
        _ => K::Other,
    };
    (kind, kind.default_class())
}

/// A [`PublishError`] for a Kafka error (enqueue or delivery report). Kind and class from
/// [`classify_code`]; the scope is the kind's default (see the module docs).
pub fn publish_error(err: &KafkaError) -> PublishError {
    let (kind, class) = match err {
        KafkaError::ClientConfig(..) => (PublishErrorKind::Other, ErrorClass::Permanent),
        // A NUL byte in the topic name or a header key: the event cannot be encoded.
        KafkaError::Nul(_) => (PublishErrorKind::Serialization, ErrorClass::Permanent),
        // The producer went away before it reported: whether the record was stored is unknown,
        // so this is a retry (at-least-once), never a success, and not the record's fault.
        KafkaError::Canceled => {
            return PublishError::new(PublishErrorKind::Other, err.to_string())
                .with_class(ErrorClass::Transient)
                .with_scope(FailureScope::Transport)
        }
        other => match other.rdkafka_error_code() {
            Some(code) => classify_code(code),
            None => (PublishErrorKind::Other, ErrorClass::Transient),
        },
    };
    PublishError::new(kind, err.to_string()).with_class(class)
}

/// [`publish_error`] for a record to `topic`, with the topic named in the message (an unknown
/// topic says so in words: librdkafka's own text does not name it).
pub fn publish_error_to(topic: &str, err: &KafkaError) -> PublishError {
    let mut e = publish_error(err);
    e.message = if e.kind == PublishErrorKind::UnknownTopic {
        format!(
            "topic {topic:?} does not exist on the broker: {}",
            e.message
        )
    } else {
        format!("topic {topic:?}: {}", e.message)
    };
    e
}

/// The error of a record to `topic` when the broker says the topic does not exist (asked after
/// the record timed out with `detail`).
pub fn unknown_topic(topic: &str, detail: &str) -> PublishError {
    PublishError::new(
        PublishErrorKind::UnknownTopic,
        format!(
            "topic {topic:?} does not exist on the broker (deleted, or not created again after \
             a broker reset); records to it fail until it exists ({detail})"
        ),
    )
}

/// `true` if the error means the producer instance is unusable and must be rebuilt.
pub fn is_fatal(err: &KafkaError) -> bool {
    matches!(
        err.rdkafka_error_code(),
        Some(code) if classify_code(code).0 == PublishErrorKind::Fatal
    )
}

/// Class of a consumer-side error (poll or commit).
pub fn source_error_class(err: &KafkaError) -> ErrorClass {
    match err {
        KafkaError::MessageConsumptionFatal(_) => ErrorClass::Permanent,
        KafkaError::ClientConfig(..) | KafkaError::Nul(_) => ErrorClass::Permanent,
        other => match other.rdkafka_error_code() {
            Some(code) => match classify_code(code) {
                (PublishErrorKind::Authorization, _) => ErrorClass::Permanent,
                (PublishErrorKind::Fatal, _) => ErrorClass::Permanent,
                (PublishErrorKind::Other, ErrorClass::Permanent) => ErrorClass::Permanent,
                // A topic that is missing now may be created; the engine backs off.
                _ => ErrorClass::Transient,
            },
            None => ErrorClass::Transient,
        },
    }
}

/// A [`SourceError`] for a consumer-side Kafka error.
pub fn source_error(context: &str, err: KafkaError) -> SourceError {
    SourceError::new(source_error_class(&err), format!("{context}: {err}")).with_source(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ErrorClass::{Permanent, Transient};
    use PublishErrorKind as K;
    use RDKafkaErrorCode as C;

    #[test]
    fn code_table() {
        let table: &[(RDKafkaErrorCode, PublishErrorKind, ErrorClass)] = &[
            // permanent, as the architecture requires
            (C::MessageSizeTooLarge, K::RecordTooLarge, Permanent),
            (C::MessageBatchTooLarge, K::RecordTooLarge, Permanent),
            (C::UnknownTopicOrPartition, K::UnknownTopic, Permanent),
            (C::UnknownTopic, K::UnknownTopic, Permanent),
            (C::UnknownPartition, K::UnknownTopic, Permanent),
            (C::UnknownTopicId, K::UnknownTopic, Permanent),
            (C::InvalidTopic, K::UnknownTopic, Permanent),
            (C::TopicAuthorizationFailed, K::Authorization, Permanent),
            (C::ClusterAuthorizationFailed, K::Authorization, Permanent),
            (C::GroupAuthorizationFailed, K::Authorization, Permanent),
            (
                C::TransactionalIdAuthorizationFailed,
                K::Authorization,
                Permanent,
            ),
            (C::Authentication, K::Authorization, Permanent),
            (C::SaslAuthenticationFailed, K::Authorization, Permanent),
            (C::UnsupportedSASLMechanism, K::Authorization, Permanent),
            (C::InvalidRecord, K::InvalidRecord, Permanent),
            (C::InvalidTimestamp, K::InvalidRecord, Permanent),
            (C::PolicyViolation, K::InvalidRecord, Permanent),
            (C::BadMessage, K::InvalidRecord, Permanent),
            (C::BadCompression, K::InvalidRecord, Permanent),
            (C::UnsupportedCompressionType, K::InvalidRecord, Permanent),
            (C::UnsupportedForMessageFormat, K::InvalidRecord, Permanent),
            (C::InvalidMessageSize, K::InvalidRecord, Permanent),
            (C::KeySerialization, K::Serialization, Permanent),
            (C::ValueSerialization, K::Serialization, Permanent),
            (C::InvalidArgument, K::Other, Permanent),
            (C::InvalidConfig, K::Other, Permanent),
            (C::InvalidRequiredAcks, K::Other, Permanent),
            (C::UnsupportedVersion, K::Other, Permanent),
            (C::UnsupportedFeature, K::Other, Permanent),
            (C::NotImplemented, K::Other, Permanent),
            // transient
            (C::MessageTimedOut, K::Timeout, Transient),
            (C::RequestTimedOut, K::Timeout, Transient),
            (C::OperationTimedOut, K::Timeout, Transient),
            (C::TimedOutQueue, K::Timeout, Transient),
            (C::PurgeQueue, K::Timeout, Transient),
            (C::PurgeInflight, K::Timeout, Transient),
            (C::BrokerTransportFailure, K::BrokerUnavailable, Transient),
            (C::AllBrokersDown, K::BrokerUnavailable, Transient),
            (C::Resolve, K::BrokerUnavailable, Transient),
            (C::BrokerNotAvailable, K::BrokerUnavailable, Transient),
            (C::NetworkException, K::BrokerUnavailable, Transient),
            (C::BrokerDestroy, K::BrokerUnavailable, Transient),
            (C::KafkaStorageError, K::BrokerUnavailable, Transient),
            (C::ThrottlingQuotaExceeded, K::BrokerUnavailable, Transient),
            (C::CoordinatorNotAvailable, K::BrokerUnavailable, Transient),
            (C::SSL, K::BrokerUnavailable, Transient),
            (C::NotEnoughReplicas, K::NotEnoughReplicas, Transient),
            (
                C::NotEnoughReplicasAfterAppend,
                K::NotEnoughReplicas,
                Transient,
            ),
            (C::ISRInsufficient, K::NotEnoughReplicas, Transient),
            (C::NotLeaderForPartition, K::LeaderMoved, Transient),
            (C::LeaderNotAvailable, K::LeaderMoved, Transient),
            (C::FencedLeaderEpoch, K::LeaderMoved, Transient),
            (C::UnknownLeaderEpoch, K::LeaderMoved, Transient),
            (C::ReplicaNotAvailable, K::LeaderMoved, Transient),
            (C::PreferredLeaderNotAvailable, K::LeaderMoved, Transient),
            (C::ReassignmentInProgress, K::LeaderMoved, Transient),
            (C::QueueFull, K::QueueFull, Transient),
            (C::InvalidMessage, K::InvalidRecord, Transient),
            (C::InvalidDifferentRecord, K::Other, Transient),
            (C::Fatal, K::Fatal, Transient),
            (C::OutOfOrderSequenceNumber, K::Fatal, Transient),
            (C::InvalidProducerEpoch, K::Fatal, Transient),
            (C::ProducerFenced, K::Fatal, Transient),
            (C::UnknownProducerId, K::Fatal, Transient),
            (C::GaplessGuarantee, K::Fatal, Transient),
            (C::Fail, K::Other, Transient),
            (C::Unknown, K::Other, Transient),
        ];
        for &(code, kind, class) in table {
            assert_eq!(classify_code(code), (kind, class), "{code:?}");
        }
    }

    /// Whose failure each error is: the broker's (no attempt spent, the relay pauses) or the
    /// record's own. The outage cases must all be the transport's.
    #[test]
    fn scope_table() {
        use FailureScope::{Record, Transport};
        let table: &[(KafkaError, FailureScope)] = &[
            // the broker is away, or a whole batch timed out
            (KafkaError::MessageProduction(C::MessageTimedOut), Transport),
            (KafkaError::MessageProduction(C::RequestTimedOut), Transport),
            (
                KafkaError::MessageProduction(C::BrokerTransportFailure),
                Transport,
            ),
            (KafkaError::MessageProduction(C::AllBrokersDown), Transport),
            (KafkaError::Global(C::AllBrokersDown), Transport),
            (
                KafkaError::MessageProduction(C::NetworkException),
                Transport,
            ),
            (
                KafkaError::MessageProduction(C::BrokerNotAvailable),
                Transport,
            ),
            (KafkaError::MessageProduction(C::PurgeInflight), Transport),
            (KafkaError::MessageProduction(C::PurgeQueue), Transport),
            // topic or leader missing
            (
                KafkaError::MessageProduction(C::UnknownTopicOrPartition),
                Transport,
            ),
            (KafkaError::MessageProduction(C::UnknownTopic), Transport),
            (
                KafkaError::MessageProduction(C::UnknownPartition),
                Transport,
            ),
            (
                KafkaError::MessageProduction(C::LeaderNotAvailable),
                Transport,
            ),
            (
                KafkaError::MessageProduction(C::NotLeaderForPartition),
                Transport,
            ),
            (
                KafkaError::MessageProduction(C::NotEnoughReplicas),
                Transport,
            ),
            (
                KafkaError::MessageProduction(C::TopicAuthorizationFailed),
                Transport,
            ),
            (KafkaError::MessageProduction(C::QueueFull), Transport),
            (KafkaError::MessageProduction(C::Fatal), Transport),
            (
                KafkaError::MessageProduction(C::UnknownProducerId),
                Transport,
            ),
            (KafkaError::Canceled, Transport),
            // the record's own
            (
                KafkaError::MessageProduction(C::MessageSizeTooLarge),
                Record,
            ),
            (KafkaError::MessageProduction(C::InvalidRecord), Record),
            (KafkaError::MessageProduction(C::InvalidMessage), Record),
            (KafkaError::MessageProduction(C::KeySerialization), Record),
            (KafkaError::MessageProduction(C::InvalidConfig), Record),
            (KafkaError::MessageProduction(C::Fail), Record),
            (
                KafkaError::Nul(std::ffi::CString::new(vec![b'a', 0]).unwrap_err()),
                Record,
            ),
        ];
        for (err, scope) in table {
            assert_eq!(publish_error(err).scope, *scope, "{err:?}");
        }
    }

    #[test]
    fn errors_to_a_topic_name_it() {
        let e = publish_error_to("orders", &KafkaError::MessageProduction(C::UnknownTopic));
        assert_eq!(e.kind, K::UnknownTopic);
        assert_eq!(e.scope, FailureScope::Transport);
        assert!(
            e.message.contains("\"orders\" does not exist"),
            "{}",
            e.message
        );
        let e = publish_error_to("orders", &KafkaError::MessageProduction(C::MessageTimedOut));
        assert_eq!(e.kind, K::Timeout);
        assert!(e.message.starts_with("topic \"orders\": "), "{}", e.message);
        let e = unknown_topic("payments", "no delivery report");
        assert_eq!(
            (e.kind, e.class, e.scope),
            (K::UnknownTopic, Permanent, FailureScope::Transport)
        );
        assert!(
            e.message.contains("\"payments\" does not exist"),
            "{}",
            e.message
        );
    }

    #[test]
    fn every_code_has_a_mapping_and_a_kind_that_agrees() {
        // Walk the whole numeric range librdkafka defines, so a code that is not in the table
        // above still gets a deliberate answer (and a panic-free one).
        for raw in -200..=200 {
            let Ok(resp) = rdkafka::types::RDKafkaRespErr::try_from(raw) else {
                continue;
            };
            let code: RDKafkaErrorCode = resp.into();
            let (kind, class) = classify_code(code);
            if class != kind.default_class() {
                assert!(
                    matches!(
                        (kind, class),
                        (K::Other, Permanent) | (K::InvalidRecord, Transient)
                    ),
                    "{code:?} overrides the class of {kind:?} unexpectedly"
                );
            }
        }
    }

    #[test]
    fn kafka_error_variants() {
        let cases: Vec<(KafkaError, PublishErrorKind, ErrorClass)> = vec![
            (
                KafkaError::MessageProduction(C::MessageSizeTooLarge),
                K::RecordTooLarge,
                Permanent,
            ),
            (
                KafkaError::MessageProduction(C::QueueFull),
                K::QueueFull,
                Transient,
            ),
            (
                KafkaError::MessageProduction(C::MessageTimedOut),
                K::Timeout,
                Transient,
            ),
            (
                KafkaError::MessageProduction(C::UnknownTopicOrPartition),
                K::UnknownTopic,
                Permanent,
            ),
            (KafkaError::MessageProduction(C::Fatal), K::Fatal, Transient),
            (KafkaError::Canceled, K::Other, Transient),
            (KafkaError::ClientCreation("x".into()), K::Other, Transient),
            (
                KafkaError::Global(C::AllBrokersDown),
                K::BrokerUnavailable,
                Transient,
            ),
            (
                KafkaError::Nul(std::ffi::CString::new(vec![b'a', 0]).unwrap_err()),
                K::Serialization,
                Permanent,
            ),
        ];
        for (err, kind, class) in cases {
            let e = publish_error(&err);
            assert_eq!((e.kind, e.class), (kind, class), "{err:?}");
            assert!(!e.message.is_empty());
        }
        assert!(is_fatal(&KafkaError::MessageProduction(C::Fatal)));
        assert!(is_fatal(&KafkaError::MessageProduction(
            C::OutOfOrderSequenceNumber
        )));
        assert!(!is_fatal(&KafkaError::MessageProduction(
            C::MessageTimedOut
        )));
        assert!(!is_fatal(&KafkaError::Canceled));
    }

    #[test]
    fn consumer_error_classes() {
        let cases = [
            (
                KafkaError::MessageConsumption(C::BrokerTransportFailure),
                Transient,
            ),
            (
                KafkaError::MessageConsumption(C::UnknownTopicOrPartition),
                Transient,
            ),
            (
                KafkaError::ConsumerCommit(C::RebalanceInProgress),
                Transient,
            ),
            (KafkaError::ConsumerCommit(C::IllegalGeneration), Transient),
            (
                KafkaError::ConsumerCommit(C::GroupAuthorizationFailed),
                Permanent,
            ),
            (KafkaError::MessageConsumptionFatal(C::Fatal), Permanent),
            (KafkaError::MessageConsumption(C::Fatal), Permanent),
        ];
        for (err, class) in cases {
            assert_eq!(source_error_class(&err), class, "{err:?}");
        }
    }
}
