//! MySQL / MariaDB for the commands that need more than the reporting view (`migrate`, `relay`,
//! `check`): connecting with the cause named (exit 3 unreachable, exit 2 refused credentials),
//! the store with every `[outbox]` setting, and the preflight a relay runs before it claims:
//! schema version, privileges (with the exact `GRANT` statements) and the server's durability
//! settings, judged by `outbox_mysql::judge` (the CLI adds only the statement that fixes each
//! finding).

use std::time::Duration;

use outbox_core::{ClaimMode, StoreError, StoreErrorKind};
use outbox_mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use outbox_mysql::sqlx::{self, ConnectOptions, Connection};
use outbox_mysql::{Check, DurabilityReport, Finding, MigrationStatus, MySqlOutboxStore, Severity};

use crate::config::{ClaimModeName, Config};
use crate::db::Target;
use crate::error::CliError;

/// The database of the outbox tables: `outbox.schema` when it is not the PostgreSQL default
/// (`outbox`), else `None` (the URL's database).
pub fn database(config: &Config) -> Option<String> {
    let s = &config.outbox.schema;
    (s != outbox_postgres::DEFAULT_SCHEMA).then(|| s.clone())
}

/// `database.table`, or `table` in the URL's database, for messages.
pub fn table_label(config: &Config) -> String {
    match database(config) {
        Some(d) => format!("{d}.{}", config.outbox.table),
        None => config.outbox.table.clone(),
    }
}

/// Parses the URL (with `database.password` replacing the URL's own) without printing either.
pub fn connect_options(config: &Config) -> Result<(MySqlConnectOptions, Target), CliError> {
    let url = config.database_url()?;
    let mut opts: MySqlConnectOptions = url.expose().trim().parse().map_err(|e| {
        CliError::config(
            format!(
                "invalid MySQL URL {}: {}",
                url.redacted(),
                crate::config::redact_url(&format!("{e}"))
            ),
            "use mysql://user@host:port/database (put the password in \
             OUTBOX_DATABASE__PASSWORD rather than in the URL)",
        )
    })?;
    if !config.database.password.is_empty() {
        opts = opts.password(config.database.password.expose());
    }
    // Statement logging would print bound values; the CLI logs its own summaries.
    opts = opts.log_statements(tracing::log::LevelFilter::Trace);
    let target = Target {
        host: opts.get_host().to_owned(),
        port: opts.get_port(),
        database: opts.get_database().unwrap_or("").to_owned(),
        user: opts.get_username().to_owned(),
    };
    Ok((opts, target))
}

/// Opens one connection within `database.connect_timeout` (naming host, port and cause on
/// failure), then a pool of `pool_size` connections (or `database.max_connections`).
pub async fn connect(config: &Config, pool_size: u32) -> Result<(MySqlPool, Target), CliError> {
    let (opts, target) = connect_options(config)?;
    let timeout = config.database.connect_timeout.0;
    // One direct connection first: a pool would retry until its acquire timeout and then say
    // only "pool timed out".
    match tokio::time::timeout(timeout, sqlx::MySqlConnection::connect_with(&opts)).await {
        Err(_) => {
            return Err(CliError::unreachable(
                format!(
                    "cannot connect to MySQL at {}:{} (database {:?}, user {:?}): no answer \
                     within {}",
                    target.host,
                    target.port,
                    target.database,
                    target.user,
                    humantime::format_duration(timeout)
                ),
                "check that the server runs and that host and port are right (a firewall \
                 dropping packets looks like this); raise database.connect_timeout for a slow \
                 network",
            ))
        }
        Ok(Err(e)) => return Err(connect_error(&e, &target)),
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
        }
    }
    let max = if config.database.max_connections > 0 {
        config.database.max_connections
    } else {
        pool_size
    };
    let pool = MySqlPoolOptions::new()
        .max_connections(max.max(1))
        .acquire_timeout(timeout.max(Duration::from_secs(5)))
        .connect_lazy_with(opts);
    Ok((pool, target))
}

/// MariaDB's "access denied" for an account without (or with a wrong) password.
const ACCESS_DENIED_NO_PASSWORD: u16 = 1698;

fn connect_error(e: &sqlx::Error, t: &Target) -> CliError {
    let cause = crate::config::redact_url(&e.to_string());
    let at = format!("MySQL at {}:{}", t.host, t.port);
    let number = match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|m| m.number()),
        _ => None,
    };
    let refused = match e {
        // Invalid authorization: 1045, or 1698 (no or wrong password for the account).
        sqlx::Error::Database(db) => db.code().as_deref() == Some("28000"),
        _ => false,
    };
    use outbox_mysql::codes;
    match (e, number) {
        _ if refused
            || matches!(
                number,
                Some(codes::ACCESS_DENIED | ACCESS_DENIED_NO_PASSWORD)
            ) =>
        {
            CliError::config(
                format!("{at} refused user {:?}: {cause}", t.user),
                "check the user and password (OUTBOX_DATABASE__PASSWORD) and the host the user \
                 may connect from",
            )
        }
        (_, Some(codes::BAD_DB)) => CliError::config(
            format!("{at} has no database {:?}: {cause}", t.database),
            "create the database or fix the URL's database name",
        ),
        (_, Some(codes::DBACCESS_DENIED)) => CliError::not_ready(
            format!(
                "{at}: user {:?} may not use database {:?}: {cause}",
                t.user, t.database
            ),
            "grant the user the privileges `outbox check` lists on the outbox tables",
        ),
        (sqlx::Error::Io(io), _) => CliError::unreachable(
            format!(
                "cannot connect to {at} (database {:?}): {} ({io})",
                t.database,
                match io.kind() {
                    std::io::ErrorKind::ConnectionRefused => "connection refused",
                    std::io::ErrorKind::NotFound => "host or socket not found",
                    std::io::ErrorKind::TimedOut => "timed out",
                    _ => "I/O error",
                }
            ),
            "check that MySQL / MariaDB is running and listening on that host and port",
        ),
        (sqlx::Error::Tls(_), _) => CliError::unreachable(
            format!("TLS to {at} failed: {cause}"),
            "check ssl-mode and the server's certificate",
        ),
        _ => CliError::unreachable(
            format!("cannot connect to {at}: {cause}"),
            "check the database URL and that the server runs",
        ),
    }
}

/// A pool that has not connected (nor will until used): for checks of the configuration that
/// must not touch the network.
pub fn lazy_pool(config: &Config) -> Result<MySqlPool, CliError> {
    let (opts, _) = connect_options(config)?;
    Ok(MySqlPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(opts))
}

/// The outbox store of the configuration, with every `[outbox]` setting the relay uses (claim
/// mode and lease, `locked_max_hold`, `gap_timeout`, `accept_first_version`, `archive`).
pub fn outbox_store(config: &Config, pool: MySqlPool) -> Result<MySqlOutboxStore, CliError> {
    let o = &config.outbox;
    let mode = match o.claim_mode {
        ClaimModeName::Lease => ClaimMode::lease(o.lease.0).map_err(|e| {
            CliError::config(format!("outbox.lease: {}", e.0), "use a lease of 1 s..=1 h")
        })?,
        ClaimModeName::Locked => ClaimMode::LockedTransaction,
    };
    let mut builder = MySqlOutboxStore::builder(pool)
        .table(o.table.clone())
        .claim_mode(mode)
        .locked_max_hold(o.locked_max_hold.0)
        .gap_timeout(o.gap_timeout.0)
        .accept_first_version(o.accept_first_version)
        .archive(o.archive);
    if let Some(d) = database(config) {
        builder = builder.database(d);
    }
    builder
        .build()
        .map_err(|e| CliError::config(e.message, "fix the [outbox] section"))
}

/// The privileges the relay (and every command that runs [`preflight`]) needs on one table of
/// a MySQL outbox, by table suffix.
const TABLE_PRIVILEGES: &[(&str, &[&str])] = &[
    ("", &["SELECT", "INSERT", "UPDATE", "DELETE"]),
    ("_aggregate", &["SELECT", "INSERT", "UPDATE", "DELETE"]),
    ("_audit", &["SELECT", "INSERT"]),
    ("_lease", &["SELECT", "INSERT", "DELETE"]),
    // The relay registry: each worker registers, heartbeats and deregisters.
    ("_relays", &["SELECT", "INSERT", "UPDATE", "DELETE"]),
];

/// The tables of the outbox with the privileges needed on each (the archive when the
/// scheduled cleanup archives).
fn needed(config: &Config) -> Vec<(String, Vec<&'static str>)> {
    let o = &config.outbox;
    let mut tables = vec![("outbox_schema_migrations".to_owned(), vec!["SELECT"])];
    for (suffix, p) in TABLE_PRIVILEGES {
        tables.push((format!("{}{suffix}", o.table), p.to_vec()));
    }
    if o.archive && config.cleanup.enabled {
        tables.push((format!("{}_archive", o.table), vec!["SELECT", "INSERT"]));
    }
    tables
}

/// What the connected user lacks on the outbox's tables, as `(table, privileges)`, read from
/// `information_schema` (global, database and table grants of `CURRENT_USER()`; a database
/// grant with wildcards matches as the server matches it), and the session's active role if
/// any: `information_schema` does not show what a role grants.
#[allow(clippy::type_complexity)]
async fn missing_privileges(
    pool: &MySqlPool,
    config: &Config,
) -> Result<
    (
        String,
        String,
        Option<String>,
        Vec<(String, Vec<&'static str>)>,
    ),
    sqlx::Error,
> {
    let (user, host, current_db, role): (String, String, Option<String>, Option<String>) =
        sqlx::query_as(
            "SELECT SUBSTRING_INDEX(CURRENT_USER(), '@', 1), \
                    SUBSTRING_INDEX(CURRENT_USER(), '@', -1), DATABASE(), CURRENT_ROLE()",
        )
        .fetch_one(pool)
        .await?;
    // MariaDB says NULL without a role, MySQL 8 `NONE`.
    let role = role.filter(|r| !r.is_empty() && r != "NONE");
    let db = database(config).or(current_db).unwrap_or_default();
    let grantee = format!(
        "'{}'@'{}'",
        user.replace('\'', "''"),
        host.replace('\'', "''")
    );
    let mut missing = Vec::new();
    for (table, privileges) in needed(config) {
        let mut lacking = Vec::new();
        for p in privileges {
            let held: i64 = sqlx::query_scalar(
                "SELECT (EXISTS (SELECT 1 FROM information_schema.USER_PRIVILEGES \
                                 WHERE GRANTEE = ? AND PRIVILEGE_TYPE = ?) \
                      OR EXISTS (SELECT 1 FROM information_schema.SCHEMA_PRIVILEGES \
                                 WHERE GRANTEE = ? AND ? LIKE TABLE_SCHEMA AND PRIVILEGE_TYPE = ?) \
                      OR EXISTS (SELECT 1 FROM information_schema.TABLE_PRIVILEGES \
                                 WHERE GRANTEE = ? AND TABLE_SCHEMA = ? AND TABLE_NAME = ? \
                                   AND PRIVILEGE_TYPE = ?)) AS held",
            )
            .bind(&grantee)
            .bind(p)
            .bind(&grantee)
            .bind(&db)
            .bind(p)
            .bind(&grantee)
            .bind(&db)
            .bind(&table)
            .bind(p)
            .fetch_one(pool)
            .await?;
            if held == 0 {
                lacking.push(p);
            }
        }
        if !lacking.is_empty() {
            missing.push((format!("`{db}`.`{table}`"), lacking));
        }
    }
    Ok((user, host, role, missing))
}

/// The error for a user that lacks privileges on the outbox, with the exact statements to run
/// (for its database, tables and account), or `None` when it lacks none. With a role active
/// the privileges may come through it, which `information_schema` does not show: then the
/// statements are logged as a warning and `None` is returned (a privilege that is really
/// missing stops the relay at its first use, exit 4, with the statements).
pub async fn privilege_error(
    pool: &MySqlPool,
    config: &Config,
) -> Result<Option<CliError>, CliError> {
    let table = table_label(config);
    let (user, host, role, missing) = missing_privileges(pool, config)
        .await
        .map_err(|e| store_error(&outbox_mysql::map_sqlx_error(e), &table))?;
    if missing.is_empty() {
        return Ok(None);
    }
    let account = format!(
        "'{}'@'{}'",
        user.replace('\'', "''"),
        host.replace('\'', "''")
    );
    let listed: Vec<String> = missing
        .iter()
        .map(|(t, p)| format!("{} ON {t}", p.join(", ")))
        .collect();
    let grants: Vec<String> = missing
        .iter()
        .map(|(t, p)| format!("    GRANT {} ON {t} TO {account};", p.join(", ")))
        .collect();
    if let Some(role) = role {
        tracing::warn!(
            "user {account} has role {role:?} active, whose privileges information_schema does \
             not show; not granted to the user directly: {}. If the role lacks them too, run:\n{}",
            listed.join("; "),
            grants.join("\n")
        );
        return Ok(None);
    }
    Ok(Some(CliError::not_ready(
        format!(
            "user {account} lacks privileges on the outbox: {}",
            listed.join("; ")
        ),
        format!(
            "run as a user with the GRANT OPTION on these tables (or root):\n{}",
            grants.join("\n")
        ),
    )))
}

/// A store error of the MySQL outbox `what` with its fix (the PostgreSQL wording of
/// [`CliError::from_store`], with MySQL's hints where they differ).
pub fn store_error(err: &StoreError, what: &str) -> CliError {
    match err.kind {
        StoreErrorKind::Connection => CliError::unreachable(
            format!("database connection failed: {}", err.message),
            "check that MySQL / MariaDB is running and reachable from here",
        ),
        _ => CliError::from_store(err, what),
    }
}

/// The error for a schema that is not at the version this CLI's `outbox-mysql` brings, naming
/// the pending migrations; `None` when it is up to date.
pub fn schema_error(status: &MigrationStatus, table: &str) -> Option<CliError> {
    if status.up_to_date() {
        return None;
    }
    let pending: Vec<String> = status
        .pending
        .iter()
        .map(|(v, what)| format!("{v} ({what})"))
        .collect();
    let message = if status.applied == 0 {
        format!(
            "the outbox table {table} does not exist (no migration applied; pending: {})",
            pending.join(", ")
        )
    } else {
        format!(
            "the outbox table {table} is at schema version {}, this outbox needs {} (pending: \
             {})",
            status.applied,
            status.expected,
            pending.join(", ")
        )
    };
    Some(CliError::not_ready(
        message,
        "run `outbox migrate` (with the same database URL and [outbox] schema and table), or \
         apply outbox_mysql::outbox_schema_sql with your migration tool",
    ))
}

/// Checks that the outbox tables exist at the version this CLI expects and that the connected
/// user may read and write them; returns the migration status. A missing privilege is
/// reported with the exact `GRANT` statements (exit 4), as a missing or outdated schema is
/// (exit 4, `outbox migrate`).
pub async fn preflight(
    pool: &MySqlPool,
    store: &MySqlOutboxStore,
    config: &Config,
) -> Result<MigrationStatus, CliError> {
    let table = table_label(config);
    let status = match store.migration_status().await {
        Ok(s) => s,
        Err(e) if crate::error::is_privilege(&e) => {
            return Err(privilege_error(pool, config)
                .await?
                .unwrap_or_else(|| store_error(&e, &table)))
        }
        Err(e) => return Err(store_error(&e, &table)),
    };
    if status.applied == 0 {
        if let Some(e) = mistyped_table(pool, config).await {
            return Err(e);
        }
    }
    if let Some(e) = schema_error(&status, &table) {
        return Err(e);
    }
    if let Some(e) = privilege_error(pool, config).await? {
        return Err(e);
    }
    Ok(status)
}

/// The outbox tables in the outbox's database (`outbox.schema`, else the URL's) other than
/// the configured one: logged by a migration and present. Empty when the log cannot be read.
pub async fn other_outboxes(pool: &MySqlPool, config: &Config) -> Vec<String> {
    let database = database(config);
    let log = outbox_mysql::qualified(database.as_deref(), "outbox_schema_migrations");
    // The log is utf8mb4_bin (reported as binary) and information_schema has a collation of
    // its own: the names are read as text and looked up one by one.
    let logged = sqlx::query_scalar::<_, String>(&format!(
        "SELECT DISTINCT CAST(SUBSTRING(object, 8) AS CHAR CHARACTER SET utf8mb4) FROM {log} \
         WHERE object LIKE 'outbox:%' AND object <> ?"
    ))
    .bind(format!("outbox:{}", config.outbox.table))
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    let mut present = Vec::new();
    for name in logged {
        let exists: Option<i64> = sqlx::query_scalar(
            "SELECT 1 FROM information_schema.tables \
             WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ?",
        )
        .bind(database.as_deref())
        .bind(&name)
        .fetch_optional(pool)
        .await
        .ok()
        .flatten();
        if exists.is_some() {
            present.push(name);
        }
    }
    present
}

/// For an outbox table that has no migration applied: the error naming the outbox tables
/// that do exist beside it ([`crate::suggest`]), or `None` when there are none (then
/// `outbox migrate` is the fix).
pub async fn mistyped_table(pool: &MySqlPool, config: &Config) -> Option<CliError> {
    let others = other_outboxes(pool, config).await;
    if others.is_empty() {
        return None;
    }
    let place = match database(config) {
        Some(d) => format!("database {d:?}"),
        None => "the URL's database".to_owned(),
    };
    Some(crate::suggest::missing_table(
        &place,
        &config.outbox.table,
        others,
    ))
}

/// The statement that fixes a durability finding (server settings are global: they go in the
/// server's configuration file too, or a restart undoes them).
pub fn durability_fix(finding: &Finding) -> Option<String> {
    let persist = "and the same under [mysqld] in the server's configuration file (my.cnf), so \
                   a restart keeps it";
    Some(match finding.check {
        Check::FlushAtCommit => {
            format!("SET GLOBAL innodb_flush_log_at_trx_commit = 1; {persist}")
        }
        Check::SyncBinlog => format!("SET GLOBAL sync_binlog = 1; {persist}"),
        Check::BinlogFormat => format!("SET GLOBAL binlog_format = 'ROW'; {persist}"),
        Check::StorageEngine => "ALTER TABLE <the table named> ENGINE = InnoDB;".to_owned(),
        Check::ServerVersion => "upgrade to MySQL 8.0.13+ or MariaDB 10.6+".to_owned(),
        Check::LockWaitTimeout => {
            format!("SET GLOBAL innodb_lock_wait_timeout = 50; {persist}")
        }
        _ => return None,
    })
}

/// The relay's decision on a durability report: refused (exit 4, each refusal with its fix)
/// when a promise of the outbox would not hold; `Ok` with the warnings to log otherwise.
pub fn durability_decision(report: &DurabilityReport) -> Result<Vec<String>, CliError> {
    let line = |f: &Finding| match durability_fix(f) {
        Some(fix) => format!("{} ({}); fix: {fix}", f.message, f.check.as_str()),
        None => format!("{} ({})", f.message, f.check.as_str()),
    };
    let refusals: Vec<String> = report
        .findings
        .iter()
        .filter(|f| f.severity == Severity::Refuse)
        .map(line)
        .collect();
    if !refusals.is_empty() {
        return Err(CliError::not_ready(
            format!(
                "the {} server {} does not keep the outbox's promises: {}",
                flavor(report),
                report.version,
                refusals.join("; ")
            ),
            "apply the fix named for each setting (or ask the server's administrator to), then \
             start again; `outbox check` lists every setting it reads",
        ));
    }
    Ok(report
        .findings
        .iter()
        .filter(|f| f.severity == Severity::Warn)
        .map(line)
        .collect())
}

fn flavor(report: &DurabilityReport) -> &'static str {
    match report.flavor {
        outbox_mysql::Flavor::MariaDb => "MariaDB",
        _ => "MySQL",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_mysql::{judge, ServerSettings};

    fn safe() -> ServerSettings {
        ServerSettings {
            version: "10.11.6-MariaDB".into(),
            flush_at_commit: 1,
            log_bin: true,
            binlog_format: "ROW".into(),
            sync_binlog: 1,
            lock_wait_timeout: 50,
            isolation: "REPEATABLE-READ".into(),
            non_innodb_tables: Vec::new(),
        }
    }

    /// Each unsafe setting the server could have (never set on the shared server: the
    /// decision is a function of what was read): refused with the statement that fixes it,
    /// or started with a warning naming it.
    #[test]
    fn the_relay_refuses_an_unsafe_server_with_the_fix() {
        assert_eq!(
            durability_decision(&judge(&safe())).unwrap(),
            Vec::<String>::new()
        );
        type Case = (&'static str, fn(&mut ServerSettings), &'static str);
        let refused: &[Case] = &[
            (
                "flush 2",
                |s| s.flush_at_commit = 2,
                "SET GLOBAL innodb_flush_log_at_trx_commit = 1",
            ),
            (
                "statement binlog",
                |s| s.binlog_format = "STATEMENT".into(),
                "SET GLOBAL binlog_format = 'ROW'",
            ),
            (
                "MyISAM",
                |s| s.non_innodb_tables = vec![("outbox_events".into(), "MyISAM".into())],
                "ENGINE = InnoDB",
            ),
            (
                "old server",
                |s| s.version = "10.5.1-MariaDB".into(),
                "MariaDB 10.6+",
            ),
        ];
        for (name, change, fix) in refused {
            let mut s = safe();
            change(&mut s);
            let e = durability_decision(&judge(&s)).expect_err(name);
            assert_eq!(e.exit_code(), 4, "{name}");
            assert!(e.message.contains(fix), "{name}: {e}");
        }
        let mut s = safe();
        s.sync_binlog = 0;
        let warnings = durability_decision(&judge(&s)).expect("a warning starts");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("SET GLOBAL sync_binlog = 1"),
            "{warnings:?}"
        );
    }
}
