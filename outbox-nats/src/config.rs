//! [`NatsPublisherConfig`] and its builder: validated before anything connects.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use outbox_core::ConfigError;

use crate::subject::{is_valid_token, validate_subject, SubjectMapping};

/// Default delivery timeout: 10 s from the start of a batch to its last `PubAck`.
pub const DEFAULT_DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Default timeout of connecting and of the stream checks' requests: 5 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default limit of publishes awaiting their `PubAck` at once (per publisher): 10,000.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 10_000;

/// Configuration of a [`crate::NatsPublisher`]. Build it with [`crate::NatsPublisher::builder`].
///
/// | field | default | meaning |
/// |---|---|---|
/// | `servers` | (required) | NATS URLs, comma-separated (`nats://user:pass@host:4222`; the password is redacted in `Debug`) |
/// | `subject_prefix` | (required) | subject of every aggregate type without a route: `<prefix>.<aggregate_type>` |
/// | `aggregate_routes` | empty | `aggregate_type` → subject (one aggregate type never spans two subjects) |
/// | `subject_mapping` | [`SubjectMapping::AggregateType`] | whether the aggregate id is appended to the subject |
/// | `delivery_timeout` | 10 s | bound from the start of `publish` to the last `PubAck` |
/// | `connect_timeout` | 5 s | connecting, and each request of the stream check |
/// | `max_in_flight` | 10,000 | publishes awaiting a `PubAck` at once; a batch larger than this waits for room |
/// | `relay_lease` | none | the relay's lease: the stream check warns when a stream's duplicate window is shorter, and `build` refuses a delivery timeout that does not fit in it |
/// | `client_name` | `outbox-publisher` | the connection name the server shows |
///
/// Always on and not configurable: the event id as `Nats-Msg-Id` on every message, a record
/// acknowledged only by its `PubAck`.
#[derive(Clone)]
#[non_exhaustive]
pub struct NatsPublisherConfig {
    /// NATS server URLs, comma-separated.
    pub servers: String,
    /// Subject prefix of aggregate types without a route.
    pub subject_prefix: String,
    /// Subject per aggregate type.
    pub aggregate_routes: BTreeMap<String, String>,
    /// Where the aggregate id goes.
    pub subject_mapping: SubjectMapping,
    /// Bound on one `publish` call.
    pub delivery_timeout: Duration,
    /// Connect and check timeout.
    pub connect_timeout: Duration,
    /// Publishes awaiting a `PubAck` at once.
    pub max_in_flight: usize,
    /// The relay's lease, when known.
    pub relay_lease: Option<Duration>,
    /// Connection name.
    pub client_name: String,
}

impl fmt::Debug for NatsPublisherConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsPublisherConfig")
            .field("servers", &redact_urls(&self.servers))
            .field("subject_prefix", &self.subject_prefix)
            .field("aggregate_routes", &self.aggregate_routes)
            .field("subject_mapping", &self.subject_mapping)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_in_flight", &self.max_in_flight)
            .field("relay_lease", &self.relay_lease)
            .field("client_name", &self.client_name)
            .finish()
    }
}

/// `urls` with the password of each `user:password@` replaced by `***`.
pub(crate) fn redact_urls(urls: &str) -> String {
    urls.split(',')
        .map(|u| {
            let Some((scheme, rest)) = u.split_once("://") else {
                return u.to_owned();
            };
            match rest.split_once('@') {
                Some((auth, host)) => match auth.split_once(':') {
                    Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                    None => format!("{scheme}://***@{host}"),
                },
                None => u.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

impl NatsPublisherConfig {
    /// A configuration with the defaults above.
    pub fn new(servers: impl Into<String>, subject_prefix: impl Into<String>) -> Self {
        Self {
            servers: servers.into(),
            subject_prefix: subject_prefix.into(),
            aggregate_routes: BTreeMap::new(),
            subject_mapping: SubjectMapping::default(),
            delivery_timeout: DEFAULT_DELIVERY_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            relay_lease: None,
            client_name: "outbox-publisher".into(),
        }
    }

    /// The subject an event of `aggregate_type` about `aggregate_id` is published to.
    ///
    /// `Err` names the part that is not a subject token (a permanent error of that record).
    pub fn subject_for(&self, aggregate_type: &str, aggregate_id: &str) -> Result<String, String> {
        let base = match self.aggregate_routes.get(aggregate_type) {
            Some(route) => route.clone(),
            None if is_valid_token(aggregate_type) => {
                format!("{}.{aggregate_type}", self.subject_prefix)
            }
            None => {
                return Err(format!(
                    "aggregate type {aggregate_type:?} is not a NATS subject token (no '.', '*', \
                     '>' or whitespace); route it to a subject with route_aggregate"
                ))
            }
        };
        match self.subject_mapping {
            SubjectMapping::AggregateType => Ok(base),
            SubjectMapping::AggregateTypeAndId if is_valid_token(aggregate_id) => {
                Ok(format!("{base}.{aggregate_id}"))
            }
            SubjectMapping::AggregateTypeAndId => Err(format!(
                "aggregate id {aggregate_id:?} is not a NATS subject token (no '.', '*', '>' or \
                 whitespace), and the subject mapping puts it in the subject"
            )),
        }
    }

    /// The subject spaces this configuration publishes to, each as a pattern a stream must
    /// capture: `<prefix>.>` and each route (with `.*` appended when the id is in the subject).
    pub fn subject_spaces(&self) -> Vec<String> {
        let suffix = match self.subject_mapping {
            SubjectMapping::AggregateType => "",
            SubjectMapping::AggregateTypeAndId => ".*",
        };
        let mut set: BTreeSet<String> = self
            .aggregate_routes
            .values()
            .map(|r| format!("{r}{suffix}"))
            .collect();
        set.insert(format!("{}.>", self.subject_prefix));
        set.into_iter().collect()
    }

    /// Validates the configuration.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.servers.trim().is_empty() {
            return Err(ConfigError::new("servers must not be empty"));
        }
        for server in self.servers.split(',').map(str::trim) {
            // Parsed as the client parses it when it connects, so a malformed URL is a
            // configuration error before anything touches the network.
            if let Err(e) = server.parse::<async_nats::ServerAddr>() {
                return Err(ConfigError::new(format!(
                    "servers: {:?} is not a NATS server URL: {e}",
                    redact_urls(server)
                )));
            }
        }
        validate_subject("subject_prefix", &self.subject_prefix)?;
        for (aggregate_type, subject) in &self.aggregate_routes {
            if aggregate_type.trim().is_empty() {
                return Err(ConfigError::new("a route has an empty aggregate type"));
            }
            validate_subject(
                &format!("route for aggregate type {aggregate_type:?}"),
                subject,
            )?;
            if crate::subject::covers(&format!("{}.>", self.subject_prefix), subject) {
                // `<prefix>.<x>` is where aggregate type `x` goes without a route: a route
                // into that space could put two aggregate types on one subject, or split one.
                let taken = subject
                    .strip_prefix(&format!("{}.", self.subject_prefix))
                    .is_some_and(|rest| rest != aggregate_type);
                if taken {
                    return Err(ConfigError::new(format!(
                        "route for aggregate type {aggregate_type:?}: {subject:?} lies in the \
                         prefix's own subject space ({}.<aggregate_type>), where it would mix \
                         with another aggregate type's events; route to a subject outside it",
                        self.subject_prefix
                    )));
                }
            }
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
        if self.max_in_flight == 0 {
            return Err(ConfigError::new("max_in_flight must be at least 1"));
        }
        if let Some(lease) = self.relay_lease {
            if self.delivery_timeout >= lease {
                return Err(ConfigError::new(format!(
                    "delivery timeout {:?} does not fit in the relay's lease {lease:?}: a batch \
                     could still be publishing when its lease expires and another relay claims \
                     its events",
                    self.delivery_timeout
                )));
            }
        }
        Ok(())
    }
}

/// Builder of a [`crate::NatsPublisher`].
#[derive(Clone, Debug)]
pub struct NatsPublisherBuilder {
    pub(crate) config: NatsPublisherConfig,
    pub(crate) route_conflicts: Vec<String>,
}

impl NatsPublisherBuilder {
    /// Publishes every event of aggregates of `aggregate_type` to `subject` instead of
    /// `<prefix>.<aggregate_type>`. Routing one aggregate type to two subjects is refused by
    /// [`build`](Self::build) (a consumer of both would have no order between them).
    pub fn route_aggregate(
        mut self,
        aggregate_type: impl Into<String>,
        subject: impl Into<String>,
    ) -> Self {
        let (aggregate_type, subject) = (aggregate_type.into(), subject.into());
        if let Some(before) = self.config.aggregate_routes.get(&aggregate_type) {
            if *before != subject {
                self.route_conflicts.push(format!(
                    "aggregate type {aggregate_type:?} is routed to both {before:?} and \
                     {subject:?}: route each aggregate type to exactly one subject"
                ));
            }
        }
        self.config.aggregate_routes.insert(aggregate_type, subject);
        self
    }

    /// Sets where the aggregate id goes. Default [`SubjectMapping::AggregateType`].
    pub fn subject_mapping(mut self, mapping: SubjectMapping) -> Self {
        self.config.subject_mapping = mapping;
        self
    }

    /// Sets the delivery timeout. Default 10 s.
    pub fn delivery_timeout(mut self, timeout: Duration) -> Self {
        self.config.delivery_timeout = timeout;
        self
    }

    /// Sets the connect and check timeout. Default 5 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.config.connect_timeout = timeout;
        self
    }

    /// Sets the limit of publishes awaiting a `PubAck`. Default 10,000.
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.config.max_in_flight = n;
        self
    }

    /// The relay's lease (`ClaimMode::Lease` duration): the stream check compares each
    /// stream's duplicate window with it, and `build` refuses a delivery timeout that does not
    /// fit in it.
    pub fn relay_lease(mut self, lease: Duration) -> Self {
        self.config.relay_lease = Some(lease);
        self
    }

    /// Sets the connection name. Default `outbox-publisher`.
    pub fn client_name(mut self, name: impl Into<String>) -> Self {
        self.config.client_name = name.into();
        self
    }

    /// The configuration so far.
    pub fn config(&self) -> &NatsPublisherConfig {
        &self.config
    }

    /// Validates the configuration (no network).
    pub fn build(self) -> Result<NatsPublisherConfig, ConfigError> {
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

    fn builder() -> NatsPublisherBuilder {
        crate::NatsPublisher::builder("nats://127.0.0.1:1", "outbox")
    }

    #[test]
    fn subjects_follow_the_mapping() {
        let c = builder()
            .route_aggregate("payment", "payments.events")
            .build()
            .unwrap();
        assert_eq!(c.subject_for("order", "o-1").unwrap(), "outbox.order");
        assert_eq!(c.subject_for("payment", "p-1").unwrap(), "payments.events");
        assert!(c.subject_for("order.line", "x").is_err());
        assert_eq!(c.subject_spaces(), vec!["outbox.>", "payments.events"]);

        let c = builder()
            .route_aggregate("payment", "payments.events")
            .subject_mapping(SubjectMapping::AggregateTypeAndId)
            .build()
            .unwrap();
        assert_eq!(c.subject_for("order", "o-1").unwrap(), "outbox.order.o-1");
        assert_eq!(
            c.subject_for("payment", "p-1").unwrap(),
            "payments.events.p-1"
        );
        let err = c.subject_for("order", "o 1").unwrap_err();
        assert!(err.contains("aggregate id"), "{err}");
        assert!(c.subject_for("order", "a.b").is_err());
        assert_eq!(c.subject_spaces(), vec!["outbox.>", "payments.events.*"]);
    }

    #[test]
    fn unsafe_or_invalid_settings_are_refused() {
        let cases: Vec<(NatsPublisherBuilder, &str)> = vec![
            (
                builder().delivery_timeout(Duration::ZERO),
                "delivery timeout",
            ),
            (
                builder().delivery_timeout(Duration::from_secs(7200)),
                "delivery timeout",
            ),
            (builder().connect_timeout(Duration::ZERO), "connect timeout"),
            (builder().max_in_flight(0), "max_in_flight"),
            (
                builder()
                    .delivery_timeout(Duration::from_secs(30))
                    .relay_lease(Duration::from_secs(30)),
                "lease",
            ),
            (
                builder()
                    .route_aggregate("order", "a")
                    .route_aggregate("order", "b"),
                "exactly one subject",
            ),
            (builder().route_aggregate("order", "a.*"), "literal"),
            (builder().route_aggregate("", "a"), "empty aggregate type"),
            (
                builder().route_aggregate("order", "outbox.payment"),
                "subject space",
            ),
            (
                crate::NatsPublisher::builder("nats://h:1", "out box"),
                "subject_prefix",
            ),
            (crate::NatsPublisher::builder(" ", "outbox"), "servers"),
            (
                crate::NatsPublisher::builder("http://u:pw@h:4222", "outbox"),
                "not a NATS server URL",
            ),
            (
                crate::NatsPublisher::builder("nats://h:99999", "outbox"),
                "not a NATS server URL",
            ),
        ];
        for (b, expected) in cases {
            let err = b.build().expect_err(expected).to_string();
            assert!(err.contains(expected), "{expected}: {err}");
        }
        // Routing a type to its own default subject is harmless; repeating a route too.
        assert!(builder()
            .route_aggregate("order", "outbox.order")
            .route_aggregate("order", "outbox.order")
            .relay_lease(Duration::from_secs(60))
            .build()
            .is_ok());
    }

    #[test]
    fn debug_redacts_passwords() {
        let c = crate::NatsPublisher::builder(
            "nats://relay:s3cret-pw@a:4222,nats://token-only@b:4222",
            "outbox",
        )
        .build()
        .unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret-pw"), "{shown}");
        assert!(!shown.contains("token-only"), "{shown}");
        assert!(shown.contains("relay:***@a:4222"), "{shown}");
    }
}
