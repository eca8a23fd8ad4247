//! Which store a command works on, chosen once from the database URL's scheme: `mysql://` or
//! `mariadb://` is MySQL / MariaDB (`outbox-mysql`), anything else PostgreSQL. Every command
//! asks here; none matches on the URL itself.

use std::time::Duration;

use outbox_mysql::sqlx::MySqlPool;
use outbox_mysql::MySqlOutboxStore;

use crate::config::{Config, DatabaseUrl, Secret};
use crate::error::CliError;

/// The store behind the configured database URL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// PostgreSQL (`outbox-postgres`): every command.
    Postgres,
    /// MySQL / MariaDB (`outbox-mysql`): the commands that read through
    /// [`outbox_core::ReportingStore`] (`status`, `reconcile`, `replay`, `cleanup --dry-run`),
    /// the outbox cleanup, `parked` (through [`outbox_core::OperatorStore`]), the consumers'
    /// inboxes ([`crate::consumer_inbox`]), `migrate` (the outbox), the `relay` daemon and
    /// `check` (with the server's durability settings; see [`crate::mysql`]).
    MySql,
}

/// Whether `url` names a MySQL or MariaDB server.
pub fn is_mysql(url: &str) -> bool {
    let url = url.trim_start();
    url.starts_with("mysql://") || url.starts_with("mariadb://")
}

/// The backend of the configuration's database URL.
pub fn backend(config: &Config) -> Result<Backend, CliError> {
    Ok(if is_mysql(config.database_url()?.expose()) {
        Backend::MySql
    } else {
        Backend::Postgres
    })
}

/// The MySQL outbox of the configuration, with what the reports name it by.
pub struct MySqlOutbox {
    /// The store (`outbox.table`, `outbox.archive`; `outbox.schema` names the database when
    /// it is not the PostgreSQL default).
    pub store: MySqlOutboxStore,
    /// The URL, password redacted.
    pub target: String,
    /// `database.table`, or `table` in the URL's database.
    pub table: String,
}

/// A pool on the MySQL / MariaDB server of `url` (`password`, when set, replaces the URL's),
/// with the configuration's connection settings; and the URL, password redacted.
pub async fn mysql_pool(
    config: &Config,
    url: &DatabaseUrl,
    password: &Secret,
    pool_size: u32,
) -> Result<(MySqlPool, String), CliError> {
    use outbox_mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
    let target = url.redacted();
    let mut options: MySqlConnectOptions = url.expose().trim().parse().map_err(|e| {
        CliError::config(
            format!(
                "invalid MySQL URL {target}: {}",
                crate::config::redact_url(&format!("{e}"))
            ),
            "use mysql://user:password@host:port/database",
        )
    })?;
    if !password.is_empty() {
        options = options.password(password.expose());
    }
    let max = if config.database.max_connections > 0 {
        config.database.max_connections
    } else {
        pool_size
    };
    let pool = MySqlPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(
            config
                .database
                .connect_timeout
                .0
                .max(Duration::from_secs(1)),
        )
        .connect_with(options)
        .await
        .map_err(|e| {
            CliError::unreachable(
                format!(
                    "cannot connect to MySQL at {target}: {}",
                    crate::config::redact_url(&e.to_string())
                ),
                "check the database URL and that the server runs",
            )
        })?;
    Ok((pool, target))
}

/// Connects to the MySQL / MariaDB outbox of the configuration.
pub async fn connect_mysql(config: &Config, pool_size: u32) -> Result<MySqlOutbox, CliError> {
    let (pool, target) = mysql_pool(
        config,
        config.database_url()?,
        &config.database.password,
        pool_size,
    )
    .await?;
    let o = &config.outbox;
    let mut builder = MySqlOutboxStore::builder(pool)
        .table(o.table.clone())
        .archive(o.archive);
    let table = if o.schema != outbox_postgres::DEFAULT_SCHEMA {
        builder = builder.database(o.schema.clone());
        format!("{}.{}", o.schema, o.table)
    } else {
        o.table.clone()
    };
    let store = builder
        .build()
        .map_err(|e| CliError::config(e.message, "fix the [outbox] section"))?;
    // A table without any migration where other outbox tables exist is most likely a typo:
    // name those rather than let the command fail with "run `outbox migrate`".
    if let Ok(status) = store.migration_status().await {
        if status.applied == 0 {
            if let Some(e) = crate::mysql::mistyped_table(store.pool(), config).await {
                return Err(e);
            }
        }
    }
    Ok(MySqlOutbox {
        store,
        target,
        table,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheme_chooses_the_store() {
        assert!(is_mysql("mysql://root@h/db"));
        assert!(is_mysql("  mariadb://root@h/db"));
        assert!(!is_mysql("postgres://u@h/db"));
        assert!(!is_mysql("postgresql://u@h/mysql"));
    }
}
