//! [`MemoryLog`]: an in-memory partitioned log implementing [`Publisher`], with consumer groups
//! ([`MemoryConsumer`] implements [`MessageSource`]) and scripted broker faults.
//!
//! Records are stored exactly as a Kafka publisher would write them: key = `aggregate_id`,
//! headers from [`outbox_core::wire::encode_headers`], value = payload bytes. The partition is a
//! stable hash (FNV-1a) of the key modulo the topic's partition count, so one aggregate stays in
//! one partition.
//!
//! A consumer group has one live member at a time: creating a consumer for a group is a
//! rebalance that fences the previous member (its `poll` and `commit` fail with a transient
//! error) and the new member resumes at the group's committed offsets. This models both a
//! restart and a partition moving to another process.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, wire, AckMetadata, Clock, CommitOffset, Envelope, ErrorClass, EventId,
    LogPosition, MessageSource, PartitionLag, PublishError, PublishErrorKind, PublishResult,
    Publisher, ReceivedMessage, RecordHeader, SourceError, TopicPartition,
};

use crate::clock::ManualClock;

/// One stored record.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LogRecord {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Key (the aggregate id for published events).
    pub key: Option<Vec<u8>>,
    /// Headers.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Value (the payload bytes).
    pub value: Vec<u8>,
    /// Broker time of the append.
    pub timestamp: DateTime<Utc>,
}

impl LogRecord {
    /// Decodes the envelope (never panics).
    pub fn decode(&self) -> Result<Envelope, wire::DecodeError> {
        wire::decode(&self.headers, &self.value)
    }

    /// The position of this record.
    pub fn position(&self) -> LogPosition {
        LogPosition::new(self.topic.clone(), self.partition, self.offset)
    }

    /// The record as a consumer receives it (raw headers and value, decoded envelope).
    pub fn to_received(&self) -> ReceivedMessage {
        ReceivedMessage::from_record(
            self.position(),
            self.key.clone(),
            self.headers
                .iter()
                .map(|(k, v)| RecordHeader::new(k.clone(), v.clone()))
                .collect(),
            Some(self.value.clone()),
            Some(self.timestamp),
        )
    }

    fn size(&self) -> usize {
        self.key.as_ref().map_or(0, Vec::len)
            + self
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
            + self.value.len()
    }
}

/// Which records a [`LogFault`] applies to.
#[derive(Clone)]
#[non_exhaustive]
pub enum FaultMatch {
    /// Every record.
    Any,
    /// The record of one event.
    Event(EventId),
    /// Records of one aggregate id.
    Aggregate(String),
    /// Records for which the predicate holds.
    Predicate(Arc<dyn Fn(&Envelope) -> bool + Send + Sync>),
}

impl fmt::Debug for FaultMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Any => f.write_str("Any"),
            Self::Event(id) => write!(f, "Event({id})"),
            Self::Aggregate(a) => write!(f, "Aggregate({a:?})"),
            Self::Predicate(_) => f.write_str("Predicate(..)"),
        }
    }
}

impl FaultMatch {
    fn matches(&self, e: &Envelope) -> bool {
        match self {
            Self::Any => true,
            Self::Event(id) => e.event_id == *id,
            Self::Aggregate(a) => e.aggregate_id == *a,
            Self::Predicate(p) => p(e),
        }
    }
}

/// What a [`LogFault`] does to a matching record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FaultAction {
    /// The record is not stored; the publish result is this error (with its default class).
    Fail(PublishErrorKind),
    /// The record is stored, but the acknowledgement is lost: the result is a transient
    /// `Timeout`. Republishing it creates a duplicate in the log.
    LoseAck,
}

/// A scripted broker fault.
#[derive(Clone, Debug)]
pub struct LogFault {
    /// Which records.
    pub matcher: FaultMatch,
    /// What happens.
    pub action: FaultAction,
    /// How many more records it applies to (`None`: until cleared).
    pub remaining: Option<usize>,
}

impl LogFault {
    /// A fault that applies to every matching record until cleared.
    pub fn new(matcher: FaultMatch, action: FaultAction) -> Self {
        Self {
            matcher,
            action,
            remaining: None,
        }
    }

    /// Limits the fault to the next `n` matching records.
    pub fn times(mut self, n: usize) -> Self {
        self.remaining = Some(n);
        self
    }
}

#[derive(Debug, Default)]
struct GroupState {
    generation: u64,
    committed: BTreeMap<(String, i32), i64>,
}

#[derive(Debug)]
struct LogState {
    topics: BTreeMap<String, Vec<Vec<LogRecord>>>,
    routes: BTreeMap<String, String>,
    default_topic: Option<String>,
    faults: Vec<LogFault>,
    groups: HashMap<String, GroupState>,
    /// Earliest available offset per partition (simulated retention), when above 0.
    earliest: BTreeMap<(String, i32), i64>,
    /// Bumped when a topic is recreated.
    generations: BTreeMap<String, u64>,
    publish_calls: u64,
}

struct LogShared {
    state: Mutex<LogState>,
    notify: tokio::sync::Notify,
    max_record_bytes: usize,
    delivery_timeout: Duration,
    clock: Arc<dyn Clock>,
}

/// An in-memory partitioned log: a [`Publisher`] plus consumer groups. Cloning gives another
/// handle to the same log.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use outbox_core::{Envelope, Publisher, PublishErrorKind, MessageSource};
/// use outbox_testkit::MemoryLog;
/// use std::time::Duration;
///
/// let log = MemoryLog::new("orders", 3);
/// let e = Envelope::builder("order", "o-1", 1, "order.created").build().unwrap();
/// log.fail_next(1, PublishErrorKind::BrokerUnavailable);
/// assert!(log.publish(&[&e]).await[0].is_err());
/// let ack = log.publish(&[&e]).await.remove(0).unwrap();
/// assert_eq!(ack.as_kafka().unwrap().1, MemoryLog::partition_for("o-1", 3));
///
/// let consumer = log.consumer("projection", &["orders"]);
/// let msg = consumer.poll(Duration::ZERO).await.unwrap().unwrap();
/// assert_eq!(msg.envelope.unwrap(), e);
/// # });
/// ```
#[derive(Clone)]
pub struct MemoryLog {
    shared: Arc<LogShared>,
}

impl fmt::Debug for MemoryLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("MemoryLog")
            .field(
                "topics",
                &st.topics
                    .iter()
                    .map(|(t, p)| (t.clone(), p.len()))
                    .collect::<Vec<_>>(),
            )
            .field("default_topic", &st.default_topic)
            .finish_non_exhaustive()
    }
}

/// Builder for [`MemoryLog`].
#[derive(Debug)]
#[must_use]
pub struct MemoryLogBuilder {
    topics: BTreeMap<String, usize>,
    routes: BTreeMap<String, String>,
    default_topic: Option<String>,
    max_record_bytes: usize,
    delivery_timeout: Duration,
    clock: Option<Arc<dyn Clock>>,
}

impl MemoryLogBuilder {
    /// Adds a topic with `partitions` partitions (at least 1).
    pub fn topic(mut self, name: impl Into<String>, partitions: usize) -> Self {
        self.topics.insert(name.into(), partitions.max(1));
        self
    }

    /// Topic for event types without a route.
    pub fn default_topic(mut self, name: impl Into<String>) -> Self {
        self.default_topic = Some(name.into());
        self
    }

    /// Routes `event_type` to `topic`.
    pub fn route(mut self, event_type: impl Into<String>, topic: impl Into<String>) -> Self {
        self.routes.insert(event_type.into(), topic.into());
        self
    }

    /// Largest record (key + headers + value) in bytes. Default 1 MiB, Kafka's default.
    pub fn max_record_bytes(mut self, n: usize) -> Self {
        self.max_record_bytes = n;
        self
    }

    /// The delivery timeout reported to the relay. Default 5 s.
    pub fn delivery_timeout(mut self, d: Duration) -> Self {
        self.delivery_timeout = d;
        self
    }

    /// Clock for record timestamps. Default: a fresh [`ManualClock`].
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// The log.
    pub fn build(self) -> MemoryLog {
        MemoryLog {
            shared: Arc::new(LogShared {
                state: Mutex::new(LogState {
                    topics: self
                        .topics
                        .into_iter()
                        .map(|(t, n)| (t, vec![Vec::new(); n]))
                        .collect(),
                    routes: self.routes,
                    default_topic: self.default_topic,
                    faults: Vec::new(),
                    groups: HashMap::new(),
                    earliest: BTreeMap::new(),
                    generations: BTreeMap::new(),
                    publish_calls: 0,
                }),
                notify: tokio::sync::Notify::new(),
                max_record_bytes: self.max_record_bytes,
                delivery_timeout: self.delivery_timeout,
                clock: self
                    .clock
                    .unwrap_or_else(|| Arc::new(ManualClock::default())),
            }),
        }
    }
}

impl MemoryLog {
    /// A builder with no topics, 1 MiB records and a 5 s delivery timeout.
    pub fn builder() -> MemoryLogBuilder {
        MemoryLogBuilder {
            topics: BTreeMap::new(),
            routes: BTreeMap::new(),
            default_topic: None,
            max_record_bytes: 1024 * 1024,
            delivery_timeout: Duration::from_secs(5),
            clock: None,
        }
    }

    /// A log with one topic of `partitions` partitions that receives every event type.
    pub fn new(topic: &str, partitions: usize) -> Self {
        Self::builder()
            .topic(topic, partitions)
            .default_topic(topic)
            .build()
    }

    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The partition of `key` in a topic of `partitions` partitions (FNV-1a, stable across
    /// runs and platforms).
    pub fn partition_for(key: &str, partitions: usize) -> i32 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in key.as_bytes() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        (h % partitions.max(1) as u64) as i32
    }

    /// Creates a topic (no-op if it exists).
    pub fn create_topic(&self, name: &str, partitions: usize) {
        self.lock()
            .topics
            .entry(name.to_owned())
            .or_insert_with(|| vec![Vec::new(); partitions.max(1)]);
    }

    /// Adds a scripted fault; faults are checked in insertion order, the first match applies.
    pub fn inject(&self, fault: LogFault) {
        self.lock().faults.push(fault);
    }

    /// The next `n` records fail with `kind` and are not stored.
    pub fn fail_next(&self, n: usize, kind: PublishErrorKind) {
        self.inject(LogFault::new(FaultMatch::Any, FaultAction::Fail(kind)).times(n));
    }

    /// Every record matching `predicate` fails with `kind` until [`clear_faults`](Self::clear_faults).
    pub fn fail_matching(
        &self,
        predicate: impl Fn(&Envelope) -> bool + Send + Sync + 'static,
        kind: PublishErrorKind,
    ) {
        self.inject(LogFault::new(
            FaultMatch::Predicate(Arc::new(predicate)),
            FaultAction::Fail(kind),
        ));
    }

    /// The record of `event_id` fails with `kind` until cleared.
    pub fn fail_event(&self, event_id: EventId, kind: PublishErrorKind) {
        self.inject(LogFault::new(
            FaultMatch::Event(event_id),
            FaultAction::Fail(kind),
        ));
    }

    /// The next `n` records are stored but their acknowledgement is lost (transient `Timeout`).
    pub fn lose_ack_next(&self, n: usize) {
        self.inject(LogFault::new(FaultMatch::Any, FaultAction::LoseAck).times(n));
    }

    /// Records matching `predicate` are stored but their acknowledgement is lost, until cleared.
    pub fn lose_ack_matching(&self, predicate: impl Fn(&Envelope) -> bool + Send + Sync + 'static) {
        self.inject(LogFault::new(
            FaultMatch::Predicate(Arc::new(predicate)),
            FaultAction::LoseAck,
        ));
    }

    /// Removes every scripted fault.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Number of `publish` calls so far.
    pub fn publish_calls(&self) -> u64 {
        self.lock().publish_calls
    }

    /// Appends a raw record (e.g. a malformed one) to `topic`/`partition`; returns its offset.
    pub fn append_raw(
        &self,
        topic: &str,
        partition: i32,
        key: Option<Vec<u8>>,
        headers: Vec<(String, Vec<u8>)>,
        value: Vec<u8>,
    ) -> Result<i64, PublishError> {
        let now = self.shared.clock.now();
        let offset = {
            let mut st = self.lock();
            let parts = st.topics.get_mut(topic).ok_or_else(|| {
                PublishError::new(PublishErrorKind::UnknownTopic, format!("no topic {topic}"))
            })?;
            let part = usize::try_from(partition)
                .ok()
                .and_then(|p| parts.get_mut(p))
                .ok_or_else(|| {
                    PublishError::new(
                        PublishErrorKind::UnknownTopic,
                        format!("no partition {partition} in {topic}"),
                    )
                })?;
            let offset = part.len() as i64;
            part.push(LogRecord {
                topic: topic.to_owned(),
                partition,
                offset,
                key,
                headers,
                value,
                timestamp: now,
            });
            offset
        };
        self.shared.notify.notify_waiters();
        Ok(offset)
    }

    /// Simulates retention: records of `topic`/`partition` below `offset` are no longer
    /// available to consumers (they stay visible to [`records`](Self::records)). A group whose
    /// committed offset is below it fails its next poll with a retention-gap error.
    pub fn truncate_before(&self, topic: &str, partition: i32, offset: i64) {
        let mut st = self.lock();
        let e = st
            .earliest
            .entry((topic.to_owned(), partition))
            .or_insert(0);
        *e = (*e).max(offset);
    }

    /// The earliest offset a consumer can read in `topic`/`partition`.
    pub fn earliest_offset(&self, topic: &str, partition: i32) -> i64 {
        self.lock()
            .earliest
            .get(&(topic.to_owned(), partition))
            .copied()
            .unwrap_or(0)
    }

    /// Deletes and recreates `topic` with `partitions` partitions under running consumers:
    /// every record and every group's committed offset of the topic is gone, offsets start at
    /// 0 again, and running consumers read the new topic from its beginning (the same offsets
    /// now hold other records: a rewind).
    pub fn recreate_topic(&self, topic: &str, partitions: usize) {
        let mut st = self.lock();
        st.topics
            .insert(topic.to_owned(), vec![Vec::new(); partitions.max(1)]);
        st.earliest.retain(|(t, _), _| t != topic);
        for g in st.groups.values_mut() {
            g.committed.retain(|(t, _), _| t != topic);
        }
        *st.generations.entry(topic.to_owned()).or_insert(0) += 1;
    }

    /// The records of one partition, in offset order.
    pub fn records(&self, topic: &str, partition: i32) -> Vec<LogRecord> {
        let st = self.lock();
        st.topics
            .get(topic)
            .and_then(|p| p.get(usize::try_from(partition).ok()?))
            .cloned()
            .unwrap_or_default()
    }

    /// Every record of every topic, by topic, partition and offset.
    pub fn all_records(&self) -> Vec<LogRecord> {
        self.lock()
            .topics
            .values()
            .flat_map(|parts| parts.iter().flatten().cloned())
            .collect()
    }

    /// Partition count of `topic`.
    pub fn partitions(&self, topic: &str) -> Option<usize> {
        self.lock().topics.get(topic).map(Vec::len)
    }

    /// Topic names.
    pub fn topics(&self) -> Vec<String> {
        self.lock().topics.keys().cloned().collect()
    }

    /// Next offset to write in `topic`/`partition`.
    pub fn end_offset(&self, topic: &str, partition: i32) -> i64 {
        self.records(topic, partition).len() as i64
    }

    /// The offset `group` committed for `topic`/`partition` (next offset to read).
    pub fn committed(&self, group: &str, topic: &str, partition: i32) -> Option<i64> {
        self.lock()
            .groups
            .get(group)
            .and_then(|g| g.committed.get(&(topic.to_owned(), partition)).copied())
    }

    /// Joins `group` as its only live member, reading `topics` (all partitions), from the
    /// group's committed offsets (or the beginning). Fences the previous member: a rebalance.
    pub fn consumer(&self, group: &str, topics: &[&str]) -> MemoryConsumer {
        let generation = {
            let mut st = self.lock();
            let g = st.groups.entry(group.to_owned()).or_default();
            g.generation += 1;
            g.generation
        };
        MemoryConsumer {
            log: self.clone(),
            group: group.to_owned(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            generation,
            positions: Mutex::new(BTreeMap::new()),
            cursor: Mutex::new(0),
            tracker: Mutex::new(None),
            generations: Mutex::new(BTreeMap::new()),
            paused: Mutex::default(),
        }
    }

    fn topic_for(st: &LogState, e: &Envelope) -> Option<String> {
        st.routes
            .get(&e.event_type)
            .or(st.default_topic.as_ref())
            .cloned()
    }

    fn publish_one(&self, st: &mut LogState, e: &Envelope, now: DateTime<Utc>) -> PublishResult {
        let mut action = None;
        for f in st.faults.iter_mut() {
            if f.remaining != Some(0) && f.matcher.matches(e) {
                if let Some(n) = f.remaining.as_mut() {
                    *n -= 1;
                }
                action = Some(f.action);
                break;
            }
        }
        st.faults.retain(|f| f.remaining != Some(0));
        if let Some(FaultAction::Fail(kind)) = action {
            return Err(PublishError::new(kind, "injected broker fault"));
        }
        let topic = Self::topic_for(st, e).ok_or_else(|| {
            PublishError::new(
                PublishErrorKind::UnknownTopic,
                format!("no route or default topic for {}", e.event_type),
            )
        })?;
        let max = self.shared.max_record_bytes;
        let parts = st.topics.get_mut(&topic).ok_or_else(|| {
            PublishError::new(
                PublishErrorKind::UnknownTopic,
                format!("topic {topic} does not exist"),
            )
        })?;
        let partition = Self::partition_for(&e.aggregate_id, parts.len());
        let part = &mut parts[partition as usize];
        let record = LogRecord {
            topic: topic.clone(),
            partition,
            offset: part.len() as i64,
            key: Some(e.aggregate_id.clone().into_bytes()),
            headers: wire::encode_headers(e),
            value: e.payload.bytes.clone(),
            timestamp: now,
        };
        if record.size() > max {
            return Err(PublishError::new(
                PublishErrorKind::RecordTooLarge,
                format!("record of {} bytes exceeds {max}", record.size()),
            ));
        }
        let ack = AckMetadata::kafka(topic, partition, record.offset);
        part.push(record);
        if action == Some(FaultAction::LoseAck) {
            return Err(PublishError::new(
                PublishErrorKind::Timeout,
                "no delivery report within the delivery timeout (the broker stored the record)",
            ));
        }
        Ok(ack)
    }
}

#[async_trait]
impl Publisher for MemoryLog {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let now = self.shared.clock.now();
        let results = {
            let mut st = self.lock();
            st.publish_calls += 1;
            batch
                .iter()
                .map(|e| self.publish_one(&mut st, e, now))
                .collect()
        };
        self.shared.notify.notify_waiters();
        results
    }

    fn delivery_timeout(&self) -> Duration {
        self.shared.delivery_timeout
    }
}

/// A member of a consumer group on a [`MemoryLog`]; see [`MemoryLog::consumer`].
pub struct MemoryConsumer {
    log: MemoryLog,
    group: String,
    topics: Vec<String>,
    generation: u64,
    /// Next offset to read per partition, once read from the group's committed offset.
    positions: Mutex<BTreeMap<(String, i32), i64>>,
    cursor: Mutex<usize>,
    tracker: Mutex<Option<SharedOffsetTracker>>,
    /// Topic generations this member read at.
    generations: Mutex<BTreeMap<String, u64>>,
    /// Partitions paused by [`MessageSource::pause`]: skipped by reads, positions kept.
    paused: Mutex<std::collections::BTreeSet<(String, i32)>>,
}

impl fmt::Debug for MemoryConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryConsumer")
            .field("group", &self.group)
            .field("topics", &self.topics)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl MemoryConsumer {
    /// The group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// Whether a newer member of the group has fenced this one.
    pub fn is_fenced(&self) -> bool {
        self.log
            .lock()
            .groups
            .get(&self.group)
            .is_some_and(|g| g.generation != self.generation)
    }

    fn fenced_error(&self) -> SourceError {
        SourceError::new(
            ErrorClass::Transient,
            format!(
                "consumer of group {} was fenced by a rebalance; create a new consumer",
                self.group
            ),
        )
    }

    fn attached(&self) -> Option<SharedOffsetTracker> {
        self.tracker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Reads the next available message without waiting.
    ///
    /// A partition is assigned on its first read (the attached tracker hears of it). When a
    /// newer member fenced this one, the attached tracker loses every partition and the call
    /// fails. A committed offset below the earliest available one is a retention gap
    /// ([`outbox_core::SourceErrorKind::RetentionGap`]); a position beyond the end (the topic
    /// was recreated) starts over at the earliest offset.
    pub fn try_next(&self) -> Result<Option<ReceivedMessage>, SourceError> {
        let st = self.log.lock();
        let group = st.groups.get(&self.group);
        let mut positions = self.positions.lock().unwrap_or_else(|e| e.into_inner());
        if group.is_some_and(|g| g.generation != self.generation) {
            if let Some(t) = self.attached() {
                let lost: Vec<TopicPartition> = positions
                    .keys()
                    .map(|(t, p)| TopicPartition::new(t.clone(), *p))
                    .collect();
                t.lose(&lost);
            }
            positions.clear();
            return Err(self.fenced_error());
        }
        {
            let mut seen = self.generations.lock().unwrap_or_else(|e| e.into_inner());
            for t in &self.topics {
                let now = st.generations.get(t).copied().unwrap_or(0);
                if seen
                    .insert(t.clone(), now)
                    .is_some_and(|before| before != now)
                {
                    // The topic was recreated: read it again from its beginning, without a
                    // rebalance (what a Kafka client does after an out-of-range reset).
                    for ((pt, _), pos) in positions.iter_mut() {
                        if pt == t {
                            *pos = 0;
                        }
                    }
                }
            }
        }
        let mut slots: Vec<(String, i32)> = Vec::new();
        for t in &self.topics {
            if let Some(parts) = st.topics.get(t) {
                slots.extend((0..parts.len() as i32).map(|p| (t.clone(), p)));
            }
        }
        if slots.is_empty() {
            return Ok(None);
        }
        let mut cursor = self.cursor.lock().unwrap_or_else(|e| e.into_inner());
        let mut gaps = Vec::new();
        let paused = self.paused.lock().unwrap_or_else(|e| e.into_inner());
        for i in 0..slots.len() {
            let slot = &slots[(*cursor + i) % slots.len()];
            if paused.contains(slot) {
                continue;
            }
            let earliest = st.earliest.get(slot).copied().unwrap_or(0);
            let part = &st.topics[&slot.0][slot.1 as usize];
            let pos = match positions.get(slot) {
                Some(p) => *p,
                None => {
                    let committed = group.and_then(|g| g.committed.get(slot).copied());
                    if let Some(t) = self.attached() {
                        t.assign(&[TopicPartition::new(slot.0.clone(), slot.1)]);
                    }
                    committed.unwrap_or(earliest)
                }
            };
            let pos = if pos > part.len() as i64 {
                earliest
            } else {
                pos
            };
            if pos < earliest {
                gaps.push(format!(
                    "{}/{}: next offset {pos} < earliest {earliest} ({} records lost)",
                    slot.0,
                    slot.1,
                    earliest - pos
                ));
                continue;
            }
            positions.insert(slot.clone(), pos);
            if let Some(rec) = usize::try_from(pos).ok().and_then(|p| part.get(p)) {
                positions.insert(slot.clone(), pos + 1);
                *cursor = (*cursor + i + 1) % slots.len();
                return Ok(Some(rec.to_received()));
            }
        }
        if !gaps.is_empty() {
            return Err(SourceError::retention_gap(format!(
                "group {} lost records to retention: {}",
                self.group,
                gaps.join("; ")
            )));
        }
        Ok(None)
    }
}

#[async_trait]
impl MessageSource for MemoryConsumer {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.log.shared.notify.notified();
            if let Some(m) = self.try_next()? {
                return Ok(Some(m));
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            // Bounded wait so a wake-up raced with the check above costs at most 10 ms.
            let wait = (deadline - now).min(Duration::from_millis(10));
            let _ = tokio::time::timeout(wait, notified).await;
        }
    }

    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        let mut st = self.log.lock();
        let generation = st.groups.get(&self.group).map_or(0, |g| g.generation);
        if generation != self.generation {
            return Err(SourceError::rebalanced(format!(
                "consumer of group {} was fenced by a rebalance; its commits are dropped",
                self.group
            )));
        }
        // A commit for a partition this consumer does not read is a caller bug (an engine
        // committing from the wrong message): refused as a whole, nothing committed. A
        // partition it did read that its topic no longer has (recreated with fewer partitions
        // since) is legitimate: the engine commits what it made final there; skipped (the
        // partition went with its offsets).
        let positions = self.positions.lock().unwrap_or_else(|e| e.into_inner());
        let mut kept = Vec::with_capacity(offsets.len());
        for c in offsets {
            let exists = st
                .topics
                .get(&c.topic)
                .is_some_and(|parts| c.partition >= 0 && (c.partition as usize) < parts.len());
            let was_read = positions.contains_key(&(c.topic.clone(), c.partition));
            if self.topics.contains(&c.topic) && !exists && was_read {
                continue;
            }
            let readable = self.topics.contains(&c.topic) && exists;
            if !readable {
                return Err(SourceError::new(
                    ErrorClass::Permanent,
                    format!(
                        "commit for {}/{}, which consumer of group {} does not read; nothing committed",
                        c.topic, c.partition, self.group
                    ),
                ));
            }
            kept.push(c);
        }
        drop(positions);
        let g = st.groups.entry(self.group.clone()).or_default();
        for c in kept {
            g.committed
                .insert((c.topic.clone(), c.partition), c.next_offset);
        }
        Ok(())
    }

    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        *self.tracker.lock().unwrap_or_else(|e| e.into_inner()) = Some(offsets);
    }

    /// Pauses: a paused partition is skipped by reads; its position stays where it is, so
    /// [`resume`](MessageSource::resume) continues with the next record exactly.
    async fn pause(&self, partitions: &[TopicPartition]) -> Result<bool, SourceError> {
        let mut paused = self.paused.lock().unwrap_or_else(|e| e.into_inner());
        paused.extend(partitions.iter().map(|p| (p.topic.clone(), p.partition)));
        Ok(true)
    }

    async fn resume(&self, partitions: &[TopicPartition]) -> Result<(), SourceError> {
        let mut paused = self.paused.lock().unwrap_or_else(|e| e.into_inner());
        for p in partitions {
            paused.remove(&(p.topic.clone(), p.partition));
        }
        Ok(())
    }

    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        let st = self.log.lock();
        let group = st.groups.get(&self.group);
        let mut out = Vec::new();
        for t in &self.topics {
            let Some(parts) = st.topics.get(t) else {
                continue;
            };
            for (p, records) in parts.iter().enumerate() {
                let key = (t.clone(), p as i32);
                out.push(PartitionLag::new(
                    TopicPartition::new(t.clone(), p as i32),
                    group.and_then(|g| g.committed.get(&key).copied()),
                    st.earliest.get(&key).copied().unwrap_or(0),
                    records.len() as i64,
                ));
            }
        }
        Ok(out)
    }
}
