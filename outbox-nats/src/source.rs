//! [`NatsSource`]: the consumer side, a durable JetStream pull consumer with explicit acks,
//! acknowledging per message ([`AckModel::PerMessage`]).
//!
//! # One active member
//!
//! Two live members pulling from one durable consumer would split one aggregate's versions
//! between two engines, and no version policy orders versions that two engines apply (a
//! version applied before its predecessor, an effect skipped, a spurious version gap parked:
//! `tests/adversary_source.rs`, `competing_members_*`). So a durable consumer has **one active
//! member at a time**, as RabbitMQ's single active consumer (which `RabbitSource` requires):
//!
//! * **The lease**: a key in the JetStream key-value bucket `outbox_leases_<TTL in ms>ms`
//!   (its stream `KV_outbox_leases_…`, created at start when missing; its `max_age` is the
//!   TTL), named after the stream and the durable consumer (`<stream>.<durable>`, characters
//!   outside the key alphabet written `=XX`). A member acquires it with a create (only if the
//!   key is absent) and renews it every TTL / 3 against the revision it wrote last; a key not
//!   renewed ages out of the bucket after the TTL. The TTL is `lease_ttl` (default
//!   [`DEFAULT_LEASE_TTL`], 10 s; 3 s to 1 h; the members of a durable must use the same).
//! * **Members with different TTLs** would use two buckets, and one member could be active
//!   in each. So a member that acquires its lease then looks for a live lease of the same
//!   durable consumer in the buckets of other TTLs (listing the streams `KV_outbox_leases_*`);
//!   finding one, it gives its own back and never reads: its `poll` fails with a permanent
//!   error naming both TTLs. (Each writes its key before it looks for the other's, so of two
//!   such members starting together at most one reads. A member that cannot list the streams
//!   or read the buckets gives its lease back and tries again: it needs the permission to.)
//! * **A standby** (a member without the lease) pulls nothing: its `poll` returns nothing
//!   until it acquires the lease, which it retries every TTL / 10 (at most 1 s). A member
//!   that crashed is replaced within the TTL; the messages it held come again after their
//!   ack wait. [`close`](NatsSource::close) stops reading, gives back what it held (`-NAK`)
//!   and deletes the key (only at the revision this member wrote last: a member that lost
//!   the lease without knowing it never deletes the new holder's key), so a standby takes
//!   over at once and gets the messages given back without waiting for their ack wait.
//! * **A member that loses the lease** (its renewal finds another revision, or the lease
//!   was last confirmed longer ago than the TTL minus a quarter of it, e.g. the server was
//!   unreachable) stops handing out messages at once: it drops its pull, forgets every
//!   delivery it holds **acknowledging none** (as for a delivery sequence that goes back,
//!   below), and tells the engine the partition is lost (the engine drops what it queued or
//!   held of it, and applies none of it). A task of the source's own does this the moment
//!   the lease runs out, not at the next `poll`: an engine at its in-flight bound applies
//!   what it queued without polling. The server redelivers each to the active member after
//!   its ack wait. A member never acknowledges an effect that did not commit, lease or not:
//!   only what the engine handed to `ack_ahead` or a commit passed.
//! * **Pull requests live at most the TTL** (at most 30 s) at the server. A member cut from
//!   the server without its connection closing (a half-open link, a paused process) keeps
//!   its pull request open there, and the server keeps delivering to it, the active member's
//!   redeliveries and new messages included, until the request expires: with a longer
//!   expiry the takeover waited for it (tests `tests/lease.rs`).
//! * **The window left**: the lease is checked before each message is handed out, not inside
//!   a handler. A member paused longer than the lease (a stop-the-world pause, a handler that
//!   runs long) may still finish an effect it started while another member applies the
//!   aggregate's next messages; the inbox transaction's per-aggregate checks (the dedup
//!   record, the version policy) are then the last guard. Keep handlers well below the TTL.
//! * **Scaling out** is several durable consumers over disjoint subjects, each with its own
//!   lease and one active member: an aggregate's events all go to one subject space (routes
//!   are by aggregate type, [`crate::subject`]), so durables filtered by aggregate type
//!   (`filter_subject("outbox.order")`, `…payment`) partition the work today. Partitioning
//!   one aggregate type by aggregate id is not offered yet: it needs
//!   [`SubjectMapping::AggregateTypeAndId`](crate::SubjectMapping) and a stream subject
//!   transform with the `partition(n, …)` function (server 2.10), which nothing here sets up
//!   or tests (the test server is 2.9).
//! * **The server's own alternative**: from nats-server 2.11, a consumer's priority groups
//!   with the pinned-client policy let the server keep one member pinned; this source does
//!   not use them (it must run on 2.9 and 2.10) and keeps its lease.
//!
//! # How JetStream's per-message acks meet the engine's watermark (see `docs/transports.md`)
//!
//! JetStream acknowledges **per message** and redelivers an unacknowledged message after its
//! ack wait, *after* later messages were delivered; the engine commits a **contiguous
//! watermark** ([`outbox_core::watermark`]) over offsets that only grow. The stream sequence
//! does not fit that watermark: a redelivered message's stream sequence is below ones already
//! handed out, which the watermark must treat as a rewind (forgetting every message in flight),
//! and a cumulative ack after such a rewind could cover messages still being applied.
//!
//! So a message's position ([`LogPosition::jetstream`]) is ordered by the consumer's
//! **delivery sequence** (`(stream, 0, delivery sequence)`): the sequence JetStream gives each
//! *delivery* of the durable consumer, which grows with every delivery, redeliveries included
//! (`redelivery_gets_a_new_delivery_sequence` checks this against the server). Its native
//! identity keeps the **stream sequence** and the durable consumer's name: what a parked
//! message shows an operator (`stream ORDERS seq 42 (delivery 3, consumer billing)`).
//! [`commit`](MessageSource::commit) turns "next offset `n`" into one confirmed ack (`+ACK`,
//! answered by the server) for every delivery this member handed out below `n`.
//!
//! * **Redelivery of a message still in flight here** (its ack wait ran out while the engine
//!   was applying or holding it): the copy is not handed out again; its newer delivery's reply
//!   subject replaces the old one, and the one ack covers the message.
//! * **Redelivery of a message this member does not hold** (another member crashed holding
//!   it, or this process restarted): a new, higher position; the engine applies it or finds it
//!   a duplicate, and an aggregate whose later version arrived first waits for it under
//!   `VersionPolicy::Hold` with `require_first_version`, its later messages unacknowledged
//!   (the tests `redelivered_head_*`).
//!
//! A message that is final but behind an unfinished one (an aggregate held for a missing
//! version, a handler retrying) is not left to the watermark, which would leave it
//! unacknowledged, and JetStream would redeliver it at every ack wait: the engine hands every
//! final delivery to [`ack_ahead`](MessageSource::ack_ahead) at its next commit, which acks it
//! on its own (after its transaction committed, as every ack here). The watermark's commit
//! acks what was not acked ahead (an ack that was not confirmed).
//!
//! # An ack ahead that is lost
//!
//! An ack ahead that the server does not confirm (a network outage, the connection cut) leaves
//! the message unacknowledged at the server, which redelivers it after the ack wait. Left to
//! the watermark, such a message would wait for it as long as the unfinished one before it
//! (a held aggregate): its redeliveries dropped here as "in flight" at every ack wait, and each
//! one taking a slot of `max_ack_pending` all along, so that enough of them stop the server
//! from delivering anything new, the missing version a held aggregate waits for included. So
//! the source remembers each delivery handed to `ack_ahead` as **final** until its ack is
//! confirmed, and acks it again
//!
//! * at the next [`ack_ahead`](MessageSource::ack_ahead) or [`commit`](MessageSource::commit),
//!   whatever positions they name, and
//! * at once when the server redelivers it: the redelivery is not handed out (its effect's
//!   transaction committed long ago) and its newer reply subject carries the ack. Only that
//!   message is acked then: the others' redeliveries may be on their way, and one arriving
//!   after its message was acked here would be a new message (a duplicate handed out).
//!   A redelivery already on its way when an ack at the next ack ahead or commit is confirmed
//!   is such a duplicate too, which the inbox absorbs.
//!
//! Only a delivery the engine handed to `ack_ahead` (its transaction committed) or a commit
//! passed is ever acknowledged, so nothing is acknowledged before its effect committed. A
//! redelivery of a message in flight that is *not* final (held, being applied) is still only
//! dropped: acking it would lose it. Deliveries are never limited (`max_deliver = -1`, checked
//! at start), so the redeliveries of either kind cannot use up a message's deliveries.
//!
//! # A delivery sequence that goes back
//!
//! The server numbers a consumer's deliveries from its stored state. A server that comes back
//! without the state it last had (a crash loses what it wrote of a consumer's state since the
//! disk last synced it), or a durable consumer deleted and created again, numbers them from an
//! earlier point: a delivery at or below one handed out here before. The engine's watermark
//! takes it for a rewind and forgets what it held (held versions, queued messages); the
//! numbers this source holds deliveries under now name other messages. Kept, a commit of the
//! new numbering acknowledged a held message the engine had forgotten (its effect never
//! applied: lost), and a new message could take the number of one still held here.
//!
//! So a delivery at or below the highest one handed out starts a new numbering here too: the
//! source forgets every delivery it holds, final or not, **acknowledging none**, and hands
//! the delivery out (the engine sees the same rewind at the same message). The server has
//! none of them acknowledged (or lost its record of the ack), so it delivers each again,
//! under the new numbering: the inbox applies it or finds it a duplicate. An ack ahead of a
//! position handed out before is matched by delivery *and* stream sequence, so it never
//! acknowledges the other message that holds that number now. Test:
//! `tests/source.rs` `a_delivery_sequence_that_goes_back_after_a_restart_loses_nothing`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use async_nats::jetstream::consumer::pull::{Config as PullConfig, Stream as PullStream};
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::message::{AckKind, Acker};
use async_nats::jetstream::{self, Context};
use chrono::{DateTime, Utc};
use futures::future::join_all;
use futures::StreamExt;
use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, AckModel, CommitOffset, ConfigError, ErrorClass, LogPosition, MessageSource,
    NativePosition, PartitionLag, ReceivedMessage, RecordHeader, SourceError, TopicPartition,
};
use tokio::time::Instant;

use crate::error::source_error;
use crate::lease::{Lease, LeaseView};
use crate::publisher::connect_client;

/// Default ack wait: 30 s before JetStream redelivers an unacknowledged message.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// Default most messages delivered and not acknowledged (the consumer's `max_ack_pending`).
pub const DEFAULT_MAX_ACK_PENDING: i64 = 1_000;
/// Default messages asked for per pull request.
pub const DEFAULT_PULL_BATCH: usize = 100;
/// Default TTL of the membership lease (one active member per durable consumer; module docs).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);
/// The shortest lease TTL accepted (renewed every TTL / 3).
pub const MIN_LEASE_TTL: Duration = Duration::from_secs(3);

/// The longest a pull request lives at the server (shorter: the lease TTL).
const MAX_PULL_EXPIRES: Duration = Duration::from_secs(30);

/// How often a standby looks whether its lease task acquired the lease.
const STANDBY_CHECK: Duration = Duration::from_millis(100);

/// Where a durable consumer that does not exist yet starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StartFrom {
    /// The first message of the stream (`DeliverPolicy::All`).
    #[default]
    Earliest,
    /// Messages published after the consumer is created (`DeliverPolicy::New`). The consumer
    /// is durable: a later member resumes where it is, whatever this says.
    Latest,
}

/// Configuration of a [`NatsSource`]. Build it with [`NatsSource::builder`].
///
/// | field | default | meaning |
/// |---|---|---|
/// | `servers` | (required) | NATS URLs |
/// | `stream` | (required) | the stream to read |
/// | `durable` | (required) | durable consumer name (one per consumer service; its members take turns: one active at a time, the others standbys) |
/// | `filter_subject` | none | only these subjects (e.g. `outbox.order`) |
/// | `ack_wait` | 30 s | redelivery of a message not acknowledged in time; must exceed the engine's apply + commit time |
/// | `max_ack_pending` | 1,000 | messages delivered and not acknowledged (bounds what a member holds) |
/// | `pull_batch` | 100 | messages per pull request |
/// | `start_from` | `Earliest` | where a consumer that does not exist yet starts |
/// | `connect_timeout` | 5 s | connecting and each management request |
/// | `lease_ttl` | 10 s | the membership lease: a standby takes over at most this long after the active member stopped renewing it (3 s to 1 h) |
///
/// Always: explicit acks, unlimited deliveries (`max_deliver = -1`: JetStream would otherwise
/// drop a message silently after N deliveries). An existing consumer with other acks or a
/// delivery limit is refused at start.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct NatsSourceConfig {
    /// Servers.
    pub servers: String,
    /// Stream.
    pub stream: String,
    /// Durable consumer name.
    pub durable: String,
    /// Subject filter.
    pub filter_subject: Option<String>,
    /// Ack wait.
    pub ack_wait: Duration,
    /// Max ack pending.
    pub max_ack_pending: i64,
    /// Messages per pull request.
    pub pull_batch: usize,
    /// Start of a new consumer.
    pub start_from: StartFrom,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// TTL of the membership lease.
    pub lease_ttl: Duration,
}

impl NatsSourceConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.servers.trim().is_empty() {
            return Err(ConfigError::new("servers must not be empty"));
        }
        for (what, name) in [("stream", &self.stream), ("durable", &self.durable)] {
            if name.is_empty()
                || name
                    .chars()
                    .any(|c| matches!(c, '.' | '*' | '>' | '/' | '\\') || c.is_whitespace())
            {
                return Err(ConfigError::new(format!(
                    "{what} name {name:?} is not a valid JetStream name"
                )));
            }
        }
        if let Some(f) = &self.filter_subject {
            if f.is_empty() || f.split('.').any(str::is_empty) || f.contains(char::is_whitespace) {
                return Err(ConfigError::new(format!(
                    "filter subject {f:?} is not a subject"
                )));
            }
        }
        if self.ack_wait < Duration::from_secs(1) {
            return Err(ConfigError::new(format!(
                "ack wait {:?} is below 1 s: messages would be redelivered while the engine \
                 applies them",
                self.ack_wait
            )));
        }
        if self.max_ack_pending < 1 || self.pull_batch == 0 {
            return Err(ConfigError::new(
                "max_ack_pending and pull_batch must be at least 1",
            ));
        }
        if self.lease_ttl < MIN_LEASE_TTL || self.lease_ttl > Duration::from_secs(3600) {
            return Err(ConfigError::new(format!(
                "lease TTL {:?} is outside 3 s ..= 1 h (renewed every TTL / 3)",
                self.lease_ttl
            )));
        }
        if self.pull_batch as i64 > self.max_ack_pending {
            return Err(ConfigError::new(
                "pull_batch must not exceed max_ack_pending",
            ));
        }
        Ok(())
    }
}

/// Builder of a [`NatsSource`].
#[derive(Debug)]
pub struct NatsSourceBuilder {
    config: NatsSourceConfig,
}

impl NatsSourceBuilder {
    /// Reads only `subject` (a filter; wildcards allowed).
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.config.filter_subject = Some(subject.into());
        self
    }
    /// Sets the ack wait. Default 30 s.
    pub fn ack_wait(mut self, d: Duration) -> Self {
        self.config.ack_wait = d;
        self
    }
    /// Sets `max_ack_pending`. Default 1,000.
    pub fn max_ack_pending(mut self, n: i64) -> Self {
        self.config.max_ack_pending = n;
        self
    }
    /// Sets the messages per pull request. Default 100.
    pub fn pull_batch(mut self, n: usize) -> Self {
        self.config.pull_batch = n;
        self
    }
    /// Where a consumer that does not exist yet starts. Default [`StartFrom::Earliest`].
    pub fn start_from(mut self, s: StartFrom) -> Self {
        self.config.start_from = s;
        self
    }
    /// Sets the connect timeout. Default 5 s.
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.config.connect_timeout = d;
        self
    }
    /// Sets the TTL of the membership lease (module docs, "One active member"). Default
    /// [`DEFAULT_LEASE_TTL`] (10 s); 3 s to 1 h. Members of one durable consumer must use the
    /// same TTL (the lease's bucket is one per TTL): a member that finds another one active
    /// with another TTL does not read, its `poll` fails with a permanent error.
    pub fn lease_ttl(mut self, d: Duration) -> Self {
        self.config.lease_ttl = d;
        self
    }

    /// Connects, creates the durable consumer if it does not exist (or checks the existing
    /// one) and returns the source. Reading starts at the first [`MessageSource::poll`].
    pub async fn start(self) -> Result<NatsSource, SourceError> {
        let config = self.config;
        config
            .validate()
            .map_err(|e| SourceError::new(ErrorClass::Permanent, e.to_string()))?;
        let client = connect_client(&config.servers, "outbox-consumer", config.connect_timeout)
            .await
            .map_err(|e| SourceError::new(ErrorClass::Permanent, e))?;
        let js = jetstream::new(client.clone());
        let consumer = bind_consumer(&js, &config).await?;
        let member = format!(
            "pid {} started {}",
            std::process::id(),
            Utc::now().to_rfc3339()
        );
        let lease = Lease::start(
            &js,
            &config.stream,
            &config.durable,
            config.lease_ttl,
            config.connect_timeout,
            member,
        )
        .await?;
        let member = Arc::new(Membership {
            tp: TopicPartition::new(config.stream.clone(), 0),
            durable: config.durable.clone(),
            reading_term: Mutex::new(None),
            state: Mutex::new(InFlight::default()),
            tracker: Mutex::new(None),
        });
        let watch = AbortOnDrop(tokio::spawn(watch_lease(
            lease.view().clone(),
            Arc::downgrade(&member),
        )));
        Ok(NatsSource {
            lease,
            tp: member.tp.clone(),
            member,
            _watch: watch,
            config,
            client,
            consumer,
            messages: tokio::sync::Mutex::new(None),
            assigned: AtomicBool::new(false),
        })
    }
}

async fn bind_consumer(
    js: &Context,
    config: &NatsSourceConfig,
) -> Result<PullConsumer, SourceError> {
    let t = config.connect_timeout;
    let timed_out = |what: &str| {
        SourceError::new(
            ErrorClass::Transient,
            format!("{what} timed out after {t:?}"),
        )
    };
    let stream = tokio::time::timeout(t, js.get_stream(&config.stream))
        .await
        .map_err(|_| timed_out("stream lookup"))?
        .map_err(|e| {
            let missing = matches!(e.kind(), async_nats::jetstream::context::GetStreamErrorKind::JetStream(ref j) if j.error_code().0 == 10059);
            source_error(&format!("stream {:?}", config.stream), e, missing)
        })?;
    let wanted = PullConfig {
        durable_name: Some(config.durable.clone()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: config.ack_wait,
        max_ack_pending: config.max_ack_pending,
        max_deliver: -1,
        deliver_policy: match config.start_from {
            StartFrom::Earliest => DeliverPolicy::All,
            StartFrom::Latest => DeliverPolicy::New,
        },
        filter_subject: config.filter_subject.clone().unwrap_or_default(),
        ..Default::default()
    };
    let mut consumer: PullConsumer =
        tokio::time::timeout(t, stream.get_or_create_consumer(&config.durable, wanted))
            .await
            .map_err(|_| timed_out("consumer lookup"))?
            .map_err(|e| source_error(&format!("consumer {:?}", config.durable), e, false))?;
    let info = tokio::time::timeout(t, consumer.info())
        .await
        .map_err(|_| timed_out("consumer info"))?
        .map_err(|e| source_error("consumer info", e, false))?;
    let c = &info.config;
    if c.ack_policy != AckPolicy::Explicit || c.max_deliver > 0 {
        return Err(SourceError::new(
            ErrorClass::Permanent,
            format!(
                "durable consumer {:?} exists with ack policy {:?} and max_deliver {}: the \
                 inbox needs explicit acks and unlimited deliveries (a delivery limit drops \
                 messages silently); delete or fix it",
                config.durable, c.ack_policy, c.max_deliver
            ),
        ));
    }
    Ok(consumer)
}

/// A delivery handed out and not acknowledged.
struct Delivery {
    stream_seq: u64,
    /// The reply subject of the newest delivery of the message.
    acker: Acker,
    /// Handed to `ack_ahead` (its transaction committed) and not confirmed: acked at any
    /// occasion (see the module docs).
    is_final: bool,
}

/// Deliveries handed out and not acknowledged, by delivery sequence, with the stream
/// sequence of each (to recognise a redelivery of a message still in flight).
#[derive(Default)]
struct InFlight {
    ackers: BTreeMap<u64, Delivery>,
    by_stream_seq: BTreeMap<u64, u64>,
    /// The highest delivery sequence handed out (0: none): the engine's watermark takes a
    /// delivery at or below it for a rewind.
    highest_handed_out: u64,
}

impl InFlight {
    /// Whether `delivery` starts a new numbering of the consumer's deliveries: one at or
    /// below a delivery handed out before (the server lost the consumer's state, or the
    /// consumer was created again). The numbers held here then name other messages; see
    /// the module docs ("A delivery sequence that goes back").
    fn starts_over(&self, delivery: u64) -> bool {
        delivery <= self.highest_handed_out
    }

    /// Forgets every delivery held (none is acknowledged): the server delivers each again
    /// under its new numbering. Returns how many were held, and how many of them final.
    fn forget_all(&mut self) -> (usize, usize) {
        let held = self.ackers.len();
        let finals = self.ackers.values().filter(|d| d.is_final).count();
        *self = Self::default();
        (held, finals)
    }

    /// Removes and returns the deliveries below `limit` and every final one.
    fn take_below_and_final(&mut self, limit: u64) -> Vec<(u64, Delivery)> {
        let keep = self.ackers.split_off(&limit);
        let mut due: Vec<(u64, Delivery)> = std::mem::replace(&mut self.ackers, keep)
            .into_iter()
            .collect();
        due.extend(self.take_final());
        for (_, d) in &due {
            self.by_stream_seq.remove(&d.stream_seq);
        }
        due
    }

    /// Removes and returns every final delivery.
    fn take_final(&mut self) -> Vec<(u64, Delivery)> {
        let finals: Vec<u64> = self
            .ackers
            .iter()
            .filter(|(_, d)| d.is_final)
            .map(|(n, _)| *n)
            .collect();
        finals
            .into_iter()
            .filter_map(|n| {
                let d = self.ackers.remove(&n)?;
                self.by_stream_seq.remove(&d.stream_seq);
                Some((n, d))
            })
            .collect()
    }

    /// Removes and returns one delivery, when held.
    fn take(&mut self, delivery: u64) -> Option<(u64, Delivery)> {
        let d = self.ackers.remove(&delivery)?;
        self.by_stream_seq.remove(&d.stream_seq);
        Some((delivery, d))
    }

    fn put_back(&mut self, delivery: u64, d: Delivery) {
        self.by_stream_seq.entry(d.stream_seq).or_insert(delivery);
        self.ackers.entry(delivery).or_insert(d);
    }
}

/// What a member reads under its lease, shared with the task that watches the lease
/// ([`watch_lease`]).
struct Membership {
    tp: TopicPartition,
    durable: String,
    /// The lease term this member hands out messages under (none: a standby). Locked before
    /// `state` wherever both are.
    reading_term: Mutex<Option<u64>>,
    state: Mutex<InFlight>,
    tracker: Mutex<Option<SharedOffsetTracker>>,
}

impl Membership {
    fn state(&self) -> std::sync::MutexGuard<'_, InFlight> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn reading(&self) -> std::sync::MutexGuard<'_, Option<u64>> {
        self.reading_term
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn tracker(&self) -> Option<SharedOffsetTracker> {
        self.tracker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops reading under the term in `reading` (the lease lost or run out): forgets every
    /// delivery held, acknowledging none, and tells the engine the partition is lost.
    fn stop_reading(&self, reading: &mut Option<u64>) {
        let Some(old) = reading.take() else {
            return;
        };
        let (held, finals) = self.state().forget_all();
        if let Some(t) = self.tracker() {
            t.lose(std::slice::from_ref(&self.tp));
        }
        tracing::warn!(stream = %self.tp.topic, durable = %self.durable, term = old, held, finals, "membership lease lost: reading stopped, deliveries held here forgotten unacknowledged (redelivered after the ack wait)");
    }
}

/// Stops a member's reading the moment its lease runs out (not renewed in time) or is lost,
/// without waiting for the next `poll`: the engine checks a queued message's partition before
/// it applies it, but it polls only while below its in-flight bound, and would otherwise apply
/// what it queued after another member took over. Ends with the source.
async fn watch_lease(lease: LeaseView, member: Weak<Membership>) {
    loop {
        // A lease whose time ran out is acted on once, then only its next change wakes this.
        match lease.valid_until().filter(|until| *until > Instant::now()) {
            Some(until) => tokio::select! {
                () = tokio::time::sleep_until(until) => {}
                () = lease.changed() => {}
            },
            None => lease.changed().await,
        }
        let Some(member) = member.upgrade() else {
            return;
        };
        let mut reading = member.reading();
        if reading.is_some() && *reading != lease.valid_term() {
            member.stop_reading(&mut reading);
        }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What [`NatsSource::accept`] makes of a delivery.
enum Accepted {
    /// A message to hand out.
    New(Box<ReceivedMessage>),
    /// A redelivery of a message in flight here and not final: dropped.
    InFlight,
    /// A redelivery of a final message whose ack was not confirmed (held here under this
    /// delivery sequence): to ack at once.
    Final(u64),
    /// This member stopped reading under the lease before the delivery came (not handed out,
    /// not acknowledged; its acker, for [`close`](NatsSource::close) to give it back).
    NotHeld(Box<Acker>),
}

/// The outbox [`MessageSource`] for JetStream: a durable pull consumer, explicit acks sent
/// only through [`commit`](MessageSource::commit) (after the effects' transactions committed)
/// and [`close`](Self::close). See the [module docs](crate::source) for how acks map to offsets.
pub struct NatsSource {
    config: NatsSourceConfig,
    tp: TopicPartition,
    client: async_nats::Client,
    consumer: PullConsumer,
    messages: tokio::sync::Mutex<Option<PullStream>>,
    member: Arc<Membership>,
    assigned: AtomicBool,
    lease: Lease,
    _watch: AbortOnDrop,
}

impl fmt::Debug for NatsSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsSource")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl NatsSource {
    /// A builder for a source reading `stream` through the durable consumer `durable`.
    pub fn builder(
        servers: impl Into<String>,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> NatsSourceBuilder {
        NatsSourceBuilder {
            config: NatsSourceConfig {
                servers: servers.into(),
                stream: stream.into(),
                durable: durable.into(),
                filter_subject: None,
                ack_wait: DEFAULT_ACK_WAIT,
                max_ack_pending: DEFAULT_MAX_ACK_PENDING,
                pull_batch: DEFAULT_PULL_BATCH,
                start_from: StartFrom::Earliest,
                connect_timeout: crate::DEFAULT_CONNECT_TIMEOUT,
                lease_ttl: DEFAULT_LEASE_TTL,
            },
        }
    }

    /// The configuration.
    pub fn config(&self) -> &NatsSourceConfig {
        &self.config
    }

    /// Deliveries handed out and not acknowledged.
    pub fn unacknowledged(&self) -> usize {
        self.state().ackers.len()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, InFlight> {
        self.member.state()
    }

    fn tracker(&self) -> Option<SharedOffsetTracker> {
        self.member.tracker()
    }

    /// Leaves cleanly: stops reading, acknowledges what the attached tracker holds final (its
    /// revoke commit), gives every other message it holds back to the stream at once (`-NAK`),
    /// so another member gets it without waiting for the ack wait, and gives the lease back.
    ///
    /// Reading stops **first**: the pull is dropped (its subscription ended), and the server
    /// has forgotten the pull request, before any message is given back. A message given back
    /// while this member's pull request was still open at the server went straight back to
    /// that pull, and waited out the whole ack wait there after the member left. The messages
    /// the pull had brought and nobody was handed yet are given back too. (One race is left: a pull request the client sends on its own
    /// while those are taken, whose deliveries arrive after the subscription ended: those come
    /// again after the ack wait.)
    pub async fn close(self) {
        let mut not_held: Vec<Acker> = Vec::new();
        if let Some(mut stream) = self.messages.lock().await.take() {
            while let Some(Some(Ok(msg))) = futures::FutureExt::now_or_never(stream.next()) {
                // Recorded as held (given back below), or a redelivery of one held here (its
                // newer reply subject kept), or one this member may not hold.
                if let Ok(Accepted::NotHeld(acker)) = self.accept(msg) {
                    not_held.push(*acker);
                }
            }
            drop(stream);
            self.pull_requests_gone().await;
        }
        if let Some(t) = self.tracker() {
            let commits = t.revoke(std::slice::from_ref(&self.tp));
            if let Err(e) = self.ack_below(&commits, false).await {
                tracing::warn!(error = %e, "final acks at close failed; those messages are redelivered");
            }
        }
        let finals = self.state().take_final();
        if let Err(e) = self.ack_due(finals).await {
            tracing::warn!(error = %e, "acks of final messages at close failed; those messages are redelivered");
        }
        let mut rest: Vec<Acker> = self
            .state()
            .take_below_and_final(u64::MAX)
            .into_iter()
            .map(|(_, d)| d.acker)
            .collect();
        rest.append(&mut not_held);
        join_all(rest.iter().map(|a| a.ack_with(AckKind::Nak(None)))).await;
        // The naks are only queued on the connection: flush before the client goes.
        let _ = tokio::time::timeout(self.config.connect_timeout, self.client.flush()).await;
        self.lease.release(self.config.connect_timeout).await;
    }

    /// After the pull was dropped: waits (at most the connect timeout, 2 s at most) until the
    /// server holds no pull request of the consumer, so that a message given back is not
    /// delivered to this member's request. The drop sends the unsubscription from a task of
    /// its own, which cannot be awaited; the server forgets a pull request whose subscription
    /// is gone when it next looks at it, which a consumer info request makes it do (seen on
    /// 2.9: a message given back right after the drop went to the dropped request, and came
    /// again only after its ack wait). The other members being standbys, none of them has a
    /// pull request; if one has (this member lost the lease), the wait runs out and the
    /// messages are given back all the same.
    async fn pull_requests_gone(&self) {
        let t = self.config.connect_timeout;
        let deadline = Instant::now() + t.min(Duration::from_secs(2));
        let mut consumer = self.consumer.clone();
        loop {
            tokio::task::yield_now().await;
            let _ = tokio::time::timeout(t, self.client.flush()).await;
            match tokio::time::timeout(t, consumer.info()).await {
                Ok(Ok(info)) if info.num_waiting == 0 => return,
                Ok(Ok(_)) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                _ => return,
            }
        }
    }

    /// Whether this member holds the membership lease and hands out messages now.
    pub fn is_active(&self) -> bool {
        self.lease.view().valid_term().is_some()
    }

    /// Checks the lease before a message is handed out: `true` when this member may hand out
    /// messages. A member that lost the lease (or holds a newer term than the one it read
    /// under) stops reading and forgets what it holds, acknowledging nothing, and the engine
    /// drops what it queued or held of it (the partition is lost): the server redelivers
    /// each after its ack wait, to the active member. (The lease watch, [`watch_lease`], does
    /// the same the moment the lease runs out; a member without the lease keeps no pull.)
    fn lease_allows(&self, messages: &mut Option<PullStream>) -> bool {
        let now = self.lease.view().valid_term();
        if now.is_none() {
            *messages = None;
        }
        let mut reading = self.member.reading();
        if *reading == now {
            return now.is_some();
        }
        self.member.stop_reading(&mut reading);
        if let Some(term) = now {
            *messages = None;
            if let Some(t) = self.tracker() {
                t.assign(std::slice::from_ref(&self.tp));
            }
            tracing::info!(stream = %self.tp.topic, durable = %self.config.durable, term, "membership lease held: reading");
            *reading = Some(term);
        }
        now.is_some()
    }

    /// Acks every message handed out below the commits' next offsets (clamped to the
    /// tracker's committable offset when `clamp`), and every final one.
    async fn ack_below(&self, commits: &[CommitOffset], clamp: bool) -> Result<(), SourceError> {
        let next = commits
            .iter()
            .filter(|c| c.topic_partition() == self.tp)
            .map(|c| c.next_offset)
            .max();
        let limit = match (next, clamp) {
            (None, _) => None,
            (Some(next), false) => Some(next),
            (Some(next), true) => match self.tracker() {
                None => Some(next),
                Some(t) => {
                    let t = t.lock();
                    t.partition(&self.tp)
                        .and_then(|w| w.committable())
                        .map(|c| c.min(next))
                }
            },
        };
        let limit = limit.and_then(|l| u64::try_from(l).ok()).unwrap_or(0);
        let due = self.state().take_below_and_final(limit);
        self.ack_due(due).await
    }

    /// Acks `due` (taken from the in-flight state), each confirmed by the server; puts back
    /// those not confirmed (final ones still final), for the next occasion.
    async fn ack_due(&self, due: Vec<(u64, Delivery)>) -> Result<(), SourceError> {
        if due.is_empty() {
            return Ok(());
        }
        let t = self.config.connect_timeout;
        let acked = join_all(due.iter().map(|(_, d)| async move {
            matches!(
                tokio::time::timeout(t, d.acker.double_ack()).await,
                Ok(Ok(()))
            )
        }))
        .await;
        let mut failed = 0usize;
        {
            let mut st = self.state();
            for ((delivery, d), ok) in due.into_iter().zip(acked) {
                if !ok {
                    failed += 1;
                    st.put_back(delivery, d);
                }
            }
        }
        if failed > 0 {
            return Err(SourceError::new(
                ErrorClass::Transient,
                format!(
                    "{failed} acks on {} were not confirmed; retried at the next ack ahead or \
                     commit, or when the server redelivers them",
                    self.tp
                ),
            ));
        }
        Ok(())
    }

    /// The message to hand out for a delivery, or what to do with a redelivery of one still
    /// held here (its acker is replaced by the newer delivery's).
    fn accept(&self, msg: jetstream::Message) -> Result<Accepted, SourceError> {
        let (seq, delivery, published) = {
            let info = msg.info().map_err(|e| {
                SourceError::new(ErrorClass::Transient, format!("message metadata: {e}"))
            })?;
            (info.stream_sequence, info.consumer_sequence, info.published)
        };
        let (message, acker) = msg.split();
        {
            // Checked under the lock the lease watch stops reading under: a delivery is never
            // recorded as held after this member forgot what it held.
            let reading = self.member.reading();
            if reading.is_none() || *reading != self.lease.view().valid_term() {
                return Ok(Accepted::NotHeld(Box::new(acker)));
            }
            let mut st = self.state();
            if st.starts_over(delivery) {
                let highest = st.highest_handed_out;
                let (held, finals) = st.forget_all();
                tracing::warn!(stream = %self.tp.topic, seq, delivery, highest, held, finals, "the consumer's delivery sequence went back (the server lost its state, or the consumer was created again): forgetting the deliveries held here unacknowledged; the server delivers them again");
            }
            if let Some(held) = st.by_stream_seq.get(&seq).copied() {
                let is_final = match st.ackers.get_mut(&held) {
                    Some(slot) => {
                        slot.acker = acker;
                        slot.is_final
                    }
                    None => false,
                };
                if is_final {
                    tracing::debug!(stream = %self.tp.topic, seq, delivery, held, "redelivery of a final message whose ack was lost; acked again");
                    return Ok(Accepted::Final(held));
                }
                tracing::debug!(stream = %self.tp.topic, seq, delivery, held, "redelivery of a message still in flight; not handed out again");
                return Ok(Accepted::InFlight);
            }
            st.ackers.insert(
                delivery,
                Delivery {
                    stream_seq: seq,
                    acker,
                    is_final: false,
                },
            );
            st.by_stream_seq.insert(seq, delivery);
            st.highest_handed_out = delivery;
        }
        let mut headers: Vec<RecordHeader> = message
            .headers
            .iter()
            .flat_map(|h| h.iter())
            .filter(|(name, _)| AsRef::<str>::as_ref(*name) != "Nats-Msg-Id")
            .flat_map(|(name, values)| {
                values.iter().map(move |v| {
                    RecordHeader::new(AsRef::<str>::as_ref(name), v.as_str().as_bytes())
                })
            })
            .collect();
        headers.sort_by(|a, b| a.name.cmp(&b.name));
        let timestamp =
            DateTime::<Utc>::from_timestamp(published.unix_timestamp(), published.nanosecond());
        tracing::trace!(stream = %self.tp.topic, seq, delivery, "message handed out");
        let position =
            LogPosition::jetstream(self.tp.topic.clone(), seq, delivery, &self.config.durable);
        Ok(Accepted::New(Box::new(ReceivedMessage::from_record(
            position,
            None,
            headers,
            Some(message.payload.to_vec()),
            timestamp,
        ))))
    }
}

#[async_trait]
impl MessageSource for NatsSource {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        if !self.assigned.swap(true, Ordering::SeqCst) {
            if let Some(t) = self.tracker() {
                t.assign(std::slice::from_ref(&self.tp));
            }
        }
        let deadline = Instant::now() + timeout;
        let mut guard = self.messages.lock().await;
        loop {
            if let Some(other) = self.lease.view().conflict() {
                *guard = None;
                return Err(SourceError::new(
                    ErrorClass::Permanent,
                    format!(
                        "durable consumer {:?} of stream {:?}: another member holds its lease \
                         with lease TTL {other:?}, this one has {:?}; the members of one durable \
                         consumer must use the same lease_ttl (two TTLs, two lease buckets: \
                         two active members)",
                        self.config.durable, self.config.stream, self.config.lease_ttl
                    ),
                ));
            }
            if !self.lease_allows(&mut guard) {
                // A standby: nothing pulled; the lease task retries the acquisition.
                if timeout.is_zero() || Instant::now() >= deadline {
                    return Ok(None);
                }
                tokio::time::sleep_until(deadline.min(Instant::now() + STANDBY_CHECK)).await;
                continue;
            }
            if guard.is_none() {
                // A pull request lives at most the lease TTL at the server (module docs).
                let expires = self.config.lease_ttl.min(MAX_PULL_EXPIRES);
                let stream = self
                    .consumer
                    .stream()
                    .max_messages_per_batch(self.config.pull_batch)
                    .heartbeat((expires / 3).min(Duration::from_secs(5)))
                    .expires(expires)
                    .messages()
                    .await
                    .map_err(|e| source_error("pull request", e, false))?;
                *guard = Some(stream);
            }
            let stream = guard.as_mut().expect("set above");
            let next = if timeout.is_zero() {
                futures::FutureExt::now_or_never(stream.next()).flatten()
            } else {
                match tokio::time::timeout_at(deadline, stream.next()).await {
                    Ok(n) => n,
                    Err(_) => return Ok(None),
                }
            };
            match next {
                None if timeout.is_zero() => return Ok(None),
                None => {
                    *guard = None;
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                }
                Some(Ok(msg)) => {
                    if !self.lease_allows(&mut guard) {
                        // Not handed out, not acknowledged: redelivered after the ack wait.
                        continue;
                    }
                    match self.accept(msg)? {
                        Accepted::New(m) => return Ok(Some(*m)),
                        Accepted::InFlight | Accepted::NotHeld(_) => {}
                        Accepted::Final(held) => {
                            // This one only: the redeliveries of the others may be on their
                            // way already, and would be new messages once acked here.
                            let due: Vec<_> = self.state().take(held).into_iter().collect();
                            if let Err(e) = self.ack_due(due).await {
                                tracing::warn!(error = %e, "acking a redelivered final message failed");
                            }
                        }
                    }
                    if Instant::now() >= deadline && !timeout.is_zero() {
                        return Ok(None);
                    }
                }
                Some(Err(e)) => {
                    use async_nats::jetstream::consumer::pull::MessagesErrorKind as M;
                    let permanent = matches!(e.kind(), M::ConsumerDeleted | M::PushBasedConsumer);
                    *guard = None;
                    return Err(source_error(&format!("reading {}", self.tp), e, permanent));
                }
            }
        }
    }

    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        self.ack_below(offsets, true).await
    }

    /// Acks each final delivery still held here on its own (a redelivery of it that arrived
    /// meanwhile replaced its reply subject, so the ack covers the message), with every one
    /// handed here before whose ack was not confirmed. One not confirmed stays final: acked
    /// at the next ack ahead or commit, or when the server redelivers it (module docs).
    async fn ack_ahead(&self, positions: &[LogPosition]) -> Result<(), SourceError> {
        let due = {
            let mut st = self.state();
            for p in positions
                .iter()
                .filter(|p| p.topic == self.tp.topic && p.partition == self.tp.partition)
            {
                // The delivery *and* the message: after the numbering started over, the
                // position of a message handed out before may name another one here now.
                let NativePosition::JetStream {
                    stream_sequence, ..
                } = p.native
                else {
                    continue;
                };
                let Ok(d) = u64::try_from(p.offset) else {
                    continue;
                };
                if let Some(slot) = st.ackers.get_mut(&d) {
                    if slot.stream_seq == stream_sequence {
                        slot.is_final = true;
                    }
                }
            }
            st.take_final()
        };
        self.ack_due(due).await
    }

    /// Per message: a commit acks each delivery below it (see the [module docs](crate::source)).
    fn ack_model(&self) -> AckModel {
        AckModel::PerMessage
    }

    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        *self
            .member
            .tracker
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(offsets);
    }

    /// Lag from the consumer's own counters, in delivery sequences like the positions:
    /// `committed` is the ack floor + 1, `end` the last delivery + 1 plus the messages not
    /// delivered yet. JetStream skips messages deleted by retention without telling a consumer,
    /// so `earliest` is the ack floor too and no retention gap is reported (see
    /// `docs/transports.md`).
    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        let mut c = self.consumer.clone();
        let info = tokio::time::timeout(self.config.connect_timeout, c.info())
            .await
            .map_err(|_| SourceError::new(ErrorClass::Transient, "consumer info timed out"))?
            .map_err(|e| source_error("consumer info", e, false))?;
        let seq = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let committed = seq(info.ack_floor.consumer_sequence).saturating_add(1);
        let end = seq(info.delivered.consumer_sequence)
            .saturating_add(1)
            .saturating_add(seq(info.num_pending));
        Ok(vec![PartitionLag::new(
            self.tp.clone(),
            Some(committed),
            committed,
            end.max(committed),
        )])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsafe_source_settings_are_refused() {
        let base = || NatsSource::builder("nats://h:1", "S", "d").config;
        assert!(base().validate().is_ok());
        let cases: Vec<(NatsSourceConfig, &str)> = vec![
            (
                NatsSourceConfig {
                    ack_wait: Duration::from_millis(500),
                    ..base()
                },
                "ack wait",
            ),
            (
                NatsSourceConfig {
                    max_ack_pending: 0,
                    ..base()
                },
                "max_ack_pending",
            ),
            (
                NatsSourceConfig {
                    pull_batch: 0,
                    ..base()
                },
                "pull_batch",
            ),
            (
                NatsSourceConfig {
                    pull_batch: 2_000,
                    ..base()
                },
                "pull_batch",
            ),
            (
                NatsSourceConfig {
                    stream: "a.b".into(),
                    ..base()
                },
                "stream name",
            ),
            (
                NatsSourceConfig {
                    durable: "".into(),
                    ..base()
                },
                "durable name",
            ),
            (
                NatsSourceConfig {
                    filter_subject: Some("a..b".into()),
                    ..base()
                },
                "filter subject",
            ),
            (
                NatsSourceConfig {
                    lease_ttl: Duration::from_secs(2),
                    ..base()
                },
                "lease TTL",
            ),
            (
                NatsSourceConfig {
                    servers: "".into(),
                    ..base()
                },
                "servers",
            ),
        ];
        for (c, expected) in cases {
            let err = c.validate().expect_err(expected).to_string();
            assert!(err.contains(expected), "{expected}: {err}");
        }
    }
}
