//! What the console reads and does, on either store: the reporting role for the backlog and
//! latency, the operator role for parked events and their audited actions
//! ([`outbox_core::ReportingStore`], [`outbox_core::OperatorStore`]), and one SQL read of each
//! store's own: the relays holding claims right now.

use chrono::{DateTime, Utc};
use outbox_core::prelude::*;
use outbox_core::{AuditEntry, EventId, LatencySummary, OutboxStats, ParkedEvent, StoreError};
use outbox_mysql::MySqlOutboxStore;
use outbox_postgres::PostgresOutboxStore;
use serde::Serialize;

use crate::config::Config;
use crate::error::CliError;

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

    /// The relays holding unexpired leases now, by owner (lease claim mode; a locked claim
    /// leaves no row to read).
    // REGISTRY: once the relay registry (a separate branch) is merged, the console lists the
    // registered relays (alive or not) and keeps this read as the claims each one holds.
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
                // DATETIME(6) columns hold UTC (the store writes UTC_TIMESTAMP(6)).
                let rows: Vec<(String, i64, Option<chrono::NaiveDateTime>)> =
                    outbox_mysql::sqlx::query_as(&format!(
                        "SELECT owner, CAST(SUM(n) AS SIGNED), MAX(until) FROM ( \
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
