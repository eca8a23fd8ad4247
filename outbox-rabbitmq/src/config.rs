//! [`RabbitPublisherConfig`] and its builder: validated before anything connects.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use outbox_core::ConfigError;

use crate::connection::redact_uri;

/// Default delivery timeout: 10 s from the start of a batch to its last confirm.
pub const DEFAULT_DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Default timeout of connecting and of the topology checks: 5 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default largest message: 16 MiB (RabbitMQ's own `max_message_size` defaults to 128 MiB;
/// messages that large hurt any broker).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// What the routing key of a message is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RoutingKey {
    /// The aggregate type (or its route): for `topic` and `direct` exchanges, where queues
    /// bind by aggregate type.
    #[default]
    AggregateType,
    /// The aggregate id: for an `x-consistent-hash` exchange, which hashes it onto one of
    /// several queues, so one aggregate always reaches the same queue.
    AggregateId,
}

/// The exchange type the start-up check expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ExchangeKind {
    /// `topic`.
    #[default]
    Topic,
    /// `direct`.
    Direct,
    /// `fanout`.
    Fanout,
    /// `headers`.
    Headers,
    /// `x-consistent-hash` (the `rabbitmq_consistent_hash_exchange` plugin).
    ConsistentHash,
}

impl ExchangeKind {
    /// The exchange type as AMQP names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Topic => "topic",
            Self::Direct => "direct",
            Self::Fanout => "fanout",
            Self::Headers => "headers",
            Self::ConsistentHash => "x-consistent-hash",
        }
    }

    pub(crate) fn lapin(self) -> lapin::ExchangeKind {
        match self {
            Self::Topic => lapin::ExchangeKind::Topic,
            Self::Direct => lapin::ExchangeKind::Direct,
            Self::Fanout => lapin::ExchangeKind::Fanout,
            Self::Headers => lapin::ExchangeKind::Headers,
            Self::ConsistentHash => lapin::ExchangeKind::Custom("x-consistent-hash".into()),
        }
    }
}

/// Configuration of a [`crate::RabbitPublisher`]. Build it with
/// [`crate::RabbitPublisher::builder`].
///
/// | field | default | meaning |
/// |---|---|---|
/// | `uri` | (required) | `amqp://user:password@host:5672/vhost` (the password is redacted in `Debug`) |
/// | `exchange` | (required) | a named, durable exchange (the default exchange is refused) |
/// | `exchange_kind` | `Topic` | the type the start-up check expects |
/// | `routing_key` | [`RoutingKey::AggregateType`] | what the routing key is |
/// | `aggregate_routes` | empty | `aggregate_type` → routing key (with `AggregateType` keys) |
/// | `delivery_timeout` | 10 s | bound from the start of `publish` to the last confirm |
/// | `connect_timeout` | 5 s | connecting, and each request of the topology check |
/// | `max_message_bytes` | 16 MiB | larger messages fail as `record_too_large` before they are sent |
/// | `connection_name` | `outbox-publisher` | what the broker shows |
///
/// Always on and not configurable: publisher confirms, `mandatory` (an unroutable message is
/// returned and reported, never dropped), persistent messages (`delivery_mode = 2`), the event
/// id as `message_id`.
#[derive(Clone)]
#[non_exhaustive]
pub struct RabbitPublisherConfig {
    /// AMQP URI.
    pub uri: String,
    /// Exchange.
    pub exchange: String,
    /// Expected exchange type.
    pub exchange_kind: ExchangeKind,
    /// Routing key.
    pub routing_key: RoutingKey,
    /// Routing key per aggregate type.
    pub aggregate_routes: BTreeMap<String, String>,
    /// Delivery timeout.
    pub delivery_timeout: Duration,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Largest message.
    pub max_message_bytes: usize,
    /// Connection name.
    pub connection_name: String,
}

impl fmt::Debug for RabbitPublisherConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitPublisherConfig")
            .field("uri", &redact_uri(&self.uri))
            .field("exchange", &self.exchange)
            .field("exchange_kind", &self.exchange_kind)
            .field("routing_key", &self.routing_key)
            .field("aggregate_routes", &self.aggregate_routes)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("connection_name", &self.connection_name)
            .finish()
    }
}

impl RabbitPublisherConfig {
    /// A configuration with the defaults above.
    pub fn new(uri: impl Into<String>, exchange: impl Into<String>) -> Self {
        Self {
            uri: uri.into(),
            exchange: exchange.into(),
            exchange_kind: ExchangeKind::default(),
            routing_key: RoutingKey::default(),
            aggregate_routes: BTreeMap::new(),
            delivery_timeout: DEFAULT_DELIVERY_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            connection_name: "outbox-publisher".into(),
        }
    }

    /// The routing key of an event of `aggregate_type` about `aggregate_id`.
    pub fn routing_key_for<'a>(
        &'a self,
        aggregate_type: &'a str,
        aggregate_id: &'a str,
    ) -> &'a str {
        match self.routing_key {
            RoutingKey::AggregateType => self
                .aggregate_routes
                .get(aggregate_type)
                .map_or(aggregate_type, String::as_str),
            RoutingKey::AggregateId => aggregate_id,
        }
    }

    /// Validates the configuration.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.uri.trim().is_empty() {
            return Err(ConfigError::new("uri must not be empty"));
        }
        // Parsed as lapin parses it when it connects, so a malformed URI is a configuration
        // error before anything touches the network.
        if let Err(e) = self.uri.parse::<lapin::uri::AMQPUri>() {
            return Err(ConfigError::new(format!(
                "uri {:?} is not an AMQP URI: {e}",
                redact_uri(&self.uri)
            )));
        }
        if self.exchange.is_empty() {
            return Err(ConfigError::new(
                "exchange: the default exchange (\"\") cannot be checked for durability and \
                 routes by queue name only; publish to a named durable exchange",
            ));
        }
        if self.exchange.len() > 255 || self.exchange.chars().any(char::is_control) {
            return Err(ConfigError::new(format!(
                "exchange {:?} is not a valid exchange name (at most 255 bytes, no control \
                 characters)",
                self.exchange
            )));
        }
        if self.exchange.starts_with("amq.") {
            return Err(ConfigError::new(format!(
                "exchange {:?}: the broker's predefined amq.* exchanges are shared by every \
                 application; declare an exchange of your own",
                self.exchange
            )));
        }
        for (t, key) in &self.aggregate_routes {
            if t.trim().is_empty() || key.len() > 255 {
                return Err(ConfigError::new(format!(
                    "route {t:?} → {key:?}: empty aggregate type or routing key over 255 bytes"
                )));
            }
        }
        if !self.aggregate_routes.is_empty() && self.routing_key == RoutingKey::AggregateId {
            return Err(ConfigError::new(
                "routes by aggregate type do nothing when the routing key is the aggregate id",
            ));
        }
        if self.delivery_timeout.is_zero() || self.delivery_timeout > Duration::from_secs(3600) {
            return Err(ConfigError::new(format!(
                "delivery timeout {:?} must be between 1 ms and 1 h",
                self.delivery_timeout
            )));
        }
        if self.connect_timeout.is_zero() {
            return Err(ConfigError::new(
                "connect timeout must be greater than zero",
            ));
        }
        if self.max_message_bytes == 0 || self.max_message_bytes > 512 * 1024 * 1024 {
            return Err(ConfigError::new(
                "max_message_bytes must be between 1 and 512 MiB (RabbitMQ's hard limit)",
            ));
        }
        Ok(())
    }
}

/// Builder of a [`crate::RabbitPublisher`].
#[derive(Clone, Debug)]
pub struct RabbitPublisherBuilder {
    pub(crate) config: RabbitPublisherConfig,
    pub(crate) route_conflicts: Vec<String>,
}

impl RabbitPublisherBuilder {
    /// Publishes events of `aggregate_type` with `routing_key` instead of the type's name.
    /// Routing one aggregate type to two keys is refused by [`build`](Self::build).
    pub fn route_aggregate(
        mut self,
        aggregate_type: impl Into<String>,
        routing_key: impl Into<String>,
    ) -> Self {
        let (t, key) = (aggregate_type.into(), routing_key.into());
        if let Some(before) = self.config.aggregate_routes.get(&t) {
            if *before != key {
                self.route_conflicts.push(format!(
                    "aggregate type {t:?} is routed to both {before:?} and {key:?}: route each \
                     aggregate type to exactly one routing key"
                ));
            }
        }
        self.config.aggregate_routes.insert(t, key);
        self
    }

    /// Sets what the routing key is. Default [`RoutingKey::AggregateType`].
    pub fn routing_key(mut self, r: RoutingKey) -> Self {
        self.config.routing_key = r;
        self
    }

    /// Sets the exchange type the start-up check expects. Default `Topic`.
    pub fn exchange_kind(mut self, k: ExchangeKind) -> Self {
        self.config.exchange_kind = k;
        self
    }

    /// Sets the delivery timeout. Default 10 s.
    pub fn delivery_timeout(mut self, d: Duration) -> Self {
        self.config.delivery_timeout = d;
        self
    }

    /// Sets the connect timeout. Default 5 s.
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.config.connect_timeout = d;
        self
    }

    /// Sets the largest message. Default 16 MiB.
    pub fn max_message_bytes(mut self, n: usize) -> Self {
        self.config.max_message_bytes = n;
        self
    }

    /// Sets the connection name. Default `outbox-publisher`.
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.config.connection_name = name.into();
        self
    }

    /// The configuration so far.
    pub fn config(&self) -> &RabbitPublisherConfig {
        &self.config
    }

    /// Validates the configuration (no network).
    pub fn build(self) -> Result<RabbitPublisherConfig, ConfigError> {
        if !self.route_conflicts.is_empty() {
            return Err(ConfigError::new(self.route_conflicts.join("; ")));
        }
        self.config.validate()?;
        Ok(self.config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builder() -> RabbitPublisherBuilder {
        crate::RabbitPublisher::builder("amqp://guest:guest@127.0.0.1:1/%2f", "outbox")
    }

    #[test]
    fn routing_keys() {
        let c = builder()
            .route_aggregate("payment", "payments")
            .build()
            .unwrap();
        assert_eq!(c.routing_key_for("order", "o-1"), "order");
        assert_eq!(c.routing_key_for("payment", "p-1"), "payments");
        let c = builder()
            .routing_key(RoutingKey::AggregateId)
            .build()
            .unwrap();
        assert_eq!(c.routing_key_for("order", "o-1"), "o-1");
    }

    #[test]
    fn unsafe_or_invalid_settings_are_refused() {
        let cases: Vec<(RabbitPublisherBuilder, &str)> = vec![
            (
                crate::RabbitPublisher::builder("amqp://h", ""),
                "default exchange",
            ),
            (
                crate::RabbitPublisher::builder("amqp://h", "amq.topic"),
                "predefined",
            ),
            (crate::RabbitPublisher::builder(" ", "x"), "uri"),
            (
                crate::RabbitPublisher::builder("http://u:pw@h:5672/%2f", "x"),
                "not an AMQP URI",
            ),
            (
                crate::RabbitPublisher::builder("amqp://h:99999/%2f", "x"),
                "not an AMQP URI",
            ),
            (
                builder().delivery_timeout(Duration::ZERO),
                "delivery timeout",
            ),
            (builder().connect_timeout(Duration::ZERO), "connect timeout"),
            (builder().max_message_bytes(0), "max_message_bytes"),
            (
                builder().max_message_bytes(600 * 1024 * 1024),
                "max_message_bytes",
            ),
            (
                builder()
                    .route_aggregate("order", "a")
                    .route_aggregate("order", "b"),
                "exactly one routing key",
            ),
            (
                builder()
                    .route_aggregate("order", "a")
                    .routing_key(RoutingKey::AggregateId),
                "routes by aggregate type",
            ),
        ];
        for (b, expected) in cases {
            let err = b.build().expect_err(expected).to_string();
            assert!(err.contains(expected), "{expected}: {err}");
        }
    }

    #[test]
    fn debug_redacts_the_password() {
        let c = crate::RabbitPublisher::builder("amqp://relay:hunter2-pw@h:5672/%2f", "x")
            .build()
            .unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2-pw"), "{shown}");
        assert!(shown.contains("relay:***@h"), "{shown}");
    }
}
