//! The transport a case runs over ([`Transport`]): the broker the relays publish to and the
//! consumer engine reads from, in memory, with the delivery semantics of Kafka, NATS JetStream
//! or RabbitMQ.
//!
//! The broker's storage is always the simulation's [`MemoryLog`] (what was stored, in order):
//! Kafka's topic of partitions; JetStream's stream (one partition, stream sequence = offset +
//! 1); RabbitMQ's queue (one partition, in the order messages were enqueued). What differs is
//! how records get in and how they come out:
//!
//! | | Kafka | JetStream | RabbitMQ |
//! |---|---|---|---|
//! | a re-send of a stored event | stored again | not stored within the duplicate window ([`DUPLICATE_WINDOW`], `Nats-Msg-Id` = event id); its `PubAck` names the copy stored before, flagged duplicate | stored again (the consumer gets both) |
//! | acknowledgement metadata | topic, partition, offset | stream, stream sequence, subject | exchange, routing key (no position) |
//! | positions handed to the engine | offsets | [`LogPosition::jetstream`]: stream sequence, a new delivery sequence for every delivery | [`LogPosition::rabbitmq`]: the channel's delivery tag, the redelivered flag |
//! | a commit "next `n`" | the group's offset | a per-message `+ACK` of every delivery below `n` this member holds ([`AckModel::PerMessage`]); each final delivery also acked ahead of the watermark (`ack_ahead`) | `basic.ack` with `multiple` up to tag `n - 1` on the current channel |
//! | redelivery | from the committed offset after a crash or rebalance | of every unacked message whose ack wait ([`ACK_WAIT`], virtual time moved by [`crate::Step::Advance`]) ran out, *after* later messages were delivered, at a new delivery sequence; a crashed member's messages likewise; a clean leave (`Rebalance`) gives them back at once (`-NAK`) | every unacked delivery of a channel that closes (a crash, or `Rebalance`: the channel is lost under the running engine), flagged redelivered, back at its place in the queue, on a new channel whose tags start again at 1 |
//!
//! The consumer's source for JetStream and RabbitMQ follows what `outbox-nats` and
//! `outbox-rabbitmq` do with those deliveries (a redelivery of a message still held is not
//! handed out again; commits are clamped to the tracker's committable offset; a new channel is
//! a new assignment of the tracker): the simulation drives the real engine against the
//! transports' semantics, not the adapters themselves (those are tested against the servers).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, AckMetadata, AckModel, CommitOffset, Envelope, EventId, LogPosition,
    MessageSource, PartitionLag, PublishResult, Publisher, ReceivedMessage, SourceError,
    TopicPartition,
};
use outbox_testkit::{LogRecord, MemoryConsumer, MemoryLog};

use crate::config::SeededBug;

/// The transport of a case.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Transport {
    /// A partitioned log with offset commits (Kafka).
    #[default]
    Kafka,
    /// One ordered stream, a durable consumer with per-message acks and redelivery after the
    /// ack wait (NATS JetStream).
    JetStream,
    /// A queue consumed on a channel, `ack multiple` by delivery tag, requeue of everything
    /// unacked when the channel closes (RabbitMQ).
    RabbitMq,
}

impl Transport {
    /// Every transport.
    pub const ALL: [Transport; 3] = [Self::Kafka, Self::JetStream, Self::RabbitMq];
}

/// How long JetStream waits for an acknowledgement before it redelivers (virtual time).
pub const ACK_WAIT: Duration = Duration::from_secs(30);
/// JetStream's duplicate window: a message id seen within it is not stored again.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// The exchange the RabbitMQ publisher sends to.
pub const EXCHANGE: &str = "outbox";

/// One delivery of a JetStream message not acknowledged yet.
#[derive(Clone, Copy, Debug)]
struct Pending {
    /// When it was delivered (virtual time): its ack wait runs from here.
    at: Duration,
}

#[derive(Debug, Default)]
struct BrokerState {
    /// The transport's virtual time (moved by `Step::Advance`).
    now: Duration,
    /// JetStream: message id -> (stream sequence, when stored), for the duplicate window.
    msg_ids: HashMap<EventId, (u64, Duration)>,
    /// Entries (log indices of partition 0) acknowledged.
    acked: BTreeSet<usize>,
    /// Entries delivered more than once.
    redelivered: BTreeSet<usize>,
    /// JetStream: the next entry never delivered.
    next_new: usize,
    /// JetStream: the last delivery sequence given out.
    delivery_seq: u64,
    /// JetStream: the first delivery sequence of each entry delivered.
    first_delivery: BTreeMap<usize, u64>,
    /// JetStream: unacknowledged deliveries by entry.
    pending: BTreeMap<usize, Pending>,
    /// JetStream: entries due for redelivery (ack wait ran out, or given back), in order.
    redeliver: VecDeque<usize>,
    /// RabbitMQ: entries put in the queue so far.
    enqueued: usize,
    /// RabbitMQ: ready entries in queue order, with their redelivered flag.
    ready: VecDeque<(usize, bool)>,
    /// RabbitMQ: the current channel (0: none yet).
    channel: u64,
    /// RabbitMQ: deliveries of the current channel not acknowledged, by tag.
    unacked: BTreeMap<u64, (usize, bool)>,
    /// RabbitMQ: the last tag of the current channel.
    tag: u64,
    /// JetStream: re-sends kept out of the stream by the duplicate window.
    deduplicated: usize,
    /// JetStream: redeliveries handed to a member holding later messages unacknowledged.
    behind_later: usize,
    /// JetStream: new messages another member is still to pull before it dies.
    other_takes: usize,
    /// JetStream: messages another member pulled and died holding.
    taken_by_dead: usize,
}

/// The broker of a case: publishes as its transport does and hands out deliveries.
#[derive(Clone, Debug)]
pub(crate) struct Broker {
    transport: Transport,
    log: MemoryLog,
    state: Arc<Mutex<BrokerState>>,
}

impl Broker {
    pub(crate) fn new(transport: Transport, log: MemoryLog) -> Self {
        Self {
            transport,
            log,
            state: Arc::default(),
        }
    }

    pub(crate) fn transport(&self) -> Transport {
        self.transport
    }

    fn lock(&self) -> MutexGuard<'_, BrokerState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn entries(&self) -> Vec<LogRecord> {
        self.log.records(crate::runner::TOPIC, 0)
    }

    /// Stores `e` as the transport does; the acknowledgement it gives.
    pub(crate) async fn publish(&self, e: &Envelope) -> Result<PublishResult, String> {
        if self.transport == Transport::JetStream {
            let mut st = self.lock();
            if let Some((sequence, at)) = st.msg_ids.get(&e.event_id).copied() {
                if st.now.saturating_sub(at) < DUPLICATE_WINDOW {
                    st.deduplicated += 1;
                    return Ok(Ok(AckMetadata::JetStream {
                        stream: crate::runner::TOPIC.to_owned(),
                        sequence,
                        subject: subject(e),
                        duplicate: true,
                    }));
                }
            }
        }
        let mut r = self.log.publish(&[e]).await;
        let stored = r.pop().ok_or("the log answered nothing")?;
        let Ok(ack) = stored else {
            return Ok(stored);
        };
        Ok(Ok(match self.transport {
            Transport::Kafka => ack,
            Transport::JetStream => {
                let (_, _, offset) = ack.as_kafka().ok_or("the log gave no offset")?;
                let sequence = u64::try_from(offset + 1).map_err(|e| e.to_string())?;
                let mut st = self.lock();
                let now = st.now;
                st.msg_ids.insert(e.event_id, (sequence, now));
                AckMetadata::JetStream {
                    stream: crate::runner::TOPIC.to_owned(),
                    sequence,
                    subject: subject(e),
                    duplicate: false,
                }
            }
            Transport::RabbitMq => AckMetadata::RabbitMq {
                exchange: EXCHANGE.to_owned(),
                routing_key: e.aggregate_id.clone(),
            },
        }))
    }

    /// Virtual time passes: JetStream queues every delivery whose ack wait ran out.
    pub(crate) fn advance(&self, d: Duration) {
        let mut st = self.lock();
        st.now += d;
        let now = st.now;
        let due: Vec<usize> = st
            .pending
            .iter()
            .filter(|(_, p)| p.at + ACK_WAIT <= now)
            .map(|(e, _)| *e)
            .collect();
        for e in due {
            if !st.redeliver.contains(&e) {
                st.redeliver.push_back(e);
            }
        }
    }

    /// At quiescence: the ack wait of every unacknowledged JetStream delivery runs out.
    /// Returns how many deliveries were queued again.
    pub(crate) fn expire_all(&self) -> usize {
        if self.transport != Transport::JetStream {
            return 0;
        }
        let before = self.lock().redeliver.len();
        self.advance(ACK_WAIT);
        self.lock().redeliver.len() - before
    }

    /// Whether the acknowledged state covers every stored message (at quiescence).
    pub(crate) fn all_acked(&self) -> Result<(), String> {
        let st = self.lock();
        let missing: Vec<usize> = (0..self.entries().len())
            .filter(|e| !st.acked.contains(e))
            .collect();
        match missing.first() {
            None => Ok(()),
            Some(_) => Err(format!(
                "{:?}: messages never acknowledged after draining (stream sequence / queue \
                 entry - 1): {missing:?}",
                self.transport
            )),
        }
    }

    /// The acknowledged entries and their records (for the invariant "an acknowledged message
    /// is final").
    pub(crate) fn acked_records(&self) -> Vec<LogRecord> {
        let entries = self.entries();
        let st = self.lock();
        st.acked
            .iter()
            .filter_map(|e| entries.get(*e).cloned())
            .collect()
    }

    /// JetStream: each delivered event's first delivery sequence.
    pub(crate) fn first_deliveries(&self) -> Vec<(EventId, i64)> {
        let entries = self.entries();
        let st = self.lock();
        st.first_delivery
            .iter()
            .filter_map(|(e, d)| {
                let id = entries.get(*e)?.decode().ok()?.event_id;
                Some((id, i64::try_from(*d).unwrap_or(i64::MAX)))
            })
            .collect()
    }

    /// Events delivered more than once (redeliveries after later messages, on JetStream).
    pub(crate) fn redelivered_events(&self) -> BTreeSet<EventId> {
        let entries = self.entries();
        let st = self.lock();
        st.redelivered
            .iter()
            .filter_map(|e| entries.get(*e)?.decode().ok())
            .map(|e| e.event_id)
            .collect()
    }

    /// Re-sends JetStream's duplicate window kept out of the stream.
    pub(crate) fn deduplicated_sends(&self) -> usize {
        self.lock().deduplicated
    }

    /// JetStream redeliveries handed to a member that held later messages unacknowledged.
    pub(crate) fn redelivered_behind_later(&self) -> usize {
        self.lock().behind_later
    }

    // ---- JetStream ----

    /// The next delivery: a due redelivery first, else the next new message. `(entry,
    /// delivery sequence, whether it is a redelivery)`.
    fn js_next(&self) -> Option<(usize, u64, bool)> {
        let len = self.entries().len();
        let mut st = self.lock();
        let entry = loop {
            match st.redeliver.pop_front() {
                Some(e) if st.pending.contains_key(&e) => {
                    st.redelivered.insert(e);
                    break e;
                }
                Some(_) => continue, // acknowledged meanwhile
                None if st.next_new < len && st.other_takes > 0 => {
                    // Pulled by the other member, which dies holding it: pending from now.
                    st.other_takes -= 1;
                    st.taken_by_dead += 1;
                    st.delivery_seq += 1;
                    let (e, d, at) = (st.next_new, st.delivery_seq, st.now);
                    st.next_new += 1;
                    st.first_delivery.insert(e, d);
                    st.pending.insert(e, Pending { at });
                    continue;
                }
                None if st.next_new < len => {
                    st.next_new += 1;
                    break st.next_new - 1;
                }
                None => return None,
            }
        };
        st.delivery_seq += 1;
        let (delivery, at) = (st.delivery_seq, st.now);
        let again = st.first_delivery.contains_key(&entry);
        st.first_delivery.entry(entry).or_insert(delivery);
        st.pending.insert(entry, Pending { at });
        Some((entry, delivery, again))
    }

    fn js_ack(&self, entries: &[usize]) {
        let mut st = self.lock();
        for e in entries {
            // Acknowledged by stream sequence, whichever delivery's reply subject it came on.
            if st.pending.remove(e).is_some() {
                st.acked.insert(*e);
            }
        }
    }

    /// JetStream: another member of the durable consumer pulls the next `n` new messages
    /// before the live one and dies without acknowledging them (they come back after their
    /// ack wait). A no-op on the other transports.
    pub(crate) fn member_dies(&self, n: usize) {
        if self.transport == Transport::JetStream {
            self.lock().other_takes += n;
        }
    }

    /// JetStream messages another member pulled and died holding.
    pub(crate) fn taken_by_dead_members(&self) -> usize {
        self.lock().taken_by_dead
    }

    /// `-NAK`: redelivered at once (a clean leave gives back what it holds).
    fn js_nak(&self, entries: &[usize]) {
        let mut st = self.lock();
        for e in entries {
            if st.pending.contains_key(e) && !st.redeliver.contains(e) {
                st.redeliver.push_back(*e);
            }
        }
    }

    // ---- RabbitMQ ----

    fn enqueue_new(&self, st: &mut BrokerState) {
        let len = self.entries().len();
        while st.enqueued < len {
            st.ready.push_back((st.enqueued, false));
            st.enqueued += 1;
        }
    }

    /// Opens a new channel (the previous one, if any, is closed first). Its id.
    fn rabbit_open(&self) -> u64 {
        let mut st = self.lock();
        Self::requeue(&mut st);
        st.channel += 1;
        st.tag = 0;
        st.channel
    }

    /// The channel `channel` closes: every unacked delivery goes back to its place in the
    /// queue, flagged redelivered.
    fn rabbit_close(&self, channel: u64) {
        let mut st = self.lock();
        if st.channel == channel {
            Self::requeue(&mut st);
        }
    }

    fn requeue(st: &mut BrokerState) {
        let back: Vec<(usize, bool)> = std::mem::take(&mut st.unacked)
            .into_values()
            .map(|(e, _)| (e, true))
            .collect();
        if back.is_empty() {
            return;
        }
        st.ready.extend(back);
        st.ready.make_contiguous().sort_by_key(|(e, _)| *e);
    }

    /// The next delivery on `channel`: `(tag, entry, redelivered)`.
    fn rabbit_next(&self, channel: u64) -> Option<(u64, usize, bool)> {
        let mut st = self.lock();
        if st.channel != channel {
            return None;
        }
        self.enqueue_new(&mut st);
        let (entry, redelivered) = st.ready.pop_front()?;
        if redelivered {
            st.redelivered.insert(entry);
        }
        st.tag += 1;
        let tag = st.tag;
        st.unacked.insert(tag, (entry, redelivered));
        Some((tag, entry, redelivered))
    }

    /// RabbitMQ: the events the current channel delivered and holds unacknowledged.
    pub(crate) fn rabbit_unacked(&self) -> Vec<EventId> {
        let entries: Vec<usize> = self.lock().unacked.values().map(|(e, _)| *e).collect();
        let records = self.entries();
        entries
            .iter()
            .filter_map(|e| records.get(*e)?.decode().ok())
            .map(|e| e.event_id)
            .collect()
    }

    /// `basic.ack(tag, multiple)` on `channel`; false when the channel is closed.
    fn rabbit_ack(&self, channel: u64, tag: u64, multiple: bool) -> bool {
        let mut st = self.lock();
        if st.channel != channel {
            return false;
        }
        let tags: Vec<u64> = if multiple {
            st.unacked.range(..=tag).map(|(t, _)| *t).collect()
        } else {
            vec![tag]
        };
        for t in tags {
            if let Some((e, _)) = st.unacked.remove(&t) {
                st.acked.insert(e);
            }
        }
        true
    }
}

/// The subject a JetStream publisher sends an event to.
fn subject(e: &Envelope) -> String {
    format!("{}.{}", crate::runner::TOPIC, e.aggregate_type)
}

/// Where the acknowledgement metadata stored for event `id` of `aggregate` points, checked
/// against the broker's storage: `Err` names what is there instead.
pub(crate) fn check_ack(
    ack: &AckMetadata,
    log: &MemoryLog,
    id: EventId,
    aggregate: &str,
) -> Result<(), String> {
    let event_at = |topic: &str, partition: i32, offset: i64| {
        log.records(topic, partition)
            .into_iter()
            .find(|r| r.offset == offset)
            .and_then(|r| r.decode().ok())
            .map(|e| e.event_id)
    };
    let there = match ack {
        AckMetadata::Kafka {
            topic,
            partition,
            offset,
        } => event_at(topic.as_str(), *partition, *offset),
        AckMetadata::JetStream {
            stream, sequence, ..
        } => {
            let offset = i64::try_from(*sequence).unwrap_or(i64::MAX) - 1;
            event_at(stream.as_str(), 0, offset)
        }
        AckMetadata::RabbitMq {
            exchange,
            routing_key,
        } => {
            // A confirm names no position: the event is in the queue, routed by its key.
            let stored = log
                .all_records()
                .iter()
                .filter_map(|r| r.decode().ok())
                .any(|e| e.event_id == id);
            (exchange == EXCHANGE && routing_key == aggregate && stored).then_some(id)
        }
        other => {
            return Err(format!(
                "an acknowledgement of an unknown transport: {other}"
            ))
        }
    };
    if there == Some(id) {
        Ok(())
    } else {
        Err(format!(
            "event {id} is marked published at {ack} but the log holds {} there",
            there.map_or_else(|| "nothing".to_owned(), |t| t.to_string())
        ))
    }
}

/// A member of the consumer: reads the broker as its transport delivers.
#[derive(Debug)]
pub enum TransportSource {
    /// A Kafka consumer-group member.
    Kafka(MemoryConsumer),
    /// A JetStream durable pull consumer's member.
    JetStream(JetStreamMember),
    /// A RabbitMQ consumer on a channel.
    RabbitMq(RabbitMember),
}

impl TransportSource {
    pub(crate) fn new(broker: &Broker, log: &MemoryLog, bug: Option<SeededBug>) -> Self {
        match broker.transport {
            Transport::Kafka => {
                Self::Kafka(log.consumer(crate::runner::GROUP, &[crate::runner::TOPIC]))
            }
            Transport::JetStream => Self::JetStream(JetStreamMember {
                broker: broker.clone(),
                bug,
                held: Mutex::default(),
                tracker: Mutex::default(),
            }),
            Transport::RabbitMq => Self::RabbitMq(RabbitMember {
                broker: broker.clone(),
                bug,
                state: Mutex::default(),
                tracker: Mutex::default(),
            }),
        }
    }

    /// A clean leave after the final commit: JetStream gives back what it holds (`-NAK`);
    /// the others need nothing more (a Kafka group rebalances, a RabbitMQ channel closes
    /// when the member is dropped).
    pub(crate) fn leave(&self) {
        if let Self::JetStream(m) = self {
            let rest: Vec<usize> = std::mem::take(&mut *m.held()).into_values().collect();
            m.broker.js_nak(&rest);
        }
    }

    /// RabbitMQ: the channel is lost under the running engine. Whether this transport has
    /// such a thing.
    pub(crate) fn lose_channel(&self) -> bool {
        match self {
            Self::RabbitMq(m) => {
                m.lose();
                true
            }
            _ => false,
        }
    }
}

fn tracker_of(t: &Mutex<Option<SharedOffsetTracker>>) -> Option<SharedOffsetTracker> {
    t.lock().unwrap_or_else(PoisonError::into_inner).clone()
}

/// The tracker's committable offset of `tp`, at most `next` (what the adapters clamp a commit
/// to).
fn clamp(tracker: Option<SharedOffsetTracker>, tp: &TopicPartition, next: i64) -> Option<i64> {
    match tracker {
        None => Some(next),
        Some(t) => t
            .lock()
            .partition(tp)
            .and_then(|w| w.committable())
            .map(|c| c.min(next)),
    }
}

fn topic_partition() -> TopicPartition {
    TopicPartition::new(crate::runner::TOPIC, 0)
}

fn next_of(offsets: &[CommitOffset]) -> Option<i64> {
    let tp = topic_partition();
    offsets
        .iter()
        .filter(|c| c.topic_partition() == tp)
        .map(|c| c.next_offset)
        .max()
}

/// A JetStream member: deliveries it holds unacknowledged, by the offset it handed out.
#[derive(Debug)]
pub struct JetStreamMember {
    broker: Broker,
    bug: Option<SeededBug>,
    /// Offset handed out -> entry.
    held: Mutex<BTreeMap<i64, usize>>,
    tracker: Mutex<Option<SharedOffsetTracker>>,
}

impl JetStreamMember {
    fn held(&self) -> MutexGuard<'_, BTreeMap<i64, usize>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn try_next(&self) -> Option<ReceivedMessage> {
        loop {
            let (entry, delivery, again) = self.broker.js_next()?;
            let (held_here, later_held) = {
                let held = self.held();
                (
                    held.values().any(|e| *e == entry),
                    held.values().any(|e| *e > entry),
                )
            };
            if held_here {
                // A redelivery of a message still held here: not handed out again (its new
                // delivery's acknowledgement is the one the held entry sends).
                continue;
            }
            if again && later_held {
                // Another member's message (it crashed holding it) comes back behind later
                // messages this member holds unacknowledged.
                self.broker.lock().behind_later += 1;
            }
            let record = self.broker.entries().get(entry)?.clone();
            let stream_sequence = entry as u64 + 1;
            let mut msg = record.to_received();
            msg.position = LogPosition::jetstream(
                crate::runner::TOPIC,
                stream_sequence,
                delivery,
                crate::runner::GROUP,
            );
            if self.bug == Some(SeededBug::JetStreamStreamSequenceOffsets) {
                // The seeded bug: ordered by the stream sequence, which goes backwards on a
                // redelivery after later messages (the watermark takes it for a rewind).
                msg.position.offset = stream_sequence as i64;
            }
            if self.bug == Some(SeededBug::JetStreamAckOnDelivery) {
                self.broker.js_ack(&[entry]);
            } else {
                self.held().insert(msg.position.offset, entry);
            }
            return Some(msg);
        }
    }
}

#[async_trait]
impl MessageSource for JetStreamMember {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        if let Some(m) = self.try_next() {
            return Ok(Some(m));
        }
        tokio::time::sleep(timeout).await;
        Ok(self.try_next())
    }

    /// One acknowledgement for every delivery held here below the commit (clamped to the
    /// tracker's committable offset, as `outbox-nats` does).
    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        let Some(next) = next_of(offsets) else {
            return Ok(());
        };
        let Some(limit) = clamp(tracker_of(&self.tracker), &topic_partition(), next) else {
            return Ok(());
        };
        let due: Vec<usize> = {
            let mut held = self.held();
            let keep = held.split_off(&limit);
            std::mem::replace(&mut *held, keep).into_values().collect()
        };
        self.broker.js_ack(&due);
        Ok(())
    }

    /// Acknowledges each final delivery still held here on its own (as `outbox-nats` does);
    /// a position not held here is skipped.
    async fn ack_ahead(&self, positions: &[LogPosition]) -> Result<(), SourceError> {
        let tp = topic_partition();
        let due: Vec<usize> = {
            let mut held = self.held();
            positions
                .iter()
                .filter(|p| p.topic_partition() == tp)
                .filter_map(|p| held.remove(&p.offset))
                .collect()
        };
        self.broker.js_ack(&due);
        Ok(())
    }

    fn ack_model(&self) -> AckModel {
        AckModel::PerMessage
    }

    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        offsets.assign(&[topic_partition()]);
        *self.tracker.lock().unwrap_or_else(PoisonError::into_inner) = Some(offsets);
    }
}

#[derive(Debug, Default)]
struct ChannelState {
    /// The broker's channel this member consumes on (`None`: closed; opened at the next poll).
    channel: Option<u64>,
    highest_tag: u64,
    acked_to: u64,
}

/// A RabbitMQ member: consumes on one channel at a time.
#[derive(Debug)]
pub struct RabbitMember {
    broker: Broker,
    bug: Option<SeededBug>,
    state: Mutex<ChannelState>,
    tracker: Mutex<Option<SharedOffsetTracker>>,
}

impl RabbitMember {
    fn state(&self) -> MutexGuard<'_, ChannelState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The channel is lost: its unacked deliveries go back to the queue, and the tracker
    /// loses the "partition" (a new channel is a new assignment).
    fn lose(&self) {
        let channel = self.state().channel.take();
        if let Some(c) = channel {
            self.broker.rabbit_close(c);
        }
        if let Some(t) = tracker_of(&self.tracker) {
            t.lose(&[topic_partition()]);
        }
    }

    fn try_next(&self) -> Option<ReceivedMessage> {
        let channel = {
            let mut st = self.state();
            match st.channel {
                Some(c) => c,
                None => {
                    let c = self.broker.rabbit_open();
                    *st = ChannelState {
                        channel: Some(c),
                        highest_tag: 0,
                        acked_to: 0,
                    };
                    if let Some(t) = tracker_of(&self.tracker) {
                        // Tags start at 1 again: a fresh watermark.
                        t.assign(&[topic_partition()]);
                    }
                    c
                }
            }
        };
        loop {
            let (tag, entry, redelivered) = self.broker.rabbit_next(channel)?;
            if redelivered && self.bug == Some(SeededBug::RabbitSkipsRedelivered) {
                // The seeded bug: the redelivered flag taken for proof that the message was
                // handled before; acknowledged alone and not handed to the engine.
                self.broker.rabbit_ack(channel, tag, false);
                continue;
            }
            let record = self.broker.entries().get(entry)?.clone();
            let e = record.decode().ok();
            self.state().highest_tag = tag;
            let mut msg = record.to_received();
            msg.position = LogPosition::rabbitmq(
                crate::runner::TOPIC,
                tag,
                EXCHANGE,
                e.map(|e| e.aggregate_id).unwrap_or_default(),
                redelivered,
            );
            return Some(msg);
        }
    }
}

impl Drop for RabbitMember {
    /// The process (and its connection) goes: the channel closes.
    fn drop(&mut self) {
        if let Some(c) = self.state().channel.take() {
            self.broker.rabbit_close(c);
        }
    }
}

#[async_trait]
impl MessageSource for RabbitMember {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        if let Some(m) = self.try_next() {
            return Ok(Some(m));
        }
        tokio::time::sleep(timeout).await;
        Ok(self.try_next())
    }

    /// `ack multiple` up to tag `next - 1` on the current channel, clamped to the tracker's
    /// committable offset and to the tags this channel handed out (as `outbox-rabbitmq`
    /// does); refused as a rebalance while the channel is closed.
    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        let Some(next) = next_of(offsets) else {
            return Ok(());
        };
        let Some(limit) = clamp(tracker_of(&self.tracker), &topic_partition(), next) else {
            return Ok(());
        };
        let mut st = self.state();
        let Some(channel) = st.channel else {
            return Err(SourceError::rebalanced(
                "the channel is closed: its unacknowledged deliveries go back to the queue",
            ));
        };
        let tag = u64::try_from(limit.saturating_sub(1))
            .unwrap_or(0)
            .min(st.highest_tag);
        if tag <= st.acked_to {
            return Ok(());
        }
        if !self.broker.rabbit_ack(channel, tag, true) {
            return Err(SourceError::rebalanced("the channel closed"));
        }
        st.acked_to = tag;
        Ok(())
    }

    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        *self.tracker.lock().unwrap_or_else(PoisonError::into_inner) = Some(offsets);
    }
}

#[async_trait]
impl MessageSource for TransportSource {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        match self {
            Self::Kafka(s) => s.poll(timeout).await,
            Self::JetStream(s) => s.poll(timeout).await,
            Self::RabbitMq(s) => s.poll(timeout).await,
        }
    }

    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        match self {
            Self::Kafka(s) => s.commit(offsets).await,
            Self::JetStream(s) => s.commit(offsets).await,
            Self::RabbitMq(s) => s.commit(offsets).await,
        }
    }

    async fn ack_ahead(&self, positions: &[LogPosition]) -> Result<(), SourceError> {
        match self {
            Self::JetStream(s) => s.ack_ahead(positions).await,
            _ => Ok(()),
        }
    }

    fn ack_model(&self) -> AckModel {
        match self {
            Self::Kafka(s) => s.ack_model(),
            Self::JetStream(s) => s.ack_model(),
            Self::RabbitMq(s) => s.ack_model(),
        }
    }

    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        match self {
            Self::Kafka(s) => s.attach_offsets(offsets),
            Self::JetStream(s) => s.attach_offsets(offsets),
            Self::RabbitMq(s) => s.attach_offsets(offsets),
        }
    }

    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        match self {
            Self::Kafka(s) => s.lag().await,
            _ => Ok(Vec::new()),
        }
    }

    async fn pause(&self, partitions: &[TopicPartition]) -> Result<bool, SourceError> {
        match self {
            Self::Kafka(s) => s.pause(partitions).await,
            _ => Ok(false),
        }
    }

    async fn resume(&self, partitions: &[TopicPartition]) -> Result<(), SourceError> {
        match self {
            Self::Kafka(s) => s.resume(partitions).await,
            _ => Ok(()),
        }
    }
}
