//! [`NatsPublisher`]: the outbox [`Publisher`] on JetStream, acknowledged by `PubAck`s.

use std::collections::{BTreeSet, HashSet};
use std::fmt;
use std::str::FromStr;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use async_nats::header::{HeaderMap, HeaderName, HeaderValue, NATS_MESSAGE_ID};
use std::future::IntoFuture;

use async_nats::jetstream::context::{
    GetStreamByNameErrorKind, PublishAckFuture, PublishErrorKind as NatsKind,
};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, Context};
use bytes::Bytes;
use futures::future::join_all;
use outbox_core::{
    async_trait, wire, ConfigError, Envelope, ErrorClass, FailureScope, PublishError,
    PublishErrorKind, PublishResult, Publisher,
};
use tokio::time::Instant;

use crate::config::{redact_urls, NatsPublisherBuilder, NatsPublisherConfig};
use crate::error::{error_on, publish_error};
use crate::streams::{check_streams, StreamCheckError, StreamReport};

/// Extra time [`NatsPublisher::publish`] waits beyond the delivery timeout for the last
/// `PubAck`s and for asking the server about a missing stream.
pub const REPORT_GRACE: Duration = Duration::from_millis(500);

/// Bytes a message's protocol line and header block add beyond names and values (`NATS/1.0`,
/// separators): counted against the server's `max_payload` before sending.
const HEADER_OVERHEAD: usize = 64;

/// Why [`NatsPublisherBuilder::start`] failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration is invalid or unsafe.
    Config(ConfigError),
    /// The client could not be created (bad URL, TLS setup).
    Connect(String),
    /// A stream is missing or the server could not be asked.
    Streams(StreamCheckError),
}

impl StartError {
    /// Whether trying again later can succeed (the server was unreachable).
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Streams(e) if e.is_transient())
    }
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config(e) => write!(f, "{e}"),
            Self::Connect(e) => write!(f, "cannot create the NATS client: {e}"),
            Self::Streams(e) => write!(f, "stream check failed: {e}"),
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Config(e) => Some(e),
            Self::Connect(_) => None,
            Self::Streams(e) => Some(e),
        }
    }
}

impl NatsPublisherBuilder {
    /// Validates the configuration and creates the client. The client connects (and
    /// reconnects) in the background, so this does not wait for the server; call
    /// [`NatsPublisher::check_streams`] (or use [`start`](Self::start)) before publishing.
    pub async fn connect(self) -> Result<NatsPublisher, StartError> {
        let config = self.build().map_err(StartError::Config)?;
        NatsPublisher::connect(config).await
    }

    /// [`connect`](Self::connect), then [`NatsPublisher::check_streams`]: fails at start on a
    /// subject no stream captures (permanent) or an unreachable server (transient), instead of
    /// at the first publish.
    pub async fn start(self) -> Result<NatsPublisher, StartError> {
        let publisher = self.connect().await?;
        publisher
            .check_streams()
            .await
            .map_err(StartError::Streams)?;
        Ok(publisher)
    }
}

/// The outbox [`Publisher`] for NATS JetStream.
///
/// * A batch is published as a whole: every message is handed to the connection (one request
///   each, with its own reply inbox), then every `PubAck` is awaited together. A result is
///   `Ok` only from a `PubAck` without an error, carrying the stream and stream sequence
///   ([`crate::ack`]). A `PubAck` marked duplicate (the stream already held this
///   `Nats-Msg-Id`, a re-send) is an acknowledgement too: the event is stored.
/// * Every message carries the event id as `Nats-Msg-Id`, so re-sends inside the stream's
///   duplicate window are dropped by the server. An operator replay (an envelope carrying
///   [`wire::REPLAY_HEADER`]) is sent as `<event id>:<replay id>` instead: a replay is a
///   deliberate second delivery that the window must not drop, while a retry within one replay
///   run still is.
/// * Messages of one connection reach the server in order, so one aggregate's events are
///   stored in order. If handing a message to the connection fails, later events of the same
///   aggregate in the batch are not sent (they fail transiently).
/// * A message over the server's `max_payload` fails as `record_too_large` before it is sent:
///   the server would close the connection, failing the whole batch.
/// * [`publish`](Publisher::publish) returns within
///   [`delivery_timeout`](Publisher::delivery_timeout) + [`REPORT_GRACE`] of its start;
///   while the server is away the client keeps reconnecting, and the batch's records fail as
///   transient transport errors (`timeout`, `broker_unavailable`).
/// * "No responders" (no stream captured the subject) is reported as `unknown_topic`
///   (permanent) only after the JetStream API confirms that no stream captures the subject;
///   while the API does not answer (a server still starting) it is `broker_unavailable`.
pub struct NatsPublisher {
    config: NatsPublisherConfig,
    client: async_nats::Client,
    js: Context,
    last_report: Mutex<Option<StreamReport>>,
}

impl fmt::Debug for NatsPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsPublisher")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl NatsPublisher {
    /// A builder for a publisher to `servers` with subjects `<subject_prefix>.<aggregate_type>`.
    pub fn builder(
        servers: impl Into<String>,
        subject_prefix: impl Into<String>,
    ) -> NatsPublisherBuilder {
        NatsPublisherBuilder {
            config: NatsPublisherConfig::new(servers, subject_prefix),
            route_conflicts: Vec::new(),
        }
    }

    /// A publisher from a complete configuration (validated here).
    pub async fn connect(config: NatsPublisherConfig) -> Result<Self, StartError> {
        config.validate().map_err(StartError::Config)?;
        let client = connect_client(&config.servers, &config.client_name, config.connect_timeout)
            .await
            .map_err(StartError::Connect)?;
        let js = jetstream::ContextBuilder::new()
            .timeout(config.delivery_timeout)
            .max_ack_inflight(config.max_in_flight)
            .backpressure_on_inflight(true)
            .build(client.clone());
        Ok(Self {
            config,
            client,
            js,
            last_report: Mutex::new(None),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &NatsPublisherConfig {
        &self.config
    }

    /// Checks that a stream captures every subject space of the configuration, and reports the
    /// streams' duplicate window, storage, replicas and retention; logs each warning
    /// ([`crate::StreamWarning`]).
    pub async fn check_streams(&self) -> Result<StreamReport, StreamCheckError> {
        let report = check_streams(
            &self.js,
            &self.config.subject_spaces(),
            self.config.relay_lease,
            self.config.connect_timeout,
        )
        .await?;
        for s in &report.streams {
            tracing::info!(stream = %s.name, subjects = ?s.subjects, duplicate_window = ?s.duplicate_window, storage = ?s.storage, replicas = s.replicas, retention = ?s.retention, "outbox stream checked");
        }
        for w in &report.warnings {
            tracing::warn!("{w}");
        }
        *self
            .last_report
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(report.clone());
        Ok(report)
    }

    /// The report of the last successful [`check_streams`](Self::check_streams).
    pub fn stream_report(&self) -> Option<StreamReport> {
        self.last_report
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The client (for health checks and tests).
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The largest message (payload and headers) the server accepts; 1 MiB until the first
    /// connection tells.
    fn max_payload(&self) -> usize {
        match self.client.server_info().max_payload {
            0 => 1024 * 1024,
            n => n,
        }
    }

    /// For the records that failed as "no responders": asks the JetStream API whether a stream
    /// captures their subject, within what is left until `deadline`. Confirmed missing stays
    /// `unknown_topic` (permanent); anything else (a stream exists, the API does not answer)
    /// becomes `broker_unavailable` (transient).
    async fn confirm_missing_streams(
        &self,
        subjects: &[Option<String>],
        results: &mut [PublishResult],
        deadline: Instant,
    ) {
        let suspects: BTreeSet<&str> = subjects
            .iter()
            .zip(results.iter())
            .filter_map(|(s, r)| match (s, r) {
                (Some(s), Err(e)) if e.kind == PublishErrorKind::UnknownTopic => Some(s.as_str()),
                _ => None,
            })
            .collect();
        if suspects.is_empty() {
            return;
        }
        let budget = deadline
            .saturating_duration_since(Instant::now())
            .min(self.config.connect_timeout);
        let mut missing: HashSet<&str> = HashSet::new();
        for subject in suspects {
            let found =
                tokio::time::timeout(budget, self.js.stream_by_subject(subject.to_owned())).await;
            if let Ok(Err(e)) = found {
                if matches!(e.kind(), GetStreamByNameErrorKind::NotFound) {
                    missing.insert(subject);
                }
            }
        }
        for (s, r) in subjects.iter().zip(results.iter_mut()) {
            let (Some(s), Err(e)) = (s, &*r) else {
                continue;
            };
            if e.kind == PublishErrorKind::UnknownTopic && !missing.contains(s.as_str()) {
                *r = Err(error_on(
                    s,
                    PublishErrorKind::BrokerUnavailable,
                    "no responders, and the JetStream API did not confirm a missing stream (a \
                     server starting, or its JetStream not ready yet)",
                ));
            }
        }
        if !missing.is_empty() {
            tracing::warn!(subjects = ?missing, "no JetStream stream captures these outbox subjects; records to them fail until a stream does");
        }
    }
}

/// Connects a client that reconnects forever in the background (the relay outlives outages).
pub(crate) async fn connect_client(
    servers: &str,
    name: &str,
    timeout: Duration,
) -> Result<async_nats::Client, String> {
    let addrs: Vec<async_nats::ServerAddr> = servers
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", redact_urls(servers)))?;
    async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(timeout)
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connect(addrs)
        .await
        .map_err(|e| format!("{}: {e}", redact_urls(servers)))
}

/// The NATS headers of `e`: the wire mapping plus `Nats-Msg-Id` ([`message_id`]). `Err` when a
/// name or value cannot travel as a NATS header (permanent, the record's own).
pub(crate) fn headers_of(e: &Envelope) -> Result<(HeaderMap, usize), String> {
    let mut headers = HeaderMap::new();
    let mut size = 0;
    let mut bad: Option<String> = None;
    wire::for_each_header(e, |name, value| {
        if bad.is_some() {
            return;
        }
        let text = match std::str::from_utf8(value) {
            Ok(t) => t,
            Err(_) => {
                bad = Some(format!("header {name:?} is not UTF-8"));
                return;
            }
        };
        match (HeaderName::from_str(name), HeaderValue::from_str(text)) {
            (Ok(n), Ok(v)) => {
                size += name.len() + text.len() + 4;
                headers.append(n, v);
            }
            (Err(_), _) => {
                bad = Some(format!(
                    "header name {name:?} cannot travel in NATS (':', spaces or control characters)"
                ))
            }
            (_, Err(_)) => bad = Some(format!("header {name:?} has a line break in its value")),
        }
    });
    if let Some(bad) = bad {
        return Err(bad);
    }
    let id = message_id(e);
    size += "Nats-Msg-Id".len() + id.len() + 4;
    headers.insert(NATS_MESSAGE_ID, id.as_str());
    Ok((headers, size + HEADER_OVERHEAD))
}

/// The `Nats-Msg-Id` of `e`: its event id, or `<event id>:<replay id>` for an operator replay.
pub(crate) fn message_id(e: &Envelope) -> String {
    match e.headers.get(wire::REPLAY_HEADER) {
        Some(replay) => format!("{}:{replay}", e.event_id),
        None => e.event_id.to_string(),
    }
}

enum Slot {
    Done(PublishResult),
    Waiting(PublishAckFuture),
}

#[async_trait]
impl Publisher for NatsPublisher {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let started = Instant::now();
        let send_deadline = started + self.config.delivery_timeout;
        let ack_deadline = send_deadline + REPORT_GRACE;
        let max_payload = self.max_payload();
        let mut failed_aggregates: HashSet<&str> = HashSet::new();
        let mut slots: Vec<Slot> = Vec::with_capacity(batch.len());
        let mut subjects: Vec<Option<String>> = Vec::with_capacity(batch.len());

        for e in batch {
            if failed_aggregates.contains(e.aggregate_id.as_str()) {
                subjects.push(None);
                slots.push(Slot::Done(Err(PublishError::new(
                    PublishErrorKind::Other,
                    "not sent: an earlier event of the same aggregate in this batch failed",
                )
                .with_class(ErrorClass::Transient)
                .with_scope(FailureScope::Transport))));
                continue;
            }
            let subject = match self.config.subject_for(&e.aggregate_type, &e.aggregate_id) {
                Ok(s) => s,
                Err(why) => {
                    failed_aggregates.insert(&e.aggregate_id);
                    subjects.push(None);
                    slots.push(Slot::Done(Err(PublishError::new(
                        PublishErrorKind::Serialization,
                        why,
                    ))));
                    continue;
                }
            };
            let (headers, header_bytes) = match headers_of(e) {
                Ok(h) => h,
                Err(why) => {
                    failed_aggregates.insert(&e.aggregate_id);
                    slots.push(Slot::Done(Err(error_on(
                        &subject,
                        PublishErrorKind::Serialization,
                        &why,
                    ))));
                    subjects.push(Some(subject));
                    continue;
                }
            };
            let size = e.payload.bytes.len() + header_bytes + subject.len();
            if size > max_payload {
                failed_aggregates.insert(&e.aggregate_id);
                slots.push(Slot::Done(Err(error_on(
                    &subject,
                    PublishErrorKind::RecordTooLarge,
                    &format!(
                        "message of about {size} bytes exceeds the server's max_payload of \
                         {max_payload} bytes"
                    ),
                ))));
                subjects.push(Some(subject));
                continue;
            }
            let message = PublishMessage::build()
                .payload(Bytes::copy_from_slice(&e.payload.bytes))
                .headers(headers);
            let slot = match tokio::time::timeout_at(
                send_deadline,
                self.js.send_publish(subject.clone(), message),
            )
            .await
            {
                Ok(Ok(ack)) => Slot::Waiting(ack),
                Ok(Err(err)) => {
                    failed_aggregates.insert(&e.aggregate_id);
                    tracing::warn!(event_id = %e.event_id, aggregate_id = %e.aggregate_id, event_type = %e.event_type, subject, error = %err, stage = "send", "message not handed to the connection");
                    Slot::Done(Err(publish_error(&subject, &err)))
                }
                Err(_elapsed) => {
                    failed_aggregates.insert(&e.aggregate_id);
                    Slot::Done(Err(error_on(
                        &subject,
                        PublishErrorKind::Timeout,
                        "the connection did not take the message within the delivery timeout",
                    )))
                }
            };
            slots.push(slot);
            subjects.push(Some(subject));
        }

        let mut results: Vec<PublishResult> = join_all(slots.into_iter().zip(&subjects).map(
            |(slot, subject)| async move {
                let subject = subject.as_deref().unwrap_or("");
                match slot {
                    Slot::Done(r) => r,
                    Slot::Waiting(ack) => {
                        match tokio::time::timeout_at(ack_deadline, ack.into_future()).await {
                            Ok(Ok(ack)) => Ok(crate::ack::from_pub_ack(&ack, subject)),
                            Ok(Err(err)) if err.kind() == NatsKind::TimedOut => Err(error_on(
                                subject,
                                PublishErrorKind::Timeout,
                                "no PubAck within the delivery timeout",
                            )),
                            Ok(Err(err)) => Err(publish_error(subject, &err)),
                            Err(_elapsed) => Err(error_on(
                                subject,
                                PublishErrorKind::Timeout,
                                "no PubAck within the delivery timeout",
                            )),
                        }
                    }
                }
            },
        ))
        .await;
        self.confirm_missing_streams(&subjects, &mut results, ack_deadline)
            .await;
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
    fn a_replay_gets_a_message_id_of_its_own() {
        let e = Envelope::builder("order", "o-1", 3, "order.paid")
            .build()
            .unwrap();
        assert_eq!(message_id(&e), e.event_id.to_string());
        let mut replayed = e.clone();
        replayed
            .headers
            .insert(wire::REPLAY_HEADER.to_owned(), "r-1".to_owned());
        let (h, _) = headers_of(&replayed).unwrap();
        let id = h.get(NATS_MESSAGE_ID).unwrap().as_str().to_owned();
        assert_eq!(id, format!("{}:r-1", e.event_id));
        // A second replay run is a new message; the same run's retry is the same one.
        let mut again = e.clone();
        again
            .headers
            .insert(wire::REPLAY_HEADER.to_owned(), "r-2".to_owned());
        assert_ne!(message_id(&again), id);
        assert_eq!(message_id(&replayed), id);
    }

    #[test]
    fn headers_follow_the_wire_mapping_and_carry_the_message_id() {
        let e = Envelope::builder("order", "o-1", 3, "order.paid")
            .header(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )
            .build()
            .unwrap();
        let (h, size) = headers_of(&e).unwrap();
        assert_eq!(
            h.get(NATS_MESSAGE_ID).map(|v| v.as_str()),
            Some(e.event_id.to_string().as_str())
        );
        let pairs: Vec<(String, Vec<u8>)> = wire::encode_headers(&e)
            .into_iter()
            .map(|(k, _)| {
                let v = h.get(k.as_str()).expect("header present").as_str();
                (k, v.as_bytes().to_vec())
            })
            .collect();
        assert_eq!(wire::decode(&pairs, &e.payload.bytes).unwrap(), e);
        assert!(size > 100, "{size}");
    }

    #[test]
    fn headers_nats_cannot_carry_are_refused() {
        let with = |name: &str, value: &str| {
            let mut e = Envelope::builder("order", "o-1", 1, "t").build().unwrap();
            e.headers.insert(name.to_owned(), value.to_owned());
            headers_of(&e)
        };
        assert!(with("x-ok", "fine").is_ok());
        assert!(with("bad:name", "v").unwrap_err().contains("bad:name"));
        assert!(with("bad name", "v").is_err());
        assert!(with("x-v", "line\r\nbreak")
            .unwrap_err()
            .contains("line break"));
    }
}
