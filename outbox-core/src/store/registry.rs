//! The relay registry: which relays run, where, and what they hold.
//!
//! A relay registers each of its claim owners when it starts, heartbeats every
//! [`RelayRegistration::heartbeat_interval`], and deregisters when it stops gracefully. A relay
//! killed (SIGKILL, a lost host) leaves its entry behind; once its heartbeat is older than
//! [`STALE_AFTER_HEARTBEATS`] intervals it is **stale**: most likely dead, and its live claims
//! (if any) are what `outbox parked release-claims` ends. Operators read the registry
//! (`outbox status`); nothing on the hot path does.
//!
//! Times are on the store's clock (the database's for SQL stores), so the heartbeat's age does
//! not depend on the clocks of the relays' hosts or of the operator's.

use std::time::Duration;

use async_trait::async_trait;

use crate::error::StoreError;
use crate::store::reporting::UtcTime;

/// A relay entry is stale when its last heartbeat is older than this many of its own
/// heartbeat intervals: two heartbeats missed in a row, plus one interval of slack for a slow
/// database.
pub const STALE_AFTER_HEARTBEATS: u32 = 3;

/// Entries whose heartbeat is older than this are removed when a relay registers: a relay
/// gone for a day has had every lease of its expire (leases are at most an hour).
pub const FORGET_AFTER: Duration = Duration::from_secs(24 * 3600);

/// What a relay says about itself when it registers.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayRegistration {
    /// The claim owner (`ClaimRequest::owner`): the key of the entry.
    pub owner: String,
    /// The host the relay runs on.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// The library (or program) version.
    pub version: String,
    /// Its claim mode, as [`crate::ClaimMode`]'s name (`lease` or `locked`).
    pub claim_mode: String,
    /// How often it heartbeats.
    pub heartbeat_interval: Duration,
}

impl RelayRegistration {
    /// A registration.
    pub fn new(
        owner: impl Into<String>,
        host: impl Into<String>,
        pid: u32,
        version: impl Into<String>,
        claim_mode: impl Into<String>,
        heartbeat_interval: Duration,
    ) -> Self {
        Self {
            owner: owner.into(),
            host: host.into(),
            pid,
            version: version.into(),
            claim_mode: claim_mode.into(),
            heartbeat_interval,
        }
    }
}

/// Whether a registered relay is running.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RelayState {
    /// Heartbeat within [`STALE_AFTER_HEARTBEATS`] intervals.
    Live,
    /// Heartbeat older than that: most likely dead (killed without deregistering), or cut off
    /// from the database.
    Stale,
}

impl RelayState {
    /// `live` or `stale` (metric labels, JSON).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Stale => "stale",
        }
    }
}

/// A registered relay as the registry holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayEntry {
    /// What it registered with.
    pub registration: RelayRegistration,
    /// When it registered (store clock).
    pub started_at: UtcTime,
    /// Its last heartbeat (store clock).
    pub heartbeat_at: UtcTime,
    /// Age of the last heartbeat when the entry was read (store clock).
    pub heartbeat_age: Duration,
    /// Events it held claimed at its last heartbeat.
    pub held: u64,
}

impl RelayEntry {
    /// An entry.
    pub fn new(
        registration: RelayRegistration,
        started_at: UtcTime,
        heartbeat_at: UtcTime,
        heartbeat_age: Duration,
        held: u64,
    ) -> Self {
        Self {
            registration,
            started_at,
            heartbeat_at,
            heartbeat_age,
            held,
        }
    }

    /// Live or stale, by the age of its heartbeat against its own interval.
    pub fn state(&self) -> RelayState {
        relay_state(self.heartbeat_age, self.registration.heartbeat_interval)
    }
}

/// Live when `heartbeat_age` is at most [`STALE_AFTER_HEARTBEATS`] times `interval`.
pub fn relay_state(heartbeat_age: Duration, interval: Duration) -> RelayState {
    if heartbeat_age <= interval.saturating_mul(STALE_AFTER_HEARTBEATS) {
        RelayState::Live
    } else {
        RelayState::Stale
    }
}

/// The registry role: relays say they run; operators see which do.
///
/// A store that keeps an outbox SHOULD keep its registry beside it (same database), so that
/// the relays of one outbox are listed together.
#[async_trait]
pub trait RelayRegistry: Send + Sync {
    /// Registers (or registers again) `registration.owner`: its `started_at` and
    /// `heartbeat_at` become the store's now, `held` 0. MUST replace an entry of the same
    /// owner. SHOULD remove entries whose heartbeat is older than [`FORGET_AFTER`].
    async fn register_relay(&self, registration: &RelayRegistration) -> Result<(), StoreError>;

    /// Records a heartbeat of `owner` holding `held` claimed events. Returns `false` (and
    /// writes nothing) when `owner` has no entry (removed meanwhile): the relay registers again.
    async fn heartbeat_relay(&self, owner: &str, held: u64) -> Result<bool, StoreError>;

    /// Removes `owner`'s entry (graceful shutdown). MUST be a no-op when there is none.
    async fn deregister_relay(&self, owner: &str) -> Result<(), StoreError>;

    /// Every entry, live and stale, by owner.
    async fn relays(&self) -> Result<Vec<RelayEntry>, StoreError>;

    /// How many events `owner` holds under a live lease now (what
    /// [`OperatorStore::release_claims_of`](crate::OperatorStore::release_claims_of) would
    /// release). MAY return 0 in locked-transaction mode, where claims end with the relay's
    /// connection.
    async fn live_claims_of(&self, owner: &str) -> Result<u64, StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_after_three_intervals() {
        let i = Duration::from_secs(5);
        assert_eq!(relay_state(Duration::ZERO, i), RelayState::Live);
        assert_eq!(relay_state(Duration::from_secs(15), i), RelayState::Live);
        assert_eq!(
            relay_state(Duration::from_millis(15_001), i),
            RelayState::Stale
        );
        assert_eq!(RelayState::Stale.as_str(), "stale");
    }
}
