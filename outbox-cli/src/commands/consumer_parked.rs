//! `outbox parked list|show|discard --consumer NAME`: a consumer's parked messages, through the
//! library's operator API ([`outbox_inbox::ParkedMessages`]) over the consumer's inbox
//! (`<inbox_table>_parked`, `<inbox_table>_audit`), on PostgreSQL or MySQL / MariaDB
//! ([`crate::consumer_inbox`]): the same code over either store's `InboxParking`. Every action
//! is audited by the library in the transaction of its first effect.
//!
//! What this command can and cannot do for a consumer:
//!
//! * **list / show**: everything the consumer parked, with the reason, the attempts, the
//!   messages waiting behind a head and the audit trail.
//! * **discard** resolves the message without effect (registered as processed; its version
//!   counted as applied only when that skips no version that was never seen; `--skip-to
//!   VERSION` declares, audited, that the unseen versions up to VERSION will never come) with
//!   a recorded reason, then releases the messages waiting behind it
//!   in order, as the library does. Released messages that turn out to be duplicates or stale
//!   are resolved without effect. The first one that needs its effect applied stops the
//!   release: applying an effect needs the consumer's own handler, which this command does not
//!   have. That message becomes the aggregate's parked head, with a reason that says so, and is
//!   retried from the consumer service. Nothing is applied out of order and nothing is lost.
//! * **retry** applies the message's effect, which only the consumer's handler can do: the
//!   command records an audited retry *request* on the message
//!   (`ParkedMessages::request_retry`); the consumer service's `ConsumerEngine` looks for
//!   requests at start and then every `retry_requests_interval` (5 s by default), performs the
//!   retry with its handler (audited as a retry, with its outcome), releases what waits behind
//!   the message in order, and clears the request (also when the message fails again: it stays
//!   parked with its attempts counted). Nothing happens while no engine of the consumer runs;
//!   `show` displays a pending request.
//! * **reissue** is a producer action (a copy of an outbox event with a new id) and is refused
//!   for a consumer.

use outbox_core::{
    async_trait, Envelope, InboxAuditEntry, InboxParking, LogPosition, NativePosition,
    ParkedFilter, ParkedId, ParkedMessage,
};
use outbox_inbox::{
    Handler, HandlerError, InboxProcessor, OperatorError, ParkedMessages, VersionPolicy,
};
use serde_json::{json, Value};

use crate::config::{Config, ConsumerConfig, VersionPolicyName};
use crate::consumer_inbox::{on_inbox, ConsumerInbox};
use crate::db;
use crate::error::CliError;
use crate::opt::{ParkedActionOpts, ParkedListOpts, ParkedTarget};
use crate::output::{age, Output};

/// Why a released message stays parked after a discard from this command.
pub const NEEDS_HANDLER: &str = "not applied: released by `outbox parked discard`, which cannot \
                                 run this consumer's handler; request a retry (`outbox parked \
                                 retry ID --consumer NAME`), which the consumer service performs";

/// The handler of a command that has no consumer code: it applies nothing, so a released
/// message that needs its effect stays parked (the library's rule for a message that fails
/// again).
struct NoEffect;

#[async_trait]
impl<Tx: Send> Handler<Tx> for NoEffect {
    async fn handle(&self, _tx: &mut Tx, _event: &Envelope) -> Result<(), HandlerError> {
        Err(HandlerError::permanent(NEEDS_HANDLER))
    }
}

type Ops<I> = ParkedMessages<I, NoEffect>;

/// Consumer `name`'s inbox (PostgreSQL or MySQL, see [`crate::consumer_inbox`]).
async fn open(
    config: &Config,
    name: &str,
) -> Result<(ConsumerInbox, ConsumerConfig, String), CliError> {
    let c = db::consumer(config, name)?.clone();
    let (inbox, table) = crate::consumer_inbox::open(config, &c, 2).await?;
    Ok((inbox, c, table))
}

/// The operator API over `store` for consumer `c`, with its version policy.
fn ops<I: InboxParking>(store: I, c: &ConsumerConfig) -> Ops<I> {
    let policy = match c.version_policy {
        VersionPolicyName::Unchecked => VersionPolicy::Unchecked,
        // Hold and Reject both track versions; their bounds matter to the engine only.
        VersionPolicyName::Reject | VersionPolicyName::Hold => VersionPolicy::Reject,
    };
    ParkedMessages::new(
        InboxProcessor::new(c.name.clone(), store, NoEffect).with_version_policy(policy),
    )
}

fn parked_id(s: &str, consumer: &str) -> Result<ParkedId, CliError> {
    s.trim().parse().map_err(|_| {
        CliError::config(
            format!("{s:?} is not a parked message id of consumer {consumer:?}"),
            format!(
                "pass the number in the id column of `outbox parked list --consumer {consumer}`"
            ),
        )
    })
}

/// A consumer's parked message as JSON (never the payload).
pub fn message_json(m: &ParkedMessage) -> Value {
    let r = &m.record;
    let event = r.decode().ok();
    json!({
        "id": m.id.0,
        "consumer": m.consumer,
        "status": m.status.as_str(),
        "kind": m.kind.map(|k| k.as_str()),
        "reason": m.reason,
        "attempts": m.attempts,
        "parked_at": m.parked_at.to_rfc3339(),
        "resolved_at": m.resolved_at.map(|t| t.to_rfc3339()),
        "topic": r.position.topic,
        "partition": r.position.partition,
        "offset": r.position.offset,
        "native": native_json(&r.position),
        "aggregate_type": r.aggregate.as_ref().map(|a| a.aggregate_type.clone()),
        "aggregate_id": r.aggregate.as_ref().map(|a| a.aggregate_id.clone()),
        "aggregate_version": r.aggregate_version,
        "event_id": r.event_id.map(|i| i.to_string()),
        "dedup_id": r.dedup_id.map(|i| i.to_string()),
        "event_type": event.as_ref().map(|e| e.event_type.clone()),
        "payload_bytes": r.value.as_ref().map_or(0, Vec::len),
        "retry_request": m.retry_request.as_ref().map(|q| json!({
            "requested_by": q.actor,
            "reason": q.reason,
            "requested_at": q.requested_at.to_rfc3339(),
        })),
    })
}

/// The transport's own identity of a parked message's position (`offset` above is what the
/// engine ordered by: a JetStream delivery sequence, a RabbitMQ delivery tag).
fn native_json(p: &LogPosition) -> Value {
    match &p.native {
        NativePosition::JetStream {
            stream_sequence,
            consumer,
        } => json!({
            "transport": "nats",
            "stream": p.topic,
            "stream_sequence": stream_sequence,
            "delivery_sequence": p.offset,
            "consumer": consumer,
        }),
        NativePosition::RabbitMq {
            exchange,
            routing_key,
            redelivered,
        } => json!({
            "transport": "rabbitmq",
            "queue": p.topic,
            "exchange": exchange,
            "routing_key": routing_key,
            "delivery_tag": p.offset,
            "redelivered": redelivered,
        }),
        _ => json!({
            "transport": "kafka",
            "topic": p.topic,
            "partition": p.partition,
            "offset": p.offset,
        }),
    }
}

/// Where a parked message was read, in its transport's terms: `orders[2] offset 41`, `stream
/// ORDERS seq 42 (delivery 3, consumer billing)`, `queue orders tag 7 (exchange outbox,
/// routing key order.created)`.
fn read_at(p: &LogPosition) -> String {
    match p.native {
        NativePosition::Log => format!("{}[{}] offset {}", p.topic, p.partition, p.offset),
        _ => p.to_string(),
    }
}

/// The list's short form of where a message was read: what finds it on the broker
/// (`orders/2@41`, `ORDERS seq 42`, `outbox -> order.created`; a RabbitMQ delivery tag means
/// nothing once its channel is gone).
fn read_at_short(p: &LogPosition) -> String {
    match &p.native {
        NativePosition::JetStream {
            stream_sequence, ..
        } => format!("{} seq {stream_sequence}", p.topic),
        NativePosition::RabbitMq {
            exchange,
            routing_key,
            ..
        } => format!("{exchange} -> {routing_key}"),
        _ => format!("{}/{}@{}", p.topic, p.partition, p.offset),
    }
}

fn audit_json(a: &InboxAuditEntry) -> Value {
    json!({
        "id": a.parked_id.0,
        "action": a.action.as_str(),
        "actor": a.actor,
        "reason": a.reason,
        "outcome": a.outcome,
        "at": a.at.to_rfc3339(),
    })
}

fn aggregate_label(m: &ParkedMessage) -> String {
    match &m.record.aggregate {
        Some(a) => format!("{}/{}", a.aggregate_type, a.aggregate_id),
        None => "(unknown)".into(),
    }
}

fn operator_error(e: OperatorError, c: &ConsumerConfig, table: &str) -> CliError {
    match e {
        OperatorError::NotFound(id) => CliError::failed(format!(
            "consumer {} has no parked message {id} in {table}",
            c.name
        ))
        .with_hint(format!(
            "see `outbox parked list --consumer {} --all`",
            c.name
        )),
        OperatorError::NotOpen { id, status } => CliError::failed(format!(
            "parked message {id} of consumer {} is {} already: nothing to do",
            c.name,
            status.as_str()
        )),
        OperatorError::Invalid(m) => {
            CliError::config(m, "check --reason, --actor and --skip-to (see --help)")
        }
        OperatorError::Store(e) => db::inbox_error(&e, c, table),
        other => CliError::failed(other.to_string()),
    }
}

/// `outbox parked list --consumer NAME [--all] [--limit N]`.
pub async fn list(
    config: &Config,
    name: &str,
    o: &ParkedListOpts,
    out: &Output,
) -> Result<(), CliError> {
    let (inbox, c, table) = open(config, name).await?;
    on_inbox!(inbox, |store| list_on(&ops(store, &c), &c, &table, o, out)
        .await)
}

async fn list_on<I: InboxParking>(
    ops: &Ops<I>,
    c: &ConsumerConfig,
    table: &str,
    o: &ParkedListOpts,
    out: &Output,
) -> Result<(), CliError> {
    let mut filter = ParkedFilter::open().limit(o.limit.max(1));
    if o.all {
        filter = filter.all();
    }
    let parked = ops
        .list(&filter)
        .await
        .map_err(|e| db::inbox_error(&e, c, table))?;
    if out.json {
        out.json(&json!({
            "side": "consumer",
            "consumer": c.name,
            "parked": parked.iter().map(message_json).collect::<Vec<_>>(),
        }));
        return Ok(());
    }
    if parked.is_empty() {
        println!(
            "no {}parked messages of consumer {} in {table}",
            if o.all { "" } else { "open " },
            c.name
        );
        return Ok(());
    }
    let now = chrono::Utc::now();
    let rows = parked
        .iter()
        .map(|m| {
            let event = m.record.decode().ok();
            vec![
                m.id.to_string(),
                m.status.as_str().to_owned(),
                aggregate_label(m),
                m.record
                    .aggregate_version
                    .map_or_else(|| "-".into(), |v| v.to_string()),
                event.map_or_else(|| "-".into(), |e| e.event_type),
                m.kind.map_or("-", |k| k.as_str()).to_owned(),
                m.reason.clone(),
                m.attempts.to_string(),
                age((now - m.parked_at).to_std().ok()),
                read_at_short(&m.record.position),
            ]
        })
        .collect();
    println!(
        "{}",
        out.table(
            &[
                "id",
                "status",
                "aggregate",
                "version",
                "type",
                "kind",
                "reason",
                "attempts",
                "parked for",
                "read at"
            ],
            rows
        )
    );
    println!(
        "{} message(s) of consumer {}; `outbox parked show <id> --consumer {}` for details and \
         the audit trail",
        parked.len(),
        c.name,
        c.name
    );
    Ok(())
}

/// Consumer `name`'s open parked messages (heads and those waiting behind them) as JSON, at
/// most `limit`: what the web console lists.
pub(crate) async fn open_messages(
    config: &Config,
    name: &str,
    limit: usize,
) -> Result<Vec<Value>, CliError> {
    let (inbox, c, table) = open(config, name).await?;
    on_inbox!(inbox, |store| {
        let parked = ops(store, &c)
            .list(&ParkedFilter::open().limit(limit.max(1)))
            .await
            .map_err(|e| db::inbox_error(&e, &c, &table))?;
        Ok(parked.iter().map(message_json).collect())
    })
}

/// `outbox parked show ID --consumer NAME`.
pub async fn show(
    config: &Config,
    name: &str,
    t: &ParkedTarget,
    out: &Output,
) -> Result<(), CliError> {
    let id = parked_id(&t.event_id, name)?;
    let (inbox, c, table) = open(config, name).await?;
    on_inbox!(inbox, |store| show_on(&ops(store, &c), &c, &table, id, out)
        .await)
}

async fn show_on<I: InboxParking>(
    ops: &Ops<I>,
    c: &ConsumerConfig,
    table: &str,
    id: ParkedId,
    out: &Output,
) -> Result<(), CliError> {
    let map = |e: outbox_core::StoreError| db::inbox_error(&e, c, table);
    let Some(m) = ops.show(id).await.map_err(map)? else {
        return Err(operator_error(OperatorError::NotFound(id), c, table));
    };
    let trail = ops.audit_trail(Some(id)).await.map_err(map)?;
    // What waits behind it (for an open message of a known aggregate).
    let behind: Vec<ParkedMessage> = match (&m.record.aggregate, m.status.is_open()) {
        (Some(a), true) => ops
            .list(&ParkedFilter::open().aggregate(a.clone()).limit(10_000))
            .await
            .map_err(map)?
            .into_iter()
            .filter(|x| x.id != m.id)
            .collect(),
        _ => Vec::new(),
    };
    if out.json {
        out.json(&json!({
            "side": "consumer",
            "consumer": c.name,
            "parked": message_json(&m),
            "same_aggregate_open": behind.iter().map(|x| x.id.0).collect::<Vec<_>>(),
            "audit": trail.iter().map(audit_json).collect::<Vec<_>>(),
        }));
        return Ok(());
    }
    let r = &m.record;
    let event = r.decode();
    let mut rows = vec![
        vec!["id".into(), m.id.to_string()],
        vec!["consumer".into(), c.name.clone()],
        vec!["status".into(), m.status.as_str().into()],
        vec![
            "aggregate".into(),
            format!(
                "{} v{}",
                aggregate_label(&m),
                r.aggregate_version
                    .map_or_else(|| "?".into(), |v| v.to_string())
            ),
        ],
        vec![
            "event".into(),
            match &event {
                Ok(e) => format!("{} {}", e.event_type, e.event_id),
                Err(e) => format!("cannot be decoded: {e}"),
            },
        ],
        vec!["read at".into(), read_at(&r.position)],
        vec![
            "payload".into(),
            format!("{} bytes", r.value.as_ref().map_or(0, Vec::len)),
        ],
        vec!["parked".into(), m.parked_at.to_rfc3339()],
        vec!["kind".into(), m.kind.map_or("-", |k| k.as_str()).into()],
        vec!["reason".into(), m.reason.clone()],
        vec!["attempts".into(), m.attempts.to_string()],
    ];
    if let Some(t) = m.resolved_at {
        rows.push(vec!["resolved".into(), t.to_rfc3339()]);
    }
    if let Some(q) = &m.retry_request {
        rows.push(vec![
            "retry requested".into(),
            format!(
                "by {} at {} ({}): pending until the consumer service's next check",
                q.actor,
                q.requested_at.to_rfc3339(),
                if q.reason.is_empty() {
                    "no reason given"
                } else {
                    q.reason.as_str()
                }
            ),
        ]);
    }
    if !behind.is_empty() {
        rows.push(vec![
            "same aggregate".into(),
            format!(
                "{} other open message(s): {}",
                behind.len(),
                behind
                    .iter()
                    .map(|x| format!("{} ({})", x.id, x.status.as_str()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ]);
    }
    println!("{}", out.table(&["parked message", ""], rows));
    if trail.is_empty() {
        println!("audit trail: no operator action yet");
    } else {
        let rows = trail
            .iter()
            .map(|a| {
                vec![
                    a.at.to_rfc3339(),
                    a.action.as_str().into(),
                    a.actor.clone(),
                    a.reason.clone(),
                    a.outcome.clone(),
                ]
            })
            .collect();
        println!(
            "{}",
            out.table(&["at", "action", "actor", "reason", "outcome"], rows)
        );
    }
    Ok(())
}

/// `outbox parked discard ID --consumer NAME --reason R`.
pub async fn discard(
    config: &Config,
    name: &str,
    o: &ParkedActionOpts,
    out: &Output,
) -> Result<(), CliError> {
    let id = parked_id(&o.event_id, name)?;
    let reason = o.reason.as_deref().map(str::trim).unwrap_or("");
    if reason.is_empty() {
        return Err(CliError::config(
            "discard needs a reason",
            "pass --reason \"...\" (recorded in the consumer's audit trail with the actor)",
        ));
    }
    let actor = super::actor(o.actor.as_deref());
    let (inbox, c, table) = open(config, name).await?;
    on_inbox!(inbox, |store| {
        discard_on(&ops(store, &c), &c, &table, id, &actor, reason, o, out).await
    })
}

#[allow(clippy::too_many_arguments)]
async fn discard_on<I: InboxParking>(
    ops: &Ops<I>,
    c: &ConsumerConfig,
    table: &str,
    id: ParkedId,
    actor: &str,
    reason: &str,
    o: &ParkedActionOpts,
    out: &Output,
) -> Result<(), CliError> {
    let map = |e: outbox_core::StoreError| db::inbox_error(&e, c, table);
    let Some(m) = ops.show(id).await.map_err(map)? else {
        return Err(operator_error(OperatorError::NotFound(id), c, table));
    };
    if m.status == outbox_core::ParkedStatus::Parked {
        if let Some(a) = &m.record.aggregate {
            let behind = ops
                .list(&ParkedFilter::open().aggregate(a.clone()).limit(10_000))
                .await
                .map_err(map)?
                .into_iter()
                .filter(|x| x.id != id)
                .count();
            if behind > 0 {
                eprintln!(
                    "{behind} message(s) of {} wait behind {id}: after the discard they are \
                     released in order; the first that needs its effect stays parked for a \
                     retry from the consumer service (this command cannot apply effects)",
                    aggregate_label(&m)
                );
                out.confirm(&format!("Discard {id} of consumer {}?", c.name), o.yes)?;
            }
        }
    }
    let report = match o.skip_to {
        Some(to) => ops.discard_skipping_to(id, actor, reason, to).await,
        None => ops.discard(id, actor, reason).await,
    }
    .map_err(|e| operator_error(e, c, table))?;
    if out.json {
        out.json(&json!({
            "side": "consumer",
            "consumer": c.name,
            "action": "discard",
            "id": id.0,
            "actor": actor,
            "reason": reason,
            "applied": report.applied,
            "skipped": report.skipped,
            "discarded": report.discarded,
            "still_parked": report.still_parked.as_ref().map(|(i, why)| json!({"id": i.0, "reason": why})),
            "released": report.released,
            "skip_to": o.skip_to,
            "skipped_versions": report.skipped_versions,
        }));
        return Ok(());
    }
    println!(
        "discarded parked message {id} of consumer {} (audited as {actor})",
        c.name
    );
    if report.skipped_versions > 0 {
        println!(
            "versions up to {} skipped: {} version(s) never seen will never be applied \
             (audited)",
            o.skip_to.unwrap_or_default(),
            report.skipped_versions
        );
    }
    if report.skipped > 0 {
        println!(
            "{} released message(s) were duplicates or stale: resolved without effect",
            report.skipped
        );
    }
    match (&report.still_parked, report.released) {
        (Some((next, _)), _) => println!(
            "message {next} now blocks {}: it needs the consumer's handler; retry it from the \
             consumer service, or discard it too",
            aggregate_label(&m)
        ),
        (None, true) => {
            println!("its aggregate is released: the consumer applies its next messages")
        }
        (None, false) => println!("its aggregate stays blocked by an earlier parked message"),
    }
    Ok(())
}

/// `outbox parked retry ID --consumer NAME [--reason R]`: records an audited retry request,
/// which the consumer service performs with its handler at its next check.
pub async fn retry(
    config: &Config,
    name: &str,
    o: &ParkedActionOpts,
    out: &Output,
) -> Result<(), CliError> {
    let id = parked_id(&o.event_id, name)?;
    let reason = o.reason.as_deref().map(str::trim).unwrap_or("");
    let actor = super::actor(o.actor.as_deref());
    let (inbox, c, table) = open(config, name).await?;
    on_inbox!(inbox, |store| {
        retry_on(&ops(store, &c), &c, &table, id, &actor, reason, out).await
    })
}

async fn retry_on<I: InboxParking>(
    ops: &Ops<I>,
    c: &ConsumerConfig,
    table: &str,
    id: ParkedId,
    actor: &str,
    reason: &str,
    out: &Output,
) -> Result<(), CliError> {
    let request = ops
        .request_retry(id, actor, reason)
        .await
        .map_err(|e| operator_error(e, c, table))?;
    if out.json {
        out.json(&json!({
            "side": "consumer",
            "consumer": c.name,
            "action": "request_retry",
            "id": id.0,
            "actor": actor,
            "reason": reason,
            "requested_at": request.requested_at.to_rfc3339(),
        }));
        return Ok(());
    }
    println!(
        "retry of parked message {id} of consumer {} requested (audited as {actor}); the \
         consumer service performs it with its handler at its next check (at start, then every \
         retry_requests_interval, 5 s by default) and releases what waits behind it in order. \
         Nothing happens while no engine of {} runs. See the outcome with `outbox parked show \
         {id} --consumer {}`.",
        c.name, c.name, c.name
    );
    Ok(())
}

/// `outbox parked reissue ID --consumer NAME`: refused.
pub fn reissue(name: &str) -> CliError {
    CliError::config(
        format!(
            "reissue does not apply to consumer {name:?}: it puts a copy of a parked outbox \
             event into the outbox; a consumer's parked message was delivered already, and a \
             copy would be a duplicate to its inbox"
        ),
        "for a consumer: `outbox parked discard ID --consumer NAME --reason ...`, or a retry \
         from the consumer service; reissue works on the producer side (leave out --consumer)",
    )
}
