//! The start-up checks: the exchange exists, is durable and of the expected type; a queue
//! exists, is durable, is a quorum queue, and whether it has a single active consumer.
//!
//! AMQP 0-9-1 has no "describe": a passive declare tells whether an exchange or queue exists
//! (and a queue's counts), and a declare with the expected properties succeeds only when the
//! existing one is equivalent (else the broker answers 406 PRECONDITION_FAILED naming the
//! differing property). Each probe runs on a channel of its own, since a failed declare closes
//! its channel. Nothing is created: every declare is passive or equivalent to what exists.

use std::fmt;
use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::Connection;

use crate::config::ExchangeKind;

/// What the exchange check found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExchangeReport {
    /// Exchange name.
    pub name: String,
    /// Its type (checked equal to the configured one).
    pub kind: ExchangeKind,
    /// Durable (checked: a non-durable exchange is refused).
    pub durable: bool,
    /// Publisher confirms on the publisher's channels (always).
    pub confirms: bool,
    /// Messages published `mandatory` (always).
    pub mandatory: bool,
}

/// What the queue check found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueReport {
    /// Queue name.
    pub name: String,
    /// Durable quorum queue (checked: anything else is refused).
    pub quorum: bool,
    /// Single active consumer: only one consumer receives at a time, so one aggregate's
    /// messages are never split between two members.
    pub single_active_consumer: bool,
    /// Messages ready for delivery.
    pub messages: u32,
    /// Consumers attached.
    pub consumers: u32,
}

/// Why a topology check failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TopologyError {
    /// The exchange or queue does not exist (permanent).
    Missing {
        /// `exchange` or `queue`.
        what: &'static str,
        /// Its name.
        name: String,
    },
    /// It exists with other properties (permanent), e.g. not durable, another type, a
    /// classic queue.
    Inequivalent {
        /// `exchange` or `queue`.
        what: &'static str,
        /// Its name.
        name: String,
        /// What was expected.
        expected: String,
        /// The broker's answer.
        detail: String,
    },
    /// The broker could not be asked (transient).
    Unreachable {
        /// What failed.
        detail: String,
    },
}

impl TopologyError {
    /// Whether trying again later can succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unreachable { .. })
    }
}

impl fmt::Display for TopologyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing { what, name } => write!(
                f,
                "{what} {name:?} does not exist: declare it (durable) before starting"
            ),
            Self::Inequivalent {
                what,
                name,
                expected,
                detail,
            } => write!(f, "{what} {name:?} is not {expected}: {detail}"),
            Self::Unreachable { detail } => write!(f, "RabbitMQ could not be asked: {detail}"),
        }
    }
}

impl std::error::Error for TopologyError {}

fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => Some(p.get_id()),
        _ => None,
    }
}

fn unreachable(e: impl fmt::Display) -> TopologyError {
    TopologyError::Unreachable {
        detail: e.to_string(),
    }
}

async fn timed<T>(
    timeout: Duration,
    f: impl std::future::Future<Output = Result<T, lapin::Error>>,
) -> Result<Result<T, lapin::Error>, TopologyError> {
    tokio::time::timeout(timeout, f)
        .await
        .map_err(|_| unreachable(format!("no answer within {timeout:?}")))
}

/// Checks that `name` exists, is durable and of type `kind`.
pub async fn check_exchange(
    conn: &Connection,
    name: &str,
    kind: ExchangeKind,
    timeout: Duration,
) -> Result<ExchangeReport, TopologyError> {
    let ch = timed(timeout, conn.create_channel())
        .await?
        .map_err(unreachable)?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match timed(
        timeout,
        ch.exchange_declare(name, kind.lapin(), passive, FieldTable::default()),
    )
    .await?
    {
        Ok(()) => {}
        Err(e) if reply_code(&e) == Some(404) => {
            return Err(TopologyError::Missing {
                what: "exchange",
                name: name.to_owned(),
            })
        }
        Err(e) => return Err(unreachable(e)),
    }
    let _ = tokio::time::timeout(timeout, ch.close(200, "checked")).await;
    let ch = timed(timeout, conn.create_channel())
        .await?
        .map_err(unreachable)?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    match timed(
        timeout,
        ch.exchange_declare(name, kind.lapin(), durable, FieldTable::default()),
    )
    .await?
    {
        Ok(()) => {
            let _ = tokio::time::timeout(timeout, ch.close(200, "checked")).await;
            Ok(ExchangeReport {
                name: name.to_owned(),
                kind,
                durable: true,
                confirms: true,
                mandatory: true,
            })
        }
        Err(e) if reply_code(&e) == Some(406) => Err(TopologyError::Inequivalent {
            what: "exchange",
            name: name.to_owned(),
            expected: format!("a durable {} exchange", kind.as_str()),
            detail: e.to_string(),
        }),
        Err(e) => Err(unreachable(e)),
    }
}

/// The arguments of a durable quorum queue, with single active consumer when `sac`.
pub fn quorum_arguments(sac: bool) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    if sac {
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    }
    args
}

/// Checks that `name` exists and is a durable quorum queue, and whether it has a single active
/// consumer.
pub async fn check_queue(
    conn: &Connection,
    name: &str,
    timeout: Duration,
) -> Result<QueueReport, TopologyError> {
    let ch = timed(timeout, conn.create_channel())
        .await?
        .map_err(unreachable)?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let q = match timed(
        timeout,
        ch.queue_declare(name, passive, FieldTable::default()),
    )
    .await?
    {
        Ok(q) => q,
        Err(e) if reply_code(&e) == Some(404) => {
            return Err(TopologyError::Missing {
                what: "queue",
                name: name.to_owned(),
            })
        }
        Err(e) => return Err(unreachable(e)),
    };
    let _ = tokio::time::timeout(timeout, ch.close(200, "checked")).await;
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let mut last = None;
    for sac in [true, false] {
        let ch = timed(timeout, conn.create_channel())
            .await?
            .map_err(unreachable)?;
        match timed(
            timeout,
            ch.queue_declare(name, durable, quorum_arguments(sac)),
        )
        .await?
        {
            Ok(_) => {
                let _ = tokio::time::timeout(timeout, ch.close(200, "checked")).await;
                return Ok(QueueReport {
                    name: name.to_owned(),
                    quorum: true,
                    single_active_consumer: sac,
                    messages: q.message_count(),
                    consumers: q.consumer_count(),
                });
            }
            Err(e) if reply_code(&e) == Some(406) => last = Some(e.to_string()),
            Err(e) => return Err(unreachable(e)),
        }
    }
    Err(TopologyError::Inequivalent {
        what: "queue",
        name: name.to_owned(),
        expected: "a durable quorum queue".into(),
        detail: last.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_what_to_do() {
        let e = TopologyError::Missing {
            what: "exchange",
            name: "orders".into(),
        };
        assert!(!e.is_transient());
        assert!(e.to_string().contains("declare it"), "{e}");
        assert!(TopologyError::Unreachable { detail: "x".into() }.is_transient());
        let e = TopologyError::Inequivalent {
            what: "queue",
            name: "q".into(),
            expected: "a durable quorum queue".into(),
            detail: "inequivalent arg 'x-queue-type'".into(),
        };
        assert!(e.to_string().contains("quorum"), "{e}");
    }
}
