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
    /// What [`judge_queue`] warns of (missing single active consumer, a reject-publish length
    /// limit, a delivery limit with dead-lettering).
    pub warnings: Vec<String>,
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

/// A queue argument's value, as the broker reports it in an inequivalence.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ArgValue {
    /// A string (`longstr`).
    Str(String),
    /// An integer (any of AMQP's integer types).
    Int(i64),
    /// A boolean.
    Bool(bool),
}

impl ArgValue {
    fn amqp(&self) -> AMQPValue {
        match self {
            Self::Str(s) => AMQPValue::LongString(s.as_str().into()),
            Self::Int(i) => AMQPValue::LongLongInt(*i),
            Self::Bool(b) => AMQPValue::Boolean(*b),
        }
    }
}

impl fmt::Display for ArgValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Str(s) => f.write_str(s),
            Self::Int(i) => write!(f, "{i}"),
            Self::Bool(b) => write!(f, "{b}"),
        }
    }
}

/// A queue as AMQP 0-9-1 can describe it: what a `queue.declare` compares (durable,
/// auto-delete and the `x-` arguments RabbitMQ checks for equivalence: type, single active
/// consumer, TTLs, length limits, dead-lettering, delivery limit), and its counts.
///
/// AMQP has no "describe": [`describe_queue`] declares the queue with the properties it
/// believes, and each `406 PRECONDITION_FAILED` names one property that differs and its
/// current value, until a declare is equivalent (so nothing is created or changed). Policies
/// (`rabbitmqctl set_policy`) and bindings are not visible this way.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueFacts {
    /// Queue name.
    pub name: String,
    /// Durable.
    pub durable: bool,
    /// Deleted when its last consumer goes.
    pub auto_delete: bool,
    /// The compared `x-` arguments the queue was declared with.
    pub arguments: std::collections::BTreeMap<String, ArgValue>,
    /// Messages ready for delivery.
    pub messages: u32,
    /// Consumers attached.
    pub consumers: u32,
}

impl QueueFacts {
    fn arg(&self, key: &str) -> Option<&ArgValue> {
        self.arguments.get(key)
    }

    fn int(&self, key: &str) -> Option<i64> {
        match self.arg(key) {
            Some(ArgValue::Int(i)) => Some(*i),
            Some(ArgValue::Str(s)) => s.parse().ok(),
            _ => None,
        }
    }

    fn text(&self, key: &str) -> Option<&str> {
        match self.arg(key) {
            Some(ArgValue::Str(s)) => Some(s),
            _ => None,
        }
    }

    /// `quorum`, `classic` (also when no type was given) or `stream`.
    pub fn queue_type(&self) -> &str {
        self.text("x-queue-type").unwrap_or("classic")
    }

    /// Declared with `x-single-active-consumer = true`.
    pub fn single_active_consumer(&self) -> bool {
        matches!(
            self.arg("x-single-active-consumer"),
            Some(ArgValue::Bool(true))
        )
    }

    /// `x-dead-letter-exchange`, when set (`""` is the default exchange).
    pub fn dead_letter_exchange(&self) -> Option<&str> {
        self.text("x-dead-letter-exchange")
    }
}

/// How serious a [`QueueProblem`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueueSeverity {
    /// The consumer refuses the queue: events would be lost or the queue could vanish.
    Refuse,
    /// Worth fixing; the consumer runs.
    Warn,
}

/// One thing wrong with a consumer's queue, and what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueProblem {
    /// Refuse or warn.
    pub severity: QueueSeverity,
    /// What was found.
    pub message: String,
    /// What to run or change.
    pub fix: String,
}

/// The arguments to declare a replacement queue with (what the fixes name).
fn declare_hint(name: &str) -> String {
    format!(
        "declare a new durable quorum queue with single active consumer and none of the \
         arguments named (queue arguments cannot change in place): `rabbitmqadmin declare queue \
         name={name}-v2 durable=true arguments='{{\"x-queue-type\":\"quorum\",\
         \"x-single-active-consumer\":true}}'`, bind it as {name:?} is bound, move the consumer \
         to it once {name:?} is drained"
    )
}

/// Judges a consumer's queue: what loses events or lets the queue vanish is
/// [`QueueSeverity::Refuse`]; what weakens order or availability is
/// [`QueueSeverity::Warn`]. An empty list means a durable quorum queue with single active
/// consumer and no argument that drops messages.
///
/// | found | severity | why |
/// |---|---|---|
/// | not durable, or auto-delete | refuse | a broker restart (or the last consumer leaving) deletes the queue and its messages |
/// | classic or stream queue | refuse | the source needs a quorum queue (replicated, redelivery counted); a classic queue with single active consumer keeps order but lives on one node |
/// | `x-expires` | refuse | the queue is deleted after that long without consumers |
/// | `x-message-ttl` | refuse | messages expire unconsumed (dropped, or dead-lettered away from the inbox) |
/// | `x-max-length(-bytes)` with overflow `drop-head` (the default) | refuse | the oldest events are dropped when the queue is full |
/// | `x-max-length(-bytes)` with `reject-publish(-dlx)` | warn | a full queue refuses the relay's publications: events wait in the outbox |
/// | `x-delivery-limit` without a dead-letter exchange | refuse | a message delivered that many times is dropped (the inbox parks poison messages itself) |
/// | `x-delivery-limit` with a dead-letter exchange | warn | such a message goes to the dead-letter exchange, not to the inbox's parking |
/// | no single active consumer | warn | two consumer processes would split one aggregate's messages (the source refuses it unless it runs as one process) |
pub fn judge_queue(q: &QueueFacts) -> Vec<QueueProblem> {
    let mut out = Vec::new();
    let name = q.name.as_str();
    let refuse = |out: &mut Vec<QueueProblem>, message: String, fix: String| {
        out.push(QueueProblem {
            severity: QueueSeverity::Refuse,
            message,
            fix,
        })
    };
    if !q.durable {
        refuse(
            &mut out,
            format!("queue {name:?} is not durable: a broker restart deletes it with its messages"),
            declare_hint(name),
        );
    }
    if q.auto_delete {
        refuse(
            &mut out,
            format!(
                "queue {name:?} is auto-delete: it is deleted with its messages when its last \
                 consumer goes"
            ),
            declare_hint(name),
        );
    }
    match q.queue_type() {
        "quorum" => {}
        "classic" if q.single_active_consumer() => refuse(
            &mut out,
            format!(
                "queue {name:?} is a classic queue (with single active consumer: order is kept, \
                 but it lives on one node and its redeliveries are not counted); the consumer \
                 needs a quorum queue"
            ),
            declare_hint(name),
        ),
        other => refuse(
            &mut out,
            format!("queue {name:?} is a {other} queue, not a durable quorum queue"),
            declare_hint(name),
        ),
    }
    if let Some(ms) = q.int("x-expires") {
        refuse(
            &mut out,
            format!(
                "queue {name:?} has x-expires = {ms} ms: it is deleted with its messages after \
                 that long without a consumer"
            ),
            declare_hint(name),
        );
    }
    let dlx = q.dead_letter_exchange().map(|x| {
        if x.is_empty() {
            "the default exchange".to_owned()
        } else {
            format!("exchange {x:?}")
        }
    });
    if let Some(ms) = q.int("x-message-ttl") {
        refuse(
            &mut out,
            format!(
                "queue {name:?} has x-message-ttl = {ms} ms: an event not consumed in time is {}, \
                 never reaching the inbox",
                dlx.as_ref()
                    .map_or_else(|| "dropped".to_owned(), |d| format!("dead-lettered to {d}"))
            ),
            declare_hint(name),
        );
    }
    for key in ["x-max-length", "x-max-length-bytes"] {
        let Some(limit) = q.int(key) else { continue };
        let overflow = q.text("x-overflow").unwrap_or("drop-head");
        if overflow == "drop-head" {
            refuse(
                &mut out,
                format!(
                    "queue {name:?} has {key} = {limit} with overflow drop-head: when it is full \
                     the oldest events are {}",
                    dlx.as_ref()
                        .map_or_else(|| "dropped".to_owned(), |d| format!("dead-lettered to {d}"))
                ),
                declare_hint(name),
            );
        } else {
            out.push(QueueProblem {
                severity: QueueSeverity::Warn,
                message: format!(
                    "queue {name:?} has {key} = {limit} with overflow {overflow}: when it is \
                     full the broker refuses the relay's publications (events wait in the \
                     outbox; `outbox status` shows the backlog)"
                ),
                fix: "size the limit for the longest consumer outage, or remove it".into(),
            });
        }
    }
    if let Some(n) = q.int("x-delivery-limit") {
        match &dlx {
            None => out.push(QueueProblem {
                severity: QueueSeverity::Refuse,
                message: format!(
                    "queue {name:?} has x-delivery-limit = {n} and no dead-letter exchange: a \
                     message delivered {n} times (a consumer crashing on it, or restarting) is \
                     dropped; the inbox parks poison messages itself"
                ),
                fix: declare_hint(name),
            }),
            Some(d) => out.push(QueueProblem {
                severity: QueueSeverity::Warn,
                message: format!(
                    "queue {name:?} has x-delivery-limit = {n}: a message delivered {n} times is \
                     dead-lettered to {d} and its aggregate goes on without it (the inbox \
                     parks poison messages itself, holding the aggregate)"
                ),
                fix: format!(
                    "remove x-delivery-limit ({}), or watch {d} and replay what lands there",
                    declare_hint(name)
                ),
            }),
        }
    }
    if !q.single_active_consumer() {
        out.push(QueueProblem {
            severity: QueueSeverity::Warn,
            message: format!(
                "queue {name:?} has no single active consumer: two consumer processes would split \
                 one aggregate's messages between them (the consumer refuses it unless built \
                 with require_single_active_consumer(false) for a single process)"
            ),
            fix: declare_hint(name),
        });
    }
    out
}

/// What a `406 PRECONDITION_FAILED` to a queue declare says differs: the property and its
/// current value (`None`: the queue does not have it).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Difference {
    /// `durable` or `auto_delete` is the other way.
    Flag(String, bool),
    /// An argument has `Some(value)`, or is absent.
    Arg(String, Option<ArgValue>),
}

/// Parses RabbitMQ's inequivalence text, e.g. `inequivalent arg 'x-queue-type' for queue 'q'
/// in vhost '/': received the value 'quorum' of type 'longstr' but current is none`, or
/// `... arg 'durable' ...: received 'true' but current is 'false'`.
pub(crate) fn parse_difference(text: &str) -> Option<Difference> {
    let rest = &text[text.find("inequivalent arg '")? + "inequivalent arg '".len()..];
    let key = &rest[..rest.find('\'')?];
    let current = &rest[rest.rfind("but current is ")? + "but current is ".len()..];
    let current = current.trim_end();
    if key == "durable" || key == "auto_delete" {
        let v = current.trim_matches('\'');
        return match v {
            "true" => Some(Difference::Flag(key.to_owned(), true)),
            "false" => Some(Difference::Flag(key.to_owned(), false)),
            _ => None,
        };
    }
    if current == "none" {
        return Some(Difference::Arg(key.to_owned(), None));
    }
    // "the value 'V' of type 'T'"
    let v = current.strip_prefix("the value '")?;
    let split = v.rfind("' of type '")?;
    let (value, ty) = (
        &v[..split],
        v[split + "' of type '".len()..].trim_end_matches('\''),
    );
    let value = match ty {
        "longstr" | "shortstr" => ArgValue::Str(value.to_owned()),
        "bool" => ArgValue::Bool(value == "true"),
        "long" | "signedint" | "short" | "byte" | "unsignedbyte" | "unsignedshort"
        | "unsignedint" => ArgValue::Int(value.parse().ok()?),
        _ => return None,
    };
    Some(Difference::Arg(key.to_owned(), Some(value)))
}

fn error_text(e: &lapin::Error) -> String {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => p.get_message().as_str().to_owned(),
        _ => e.to_string(),
    }
}

/// Describes `name` (see [`QueueFacts`]): a passive declare for its existence and counts,
/// then equivalent declares, each on a channel of its own, learning one differing property
/// from each refusal. Nothing is created or changed.
pub async fn describe_queue(
    conn: &Connection,
    name: &str,
    timeout: Duration,
) -> Result<QueueFacts, TopologyError> {
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
    // The guess a consumer's queue should match; every refusal corrects one property.
    let mut facts = QueueFacts {
        name: name.to_owned(),
        durable: true,
        auto_delete: false,
        arguments: [
            ("x-queue-type".to_owned(), ArgValue::Str("quorum".into())),
            ("x-single-active-consumer".to_owned(), ArgValue::Bool(true)),
        ]
        .into_iter()
        .collect(),
        messages: q.message_count(),
        consumers: q.consumer_count(),
    };
    // Each round learns one property; RabbitMQ compares fewer than 30.
    for _ in 0..32 {
        let ch = timed(timeout, conn.create_channel())
            .await?
            .map_err(unreachable)?;
        let mut args = FieldTable::default();
        for (k, v) in &facts.arguments {
            args.insert(k.as_str().into(), v.amqp());
        }
        let opts = QueueDeclareOptions {
            durable: facts.durable,
            auto_delete: facts.auto_delete,
            ..Default::default()
        };
        match timed(timeout, ch.queue_declare(name, opts, args)).await? {
            Ok(_) => {
                let _ = tokio::time::timeout(timeout, ch.close(200, "checked")).await;
                return Ok(facts);
            }
            Err(e) if reply_code(&e) == Some(406) => {
                let text = error_text(&e);
                match parse_difference(&text) {
                    Some(Difference::Flag(k, v)) if k == "durable" => facts.durable = v,
                    Some(Difference::Flag(_, v)) => facts.auto_delete = v,
                    Some(Difference::Arg(k, Some(v))) => {
                        facts.arguments.insert(k, v);
                    }
                    Some(Difference::Arg(k, None)) => {
                        facts.arguments.remove(&k);
                    }
                    None => {
                        return Err(TopologyError::Inequivalent {
                            what: "queue",
                            name: name.to_owned(),
                            expected: "describable over AMQP".into(),
                            detail: text,
                        })
                    }
                }
            }
            Err(e) => return Err(unreachable(e)),
        }
    }
    Err(TopologyError::Inequivalent {
        what: "queue",
        name: name.to_owned(),
        expected: "describable over AMQP".into(),
        detail: "more differing properties than a queue can have".into(),
    })
}

/// Checks that `name` exists and is a durable quorum queue that drops no message on its own
/// (no TTL, no expiry, no drop-head length limit, no delivery limit without dead-lettering:
/// [`judge_queue`]'s refusals), and whether it has a single active consumer.
pub async fn check_queue(
    conn: &Connection,
    name: &str,
    timeout: Duration,
) -> Result<QueueReport, TopologyError> {
    let facts = describe_queue(conn, name, timeout).await?;
    let problems = judge_queue(&facts);
    if let Some(p) = problems
        .iter()
        .find(|p| p.severity == QueueSeverity::Refuse)
    {
        return Err(TopologyError::Inequivalent {
            what: "queue",
            name: name.to_owned(),
            expected: "a durable quorum queue that drops no message".into(),
            detail: format!("{}; {}", p.message, p.fix),
        });
    }
    Ok(QueueReport {
        name: name.to_owned(),
        quorum: true,
        single_active_consumer: facts.single_active_consumer(),
        messages: facts.messages,
        consumers: facts.consumers,
        warnings: problems.into_iter().map(|p| p.message).collect(),
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

    /// RabbitMQ's inequivalence texts (as the broker sent them in `queue_check.rs`) parse into
    /// the property and its current value; anything else is not guessed at.
    #[test]
    fn inequivalences_parse_into_the_current_value() {
        let p = |t: &str| parse_difference(t);
        assert_eq!(
            p("PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': \
               received the value 'quorum' of type 'longstr' but current is none"),
            Some(Difference::Arg("x-queue-type".into(), None))
        );
        assert_eq!(
            p(
                "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost \
               '/': received none but current is the value '60000' of type 'long'"
            ),
            Some(Difference::Arg(
                "x-message-ttl".into(),
                Some(ArgValue::Int(60_000))
            ))
        );
        assert_eq!(
            p(
                "PRECONDITION_FAILED - inequivalent arg 'x-single-active-consumer' for queue 'q' \
               in vhost '/': received the value 'true' of type 'bool' but current is the value \
               'false' of type 'bool'"
            ),
            Some(Difference::Arg(
                "x-single-active-consumer".into(),
                Some(ArgValue::Bool(false))
            ))
        );
        assert_eq!(
            p(
                "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-exchange' for queue 'q' in \
               vhost '/': received none but current is the value 'dl x' of type 'longstr'"
            ),
            Some(Difference::Arg(
                "x-dead-letter-exchange".into(),
                Some(ArgValue::Str("dl x".into()))
            ))
        );
        assert_eq!(
            p(
                "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/': \
               received 'true' but current is 'false'"
            ),
            Some(Difference::Flag("durable".into(), false))
        );
        assert_eq!(p("PRECONDITION_FAILED - something else"), None);
        assert_eq!(
            p(
                "inequivalent arg 'x-x' for queue 'q': received none but current is the value \
               '[1]' of type 'array'"
            ),
            None
        );
    }

    fn facts(args: &[(&str, ArgValue)]) -> QueueFacts {
        QueueFacts {
            name: "q".into(),
            durable: true,
            auto_delete: false,
            arguments: args
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect(),
            messages: 0,
            consumers: 0,
        }
    }

    /// The judgement table, case by case (the broker tests read each from a real queue).
    #[test]
    fn the_judgement_follows_its_table() {
        let quorum = ("x-queue-type", ArgValue::Str("quorum".into()));
        let sac = ("x-single-active-consumer", ArgValue::Bool(true));
        let severities = |args: &[(&str, ArgValue)]| {
            judge_queue(&facts(args))
                .into_iter()
                .map(|p| p.severity)
                .collect::<Vec<_>>()
        };
        assert!(severities(&[quorum.clone(), sac.clone()]).is_empty());
        assert_eq!(
            severities(std::slice::from_ref(&quorum)),
            [QueueSeverity::Warn]
        );
        assert_eq!(
            severities(std::slice::from_ref(&sac)),
            [QueueSeverity::Refuse]
        );
        let limit = ("x-delivery-limit", ArgValue::Int(3));
        let dlx = ("x-dead-letter-exchange", ArgValue::Str(String::new()));
        assert_eq!(
            severities(&[quorum.clone(), sac.clone(), limit.clone()]),
            [QueueSeverity::Refuse]
        );
        let with_dlx = judge_queue(&facts(&[quorum.clone(), sac.clone(), limit, dlx]));
        assert_eq!(with_dlx.len(), 1);
        assert_eq!(with_dlx[0].severity, QueueSeverity::Warn);
        assert!(with_dlx[0].message.contains("the default exchange"));
        let reject = ("x-overflow", ArgValue::Str("reject-publish-dlx".into()));
        let len = ("x-max-length", ArgValue::Int(10));
        assert_eq!(
            severities(&[quorum.clone(), sac.clone(), len.clone(), reject]),
            [QueueSeverity::Warn]
        );
        assert_eq!(severities(&[quorum, sac, len]), [QueueSeverity::Refuse]);
        let mut f = facts(&[]);
        f.durable = false;
        f.auto_delete = true;
        let refusals = judge_queue(&f)
            .into_iter()
            .filter(|p| p.severity == QueueSeverity::Refuse)
            .count();
        assert_eq!(refusals, 3, "not durable, auto-delete, classic");
    }
}
