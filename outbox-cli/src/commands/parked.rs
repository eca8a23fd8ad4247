//! `outbox parked list|show|retry|discard|reissue|release-claims`: producer-side parked events,
//! every action audited by the store. With `--consumer NAME`, a consumer's parked messages
//! ([`consumer_parked`]).
//!
//! The producer side runs on any store through the operator role
//! ([`outbox_core::OperatorStore`]): PostgreSQL, or MySQL / MariaDB for a `mysql://` URL
//! ([`crate::store`]). The flags are checked before the store is opened.

use outbox_core::prelude::*;
use outbox_core::{AuditEntry, EventId, ParkedEvent, RelayState};
use serde_json::{json, Value};

use super::consumer_parked;
use crate::config::Config;
use crate::db;
use crate::error::CliError;
use crate::opt::{ParkedActionOpts, ParkedCommand, ReleaseClaimsOpts};
use crate::output::{age, Output};
use crate::relays::Relays;
use crate::store::Backend;

/// What the producer side does, once the flags are checked.
enum Op {
    List { limit: usize },
    Show { id: EventId },
    Act(Act),
    ReleaseClaims(ReleaseClaimsOpts),
}

/// A retry, discard or re-issue with its checked inputs.
struct Act {
    what: Action,
    id: EventId,
    reason: String,
    actor: String,
    yes: bool,
}

/// Opens the outbox of the configuration (PostgreSQL after its preflight, or MySQL) and runs
/// `op` through the operator role.
async fn on_outbox(config: &Config, op: Op, out: &Output) -> Result<(), CliError> {
    match crate::store::backend(config)? {
        Backend::MySql => {
            let m = crate::store::connect_mysql(config, 2).await?;
            exec(&m.store, &m.table, op, out).await
        }
        Backend::Postgres => {
            let (pool, _) = db::connect_outbox(config, 2).await?;
            db::preflight(&pool, config).await?;
            let store = db::outbox_store(config, pool)?;
            let table = format!("{}.{}", config.outbox.schema, config.outbox.table);
            exec(&store, &table, op, out).await
        }
    }
}

fn event_id(s: &str) -> Result<EventId, CliError> {
    s.trim().parse().map_err(|e| {
        CliError::config(
            format!("{s:?} is not an event id: {e}"),
            "pass the UUID shown by `outbox parked list`",
        )
    })
}

/// A parked event as JSON (never the payload: it may hold personal data).
pub fn parked_json(p: &ParkedEvent) -> Value {
    let e = &p.envelope;
    json!({
        "event_id": e.event_id.to_string(),
        "aggregate_type": e.aggregate_type,
        "aggregate_id": e.aggregate_id,
        "aggregate_version": e.aggregate_version,
        "event_type": e.event_type,
        "created_at": e.created_at.to_rfc3339(),
        "payload_bytes": e.payload.bytes.len(),
        "content_type": e.payload.content_type,
        "original_event_id": e.original_event_id().map(|i| i.to_string()),
        "attempts": p.attempts,
        "park_kind": p.reason.kind.as_str(),
        "error_class": p.reason.error.class.as_str(),
        "error_kind": p.reason.error.kind,
        "error_message": p.reason.error.message,
        "parked_at": p.parked_at.to_rfc3339(),
        "delivery_uncertain": p.delivery_uncertain,
    })
}

pub(crate) fn audit_json(a: &AuditEntry) -> Value {
    json!({
        "event_id": a.event_id.to_string(),
        "action": a.action.as_str(),
        "actor": a.actor,
        "reason": a.reason,
        "new_event_id": a.new_event_id.map(|i| i.to_string()),
        "at": a.at.to_rfc3339(),
    })
}

/// What is known of the earlier attempts, in a sentence for the operator.
pub(crate) fn attempts_note(p: &ParkedEvent) -> String {
    if p.delivery_uncertain {
        format!(
            "{} attempt(s); the last failure ({}) leaves open that the broker stored the event: \
             it may already be in the topic. A re-issued copy carries this event's id in \
             outbox_original_event_id, so inboxes apply the two once; consumers that do not \
             deduplicate may see it twice.",
            p.attempts, p.reason.error.kind
        )
    } else if p.attempts == 0 {
        // Parked by the store's version rule (out of order, a version gap) or before a send:
        // the broker never saw it, so it did not refuse anything either.
        format!(
            "never sent: parked before any attempt ({}); the event is not at the broker.",
            p.reason.error.kind
        )
    } else {
        format!(
            "{} attempt(s); the broker refused each one ({}): the event is not in the topic.",
            p.attempts, p.reason.error.kind
        )
    }
}

/// Runs `outbox parked ...`.
pub async fn run(config: &Config, cmd: ParkedCommand, out: &Output) -> Result<(), CliError> {
    let op = match cmd {
        ParkedCommand::List(o) => {
            if let Some(c) = &o.consumer {
                return consumer_parked::list(config, c, &o, out).await;
            }
            if o.all {
                return Err(CliError::config(
                    "--all lists a consumer's resolved messages too; the outbox keeps no \
                     resolved parked events apart (see `parked show ID` for an event's trail)",
                    "add --consumer NAME, or leave out --all",
                ));
            }
            Op::List {
                limit: o.limit.max(1),
            }
        }
        ParkedCommand::Show(t) => {
            if let Some(c) = &t.consumer {
                return consumer_parked::show(config, c, &t, out).await;
            }
            Op::Show {
                id: event_id(&t.event_id)?,
            }
        }
        ParkedCommand::Retry(o) => match action(config, Action::Retry, &o, out).await? {
            Some(act) => Op::Act(act),
            None => return Ok(()),
        },
        ParkedCommand::Discard(o) => match action(config, Action::Discard, &o, out).await? {
            Some(act) => Op::Act(act),
            None => return Ok(()),
        },
        ParkedCommand::Reissue(o) => match action(config, Action::Reissue, &o, out).await? {
            Some(act) => Op::Act(act),
            None => return Ok(()),
        },
        ParkedCommand::ReleaseClaims(o) => Op::ReleaseClaims(o),
    };
    on_outbox(config, op, out).await
}

/// Runs a checked producer-side operation on `store`, whatever the store.
async fn exec<S: OperatorStore + RelayRegistry>(
    store: &S,
    table: &str,
    op: Op,
    out: &Output,
) -> Result<(), CliError> {
    let map = |e: outbox_core::StoreError| CliError::from_store(&e, table);
    match op {
        Op::List { limit } => {
            let parked = store.list_parked(limit).await.map_err(map)?;
            if out.json {
                out.json(&json!({
                    "side": "producer",
                    "parked": parked.iter().map(parked_json).collect::<Vec<_>>(),
                }));
                return Ok(());
            }
            if parked.is_empty() {
                println!("no parked events in {table}");
                return Ok(());
            }
            let now = chrono::Utc::now();
            let rows = parked
                .iter()
                .map(|p| {
                    let e = &p.envelope;
                    vec![
                        e.event_id.to_string(),
                        format!("{}/{}", e.aggregate_type, e.aggregate_id),
                        e.aggregate_version.to_string(),
                        e.event_type.clone(),
                        p.reason.kind.as_str().to_owned(),
                        format!("{}: {}", p.reason.error.kind, p.reason.error.message),
                        p.attempts.to_string(),
                        age((now - p.parked_at).to_std().ok()),
                    ]
                })
                .collect();
            println!(
                "{}",
                out.table_keeping(
                    &[
                        "event id",
                        "aggregate",
                        "version",
                        "type",
                        "kind",
                        "last error",
                        "attempts",
                        "parked for"
                    ],
                    rows,
                    &[0],
                )
            );
            println!(
                "{} parked; `outbox parked show <id>` for details, then retry, discard or reissue",
                parked.len()
            );
            Ok(())
        }
        Op::Show { id } => {
            let trail = store.audit_trail(Some(id)).await.map_err(map)?;
            let parked = match store.parked_event(id).await {
                Ok(p) => Some(p),
                Err(e) if e.kind == outbox_core::StoreErrorKind::NotFound => None,
                Err(e) => return Err(map(e)),
            };
            if parked.is_none() && trail.is_empty() {
                return Err(CliError::failed(format!(
                    "event {id} is not parked in {table} and has no audit trail"
                )));
            }
            if out.json {
                out.json(&json!({
                    "side": "producer",
                    "parked": parked.as_ref().map(parked_json),
                    "earlier_attempts": parked.as_ref().map(attempts_note),
                    "audit": trail.iter().map(audit_json).collect::<Vec<_>>(),
                }));
                return Ok(());
            }
            match &parked {
                Some(p) => {
                    let e = &p.envelope;
                    let rows = vec![
                        vec!["event id".into(), e.event_id.to_string()],
                        vec![
                            "aggregate".into(),
                            format!(
                                "{}/{} v{}",
                                e.aggregate_type, e.aggregate_id, e.aggregate_version
                            ),
                        ],
                        vec!["event type".into(), e.event_type.clone()],
                        vec!["created".into(), e.created_at.to_rfc3339()],
                        vec![
                            "payload".into(),
                            format!(
                                "{} bytes, {}",
                                e.payload.bytes.len(),
                                e.payload.content_type
                            ),
                        ],
                        vec!["parked".into(), p.parked_at.to_rfc3339()],
                        vec!["kind".into(), p.reason.kind.as_str().into()],
                        vec![
                            "last error".into(),
                            format!(
                                "{} ({}): {}",
                                p.reason.error.kind,
                                p.reason.error.class.as_str(),
                                p.reason.error.message
                            ),
                        ],
                        vec!["earlier attempts".into(), attempts_note(p)],
                    ];
                    println!("{}", out.table(&["parked event", ""], rows));
                }
                None => println!("event {id} is no longer parked"),
            }
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
                            a.new_event_id.map(|i| i.to_string()).unwrap_or_default(),
                        ]
                    })
                    .collect();
                println!(
                    "{}",
                    out.table(&["at", "action", "actor", "reason", "new event id"], rows)
                );
            }
            Ok(())
        }
        Op::Act(act) => act_on(store, table, act, out).await,
        Op::ReleaseClaims(o) => release_claims(store, o, out).await.map_err(|e| match e {
            Released::Store(e) => map(e),
            Released::Cli(e) => e,
        }),
    }
}

enum Released {
    Store(outbox_core::StoreError),
    Cli(CliError),
}

impl From<outbox_core::StoreError> for Released {
    fn from(e: outbox_core::StoreError) -> Self {
        Self::Store(e)
    }
}

impl From<CliError> for Released {
    fn from(e: CliError) -> Self {
        Self::Cli(e)
    }
}

/// `release-claims [OWNER]`: without an owner, the dead relays that still hold claims; with
/// one, its claims end, unless the registry lists it as live (then only with `--force`).
async fn release_claims<S: OperatorStore + RelayRegistry>(
    store: &S,
    o: ReleaseClaimsOpts,
    out: &Output,
) -> Result<(), Released> {
    let relays = Relays::read(store).await;
    let Some(owner) = o.owner else {
        if let Some(e) = &relays.error {
            return Err(CliError::not_ready(e.clone(), "run `outbox migrate`").into());
        }
        let dead = relays.dead_with_claims();
        if out.json {
            let list: Vec<Value> = dead
                .iter()
                .map(|(e, n)| {
                    let mut v = crate::relays::entry_json(e, Some(*n));
                    v["command"] = json!(crate::relays::release_command(&e.registration.owner));
                    v
                })
                .collect();
            out.json(&json!({"dead_relays_holding_claims": list, "live_relays": relays.live()}));
            return Ok(());
        }
        if dead.is_empty() {
            println!(
                "no dead relay holds claims ({} live, {} stale in the registry); nothing to \
                 release",
                relays.live(),
                relays.entries.len() - relays.live()
            );
            return Ok(());
        }
        let rows = dead
            .iter()
            .map(|(e, n)| {
                let r = &e.registration;
                vec![
                    r.owner.clone(),
                    r.host.clone(),
                    r.pid.to_string(),
                    age(Some(e.heartbeat_age)),
                    n.to_string(),
                    crate::relays::release_command(&r.owner),
                ]
            })
            .collect();
        println!(
            "{}",
            out.table(
                &[
                    "dead relay",
                    "host",
                    "pid",
                    "last heartbeat",
                    "claims",
                    "command"
                ],
                rows
            )
        );
        println!(
            "these relays stopped heartbeating (older than {} of their intervals) and still \
             hold claims until their leases expire; check that each is really gone (host, pid) \
             before running its command",
            outbox_core::store::STALE_AFTER_HEARTBEATS
        );
        return Ok(());
    };
    if let Some((e, _)) = relays.get(&owner) {
        if e.state() == RelayState::Live && !o.force {
            return Err(CliError::failed(format!(
                "relay {owner:?} is live: it heartbeat {} ago from {} (pid {}) and holds {} \
                 event(s); releasing a running relay's claims hands its in-flight events to \
                 other relays, which publish them again (duplicates), and an aggregate's next \
                 version can overtake the one still in flight",
                age(Some(e.heartbeat_age)),
                e.registration.host,
                e.registration.pid,
                e.held
            ))
            .with_hint(
                "stop that relay (SIGTERM releases its claims itself); only if you know it is \
                 gone although its heartbeat is recent, pass --force",
            )
            .into());
        }
    }
    out.confirm(
        &format!(
            "End every claim of relay {owner:?}? Only for a relay that is gone: if it still \
             publishes, its events go out twice and an aggregate's next version can overtake \
             its in-flight one."
        ),
        o.yes,
    )?;
    let actor = super::actor(o.actor.as_deref());
    let n = store.release_claims_of(&owner, &actor).await?;
    // A relay that is gone leaves its entry: forgotten once its claims are released.
    if relays
        .get(&owner)
        .is_some_and(|(e, _)| e.state() == RelayState::Stale)
    {
        store.deregister_relay(&owner).await?;
    }
    if out.json {
        out.json(&json!({"owner": owner, "released_aggregates": n, "actor": actor}));
    } else {
        println!("released the claims of {owner} on {n} aggregate(s) (audited)");
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Action {
    Retry,
    Discard,
    Reissue,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Action::Retry => "retry",
            Action::Discard => "discard",
            Action::Reissue => "reissue",
        }
    }
}

/// Checks a retry, discard or re-issue; a consumer's is run here (`None`), the outbox's is
/// returned to run on the store.
async fn action(
    config: &Config,
    what: Action,
    o: &ParkedActionOpts,
    out: &Output,
) -> Result<Option<Act>, CliError> {
    let name = what.name();
    if let Some(c) = &o.consumer {
        match what {
            Action::Discard => consumer_parked::discard(config, c, o, out).await?,
            Action::Retry if o.skip_to.is_some() => {
                return Err(CliError::config(
                    "--skip-to goes with discard",
                    "a retry applies the message and accepts its version gap; to skip versions \
                     without applying it, discard it with --skip-to",
                ))
            }
            Action::Retry => consumer_parked::retry(config, c, o, out).await?,
            Action::Reissue => return Err(consumer_parked::reissue(c)),
        }
        return Ok(None);
    }
    if o.skip_to.is_some() {
        return Err(CliError::config(
            "--skip-to is for a consumer's parked message",
            "pass --consumer NAME with it (the outbox never skips versions: retry, discard or \
             reissue the parked event)",
        ));
    }
    let id = event_id(&o.event_id)?;
    let reason = o.reason.as_deref().map(str::trim).unwrap_or("");
    if what != Action::Retry && reason.is_empty() {
        return Err(CliError::config(
            format!("{name} needs a reason"),
            "pass --reason \"...\" (recorded in the audit trail with the actor)",
        ));
    }
    Ok(Some(Act {
        what,
        id,
        reason: reason.to_owned(),
        actor: super::actor(o.actor.as_deref()),
        yes: o.yes,
    }))
}

/// Runs a checked retry, discard or re-issue on `store`.
async fn act_on<S: OperatorStore>(
    store: &S,
    table: &str,
    act: Act,
    out: &Output,
) -> Result<(), CliError> {
    let Act {
        what,
        id,
        reason,
        actor,
        yes,
    } = act;
    let reason = reason.as_str();
    let name = what.name();
    let map = |e: outbox_core::StoreError| CliError::from_store(&e, table);
    let parked = store.parked_event(id).await.map_err(map)?;
    if what == Action::Reissue {
        // Show what is known of the earlier attempts before asking.
        let note = attempts_note(&parked);
        eprintln!(
            "re-issue {} ({}/{} v{}, {}): {note}",
            id,
            parked.envelope.aggregate_type,
            parked.envelope.aggregate_id,
            parked.envelope.aggregate_version,
            parked.envelope.event_type
        );
        out.confirm(
            "Replace it by a copy with a new event id (the original is marked discarded)?",
            yes,
        )?;
    }
    let result = match what {
        Action::Retry => store
            .retry_parked_with_reason(id, &actor, reason)
            .await
            .map(|()| None),
        Action::Discard => store
            .discard_parked(id, &actor, reason)
            .await
            .map(|()| None),
        Action::Reissue => store.reissue_parked(id, &actor, reason).await.map(Some),
    };
    let new_id = match result {
        Ok(n) => n,
        Err(e) if e.kind == outbox_core::StoreErrorKind::Conflict && what == Action::Retry => {
            return Err(CliError::failed(format!(
                "retry refused: {} (an out-of-order event would be delivered after a later \
                 version)",
                e.message
            ))
            .with_hint("discard it with a reason instead"))
        }
        Err(e) => return Err(map(e)),
    };
    if out.json {
        out.json(&json!({
            "action": name,
            "event_id": id.to_string(),
            "new_event_id": new_id.map(|i| i.to_string()),
            "actor": actor,
            "reason": reason,
            "delivery_uncertain": parked.delivery_uncertain,
        }));
    } else {
        match new_id {
            Some(n) => println!("re-issued {id} as {n} (audited; the original is discarded)"),
            None => println!(
                "{}: {id} (audited as {actor})",
                match what {
                    Action::Retry => "claimable again",
                    _ => "discarded; its aggregate's later events flow again",
                }
            ),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::{ErrorClass, LastError, ParkKind, ParkReason};

    fn parked(attempts: u32, kind: ParkKind, error_kind: &str) -> ParkedEvent {
        let envelope = outbox_core::Envelope::builder("order", "o-1", 1, "order.step")
            .json(&serde_json::json!({"v": 1}))
            .unwrap()
            .build()
            .unwrap();
        let reason = ParkReason {
            kind,
            error: LastError {
                class: ErrorClass::Permanent,
                kind: error_kind.into(),
                message: "version 1 is at or below 101".into(),
            },
        };
        ParkedEvent::new(envelope, attempts, reason, chrono::Utc::now())
    }

    /// An event parked by the version rule was never sent: `parked show` must not say that
    /// the broker refused it (the operator trial's `out_of_order` event, 0 attempts).
    #[test]
    fn an_event_parked_before_any_attempt_is_not_said_to_be_refused_by_the_broker() {
        let note = attempts_note(&parked(0, ParkKind::OutOfOrder, "out_of_order"));
        assert!(!note.contains("refused"), "{note}");
        assert!(
            note.contains("never sent") && note.contains("out_of_order"),
            "{note}"
        );
        let note = attempts_note(&parked(1, ParkKind::PermanentError, "record_too_large"));
        assert!(
            note.contains("1 attempt(s); the broker refused each one"),
            "{note}"
        );
    }
}
