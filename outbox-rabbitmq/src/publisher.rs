//! [`RabbitPublisher`]: the outbox [`Publisher`] on RabbitMQ with publisher confirms.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use futures::future::join_all;
use lapin::message::BasicReturnMessage;
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
    /// A batch started on this channel and has not seen all its confirms.
    dirty: bool,
}

impl Link {
    fn usable(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }

    /// Closes the connection if it still works (bounded: a broker that went away never
    /// answers), else just drops it.
    async fn discard(self) {
        if self.connection.status().connected() {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                self.connection.close(200, "replaced"),
            )
            .await;
        }
    }
}

/// The outbox [`Publisher`] for RabbitMQ.
///
/// * One connection with one channel in confirm mode; a batch is published as a whole (every
///   `basic.publish` written), then every confirm is awaited together. Batches on one
///   publisher run one at a time (returned messages are matched to their messages within a
///   batch, see below). A result is `Ok` only
///   from a positive confirm without a `basic.return`: the message is stored in every queue it
///   was routed to (persistent, in durable queues: on disk).
/// * Every message is `mandatory`: a message no queue is bound for comes back as
///   `basic.return` and is reported as `unknown_topic` (permanent) naming the exchange and
///   routing key, never dropped silently. A `basic.nack` is `broker_unavailable` (transient).
///   lapin hands a returned message to whichever confirm completes next (not necessarily its
///   own), so returns are matched to messages by their `message_id` (the event id); a return
///   that matches no message of the batch fails the whole batch transiently rather than risk
///   acknowledging a message that was dropped. A channel whose batch ended with confirms
///   pending (timed out or cancelled) is replaced, so a late confirm cannot carry a return
///   into the next batch.
/// * Persistent (`delivery_mode = 2`), the event id as `message_id`, the content type as
///   `content_type`, the creation time as `timestamp`, and the envelope's wire headers
///   ([`outbox_core::wire`]) as AMQP headers (long strings), exactly as on Kafka.
/// * One channel delivers its messages to a queue in publish order, so one aggregate's events
///   are stored in order; batches do not interleave. If writing a message fails, later events of its aggregate in the batch are not
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
        let _ = tokio::time::timeout(c.connect_timeout, conn.close(200, "checked")).await;
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
                old.discard().await;
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
                    dirty: false,
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

/// For each message id of the batch, the reply of the returned message that carries it (if
/// any), and how many returned messages match no id of the batch. lapin attaches a returned
/// message to whichever confirm completes next, not to its own, so the confirm a return came
/// with says nothing about which message it was: the return's `message_id` (the event id)
/// does.
fn match_returns(ids: &[String], returns: &[Returned]) -> (Vec<Option<(u16, String)>>, usize) {
    let mut matched: Vec<Option<(u16, String)>> = vec![None; ids.len()];
    let mut unmatched = 0;
    for r in returns {
        match r
            .message_id
            .as_ref()
            .and_then(|id| ids.iter().position(|x| x == id))
        {
            Some(i) => matched[i] = Some((r.reply_code, r.reply_text.clone())),
            None => unmatched += 1,
        }
    }
    (matched, unmatched)
}

/// What a returned message says: its message id and the broker's reply.
#[derive(Clone, Debug)]
struct Returned {
    message_id: Option<String>,
    reply_code: u16,
    reply_text: String,
}

impl From<BasicReturnMessage> for Returned {
    fn from(r: BasicReturnMessage) -> Self {
        Self {
            message_id: r
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.as_str().to_owned()),
            reply_code: r.reply_code,
            reply_text: r.reply_text.as_str().to_owned(),
        }
    }
}

/// A header name AMQP cannot carry (a short string holds at most 255 bytes).
fn header_problem(e: &Envelope) -> Option<String> {
    e.headers
        .keys()
        .find(|k| k.len() > 255)
        .map(|k| format!("header name of {} bytes exceeds AMQP's 255", k.len()))
}

/// What a confirm said about one message, before returns are matched to messages.
enum Confirmed {
    Ack,
    Nack,
    Failed(PublishError),
}

#[async_trait]
impl Publisher for RabbitPublisher {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        if batch.is_empty() {
            return Vec::new();
        }
        let c = &self.config;
        let exchange = c.exchange.as_str();
        let started = Instant::now();
        let send_deadline = started + c.delivery_timeout;
        let ack_deadline = send_deadline + REPORT_GRACE;
        // The whole batch, confirms included, runs under the lock: lapin hands a returned
        // message to whichever confirm completes next, so returns are matched to messages
        // here, by message id, among this batch's messages only (see below).
        let mut guard = self.link.lock().await;
        if guard.as_ref().is_some_and(|l| l.dirty) {
            // A previous batch was cancelled or timed out with confirms pending: a late
            // confirm could take this batch's returns. Start on a fresh channel.
            if let Some(old) = guard.take() {
                old.discard().await;
            }
        }
        let link = match self.link(&mut guard, send_deadline).await {
            Ok(link) => link,
            Err(err) => {
                tracing::warn!(error = %err, "no RabbitMQ channel for the batch");
                return batch.iter().map(|_| Err(err.clone())).collect();
            }
        };
        link.dirty = true;
        let mut slots: Vec<Slot> = Vec::with_capacity(batch.len());
        let mut keys: Vec<&str> = Vec::with_capacity(batch.len());
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
            let refused = if key.len() > 255 {
                Some(PublishError::new(
                    PublishErrorKind::Serialization,
                    format!("routing key of {} bytes exceeds AMQP's 255", key.len()),
                ))
            } else if let Some(problem) = header_problem(e) {
                Some(PublishError::new(PublishErrorKind::Serialization, problem))
            } else if e.payload.bytes.len() > c.max_message_bytes {
                Some(PublishError::new(
                    PublishErrorKind::RecordTooLarge,
                    format!(
                        "exchange {exchange:?}: message of {} bytes exceeds max_message_bytes {}",
                        e.payload.bytes.len(),
                        c.max_message_bytes
                    ),
                ))
            } else {
                None
            };
            if let Some(err) = refused {
                failed_aggregates.insert(&e.aggregate_id);
                slots.push(Slot::Done(Err(err)));
                continue;
            }
            let options = BasicPublishOptions {
                mandatory: true,
                immediate: false,
            };
            let sent = tokio::time::timeout_at(
                send_deadline,
                link.channel.basic_publish(
                    exchange,
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
                    slots.push(Slot::Done(Err(publish_error(exchange, &err))));
                }
                Err(_elapsed) => {
                    failed_aggregates.insert(&e.aggregate_id);
                    slots.push(Slot::Done(Err(PublishError::new(
                        PublishErrorKind::Timeout,
                        format!(
                            "exchange {exchange:?}: the channel did not take the message within \
                             the delivery timeout"
                        ),
                    ))));
                }
            }
        }
        // Await every confirm; collect the returned messages they carry, whichever they are.
        let outcomes: Vec<(
            Option<u64>,
            Result<Confirmed, PublishResult>,
            Option<Returned>,
        )> = join_all(slots.into_iter().map(|slot| async move {
            match slot {
                Slot::Done(r) => (None, Err(r), None),
                Slot::Waiting { tag, confirm } => {
                    match tokio::time::timeout_at(ack_deadline, confirm).await {
                        Ok(Ok(Confirmation::Ack(r))) => {
                            (Some(tag), Ok(Confirmed::Ack), r.map(|r| Returned::from(*r)))
                        }
                        Ok(Ok(Confirmation::Nack(r))) => (
                            Some(tag),
                            Ok(Confirmed::Nack),
                            r.map(|r| Returned::from(*r)),
                        ),
                        // Confirms are always selected; never report an unconfirmed
                        // message as stored.
                        Ok(Ok(Confirmation::NotRequested)) => (
                            Some(tag),
                            Ok(Confirmed::Failed(PublishError::new(
                                PublishErrorKind::Other,
                                "no publisher confirm was requested for this message",
                            ))),
                            None,
                        ),
                        Ok(Err(err)) => (
                            Some(tag),
                            Ok(Confirmed::Failed(publish_error(exchange, &err))),
                            None,
                        ),
                        Err(_elapsed) => (
                            Some(tag),
                            Ok(Confirmed::Failed(PublishError::new(
                                PublishErrorKind::Timeout,
                                format!(
                                    "exchange {exchange:?}: no confirm within the delivery \
                                         timeout"
                                ),
                            ))),
                            None,
                        ),
                    }
                }
            }
        }))
        .await;
        let all_confirmed = outcomes
            .iter()
            .all(|(_, o, _)| !matches!(o, Ok(Confirmed::Failed(_))));
        let returns: Vec<Returned> = outcomes.iter().filter_map(|(_, _, r)| r.clone()).collect();
        let ids: Vec<String> = batch.iter().map(|e| e.event_id.to_string()).collect();
        let (matched, unmatched) = match_returns(&ids, &returns);
        if unmatched > 0 {
            tracing::error!(unmatched, "returned messages that match no message of the batch; no message of the batch is reported stored");
        }
        let results = outcomes
            .into_iter()
            .enumerate()
            .map(|(i, (_, outcome, _))| match outcome {
                Err(done) => done,
                Ok(_) if matched[i].is_some() => {
                    let (code, text) = matched[i].clone().expect("checked");
                    Err(returned(exchange, keys[i], code, &text))
                }
                Ok(Confirmed::Ack) if unmatched > 0 => Err(PublishError::new(
                    PublishErrorKind::Other,
                    format!(
                        "exchange {exchange:?}: a returned message of this batch could not be \
                         matched to its message, so no acknowledgement of the batch is trusted"
                    ),
                )),
                Ok(Confirmed::Ack) => Ok(crate::ack::from_confirm(exchange, keys[i])),
                Ok(Confirmed::Nack) => Err(nacked(exchange)),
                Ok(Confirmed::Failed(err)) => Err(err),
            })
            .collect();
        match guard.as_mut() {
            // Every confirm came back: nothing of this batch can reach a later one.
            Some(link) if link.usable() && all_confirmed => link.dirty = false,
            // A broken channel, or confirms still pending: replaced before the next batch
            // (its unconfirmed messages are reported above; the relay re-sends them).
            _ => {
                if let Some(old) = guard.take() {
                    old.discard().await;
                }
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

    fn returned_with(id: Option<&str>) -> Returned {
        Returned {
            message_id: id.map(str::to_owned),
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
        }
    }

    /// Returns are matched by message id whatever confirm carried them; one that matches no
    /// message of the batch is counted, so the batch's acknowledgements are not trusted.
    #[test]
    fn returns_are_matched_by_message_id() {
        let ids: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let (m, unmatched) = match_returns(&ids, &[returned_with(Some("c"))]);
        assert_eq!(m, vec![None, None, Some((312, "NO_ROUTE".into()))]);
        assert_eq!(unmatched, 0);
        let (m, unmatched) = match_returns(&ids, &[returned_with(Some("z")), returned_with(None)]);
        assert_eq!(m, vec![None, None, None]);
        assert_eq!(unmatched, 2);
    }
}
