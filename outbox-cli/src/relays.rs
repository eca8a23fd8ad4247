//! The relay registry as the commands show it: `outbox status` lists the relays, and
//! `outbox parked release-claims` lists the dead ones that still hold claims and refuses to end
//! a live one's.
//!
//! A relay is **live** while its latest heartbeat is at most
//! [`outbox_core::store::STALE_AFTER_HEARTBEATS`] (3) of its own `relay.heartbeat_interval` old, and
//! **stale** after that: killed without deregistering (SIGKILL, a lost host), or cut off from
//! the database. A stale relay's claims are counted now from the store (live leases of its
//! owner): they are what `release-claims` would end.

use outbox_core::{RelayEntry, RelayRegistry, RelayState};
use serde_json::{json, Value};

use crate::output::{age, Output};

/// The registry as read now.
#[derive(Debug, Default)]
pub struct Relays {
    /// Every entry, with the events its owner holds under a live lease now (read for stale
    /// entries only: a live relay's own count is `held`, from its latest heartbeat).
    pub entries: Vec<(RelayEntry, Option<u64>)>,
    /// Why the registry could not be read (no entries then).
    pub error: Option<String>,
}

impl Relays {
    /// Reads the registry of `store`.
    pub async fn read<S: RelayRegistry>(store: &S) -> Self {
        let list = match store.relays().await {
            Ok(l) => l,
            Err(e) => {
                return Self {
                    entries: Vec::new(),
                    error: Some(format!(
                        "cannot read the relay registry: {e} (run `outbox migrate` if the \
                         <table>_relays table is missing)"
                    )),
                }
            }
        };
        let mut entries = Vec::with_capacity(list.len());
        for e in list {
            let claims = if e.state() == RelayState::Stale {
                store.live_claims_of(&e.registration.owner).await.ok()
            } else {
                None
            };
            entries.push((e, claims));
        }
        Self {
            entries,
            error: None,
        }
    }

    /// Live entries.
    pub fn live(&self) -> usize {
        self.entries
            .iter()
            .filter(|(e, _)| e.state() == RelayState::Live)
            .count()
    }

    /// The entry of `owner`.
    pub fn get(&self, owner: &str) -> Option<&(RelayEntry, Option<u64>)> {
        self.entries
            .iter()
            .find(|(e, _)| e.registration.owner == owner)
    }

    /// Stale entries whose owner still holds claims now.
    pub fn dead_with_claims(&self) -> Vec<(&RelayEntry, u64)> {
        self.entries
            .iter()
            .filter_map(|(e, c)| match c {
                Some(n) if *n > 0 && e.state() == RelayState::Stale => Some((e, *n)),
                _ => None,
            })
            .collect()
    }

    /// The `relays` object of `outbox status --json`.
    pub fn json(&self) -> Value {
        let entries: Vec<Value> = self
            .entries
            .iter()
            .map(|(e, c)| entry_json(e, *c))
            .collect();
        json!({
            "live": self.live(),
            "stale": self.entries.len() - self.live(),
            "entries": entries,
            "error": self.error,
        })
    }

    /// The text of `outbox status`: a table of the entries and a line on what runs.
    pub fn render(&self, out: &Output) {
        if let Some(e) = &self.error {
            println!("relays: unknown: {e}");
            return;
        }
        if !self.entries.is_empty() {
            let rows = self
                .entries
                .iter()
                .map(|(e, claims)| {
                    let r = &e.registration;
                    vec![
                        r.owner.clone(),
                        e.state().as_str().to_owned(),
                        r.host.clone(),
                        r.pid.to_string(),
                        r.version.clone(),
                        r.claim_mode.clone(),
                        since(e),
                        age(Some(e.heartbeat_age)),
                        match claims {
                            Some(n) => format!("{} (now {n})", e.held),
                            None => e.held.to_string(),
                        },
                    ]
                })
                .collect();
            println!(
                "{}",
                out.table(
                    &[
                        "relay",
                        "state",
                        "host",
                        "pid",
                        "version",
                        "mode",
                        "since",
                        "last heartbeat",
                        "holds"
                    ],
                    rows
                )
            );
        }
        match self.live() {
            0 => println!(
                "relays: NONE RUNS (no live relay in the registry): nothing publishes the backlog"
            ),
            n => println!("relays: {n} live"),
        }
    }
}

/// When `e` started, and how long ago (`2026-01-02 10:00:00 UTC (3m 2s ago)`).
pub fn since(e: &RelayEntry) -> String {
    // The registry's times are the database's; the age of the start is measured from the
    // heartbeat's age, on the same clock.
    let up = (e.heartbeat_at - e.started_at)
        .to_std()
        .unwrap_or_default()
        .saturating_add(e.heartbeat_age);
    format!(
        "{} ({} ago)",
        e.started_at.format("%Y-%m-%d %H:%M:%S UTC"),
        age(Some(up))
    )
}

/// The command that ends `owner`'s claims (`outbox parked release-claims OWNER`, the owner
/// quoted for a POSIX shell when it needs to be).
pub fn release_command(owner: &str) -> String {
    format!("outbox parked release-claims {}", shell_word(owner))
}

/// `s` as one shell word.
fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:@/".contains(&b))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// One entry as JSON.
pub fn entry_json(e: &RelayEntry, claims_now: Option<u64>) -> Value {
    let r = &e.registration;
    json!({
        "owner": r.owner,
        "state": e.state().as_str(),
        "host": r.host,
        "pid": r.pid,
        "version": r.version,
        "claim_mode": r.claim_mode,
        "heartbeat_interval_seconds": r.heartbeat_interval.as_secs_f64(),
        "started_at": e.started_at.to_rfc3339(),
        "heartbeat_at": e.heartbeat_at.to_rfc3339(),
        "heartbeat_age_seconds": e.heartbeat_age.as_secs_f64(),
        "held_at_heartbeat": e.held,
        "claims_now": claims_now,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use outbox_core::RelayRegistration;

    use super::*;

    #[test]
    fn the_start_reads_as_old_as_the_heartbeat_plus_its_age() {
        // Started 3.5 s before its last heartbeat, read 0.472 s after it: up 3.972 s, never
        // younger than the heartbeat's own age (trial 2 saw "3.000 s ago" beside 3.972 s).
        let heartbeat = chrono::DateTime::parse_from_rfc3339("2026-12-05T10:00:03.5Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        let started = heartbeat - chrono::Duration::milliseconds(3500);
        let e = RelayEntry::new(
            RelayRegistration::new("r-0", "h", 1, "v", "lease", Duration::from_secs(5)),
            started,
            heartbeat,
            Duration::from_millis(472),
            0,
        );
        assert_eq!(since(&e), "2026-12-05 10:00:00 UTC (3.972 s ago)");
    }
}
