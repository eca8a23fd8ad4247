//! Error taxonomy. Every error carries its retry class.
//!
//! Adapters map their driver's typed signals (sqlx `DatabaseError::kind()`, rdkafka
//! `RDKafkaErrorCode`) into these kinds; the relay and the consumer engine decide on the class
//! only, never on message text.

use std::fmt;

/// Whether retrying the same operation can succeed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ErrorClass {
    /// May succeed later without a change (timeouts, broker unavailable, leader moves,
    /// serialization conflicts, connection loss).
    Transient,
    /// Will fail again until something is changed by a person (record too large, unknown topic,
    /// authorization, invalid record, schema violation).
    Permanent,
}

impl ErrorClass {
    /// `"transient"` or `"permanent"`, as used in metric labels and stored errors.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Transient => "transient",
            Self::Permanent => "permanent",
        }
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Anything that knows its retry class.
pub trait Classify {
    /// The retry class.
    fn class(&self) -> ErrorClass;
    /// Shorthand for `class() == Transient`.
    fn is_transient(&self) -> bool {
        self.class() == ErrorClass::Transient
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong when publishing one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PublishErrorKind {
    /// No acknowledgement within the delivery timeout.
    Timeout,
    /// Broker or transport unavailable.
    BrokerUnavailable,
    /// Not enough in-sync replicas to satisfy `acks=all`.
    NotEnoughReplicas,
    /// Partition leadership moved.
    LeaderMoved,
    /// The producer's local queue is full.
    QueueFull,
    /// The record exceeds the broker or topic size limit.
    RecordTooLarge,
    /// The topic or partition does not exist (and auto-creation is off).
    UnknownTopic,
    /// Not authorized to write.
    Authorization,
    /// The broker rejected the record as invalid.
    InvalidRecord,
    /// The event cannot be encoded for the transport (contract violation).
    Serialization,
    /// The producer is in a fatal state and must be rebuilt.
    Fatal,
    /// Anything else.
    Other,
}

impl PublishErrorKind {
    /// The default class of this kind.
    pub const fn default_class(self) -> ErrorClass {
        match self {
            Self::Timeout
            | Self::BrokerUnavailable
            | Self::NotEnoughReplicas
            | Self::LeaderMoved
            | Self::QueueFull
            | Self::Fatal
            | Self::Other => ErrorClass::Transient,
            Self::RecordTooLarge
            | Self::UnknownTopic
            | Self::Authorization
            | Self::InvalidRecord
            | Self::Serialization => ErrorClass::Permanent,
        }
    }

    /// Whose failure this kind is by default: the record's own, or the transport's (broker
    /// down, topic or leader missing, not authorized, a timeout). Transport failures do not
    /// spend a record's attempts: the relay backs off as a whole until the broker answers.
    pub const fn default_scope(self) -> FailureScope {
        match self {
            Self::Timeout
            | Self::BrokerUnavailable
            | Self::NotEnoughReplicas
            | Self::LeaderMoved
            | Self::QueueFull
            | Self::UnknownTopic
            | Self::Authorization
            | Self::Fatal => FailureScope::Transport,
            Self::RecordTooLarge | Self::InvalidRecord | Self::Serialization | Self::Other => {
                FailureScope::Record
            }
        }
    }

    /// Whether a failure of this kind leaves open that the broker stored the record (the
    /// acknowledgement may have been lost): a timeout, a transport failure after sending, a
    /// fatal producer state, anything unknown. `false` only where the broker or the client
    /// certainly refused it.
    pub const fn delivery_uncertain(self) -> bool {
        !matches!(
            self,
            Self::QueueFull
                | Self::RecordTooLarge
                | Self::UnknownTopic
                | Self::Authorization
                | Self::InvalidRecord
                | Self::Serialization
                | Self::LeaderMoved
        )
    }

    /// Parses [`as_str`](Self::as_str).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "timeout" => Self::Timeout,
            "broker_unavailable" => Self::BrokerUnavailable,
            "not_enough_replicas" => Self::NotEnoughReplicas,
            "leader_moved" => Self::LeaderMoved,
            "queue_full" => Self::QueueFull,
            "record_too_large" => Self::RecordTooLarge,
            "unknown_topic" => Self::UnknownTopic,
            "authorization" => Self::Authorization,
            "invalid_record" => Self::InvalidRecord,
            "serialization" => Self::Serialization,
            "fatal" => Self::Fatal,
            "other" => Self::Other,
            _ => return None,
        })
    }

    /// Stable snake_case name, used in metrics and stored errors.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::BrokerUnavailable => "broker_unavailable",
            Self::NotEnoughReplicas => "not_enough_replicas",
            Self::LeaderMoved => "leader_moved",
            Self::QueueFull => "queue_full",
            Self::RecordTooLarge => "record_too_large",
            Self::UnknownTopic => "unknown_topic",
            Self::Authorization => "authorization",
            Self::InvalidRecord => "invalid_record",
            Self::Serialization => "serialization",
            Self::Fatal => "fatal",
            Self::Other => "other",
        }
    }
}

/// Whose failure a publish error is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum FailureScope {
    /// The record's own failure (too large, invalid, not encodable): it spends the record's
    /// attempts, and parks it when permanent or past the attempt limit.
    Record,
    /// The transport's failure (broker unreachable, a timeout, topic or leader missing, not
    /// authorized): the record is not at fault, so no attempt is spent and it is never parked
    /// for it; the relay backs off as a whole (circuit breaker) and resumes when the broker
    /// answers.
    Transport,
}

impl FailureScope {
    /// `"record"` or `"transport"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Record => "record",
            Self::Transport => "transport",
        }
    }
}

/// A failed publication of one event.
#[derive(Debug, Clone, thiserror::Error)]
#[error("publish failed ({kind}, {class}): {message}", kind = kind.as_str())]
pub struct PublishError {
    /// What went wrong.
    pub kind: PublishErrorKind,
    /// Retry class (usually `kind.default_class()`).
    pub class: ErrorClass,
    /// Whose failure it is (usually `kind.default_scope()`).
    pub scope: FailureScope,
    /// Human-readable detail from the transport. Never contains the payload.
    pub message: String,
}

impl PublishError {
    /// An error of `kind` with its default class.
    pub fn new(kind: PublishErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            class: kind.default_class(),
            scope: kind.default_scope(),
            message: message.into(),
        }
    }

    /// Overrides the class.
    pub fn with_class(mut self, class: ErrorClass) -> Self {
        self.class = class;
        self
    }

    /// Overrides the scope.
    pub fn with_scope(mut self, scope: FailureScope) -> Self {
        self.scope = scope;
        self
    }
}

impl Classify for PublishError {
    fn class(&self) -> ErrorClass {
        self.class
    }
}

/// Kind of a storage error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// Connection lost, pool exhausted or timed out.
    Connection,
    /// Serialization failure or deadlock; retry the transaction.
    Conflict,
    /// A constraint was violated (e.g. duplicate event id).
    Constraint,
    /// The envelope failed validation.
    Validation,
    /// Refused by backpressure: the backlog is above the configured threshold.
    Backpressure,
    /// The named event does not exist or is not in the required state.
    NotFound,
    /// The claim token no longer owns the rows (lease expired and re-claimed).
    LeaseLost,
    /// Bad configuration (identifiers, durations).
    Configuration,
    /// Schema missing or out of date.
    Schema,
    /// Anything else.
    Other,
}

impl StoreErrorKind {
    /// Default retry class of the kind.
    pub const fn default_class(self) -> ErrorClass {
        match self {
            Self::Connection | Self::Conflict | Self::Backpressure | Self::LeaseLost => {
                ErrorClass::Transient
            }
            Self::Constraint
            | Self::Validation
            | Self::NotFound
            | Self::Configuration
            | Self::Schema
            | Self::Other => ErrorClass::Permanent,
        }
    }

    /// Stable snake_case name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Connection => "connection",
            Self::Conflict => "conflict",
            Self::Constraint => "constraint",
            Self::Validation => "validation",
            Self::Backpressure => "backpressure",
            Self::NotFound => "not_found",
            Self::LeaseLost => "lease_lost",
            Self::Configuration => "configuration",
            Self::Schema => "schema",
            Self::Other => "other",
        }
    }
}

/// An error from an [`crate::OutboxStore`] or [`crate::InboxStore`].
#[derive(Debug, thiserror::Error)]
#[error("store error ({kind}, {class}): {message}", kind = kind.as_str())]
pub struct StoreError {
    /// What went wrong.
    pub kind: StoreErrorKind,
    /// Retry class.
    pub class: ErrorClass,
    /// Detail.
    pub message: String,
    /// Underlying driver error, if any.
    #[source]
    pub source: Option<BoxError>,
}

impl StoreError {
    /// An error of `kind` with its default class.
    pub fn new(kind: StoreErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            class: kind.default_class(),
            message: message.into(),
            source: None,
        }
    }

    /// Attaches the underlying error.
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// Overrides the class.
    pub fn with_class(mut self, class: ErrorClass) -> Self {
        self.class = class;
        self
    }
}

impl Classify for StoreError {
    fn class(&self) -> ErrorClass {
        self.class
    }
}

impl From<crate::envelope::ValidationError> for StoreError {
    fn from(e: crate::envelope::ValidationError) -> Self {
        StoreError::new(StoreErrorKind::Validation, e.to_string()).with_source(e)
    }
}

/// What went wrong in a [`crate::MessageSource`], where the engine's reaction differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum SourceErrorKind {
    /// Anything else: the class decides (transient: back off and retry; permanent: stop).
    #[default]
    Other,
    /// A commit was refused because the group rebalanced (member fenced, generation moved,
    /// assignment lost). The engine drops those commits and polls again, which serves the
    /// rebalance; what they covered is redelivered to the partitions' owner.
    Rebalanced,
    /// The committed offset fell below the earliest available offset: records were lost to
    /// retention before this consumer read them. Permanent: the engine stops.
    RetentionGap,
}

impl SourceErrorKind {
    /// Stable name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Other => "other",
            Self::Rebalanced => "rebalanced",
            Self::RetentionGap => "retention_gap",
        }
    }
}

/// An error reading from a [`crate::MessageSource`] or committing its offsets.
#[derive(Debug, thiserror::Error)]
#[error("message source error ({class}, {kind}): {message}", kind = kind.as_str())]
pub struct SourceError {
    /// What went wrong, where it matters.
    pub kind: SourceErrorKind,
    /// Retry class.
    pub class: ErrorClass,
    /// Detail.
    pub message: String,
    /// Underlying error.
    #[source]
    pub source: Option<BoxError>,
}

impl SourceError {
    /// A new error of kind [`SourceErrorKind::Other`].
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        Self {
            kind: SourceErrorKind::Other,
            class,
            message: message.into(),
            source: None,
        }
    }

    /// Attaches the underlying error.
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// A commit refused by a rebalance (transient; see [`SourceErrorKind::Rebalanced`]).
    pub fn rebalanced(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Transient, message).with_kind(SourceErrorKind::Rebalanced)
    }

    /// Records lost to retention (permanent; see [`SourceErrorKind::RetentionGap`]).
    pub fn retention_gap(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Permanent, message).with_kind(SourceErrorKind::RetentionGap)
    }

    /// Sets the kind.
    pub fn with_kind(mut self, kind: SourceErrorKind) -> Self {
        self.kind = kind;
        self
    }
}

impl Classify for SourceError {
    fn class(&self) -> ErrorClass {
        self.class
    }
}

/// Invalid configuration, reported by `build()` methods.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(pub String);

impl ConfigError {
    /// A new configuration error.
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_kind_classification_table() {
        use ErrorClass::*;
        use FailureScope::{Record, Transport};
        use PublishErrorKind::*;
        // kind, class, scope, delivery uncertain
        let table = [
            (Timeout, Transient, Transport, true),
            (BrokerUnavailable, Transient, Transport, true),
            (NotEnoughReplicas, Transient, Transport, true),
            (LeaderMoved, Transient, Transport, false),
            (QueueFull, Transient, Transport, false),
            (Fatal, Transient, Transport, true),
            (Other, Transient, Record, true),
            (RecordTooLarge, Permanent, Record, false),
            (UnknownTopic, Permanent, Transport, false),
            (Authorization, Permanent, Transport, false),
            (InvalidRecord, Permanent, Record, false),
            (Serialization, Permanent, Record, false),
        ];
        for (kind, class, scope, uncertain) in table {
            assert_eq!(kind.default_class(), class, "{kind:?}");
            assert_eq!(kind.default_scope(), scope, "{kind:?}");
            assert_eq!(kind.delivery_uncertain(), uncertain, "{kind:?}");
            assert_eq!(PublishErrorKind::parse(kind.as_str()), Some(kind));
            let e = PublishError::new(kind, "x");
            assert_eq!((e.class(), e.scope), (class, scope));
        }
        assert_eq!(PublishErrorKind::parse("nonsense"), None);
        assert_eq!(
            PublishError::new(Timeout, "x").with_scope(Record).scope,
            Record
        );
        assert!(PublishError::new(Other, "x").with_class(Permanent).class() == Permanent);
    }

    #[test]
    fn store_kind_classification_table() {
        use ErrorClass::*;
        use StoreErrorKind::*;
        let table = [
            (Connection, Transient),
            (Conflict, Transient),
            (Backpressure, Transient),
            (LeaseLost, Transient),
            (Constraint, Permanent),
            (Validation, Permanent),
            (NotFound, Permanent),
            (Configuration, Permanent),
            (Schema, Permanent),
            (Other, Permanent),
        ];
        for (kind, class) in table {
            assert_eq!(StoreError::new(kind, "x").class(), class, "{kind:?}");
        }
    }

    /// The names are metric labels and stored values: fixed.
    #[test]
    fn names_are_fixed() {
        assert_eq!(ErrorClass::Transient.as_str(), "transient");
        assert_eq!(ErrorClass::Permanent.to_string(), "permanent");
        assert_eq!(FailureScope::Record.as_str(), "record");
        assert_eq!(FailureScope::Transport.as_str(), "transport");
        let store_kinds = [
            (StoreErrorKind::Connection, "connection"),
            (StoreErrorKind::Conflict, "conflict"),
            (StoreErrorKind::Constraint, "constraint"),
            (StoreErrorKind::Validation, "validation"),
            (StoreErrorKind::Backpressure, "backpressure"),
            (StoreErrorKind::NotFound, "not_found"),
            (StoreErrorKind::LeaseLost, "lease_lost"),
            (StoreErrorKind::Configuration, "configuration"),
            (StoreErrorKind::Schema, "schema"),
            (StoreErrorKind::Other, "other"),
        ];
        for (kind, name) in store_kinds {
            assert_eq!(kind.as_str(), name);
        }
        let source_kinds = [
            (SourceErrorKind::Other, "other"),
            (SourceErrorKind::Rebalanced, "rebalanced"),
            (SourceErrorKind::RetentionGap, "retention_gap"),
        ];
        for (kind, name) in source_kinds {
            assert_eq!(kind.as_str(), name);
        }
        let publish_kinds = [
            (PublishErrorKind::Timeout, "timeout"),
            (PublishErrorKind::BrokerUnavailable, "broker_unavailable"),
            (PublishErrorKind::NotEnoughReplicas, "not_enough_replicas"),
            (PublishErrorKind::LeaderMoved, "leader_moved"),
            (PublishErrorKind::QueueFull, "queue_full"),
            (PublishErrorKind::RecordTooLarge, "record_too_large"),
            (PublishErrorKind::UnknownTopic, "unknown_topic"),
            (PublishErrorKind::Authorization, "authorization"),
            (PublishErrorKind::InvalidRecord, "invalid_record"),
            (PublishErrorKind::Serialization, "serialization"),
            (PublishErrorKind::Fatal, "fatal"),
            (PublishErrorKind::Other, "other"),
        ];
        for (kind, name) in publish_kinds {
            assert_eq!(kind.as_str(), name);
            assert_eq!(PublishErrorKind::parse(name), Some(kind));
        }
    }

    #[test]
    fn messages_name_kind_and_class() {
        let e = PublishError::new(PublishErrorKind::QueueFull, "local queue full");
        assert_eq!(
            e.to_string(),
            "publish failed (queue_full, transient): local queue full"
        );
        let e = StoreError::new(StoreErrorKind::LeaseLost, "token gone")
            .with_class(ErrorClass::Permanent);
        assert_eq!(e.class(), ErrorClass::Permanent);
        assert!(!e.is_transient());
        assert_eq!(
            e.to_string(),
            "store error (lease_lost, permanent): token gone"
        );
        let e = SourceError::rebalanced("generation moved");
        assert_eq!(
            (e.kind, e.class(), e.is_transient()),
            (SourceErrorKind::Rebalanced, ErrorClass::Transient, true)
        );
        assert_eq!(
            e.to_string(),
            "message source error (transient, rebalanced): generation moved"
        );
        let e = SourceError::retention_gap("t/0 lost 3 records");
        assert_eq!(
            (e.kind, e.class()),
            (SourceErrorKind::RetentionGap, ErrorClass::Permanent)
        );
        let e = SourceError::new(ErrorClass::Transient, "poll failed")
            .with_source(std::io::Error::other("reset"));
        assert_eq!(e.kind, SourceErrorKind::Other);
        assert_eq!(SourceErrorKind::default(), SourceErrorKind::Other);
        assert_eq!(
            std::error::Error::source(&e).map(ToString::to_string),
            Some("reset".to_string())
        );
        assert_eq!(
            ConfigError::new("batch_size must be positive").to_string(),
            "invalid configuration: batch_size must be positive"
        );
    }

    #[test]
    fn validation_becomes_permanent_store_error() {
        let e: StoreError = crate::ValidationError::Empty("event_type").into();
        assert_eq!(e.kind, StoreErrorKind::Validation);
        assert!(!e.is_transient());
        assert!(std::error::Error::source(&e).is_some());
    }
}
