//! [`RabbitPublisher`]: the outbox [`Publisher`] on RabbitMQ with publisher confirms.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use futures::future::join_all;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::publisher_confirm::{Confirmation, PublisherConfirm};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use outbox_core::{
    async_trait, wire, ConfigError, Envelope, ErrorClass, FailureScope, PublishError,
    PublishErrorKind, PublishResult, Publisher,
};
use tokio::time::Instant;

use crate::config::{RabbitPublisherBuilder, RabbitPublisherConfig};
use crate::connection::connect;
use crate::error::{nacked, publish_error, returned};
use crate::topology::{check_exchange, ExchangeReport, TopologyError};

/// Extra time [`RabbitPublisher::publish`] waits beyond the delivery timeout for the last
/// confirms.
pub const REPORT_GRACE: Duration = Duration::from_millis(500);

/// Why [`RabbitPublisherBuilder::start`] failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration is invalid or unsafe.
    Config(ConfigError),
    /// The exchange is missing or wrong, or the broker could not be asked.
    Topology(TopologyError),
}

impl StartError {
    /// Whether trying again later can succeed (the broker was unreachable).
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Topology(e) if e.is_transient())
    }
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config(e) => write!(f, "{e}"),
            Self::Topology(e) => write!(f, "exchange check failed: {e}"),
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Config(e) => Some(e),
            Self::Topology(e) => Some(e),
        }
    }
}

impl RabbitPublisherBuilder {
    /// Validates the configuration and returns the publisher; it connects at the first
    /// publish or check (and again after the connection is lost).
    pub fn connect(self) -> Result<RabbitPublisher, ConfigError> {
        Ok(RabbitPublisher::new(self.build()?))
    }

    /// [`connect`](Self::connect), then [`RabbitPublisher::check_exchange`]: fails at start on
    /// a missing, non-durable or other-typed exchange (permanent) or an unreachable broker
    /// (transient).
    pub async fn start(self) -> Result<RabbitPublisher, StartError> {
        let p = self.connect().map_err(StartError::Config)?;
        p.check_exchange().await.map_err(StartError::Topology)?;
        Ok(p)
    }
}

/// The connection, its confirm channel and the publish sequence number of the channel's next
/// message (publisher confirms count from 1 per channel).
struct Link {
    connection: Connection,
    channel: Channel,
    next_tag: u64,
}

impl Link {
    fn usable(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }
}

/// The outbox [`Publisher`] for RabbitMQ.
///
/// * One connection with one channel in confirm mode; a batch is published as a whole (every
///   `basic.publish` written), then every confirm is awaited together. A result is `Ok` only
///   from a positive confirm without a `basic.return`: the message is stored in every queue it
///   was routed to (persistent, in durable queues: on disk).
/// * Every message is `mandatory`: a message no queue is bound for comes back as
///   `basic.return` and is reported as `unknown_topic` (permanent) naming the exchange and
///   routing key, never dropped silently. A `basic.nack` is `broker_unavailable` (transient).
/// * Persistent (`delivery_mode = 2`), the event id as `message_id`, the content type as
///   `content_type`, the creation time as `timestamp`, and the envelope's wire headers
///   ([`outbox_core::wire`]) as AMQP headers (long strings), exactly as on Kafka.
/// * One channel delivers its messages to a queue in publish order, so one aggregate's events
///   are stored in order; a batch is written under a lock, so concurrent `publish` calls do not
///   interleave. If writing a message fails, later events of its aggregate in the batch are not
///   sent.
/// * A message over `max_message_bytes` fails as `record_too_large` before it is sent: the
///   broker closes the channel on an oversize message, which would fail the whole batch.
/// * [`publish`](Publisher::publish) returns within
///   [`delivery_timeout`](Publisher::delivery_timeout) + [`REPORT_GRACE`]; a lost connection
///   fails the batch's unconfirmed records transiently (`broker_unavailable`, `timeout`), and
///   the next batch connects again.
pub struct RabbitPublisher {
    config: RabbitPublisherConfig,
    link: tokio::sync::Mutex<Option<Link>>,
    last_report: Mutex<Option<ExchangeReport>>,
}

impl fmt::Debug for RabbitPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitPublisher")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RabbitPublisher {
    /// A builder for a publisher to `exchange` at `uri`.
    pub fn builder(uri: impl Into<String>, exchange: impl Into<String>) -> RabbitPublisherBuilder {
        RabbitPublisherBuilder {
            config: RabbitPublisherConfig::new(uri, exchange),
            route_conflicts: Vec::new(),
        }
    }

    fn new(config: RabbitPublisherConfig) -> Self {
        Self {
            config,
            link: tokio::sync::Mutex::new(None),
            last_report: Mutex::new(None),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RabbitPublisherConfig {
        &self.config
    }

    /// Checks that the exchange exists, is durable and of the configured type (on a
    /// connection of its own).
    pub async fn check_exchange(&self) -> Result<ExchangeReport, TopologyError> {
        let c = &self.config;
        let conn = connect(&c.uri, &c.connection_name, c.connect_timeout)
            .await
            .map_err(|e| TopologyError::Unreachable {
                detail: e.to_string(),
            })?;
        let report = check_exchange(&conn, &c.exchange, c.exchange_kind, c.connect_timeout).await;
        let _ = conn.close(200, "checked").await;
        let report = report?;
        tracing::info!(exchange = %report.name, kind = report.kind.as_str(), durable = report.durable, confirms = report.confirms, mandatory = report.mandatory, "outbox exchange checked");
        *self
            .last_report
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(report.clone());
        Ok(report)
    }

    /// The report of the last successful [`check_exchange`](Self::check_exchange).
    pub fn exchange_report(&self) -> Option<ExchangeReport> {
        self.last_report
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A usable link: the current one, or a new connection and confirm channel.
    async fn link<'a>(
        &self,
        guard: &'a mut Option<Link>,
        deadline: Instant,
    ) -> Result<&'a mut Link, PublishError> {
        if !guard.as_ref().is_some_and(Link::usable) {
            if let Some(old) = guard.take() {
                let _ = old.connection.close(200, "replaced").await;
            }
            let c = &self.config;
            let budget = deadline
                .saturating_duration_since(Instant::now())
                .min(c.connect_timeout)
                .max(Duration::from_millis(1));
            let fresh = async {
                let connection = connect(&c.uri, &c.connection_name, budget).await?;
                let channel = connection.create_channel().await?;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                Ok::<_, lapin::Error>(Link {
                    connection,
                    channel,
                    next_tag: 1,
                })
            };
            match tokio::time::timeout(budget, fresh).await {
                Ok(Ok(link)) => *guard = Some(link),
                Ok(Err(e)) => return Err(publish_error(&c.exchange, &e)),
                Err(_) => {
                    return Err(PublishError::new(
                        PublishErrorKind::BrokerUnavailable,
                        format!(
                            "exchange {:?}: no connection to RabbitMQ within {budget:?}",
                            c.exchange
                        ),
                    ))
                }
            }
        }
        Ok(guard.as_mut().expect("set above"))
    }

    fn properties(e: &Envelope) -> BasicProperties {
        let mut headers = FieldTable::default();
        wire::for_each_header(e, |name, value| {
            headers.insert(
                ShortString::from(name),
                AMQPValue::LongString(LongString::from(value.to_vec())),
            );
        });
        BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(ShortString::from(e.event_id.to_string()))
            .with_content_type(ShortString::from(e.payload.content_type.as_str()))
            .with_timestamp(u64::try_from(e.created_at.timestamp()).unwrap_or(0))
            .with_headers(headers)
    }
}

enum Slot {
    Done(PublishResult),
    Waiting { tag: u64, confirm: PublisherConfirm },
}

/// A header name AMQP cannot carry (a short string holds at most 255 bytes).
fn header_problem(e: &Envelope) -> Option<String> {
    e.headers
        .keys()
        .find(|k| k.len() > 255)
        .map(|k| format!("header name of {} bytes exceeds AMQP's 255", k.len()))
}

#[async_trait]
impl Publisher for RabbitPublisher {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        if batch.is_empty() {
            return Vec::new();
        }
        let c = &self.config;
        let started = Instant::now();
        let send_deadline = started + c.delivery_timeout;
        let ack_deadline = send_deadline + REPORT_GRACE;
        let mut slots: Vec<Slot> = Vec::with_capacity(batch.len());
        let mut keys: Vec<&str> = Vec::with_capacity(batch.len());
        {
            let mut guard = self.link.lock().await;
            let link = match self.link(&mut guard, send_deadline).await {
                Ok(link) => link,
                Err(err) => {
                    tracing::warn!(error = %err, "no RabbitMQ channel for the batch");
                    return batch.iter().map(|_| Err(err.clone())).collect();
                }
            };
            let mut failed_aggregates: HashSet<&str> = HashSet::new();
            for e in batch {
                let key = c.routing_key_for(&e.aggregate_type, &e.aggregate_id);
                keys.push(key);
                if failed_aggregates.contains(e.aggregate_id.as_str()) {
                    slots.push(Slot::Done(Err(PublishError::new(
                        PublishErrorKind::Other,
                        "not sent: an earlier event of the same aggregate in this batch failed",
                    )
                    .with_class(ErrorClass::Transient)
                    .with_scope(FailureScope::Transport))));
                    continue;
                }
                if key.len() > 255 {
                    failed_aggregates.insert(&e.aggregate_id);
                    slots.push(Slot::Done(Err(PublishError::new(
                        PublishErrorKind::Serialization,
                        format!("routing key of {} bytes exceeds AMQP's 255", key.len()),
                    ))));
                    continue;
                }
                if let Some(problem) = header_problem(e) {
                    failed_aggregates.insert(&e.aggregate_id);
                    slots.push(Slot::Done(Err(PublishError::new(
                        PublishErrorKind::Serialization,
                        problem,
                    ))));
                    continue;
                }
                if e.payload.bytes.len() > c.max_message_bytes {
                    failed_aggregates.insert(&e.aggregate_id);
                    slots.push(Slot::Done(Err(PublishError::new(
                        PublishErrorKind::RecordTooLarge,
                        format!(
                            "exchange {:?}: message of {} bytes exceeds max_message_bytes {}",
                            c.exchange,
                            e.payload.bytes.len(),
                            c.max_message_bytes
                        ),
                    ))));
                    continue;
                }
                let options = BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                };
                let sent = tokio::time::timeout_at(
                    send_deadline,
                    link.channel.basic_publish(
                        &c.exchange,
                        key,
                        options,
                        &e.payload.bytes,
                        Self::properties(e),
                    ),
                )
                .await;
                match sent {
                    Ok(Ok(confirm)) => {
                        let tag = link.next_tag;
                        link.next_tag += 1;
                        slots.push(Slot::Waiting { tag, confirm });
                    }
                    Ok(Err(err)) => {
                        failed_aggregates.insert(&e.aggregate_id);
                        tracing::warn!(event_id = %e.event_id, aggregate_id = %e.aggregate_id, event_type = %e.event_type, routing_key = key, error = %err, stage = "send", "message not written");
                        slots.push(Slot::Done(Err(publish_error(&c.exchange, &err))));
                    }
                    Err(_elapsed) => {
                        failed_aggregates.insert(&e.aggregate_id);
                        slots.push(Slot::Done(Err(PublishError::new(
                            PublishErrorKind::Timeout,
                            format!(
                                "exchange {:?}: the channel did not take the message within \
                                 the delivery timeout",
                                c.exchange
                            ),
                        ))));
                    }
                }
            }
        }
        let exchange = c.exchange.as_str();
        let results: Vec<PublishResult> = join_all(slots.into_iter().zip(&keys).map(
            |(slot, key)| async move {
                match slot {
                    Slot::Done(r) => r,
                    Slot::Waiting { tag, confirm } => {
                        match tokio::time::timeout_at(ack_deadline, confirm).await {
                            Ok(Ok(Confirmation::Ack(None))) => {
                                Ok(crate::ack::from_confirm(exchange, tag))
                            }
                            Ok(Ok(Confirmation::Ack(Some(r)) | Confirmation::Nack(Some(r)))) => {
                                Err(returned(exchange, key, r.reply_code, r.reply_text.as_str()))
                            }
                            Ok(Ok(Confirmation::Nack(None))) => Err(nacked(exchange)),
                            // Confirms are always selected; never report an unconfirmed
                            // message as stored.
                            Ok(Ok(Confirmation::NotRequested)) => Err(PublishError::new(
                                PublishErrorKind::Other,
                                "no publisher confirm was requested for this message",
                            )),
                            Ok(Err(err)) => Err(publish_error(exchange, &err)),
                            Err(_elapsed) => Err(PublishError::new(
                                PublishErrorKind::Timeout,
                                format!(
                                    "exchange {exchange:?}: no confirm within the delivery \
                                     timeout"
                                ),
                            )),
                        }
                    }
                }
            },
        ))
        .await;
        // A broken channel is replaced before the next batch (its unconfirmed messages are
        // reported above; the relay re-sends them).
        let mut guard = self.link.lock().await;
        if guard.as_ref().is_some_and(|l| !l.usable()) {
            if let Some(old) = guard.take() {
                let _ = old.connection.close(200, "replaced").await;
            }
        }
        results
    }

    fn delivery_timeout(&self) -> Duration {
        self.config.delivery_timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_carry_the_wire_mapping_and_the_message_id() {
        let e = Envelope::builder("order", "o-1", 3, "order.paid")
            .header(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )
            .build()
            .unwrap();
        let p = RabbitPublisher::properties(&e);
        assert_eq!(p.delivery_mode(), &Some(2));
        assert_eq!(
            p.message_id().as_ref().map(|s| s.as_str().to_owned()),
            Some(e.event_id.to_string())
        );
        let headers = p.headers().as_ref().expect("headers");
        let pairs: Vec<(String, Vec<u8>)> = headers
            .inner()
            .iter()
            .map(|(k, v)| match v {
                AMQPValue::LongString(s) => (k.as_str().to_owned(), s.as_bytes().to_vec()),
                other => panic!("{k}: {other:?}"),
            })
            .collect();
        assert_eq!(wire::decode(&pairs, &e.payload.bytes).unwrap(), e);
    }
}
