//! The start-up check: a JetStream stream captures every subject the publisher can publish
//! to, and what those streams promise (duplicate window, storage, replicas, retention).

use std::fmt;
use std::time::Duration;

use async_nats::jetstream::context::GetStreamByNameErrorKind;
use async_nats::jetstream::stream::{RetentionPolicy, StorageType};
use async_nats::jetstream::Context;

use crate::subject::covers;

/// Where a stream keeps its messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Storage {
    /// On disk: survives a server restart.
    File,
    /// In memory: lost when the server restarts (an acknowledged event can vanish).
    Memory,
}

/// When a stream deletes messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Retention {
    /// By limits (age, count, size): consumers can replay.
    Limits,
    /// Once every consumer with interest acknowledged it.
    Interest,
    /// Once one consumer acknowledged it (a work queue).
    WorkQueue,
}

/// One stream as the check found it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamInfo {
    /// Stream name.
    pub name: String,
    /// Its subject filters.
    pub subjects: Vec<String>,
    /// The publisher's subject spaces it captures.
    pub captures: Vec<String>,
    /// Window in which a repeated `Nats-Msg-Id` is dropped (zero: no deduplication).
    pub duplicate_window: Duration,
    /// Storage.
    pub storage: Storage,
    /// Replicas.
    pub replicas: usize,
    /// Retention.
    pub retention: Retention,
    /// Largest message the stream accepts (`None`: the server's limit).
    pub max_message_size: Option<usize>,
    /// Messages stored now.
    pub messages: u64,
}

/// Something about a stream that weakens the relay's guarantees; logged at start.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamWarning {
    /// The duplicate window is shorter than the relay's lease: a re-send after a lost
    /// `PubAck` or an expired lease is stored twice (consumers deduplicate, but the stream
    /// holds both). A warning, not an error: re-sends after long outages fall outside any
    /// window, and the inbox absorbs them.
    DuplicateWindowShorterThanLease {
        /// Stream.
        stream: String,
        /// Its window.
        window: Duration,
        /// The relay's lease.
        lease: Duration,
    },
    /// The stream keeps messages in memory: a server restart loses acknowledged events.
    MemoryStorage {
        /// Stream.
        stream: String,
    },
    /// The stream deletes messages once consumed (interest or work-queue retention): a new
    /// consumer cannot replay, and a consumer that falls behind its dedup window cannot be
    /// checked against the stream's retention.
    ConsumedMessagesDeleted {
        /// Stream.
        stream: String,
        /// Its retention.
        retention: Retention,
    },
}

impl fmt::Display for StreamWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DuplicateWindowShorterThanLease {
                stream,
                window,
                lease,
            } => write!(
                f,
                "stream {stream:?}: duplicate window {window:?} is shorter than the relay's \
                 lease {lease:?}; re-sends after a lost PubAck may be stored twice"
            ),
            Self::MemoryStorage { stream } => write!(
                f,
                "stream {stream:?} uses memory storage: a server restart loses acknowledged \
                 events"
            ),
            Self::ConsumedMessagesDeleted { stream, retention } => write!(
                f,
                "stream {stream:?} has {retention:?} retention: consumed messages are deleted \
                 and cannot be replayed"
            ),
        }
    }
}

/// What [`check_streams`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamReport {
    /// The streams capturing the publisher's subjects.
    pub streams: Vec<StreamInfo>,
    /// What weakens the guarantees.
    pub warnings: Vec<StreamWarning>,
}

impl StreamReport {
    /// The stream capturing `subject_space`, if any.
    pub fn stream_of(&self, subject_space: &str) -> Option<&StreamInfo> {
        self.streams
            .iter()
            .find(|s| s.captures.iter().any(|c| c == subject_space))
    }
}

/// Why the stream check failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamCheckError {
    /// No stream captures (all of) this subject space: a configuration error (permanent).
    MissingStream {
        /// The subject space (e.g. `outbox.>`).
        subject: String,
        /// A stream that captures part of it, if any.
        partial: Option<String>,
    },
    /// The server or its JetStream API did not answer (transient).
    Unreachable {
        /// What failed.
        detail: String,
    },
}

impl StreamCheckError {
    /// Whether trying again later can succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unreachable { .. })
    }
}

impl fmt::Display for StreamCheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MissingStream {
                subject,
                partial: None,
            } => write!(
                f,
                "no JetStream stream captures {subject:?}: create one (e.g. `nats stream add \
                 --subjects '{subject}'`) before starting the relay"
            ),
            Self::MissingStream {
                subject,
                partial: Some(stream),
            } => write!(
                f,
                "stream {stream:?} captures only part of {subject:?}: events to the rest would \
                 have no stream; widen its subjects"
            ),
            Self::Unreachable { detail } => {
                write!(
                    f,
                    "the NATS server's JetStream API did not answer: {detail}"
                )
            }
        }
    }
}

impl std::error::Error for StreamCheckError {}

/// Finds the stream of each subject space, checks that it captures all of it, and reports the
/// streams' settings with the warnings that apply (`lease`: the relay's lease, compared with
/// each duplicate window). Each request is bounded by `timeout`.
pub async fn check_streams(
    js: &Context,
    subject_spaces: &[String],
    lease: Option<Duration>,
    timeout: Duration,
) -> Result<StreamReport, StreamCheckError> {
    let unreachable = |detail: String| StreamCheckError::Unreachable { detail };
    let mut streams: Vec<StreamInfo> = Vec::new();
    for space in subject_spaces {
        let name = match tokio::time::timeout(timeout, js.stream_by_subject(space.clone())).await {
            Err(_) => {
                return Err(unreachable(format!(
                    "stream lookup timed out after {timeout:?}"
                )))
            }
            Ok(Ok(name)) => name,
            Ok(Err(e)) if matches!(e.kind(), GetStreamByNameErrorKind::NotFound) => {
                return Err(StreamCheckError::MissingStream {
                    subject: space.clone(),
                    partial: None,
                })
            }
            Ok(Err(e)) => return Err(unreachable(e.to_string())),
        };
        if let Some(known) = streams.iter_mut().find(|s| s.name == name) {
            known.captures.push(space.clone());
            continue;
        }
        let stream = tokio::time::timeout(timeout, js.get_stream(&name))
            .await
            .map_err(|_| unreachable(format!("stream info timed out after {timeout:?}")))?
            .map_err(|e| unreachable(e.to_string()))?;
        let info = stream.cached_info();
        let c = &info.config;
        if !c.subjects.iter().any(|f| covers(f, space)) {
            return Err(StreamCheckError::MissingStream {
                subject: space.clone(),
                partial: Some(name),
            });
        }
        streams.push(StreamInfo {
            name: c.name.clone(),
            subjects: c.subjects.clone(),
            captures: vec![space.clone()],
            duplicate_window: c.duplicate_window,
            storage: match c.storage {
                StorageType::Memory => Storage::Memory,
                _ => Storage::File,
            },
            replicas: c.num_replicas.max(1),
            retention: match c.retention {
                RetentionPolicy::Interest => Retention::Interest,
                RetentionPolicy::WorkQueue => Retention::WorkQueue,
                _ => Retention::Limits,
            },
            max_message_size: usize::try_from(c.max_message_size).ok().filter(|n| *n > 0),
            messages: info.state.messages,
        });
    }
    let warnings = warnings_for(&streams, lease);
    Ok(StreamReport { streams, warnings })
}

/// The warnings that apply to `streams` (pure: table-tested).
pub(crate) fn warnings_for(streams: &[StreamInfo], lease: Option<Duration>) -> Vec<StreamWarning> {
    let mut w = Vec::new();
    for s in streams {
        if let Some(lease) = lease {
            if s.duplicate_window < lease {
                w.push(StreamWarning::DuplicateWindowShorterThanLease {
                    stream: s.name.clone(),
                    window: s.duplicate_window,
                    lease,
                });
            }
        }
        if s.storage == Storage::Memory {
            w.push(StreamWarning::MemoryStorage {
                stream: s.name.clone(),
            });
        }
        if s.retention != Retention::Limits {
            w.push(StreamWarning::ConsumedMessagesDeleted {
                stream: s.name.clone(),
                retention: s.retention,
            });
        }
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(window: u64, storage: Storage, retention: Retention) -> StreamInfo {
        StreamInfo {
            name: "S".into(),
            subjects: vec!["outbox.>".into()],
            captures: vec!["outbox.>".into()],
            duplicate_window: Duration::from_secs(window),
            storage,
            replicas: 1,
            retention,
            max_message_size: None,
            messages: 0,
        }
    }

    #[test]
    fn warning_table() {
        use Retention::*;
        use Storage::*;
        let lease = Some(Duration::from_secs(30));
        let table: &[(StreamInfo, Option<Duration>, usize)] = &[
            (stream(120, File, Limits), lease, 0),
            (stream(30, File, Limits), lease, 0),
            (stream(29, File, Limits), lease, 1),
            (stream(0, File, Limits), lease, 1),
            (stream(0, File, Limits), None, 0),
            (stream(120, Memory, Limits), lease, 1),
            (stream(120, File, WorkQueue), lease, 1),
            (stream(1, Memory, Interest), lease, 3),
        ];
        for (s, lease, n) in table {
            let w = warnings_for(std::slice::from_ref(s), *lease);
            assert_eq!(w.len(), *n, "{s:?} {lease:?}: {w:?}");
            for x in &w {
                assert!(x.to_string().contains("\"S\""), "{x}");
            }
        }
    }

    #[test]
    fn errors_say_what_to_do() {
        let e = StreamCheckError::MissingStream {
            subject: "outbox.>".into(),
            partial: None,
        };
        assert!(!e.is_transient());
        assert!(e.to_string().contains("nats stream add"), "{e}");
        let e = StreamCheckError::MissingStream {
            subject: "outbox.>".into(),
            partial: Some("S".into()),
        };
        assert!(e.to_string().contains("only part"), "{e}");
        assert!(StreamCheckError::Unreachable { detail: "x".into() }.is_transient());
    }
}
