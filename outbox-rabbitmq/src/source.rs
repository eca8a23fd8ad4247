//! [`RabbitSource`]: the consumer side, a quorum-queue consumer with manual acks, acknowledging
//! by contiguous watermark ([`AckModel::ContiguousWatermark`]).
//!
//! # How RabbitMQ's `ack multiple` is the engine's watermark (see `docs/transports.md`)
//!
//! A delivery's position ([`LogPosition::rabbitmq`]) is ordered by `(queue, 0, delivery tag)`
//! and names, as its native identity, the exchange and routing key the message was published
//! with and whether the broker redelivered it (what a parked message shows an operator: `queue
//! orders tag 7 (exchange outbox, routing key order.created, redelivered)`; a queued message
//! has no stable position of its own, the event id identifies it). Tags count deliveries on
//! one channel from 1, and `basic.ack(tag, multiple = true)` acknowledges every delivery up to `tag` on that
//! channel. That **is** a contiguous watermark, so [`commit`](MessageSource::commit) maps
//! directly: "next offset `n`" becomes one `ack multiple` up to `n - 1`.
//!
//! Tags start again at 1 on a new channel, and a channel that closes gives every unacked
//! delivery back to the queue. So a new channel is a new assignment: the source tells the
//! attached tracker ([`SharedOffsetTracker::lose`], then the new channel's first tag begins a
//! fresh watermark), and a commit is clamped to the tracker's current committable offset and to
//! the tags this channel handed out: a commit computed for the old channel never acks the new
//! channel's deliveries early. A commit while the channel is gone is reported as
//! [`SourceErrorKind::Rebalanced`](outbox_core::SourceErrorKind::Rebalanced) (the engine drops
//! it; the broker redelivers).
//!
//! AMQP has no confirmation of `basic.ack`: an ack lost with the connection means a
//! redelivery, which the inbox absorbs.
//!
//! An undecodable message (no envelope: nothing to deduplicate by) is parked once per its
//! `message_id` property within the queue ([`ReceivedMessage::with_message_id`]; the outbox
//! publisher sets the event id), so its redelivery at a tag of a new channel is found parked
//! already. A message **without** `message_id` has no identity a redelivery keeps: it is
//! parked once per position (queue, tag), and a redelivery at another tag is parked a second
//! time (two parked copies of one message, never a loss; discard one). Publish with
//! `message_id` to avoid that.

use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, Consumer};

use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, AckModel, CommitOffset, ConfigError, ErrorClass, LogPosition, MessageSource,
    PartitionLag, ReceivedMessage, RecordHeader, SourceError, TopicPartition,
};

use crate::connection::connect;
use crate::error::source_error;
use crate::topology::{check_queue, QueueReport, TopologyError};

/// Default prefetch: at most 500 unacknowledged deliveries per member.
pub const DEFAULT_PREFETCH: u16 = 500;

/// Configuration of a [`RabbitSource`]. Build it with [`RabbitSource::builder`].
///
/// | field | default | meaning |
/// |---|---|---|
/// | `uri` | (required) | AMQP URI |
/// | `queue` | (required) | a durable quorum queue (checked at start) |
/// | `prefetch` | 500 | unacknowledged deliveries per member (`basic.qos`); must cover `max_in_flight` of the engine or the engine waits for acks |
/// | `require_single_active_consumer` | `true` | refuse a queue without single active consumer (two members would split one aggregate's messages) |
/// | `connect_timeout` | 5 s | connecting and each check |
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RabbitSourceConfig {
    /// AMQP URI.
    pub uri: String,
    /// Queue.
    pub queue: String,
    /// Prefetch.
    pub prefetch: u16,
    /// Refuse a queue without single active consumer.
    pub require_single_active_consumer: bool,
    /// Connect timeout.
    pub connect_timeout: Duration,
}

/// Builder of a [`RabbitSource`].
#[derive(Debug)]
pub struct RabbitSourceBuilder {
    config: RabbitSourceConfig,
}

impl RabbitSourceBuilder {
    /// Sets the prefetch. Default 500.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.config.prefetch = n;
        self
    }

    /// Whether a queue without single active consumer is refused. Default `true`; turn it off
    /// only for a consumer that runs as exactly one process.
    pub fn require_single_active_consumer(mut self, yes: bool) -> Self {
        self.config.require_single_active_consumer = yes;
        self
    }

    /// Sets the connect timeout. Default 5 s.
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.config.connect_timeout = d;
        self
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let c = &self.config;
        if c.uri.trim().is_empty() {
            return Err(ConfigError::new("uri must not be empty"));
        }
        if c.queue.is_empty() || c.queue.len() > 255 || c.queue.starts_with("amq.") {
            return Err(ConfigError::new(format!(
                "queue {:?}: name a durable quorum queue of your own (1..=255 bytes, not amq.*)",
                c.queue
            )));
        }
        if c.prefetch == 0 {
            return Err(ConfigError::new(
                "prefetch 0 means unbounded in AMQP: set a bound",
            ));
        }
        Ok(())
    }

    /// Validates, checks the queue (durable quorum queue; single active consumer unless
    /// allowed otherwise) and returns the source with the check's report. Consuming starts at
    /// the first [`MessageSource::poll`].
    pub async fn start(self) -> Result<(RabbitSource, QueueReport), SourceError> {
        self.validate()
            .map_err(|e| SourceError::new(ErrorClass::Permanent, e.to_string()))?;
        let c = self.config;
        let conn = connect(&c.uri, "outbox-consumer-check", c.connect_timeout)
            .await
            .map_err(|e| source_error("connect", e))?;
        let report = check_queue(&conn, &c.queue, c.connect_timeout).await;
        let _ = tokio::time::timeout(c.connect_timeout, conn.close(200, "checked")).await;
        let report = report.map_err(|e| {
            let class = if e.is_transient() {
                ErrorClass::Transient
            } else {
                ErrorClass::Permanent
            };
            SourceError::new(class, e.to_string()).with_source(e)
        })?;
        if c.require_single_active_consumer && !report.single_active_consumer {
            return Err(SourceError::new(
                ErrorClass::Permanent,
                TopologyError::Inequivalent {
                    what: "queue",
                    name: c.queue.clone(),
                    expected: "a single-active-consumer queue".into(),
                    detail: "two members would split one aggregate's messages between them; \
                             declare it with x-single-active-consumer = true (or allow it with \
                             require_single_active_consumer(false) for a single process)"
                        .into(),
                }
                .to_string(),
            ));
        }
        tracing::info!(queue = %report.name, quorum = report.quorum, single_active_consumer = report.single_active_consumer, messages = report.messages, consumers = report.consumers, "inbox queue checked");
        Ok((
            RabbitSource {
                tp: TopicPartition::new(c.queue.clone(), 0),
                config: c.clone(),
                link: tokio::sync::Mutex::new(LinkState::Opening(spawn_open(c.clone()))),
                state: Mutex::new(ChannelState::default()),
                tracker: Mutex::new(None),
            },
            report,
        ))
    }
}

struct Link {
    connection: Connection,
    channel: Channel,
    consumer: Consumer,
}

/// The consuming channel, or the task opening one. Opening runs as a task of its own, so a
/// poll dropped while the connection is being made (polls are cancellation safe) does not
/// throw the attempt away: the next poll awaits the same task.
enum LinkState {
    Closed,
    Opening(tokio::task::JoinHandle<Result<Link, lapin::Error>>),
    Open(Box<Link>),
}

impl LinkState {
    fn open(&self) -> Option<&Link> {
        match self {
            Self::Open(l) => Some(l),
            _ => None,
        }
    }
}

/// Opens a connection, a channel with the prefetch, and the consumer.
fn spawn_open(c: RabbitSourceConfig) -> tokio::task::JoinHandle<Result<Link, lapin::Error>> {
    tokio::spawn(async move {
        let connection = connect(&c.uri, "outbox-consumer", c.connect_timeout).await?;
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(c.prefetch, BasicQosOptions::default())
            .await?;
        let consumer = channel
            .basic_consume(
                &c.queue,
                "",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Link {
            connection,
            channel,
            consumer,
        })
    })
}

/// What the current channel handed out and acknowledged.
#[derive(Default)]
struct ChannelState {
    /// Channels opened so far (the first is an assignment, later ones follow a loss).
    generation: u64,
    /// The current channel is open.
    open: bool,
    highest_tag: u64,
    acked_to: u64,
}

/// The outbox [`MessageSource`] for RabbitMQ: a consumer on a durable quorum queue with manual
/// acks sent only through [`commit`](MessageSource::commit) (after the effects' transactions
/// committed) and [`close`](Self::close), at most `prefetch` deliveries unacknowledged. See the
/// [module docs](crate::source) for how acks map to offsets; a redelivery after a crash is a duplicate
/// the inbox absorbs.
pub struct RabbitSource {
    config: RabbitSourceConfig,
    tp: TopicPartition,
    link: tokio::sync::Mutex<LinkState>,
    state: Mutex<ChannelState>,
    tracker: Mutex<Option<SharedOffsetTracker>>,
}

impl fmt::Debug for RabbitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitSource")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RabbitSource {
    /// A builder for a source consuming `queue` at `uri`.
    pub fn builder(uri: impl Into<String>, queue: impl Into<String>) -> RabbitSourceBuilder {
        RabbitSourceBuilder {
            config: RabbitSourceConfig {
                uri: uri.into(),
                queue: queue.into(),
                prefetch: DEFAULT_PREFETCH,
                require_single_active_consumer: true,
                connect_timeout: crate::DEFAULT_CONNECT_TIMEOUT,
            },
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RabbitSourceConfig {
        &self.config
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ChannelState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn tracker(&self) -> Option<SharedOffsetTracker> {
        self.tracker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Channels opened so far.
    pub fn channel_generation(&self) -> u64 {
        self.state().generation
    }

    /// Drops the current channel (its unacked deliveries go back to the queue) and tells the
    /// tracker that the "partition" was lost.
    async fn drop_link(&self, guard: &mut LinkState) {
        match std::mem::replace(guard, LinkState::Closed) {
            LinkState::Open(old) => {
                if old.connection.status().connected() {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(1),
                        old.connection.close(200, "reconnecting"),
                    )
                    .await;
                }
            }
            LinkState::Opening(task) => task.abort(),
            LinkState::Closed => {}
        }
        self.state().open = false;
        if let Some(t) = self.tracker() {
            t.lose(std::slice::from_ref(&self.tp));
        }
    }

    fn received(&self, d: Delivery) -> ReceivedMessage {
        {
            let mut st = self.state();
            st.highest_tag = st.highest_tag.max(d.delivery_tag);
        }
        let mut headers: Vec<RecordHeader> = d
            .properties
            .headers()
            .as_ref()
            .map(|t| {
                t.inner()
                    .iter()
                    .filter(|(k, _)| !is_broker_annotation(k.as_str()))
                    .map(|(k, v)| match amqp_bytes(v) {
                        Some(b) => RecordHeader::new(k.as_str(), b),
                        None => RecordHeader::null(k.as_str()),
                    })
                    .collect()
            })
            .unwrap_or_default();
        headers.sort_by(|a, b| a.name.cmp(&b.name));
        let timestamp = d
            .properties
            .timestamp()
            .and_then(|t| i64::try_from(t).ok())
            .and_then(|t| DateTime::<Utc>::from_timestamp(t, 0));
        let message_id = d.properties.message_id().as_ref().map(|m| m.to_string());
        let received = ReceivedMessage::from_record(
            LogPosition::rabbitmq(
                self.tp.topic.clone(),
                d.delivery_tag,
                d.exchange.as_str(),
                d.routing_key.as_str(),
                d.redelivered,
            ),
            None,
            headers,
            Some(d.data),
            timestamp,
        );
        // What a redelivery keeps (the tag is new on every channel): an undecodable message is
        // parked once per message id; one without is parked once per tag (see the module docs).
        match message_id {
            Some(id) => received.with_message_id(id),
            None => received,
        }
    }

    /// Leaves cleanly: acks what the attached tracker holds final (its revoke commit) and
    /// closes the channel, which gives every other delivery back to the queue at once.
    pub async fn close(self) {
        if let Some(t) = self.tracker() {
            let commits = t.revoke(std::slice::from_ref(&self.tp));
            if let Err(e) = self.ack_to(&commits, false).await {
                tracing::warn!(error = %e, "final ack at close failed; those deliveries are redelivered");
            }
        }
        match std::mem::replace(&mut *self.link.lock().await, LinkState::Closed) {
            LinkState::Open(link) => {
                let t = self.config.connect_timeout;
                let _ = tokio::time::timeout(t, link.channel.close(200, "leaving")).await;
                let _ = tokio::time::timeout(t, link.connection.close(200, "leaving")).await;
            }
            LinkState::Opening(task) => task.abort(),
            LinkState::Closed => {}
        }
    }

    async fn ack_to(&self, commits: &[CommitOffset], clamp: bool) -> Result<(), SourceError> {
        let Some(next) = commits
            .iter()
            .filter(|c| c.topic_partition() == self.tp)
            .map(|c| c.next_offset)
            .max()
        else {
            return Ok(());
        };
        let limit = if clamp {
            match self.tracker() {
                None => Some(next),
                Some(t) => t
                    .lock()
                    .partition(&self.tp)
                    .and_then(|w| w.committable())
                    .map(|c| c.min(next)),
            }
        } else {
            Some(next)
        };
        let Some(limit) = limit.and_then(|l| u64::try_from(l).ok()) else {
            return Ok(());
        };
        let guard = self.link.lock().await;
        let tag = {
            let st = self.state();
            if !st.open || guard.open().is_none() {
                return Err(SourceError::rebalanced(format!(
                    "the channel of {} is closed: its unacknowledged deliveries go back to the \
                     queue",
                    self.tp
                )));
            }
            let tag = limit.saturating_sub(1).min(st.highest_tag);
            if tag <= st.acked_to {
                return Ok(());
            }
            tag
        };
        let link = guard.open().expect("checked open");
        match link
            .channel
            .basic_ack(tag, BasicAckOptions { multiple: true })
            .await
        {
            Ok(()) => {
                let mut st = self.state();
                st.acked_to = st.acked_to.max(tag);
                Ok(())
            }
            Err(e) => Err(SourceError::rebalanced(format!(
                "ack up to {tag} on {} failed ({e}); the deliveries go back to the queue",
                self.tp
            ))),
        }
    }
}

/// Headers RabbitMQ itself adds to a delivery (quorum queues count redeliveries; dead
/// lettering records its history): not part of the record as published, so they are left out
/// of the headers the envelope is decoded from (a redelivered message decodes to the same
/// envelope as its first delivery).
pub(crate) fn is_broker_annotation(name: &str) -> bool {
    matches!(name, "x-delivery-count" | "x-death" | "x-received-from")
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
}

/// The bytes of a header value: strings as they are, other AMQP values in their text form;
/// `None` for AMQP's void (a null value).
fn amqp_bytes(v: &AMQPValue) -> Option<Vec<u8>> {
    match v {
        AMQPValue::LongString(s) => Some(s.as_bytes().to_vec()),
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes().to_vec()),
        AMQPValue::ByteArray(b) => Some(b.as_slice().to_vec()),
        AMQPValue::Void => None,
        other => Some(format!("{other:?}").into_bytes()),
    }
}

#[async_trait]
impl MessageSource for RabbitSource {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        let mut guard = self.link.lock().await;
        if matches!(*guard, LinkState::Closed) {
            *guard = LinkState::Opening(spawn_open(self.config.clone()));
        }
        if let LinkState::Opening(task) = &mut *guard {
            let opened = if timeout.is_zero() {
                match futures::FutureExt::now_or_never(&mut *task) {
                    None => return Ok(None),
                    Some(r) => r,
                }
            } else {
                match tokio::time::timeout(timeout, &mut *task).await {
                    Err(_) => return Ok(None),
                    Ok(r) => r,
                }
            };
            let link = match opened {
                Ok(Ok(link)) => link,
                Ok(Err(e)) => {
                    *guard = LinkState::Closed;
                    return Err(source_error("consume", e));
                }
                Err(join) => {
                    *guard = LinkState::Closed;
                    return Err(SourceError::new(
                        ErrorClass::Transient,
                        format!("opening the consumer failed: {join}"),
                    ));
                }
            };
            {
                let mut st = self.state();
                st.generation += 1;
                st.open = true;
                st.highest_tag = 0;
                st.acked_to = 0;
            }
            if let Some(t) = self.tracker() {
                // Tags start at 1 again: a fresh watermark, earlier tickets do not count.
                t.assign(std::slice::from_ref(&self.tp));
            }
            *guard = LinkState::Open(Box::new(link));
        }
        let LinkState::Open(link) = &mut *guard else {
            return Ok(None);
        };
        let consumer = &mut link.consumer;
        let next = if timeout.is_zero() {
            match futures::FutureExt::now_or_never(consumer.next()) {
                None => return Ok(None),
                Some(n) => n,
            }
        } else {
            match tokio::time::timeout(timeout, consumer.next()).await {
                Err(_) => return Ok(None),
                Ok(n) => n,
            }
        };
        match next {
            Some(Ok(d)) => Ok(Some(self.received(d))),
            Some(Err(e)) => {
                self.drop_link(&mut guard).await;
                Err(source_error(&format!("consuming {}", self.tp), e))
            }
            None => {
                self.drop_link(&mut guard).await;
                Err(SourceError::new(
                    ErrorClass::Transient,
                    format!("the consumer of {} was cancelled; consuming again", self.tp),
                ))
            }
        }
    }

    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        self.ack_to(offsets, true).await
    }

    /// A contiguous watermark per channel: `ack multiple` up to a delivery tag.
    fn ack_model(&self) -> AckModel {
        AckModel::ContiguousWatermark
    }

    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        *self.tracker.lock().unwrap_or_else(PoisonError::into_inner) = Some(offsets);
    }

    /// Ready messages in the queue plus this member's unacknowledged deliveries, as one
    /// "partition" whose committed offset is 0 (RabbitMQ has no offsets; only the difference
    /// means something).
    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        let guard = self.link.lock().await;
        let Some(link) = guard.open() else {
            return Ok(Vec::new());
        };
        let q = link
            .channel
            .queue_declare(
                &self.config.queue,
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| source_error("queue depth", e))?;
        let unacked = {
            let st = self.state();
            st.highest_tag.saturating_sub(st.acked_to)
        };
        let end = i64::from(q.message_count()) + i64::try_from(unacked).unwrap_or(i64::MAX);
        Ok(vec![PartitionLag::new(self.tp.clone(), Some(0), 0, end)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_annotations_are_not_record_headers() {
        for name in [
            "x-delivery-count",
            "x-death",
            "x-first-death-queue",
            "x-last-death-reason",
            "x-received-from",
        ] {
            assert!(is_broker_annotation(name), "{name}");
        }
        for name in ["event_id", "traceparent", "x-tenant", "x-deathly"] {
            assert!(!is_broker_annotation(name), "{name}");
        }
        assert_eq!(
            amqp_bytes(&AMQPValue::LongString("v".into())),
            Some(b"v".to_vec())
        );
        assert_eq!(amqp_bytes(&AMQPValue::Void), None);
    }
}
