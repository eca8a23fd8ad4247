//! What the console reads and does, on either store: the reporting role for the backlog and
//! latency, the operator role for parked events and their audited actions
//! ([`outbox_core::ReportingStore`], [`outbox_core::OperatorStore`]), the relay registry as
//! `outbox status` reads it ([`crate::relays::Relays`]), and one SQL read of each store's own:
//! the relays holding claims right now. [`relay_rows`] joins the last two by owner.

use chrono::{DateTime, Utc};
use outbox_core::prelude::*;
use outbox_core::{
    AuditEntry, EventId, LatencySummary, OutboxStats, ParkedEvent, RelayEntry, RelayState,
    StoreError,
};
use outbox_mysql::MySqlOutboxStore;
use outbox_postgres::PostgresOutboxStore;
use serde::Serialize;

use crate::config::Config;
use crate::error::CliError;
use crate::relays::Relays;

/// The outbox the console shows, on PostgreSQL or MySQL / MariaDB.
// One per process: its size does not matter, and a boxed variant would keep `on_store!` from
// handing the store itself to code generic over the roles.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum ConsoleStore {
    /// On PostgreSQL.
    Postgres {
        /// The store.
        store: PostgresOutboxStore,
        /// `schema.table`, for messages.
        table: String,
        /// The per-aggregate state table (leases), quoted.
        aggregates: String,
    },
    /// On MySQL / MariaDB.
    MySql {
        /// The store.
        store: MySqlOutboxStore,
        /// `database.table` or `table`, for messages.
        table: String,
        /// The per-aggregate state table (leases of relays of the previous version), quoted.
        aggregates: String,
        /// The outbox table, quoted.
        events: String,
        /// The lease table (one row per lease claim batch), quoted.
        lease: String,
    },
}

/// Runs `$body` with `$store` bound to the store inside a [`ConsoleStore`].
macro_rules! on_store {
    ($s:expr, |$store:ident| $body:expr) => {
        match $s {
            ConsoleStore::Postgres { store: $store, .. } => $body,
            ConsoleStore::MySql { store: $store, .. } => $body,
        }
    };
}

/// A relay that holds claims (leases) now.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ClaimHolder {
    /// `relay.owner` plus the worker number.
    pub owner: String,
    /// Aggregates it holds.
    pub aggregates: i64,
    /// When its last lease ends unless renewed (UTC).
    pub lease_until: Option<DateTime<Utc>>,
}

/// What a relay row's state says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowState {
    /// In the registry, heartbeating.
    Live,
    /// In the registry, its heartbeat older than
    /// [`outbox_core::store::STALE_AFTER_HEARTBEATS`] of its intervals: most likely dead.
    Stale,
    /// Holds claims but is not in the registry (a relay older than the registry, or one whose
    /// registration failed): whether it runs is unknown.
    Unregistered,
}

impl RowState {
    /// `live`, `stale` or `unregistered`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Stale => "stale",
            Self::Unregistered => "unregistered",
        }
    }
}

/// One relay as the console lists it: its registry entry, the claims it holds now, or both.
#[derive(Clone, Copy, Debug)]
pub struct RelayRow<'a> {
    /// The claim owner (`<relay.owner>-<worker>`).
    pub owner: &'a str,
    /// Its registry entry, and for a stale one the events it holds under a live lease now.
    pub entry: Option<(&'a RelayEntry, Option<u64>)>,
    /// Its unexpired leases now (none: it holds no claim, or the claims could not be read).
    pub claims: Option<&'a ClaimHolder>,
}

impl RelayRow<'_> {
    /// Live, stale or unregistered.
    pub fn state(&self) -> RowState {
        match self.entry {
            None => RowState::Unregistered,
            Some((e, _)) if e.state() == RelayState::Live => RowState::Live,
            Some(_) => RowState::Stale,
        }
    }

    /// The command that ends its claims, for a stale relay that still holds some (by the
    /// registry's count or by the leases read now): what `outbox parked release-claims`
    /// without an owner lists.
    pub fn release_command(&self) -> Option<String> {
        let (_, now) = self.entry?;
        let holds = now.is_some_and(|n| n > 0) || self.claims.is_some_and(|c| c.aggregates > 0);
        (self.state() == RowState::Stale && holds)
            .then(|| crate::relays::release_command(self.owner))
    }
}

/// The registry's entries joined by owner with the claims held now; holders the registry does
/// not know come too. By owner.
pub fn relay_rows<'a>(relays: &'a Relays, claims: &'a [ClaimHolder]) -> Vec<RelayRow<'a>> {
    let mut rows: Vec<RelayRow<'a>> = relays
        .entries
        .iter()
        .map(|(e, now)| RelayRow {
            owner: &e.registration.owner,
            entry: Some((e, *now)),
            claims: claims.iter().find(|c| c.owner == e.registration.owner),
        })
        .collect();
    rows.extend(
        claims
            .iter()
            .filter(|c| relays.get(&c.owner).is_none())
            .map(|c| RelayRow {
                owner: &c.owner,
                entry: None,
                claims: Some(c),
            }),
    );
    rows.sort_by(|a, b| a.owner.cmp(b.owner));
    rows
}

/// A retry, discard or re-issue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Claimable again, same id, attempts reset.
    Retry,
    /// Removed from delivery; its aggregate's later events flow again.
    Discard,
    /// Replaced by a copy with a new id (the original is discarded).
    Reissue,
}

impl Action {
    /// From the URL segment.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "retry" => Some(Self::Retry),
            "discard" => Some(Self::Discard),
            "reissue" => Some(Self::Reissue),
            _ => None,
        }
    }
    /// The URL segment and the audit trail's word.
    pub fn name(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Discard => "discard",
            Self::Reissue => "reissue",
        }
    }
}

impl ConsoleStore {
    /// Connects to the configuration's outbox (PostgreSQL after its preflight, or MySQL).
    pub async fn connect(config: &Config) -> Result<Self, CliError> {
        Ok(match crate::store::backend(config)? {
            crate::store::Backend::MySql => {
                let m = crate::store::connect_mysql(config, 4).await?;
                Self::mysql(config, m.store)
            }
            crate::store::Backend::Postgres => {
                let (pool, _) = crate::db::connect_outbox(config, 4).await?;
                crate::db::preflight(&pool, config).await?;
                Self::postgres(config, crate::db::outbox_store(config, pool)?)
            }
        })
    }

    /// Over a PostgreSQL store of the configuration's outbox.
    pub fn postgres(config: &Config, store: PostgresOutboxStore) -> Self {
        let o = &config.outbox;
        Self::Postgres {
            store,
            table: format!("{}.{}", o.schema, o.table),
            aggregates: outbox_postgres::qualified(&o.schema, &format!("{}_aggregate", o.table)),
        }
    }

    /// Over a MySQL store of the configuration's outbox.
    pub fn mysql(config: &Config, store: MySqlOutboxStore) -> Self {
        let database = crate::mysql::database(config);
        Self::MySql {
            store,
            table: crate::mysql::table_label(config),
            aggregates: outbox_mysql::qualified(
                database.as_deref(),
                &format!("{}_aggregate", config.outbox.table),
            ),
            events: outbox_mysql::qualified(database.as_deref(), &config.outbox.table),
            lease: outbox_mysql::qualified(
                database.as_deref(),
                &format!("{}_lease", config.outbox.table),
            ),
        }
    }

    /// The outbox table as messages name it.
    pub fn table(&self) -> &str {
        match self {
            Self::Postgres { table, .. } | Self::MySql { table, .. } => table,
        }
    }

    /// The PostgreSQL pool, which a consumer's inbox in the outbox's database shares.
    pub fn pg_pool(&self) -> Option<&sqlx::PgPool> {
        match self {
            Self::Postgres { store, .. } => Some(store.pool()),
            Self::MySql { .. } => None,
        }
    }

    /// The backlog and its ages.
    pub async fn backlog(&self) -> Result<OutboxStats, StoreError> {
        on_store!(self, |s| ReportingStore::backlog(s).await)
    }

    /// Publish latency and flow over `window`.
    pub async fn latency(&self, window: std::time::Duration) -> Result<LatencySummary, StoreError> {
        on_store!(self, |s| s.publish_latency(window).await)
    }

    /// Parked events, oldest first.
    pub async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedEvent>, StoreError> {
        on_store!(self, |s| s.list_parked(limit).await)
    }

    /// One parked event (`None` when it is not parked) and its audit trail.
    pub async fn parked(
        &self,
        id: EventId,
    ) -> Result<(Option<ParkedEvent>, Vec<AuditEntry>), StoreError> {
        on_store!(self, |s| {
            let parked = match s.parked_event(id).await {
                Ok(p) => Some(p),
                Err(e) if e.kind == outbox_core::StoreErrorKind::NotFound => None,
                Err(e) => return Err(e),
            };
            Ok((parked, s.audit_trail(Some(id)).await?))
        })
    }

    /// Runs `action` on parked event `id`, audited with `actor` and `reason`; a re-issue returns
    /// the copy's id.
    pub async fn act(
        &self,
        action: Action,
        id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<Option<EventId>, StoreError> {
        on_store!(self, |s| match action {
            Action::Retry => s
                .retry_parked_with_reason(id, actor, reason)
                .await
                .map(|()| None),
            Action::Discard => s.discard_parked(id, actor, reason).await.map(|()| None),
            Action::Reissue => s.reissue_parked(id, actor, reason).await.map(Some),
        })
    }

    /// The relay registry, live and stale entries, as `outbox status` reads it.
    pub async fn relays(&self) -> Relays {
        on_store!(self, |s| Relays::read(s).await)
    }

    /// The relays holding unexpired leases now, by owner (lease claim mode; a locked claim
    /// leaves no row to read), registered or not: [`relay_rows`] joins them to the registry.
    pub async fn claim_holders(&self) -> Result<Vec<ClaimHolder>, StoreError> {
        match self {
            Self::Postgres {
                store, aggregates, ..
            } => {
                let rows: Vec<(String, i64, Option<DateTime<Utc>>)> = sqlx::query_as(&format!(
                    "SELECT lease_owner, count(*), max(lease_until) FROM {aggregates} \
                     WHERE lease_owner IS NOT NULL AND lease_until > clock_timestamp() \
                     GROUP BY lease_owner ORDER BY lease_owner"
                ))
                .fetch_all(store.pool())
                .await
                .map_err(outbox_postgres::map_sqlx_error)?;
                Ok(rows
                    .into_iter()
                    .map(|(owner, aggregates, lease_until)| ClaimHolder {
                        owner,
                        aggregates,
                        lease_until,
                    })
                    .collect())
            }
            Self::MySql {
                store,
                aggregates,
                events,
                lease,
                ..
            } => {
                // DATETIME(6) columns hold UTC (the store writes UTC_TIMESTAMP(6)). The union
                // of the two owner columns (TEXT and VARCHAR, binary collations) comes back as
                // a BLOB on MariaDB: cast to text for the driver.
                let rows: Vec<(String, i64, Option<chrono::NaiveDateTime>)> =
                    outbox_mysql::sqlx::query_as(&format!(
                        "SELECT CAST(owner AS CHAR CHARACTER SET utf8mb4), \
                                CAST(SUM(n) AS SIGNED), MAX(until) FROM ( \
                           SELECT l.owner AS owner, COUNT(DISTINCT e.aggregate_key) AS n, \
                                  MAX(l.until) AS until \
                             FROM {lease} l JOIN {events} e ON e.claim_token = l.token \
                            WHERE e.status = 'pending' AND e.next_attempt_at > UTC_TIMESTAMP(6) \
                            GROUP BY l.owner \
                           UNION ALL \
                           SELECT lease_owner, COUNT(*), MAX(lease_until) FROM {aggregates} \
                            WHERE lease_owner IS NOT NULL AND lease_until > UTC_TIMESTAMP(6) \
                            GROUP BY lease_owner) h \
                         GROUP BY owner ORDER BY owner"
                    ))
                    .fetch_all(store.pool())
                    .await
                    .map_err(outbox_mysql::map_sqlx_error)?;
                Ok(rows
                    .into_iter()
                    .map(|(owner, aggregates, lease_until)| ClaimHolder {
                        owner,
                        aggregates,
                        lease_until: lease_until.map(|t| t.and_utc()),
                    })
                    .collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use outbox_core::RelayRegistration;

    use super::*;

    fn entry(owner: &str, heartbeat_age_ms: u64) -> RelayEntry {
        let now = Utc::now();
        RelayEntry::new(
            RelayRegistration::new(owner, "h", 1, "v", "lease", Duration::from_secs(1)),
            now,
            now,
            Duration::from_millis(heartbeat_age_ms),
            0,
        )
    }

    fn holder(owner: &str, aggregates: i64) -> ClaimHolder {
        ClaimHolder {
            owner: owner.into(),
            aggregates,
            lease_until: None,
        }
    }

    /// Registry and leases joined by owner: a stale relay holding claims (by either count) gets
    /// the command, a live one, an idle stale one and an unregistered holder do not.
    #[test]
    fn rows_join_the_registry_and_the_claims_by_owner() {
        let relays = Relays {
            entries: vec![
                (entry("b-live", 100), None),
                (entry("c-dead-leases", 9_000), Some(0)),
                (entry("d-dead-registry", 9_000), Some(2)),
                (entry("e-dead-idle", 9_000), Some(0)),
            ],
            error: None,
        };
        let claims = [
            holder("a-ghost", 1),
            holder("b-live", 3),
            holder("c-dead-leases", 2),
        ];
        let rows = relay_rows(&relays, &claims);
        let seen: Vec<_> = rows
            .iter()
            .map(|r| {
                (
                    r.owner,
                    r.state(),
                    r.claims.map(|c| c.aggregates),
                    r.release_command(),
                )
            })
            .collect();
        let cmd = |o: &str| Some(format!("outbox parked release-claims {o}"));
        assert_eq!(
            seen,
            vec![
                ("a-ghost", RowState::Unregistered, Some(1), None),
                ("b-live", RowState::Live, Some(3), None),
                (
                    "c-dead-leases",
                    RowState::Stale,
                    Some(2),
                    cmd("c-dead-leases")
                ),
                (
                    "d-dead-registry",
                    RowState::Stale,
                    None,
                    cmd("d-dead-registry")
                ),
                ("e-dead-idle", RowState::Stale, None, None),
            ]
        );
    }
}
