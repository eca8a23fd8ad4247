//! A configured consumer's inbox, on whichever store holds it: PostgreSQL
//! ([`outbox_postgres::PostgresInboxStore`]) or MySQL / MariaDB
//! ([`outbox_mysql::MySqlInboxStore`]). The consumer's `database_url` chooses, else the
//! outbox's URL (the scheme, as in [`crate::store`]). The commands work on either through
//! outbox-core's inbox roles ([`outbox_core::InboxStore`], [`outbox_core::InboxParking`]) with
//! `on_inbox!`; only the registration counts of `outbox status` and `outbox reconcile` are SQL
//! of each store's own.
//!
//! On MySQL, `inbox_schema` names the database when it is not the default (`outbox`), as
//! `outbox.schema` does for the outbox; else the inbox is in the URL's database.

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};
use outbox_core::StoreError;
use outbox_mysql::MySqlInboxStore;
use outbox_postgres::PostgresInboxStore;
use uuid::Uuid;

use crate::config::{Config, ConsumerConfig, Secret};
use crate::db;
use crate::error::CliError;
use crate::store::{is_mysql, Backend};

/// A consumer's inbox store.
// One per consumer and command: its size does not matter, and boxing a variant would keep
// `on_inbox!` from handing the store itself to code generic over the inbox traits.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum ConsumerInbox {
    /// On PostgreSQL.
    Postgres(PostgresInboxStore),
    /// On MySQL / MariaDB.
    MySql(MySqlInboxStore),
}

/// Runs `$body` with `$store` bound to the inbox store inside `$inbox` (a [`ConsumerInbox`]),
/// whatever its type: the body is generic code over outbox-core's inbox traits.
macro_rules! on_inbox {
    ($inbox:expr, |$store:ident| $body:expr) => {
        match $inbox {
            $crate::consumer_inbox::ConsumerInbox::Postgres($store) => $body,
            $crate::consumer_inbox::ConsumerInbox::MySql($store) => $body,
        }
    };
}
pub(crate) use on_inbox;

/// The store of consumer `c`'s inbox: MySQL when its `database_url` (else the outbox's) is a
/// `mysql://` or `mariadb://` URL.
pub fn backend(config: &Config, c: &ConsumerConfig) -> Result<Backend, CliError> {
    if c.database_url.is_empty() {
        return crate::store::backend(config);
    }
    Ok(if is_mysql(c.database_url.expose()) {
        Backend::MySql
    } else {
        Backend::Postgres
    })
}

/// Opens consumer `c`'s inbox with a fresh pool of `max` connections (its own database when
/// `database_url` is set, else the outbox's). Returns the store and its table as reports name
/// it.
pub async fn open(
    config: &Config,
    c: &ConsumerConfig,
    max: u32,
) -> Result<(ConsumerInbox, String), CliError> {
    match backend(config, c)? {
        Backend::Postgres => {
            let (store, table) = db::inbox_store(config, c, max).await?;
            Ok((ConsumerInbox::Postgres(store), table))
        }
        Backend::MySql => {
            let (url, password) = if c.database_url.is_empty() {
                (config.database_url()?, &config.database.password)
            } else {
                (&c.database_url, &Secret::default())
            };
            let (pool, _) = crate::store::mysql_pool(config, url, password, max).await?;
            mysql_on(c, pool)
        }
    }
}

/// Consumer `c`'s MySQL inbox on `pool`.
pub fn mysql_on(
    c: &ConsumerConfig,
    pool: outbox_mysql::sqlx::MySqlPool,
) -> Result<(ConsumerInbox, String), CliError> {
    // Before anything is read or changed: a name MySQL cannot tell from another consumer's.
    outbox_mysql::check_consumer_name(&c.name).map_err(|e| {
        CliError::config(
            e.message,
            "rename the consumer in its [[consumers]] entry (no trailing space)",
        )
    })?;
    let mut builder = MySqlInboxStore::builder(pool).table(c.inbox_table.clone());
    let table = if c.inbox_schema != outbox_postgres::DEFAULT_SCHEMA {
        builder = builder.database(c.inbox_schema.clone());
        format!("{}.{}", c.inbox_schema, c.inbox_table)
    } else {
        c.inbox_table.clone()
    };
    let store = builder.build().map_err(|e| {
        CliError::config(
            format!("consumer {}: {}", c.name, e.message),
            "fix inbox_schema / inbox_table in its [[consumers]] entry",
        )
    })?;
    Ok((ConsumerInbox::MySql(store), table))
}

impl ConsumerInbox {
    /// How many registrations `consumer` has in the inbox, and the latest registration time.
    pub async fn registrations(
        &self,
        c: &ConsumerConfig,
    ) -> Result<(i64, Option<DateTime<Utc>>), StoreError> {
        match self {
            Self::Postgres(store) => {
                let t = outbox_postgres::qualified(&c.inbox_schema, &c.inbox_table);
                sqlx::query_as::<_, (i64, Option<DateTime<Utc>>)>(&format!(
                    "SELECT count(*), max(processed_at) FROM {t} WHERE consumer = $1"
                ))
                .bind(&c.name)
                .fetch_one(store.pool())
                .await
                .map_err(outbox_postgres::map_sqlx_error)
            }
            Self::MySql(store) => {
                let t = outbox_mysql::qualified(self.mysql_database(c), &c.inbox_table);
                // DATETIME(6) columns hold UTC (the store writes UTC_TIMESTAMP(6)).
                let (n, last): (i64, Option<chrono::NaiveDateTime>) = outbox_mysql::sqlx::query_as(
                    &format!("SELECT COUNT(*), MAX(processed_at) FROM {t} WHERE consumer = ?"),
                )
                .bind(&c.name)
                .fetch_one(store.pool())
                .await
                .map_err(outbox_mysql::map_sqlx_error)?;
                Ok((n, last.map(|t| t.and_utc())))
            }
        }
    }
}

impl ConsumerInbox {
    /// How many of the published events `ids` (own id, and the original's for a re-issued
    /// copy) consumer `c` registered, by either id.
    pub async fn applied_of(
        &self,
        c: &ConsumerConfig,
        ids: &[(Uuid, Option<Uuid>)],
    ) -> Result<u64, StoreError> {
        match self {
            Self::Postgres(store) => {
                let t = outbox_postgres::qualified(&c.inbox_schema, &c.inbox_table);
                let own: Vec<Uuid> = ids.iter().map(|(i, _)| *i).collect();
                let original: Vec<Uuid> = ids.iter().map(|(i, o)| o.unwrap_or(*i)).collect();
                let n: i64 = sqlx::query_scalar(&format!(
                    "SELECT count(*) FROM UNNEST($2::uuid[], $3::uuid[]) AS e(own, original) \
                     WHERE EXISTS (SELECT 1 FROM {t} i WHERE i.consumer = $1 \
                                   AND i.event_id IN (e.own, e.original))"
                ))
                .bind(&c.name)
                .bind(&own)
                .bind(&original)
                .fetch_one(store.pool())
                .await
                .map_err(outbox_postgres::map_sqlx_error)?;
                Ok(n.max(0) as u64)
            }
            Self::MySql(store) => {
                // No array parameters: the registered ones among all ids, in bounded lists.
                let wanted: Vec<Uuid> = ids
                    .iter()
                    .flat_map(|(own, original)| std::iter::once(*own).chain(*original))
                    .collect::<BTreeSet<Uuid>>()
                    .into_iter()
                    .collect();
                let t = outbox_mysql::qualified(self.mysql_database(c), &c.inbox_table);
                let mut registered = BTreeSet::new();
                for chunk in wanted.chunks(500) {
                    let marks = vec!["?"; chunk.len()].join(", ");
                    let sql = format!(
                        "SELECT event_id FROM {t} WHERE consumer = ? AND event_id IN ({marks})"
                    );
                    let mut q = outbox_mysql::sqlx::query_scalar::<_, Uuid>(&sql).bind(&c.name);
                    for id in chunk {
                        q = q.bind(*id);
                    }
                    registered.extend(
                        q.fetch_all(store.pool())
                            .await
                            .map_err(outbox_mysql::map_sqlx_error)?,
                    );
                }
                Ok(ids
                    .iter()
                    .filter(|(own, original)| {
                        registered.contains(own)
                            || original.is_some_and(|o| registered.contains(&o))
                    })
                    .count() as u64)
            }
        }
    }

    /// The database of consumer `c`'s MySQL inbox (`inbox_schema` unless the default).
    fn mysql_database<'c>(&self, c: &'c ConsumerConfig) -> Option<&'c str> {
        (c.inbox_schema != outbox_postgres::DEFAULT_SCHEMA).then_some(c.inbox_schema.as_str())
    }
}
