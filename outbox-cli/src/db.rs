//! Connecting to PostgreSQL: fail fast with host, port and cause, and the preflight check that
//! tells "run `outbox migrate`" or "grant ..." apart from a transient failure.

use std::str::FromStr;
use std::time::Duration;

use outbox_core::ClaimMode;
use outbox_postgres::{qualified, PostgresInboxStore, PostgresOutboxStore};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

use crate::config::{ClaimModeName, Config, ConsumerConfig, DatabaseUrl, Secret};
use crate::error::CliError;

/// The latest outbox migration of `outbox-postgres` this CLI knows.
pub const OUTBOX_SCHEMA_VERSION: i32 = 4;

/// Where a database is, for messages (never the password).
#[derive(Clone, Debug)]
pub struct Target {
    /// Host (or socket directory).
    pub host: String,
    /// Port.
    pub port: u16,
    /// Database name.
    pub database: String,
    /// User.
    pub user: String,
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}@{}:{}/{}",
            self.user, self.host, self.port, self.database
        )
    }
}

/// Parses the URL (with `password` replacing the URL's own) without printing either.
pub fn connect_options(
    url: &DatabaseUrl,
    password: &Secret,
) -> Result<(PgConnectOptions, Target), CliError> {
    let mut opts = PgConnectOptions::from_str(url.expose()).map_err(|e| {
        CliError::config(
            format!(
                "database URL {} is not valid: {}",
                url.redacted(),
                crate::config::redact_url(&e.to_string())
            ),
            "use postgres://user@host:port/database (put the password in \
             OUTBOX_DATABASE__PASSWORD rather than in the URL)",
        )
    })?;
    if !password.is_empty() {
        opts = opts.password(password.expose());
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

/// Opens one connection within `timeout` (naming host, port and cause on failure), then a pool
/// of `max` connections.
pub async fn connect(
    url: &DatabaseUrl,
    password: &Secret,
    timeout: Duration,
    max: u32,
) -> Result<(PgPool, Target), CliError> {
    let (opts, target) = connect_options(url, password)?;
    // One direct connection first: a pool would retry until its acquire timeout and then say
    // only "pool timed out".
    match tokio::time::timeout(timeout, sqlx::PgConnection::connect_with(&opts)).await {
        Err(_) => {
            return Err(CliError::unreachable(
                format!(
                    "cannot connect to PostgreSQL at {}:{} (database {:?}, user {:?}): no \
                     answer within {}",
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
    let pool = PgPoolOptions::new()
        .max_connections(max.max(1))
        .acquire_timeout(timeout.max(Duration::from_secs(5)))
        .connect_lazy_with(opts);
    Ok((pool, target))
}

fn connect_error(e: &sqlx::Error, t: &Target) -> CliError {
    let cause = crate::config::redact_url(&e.to_string());
    let at = format!("PostgreSQL at {}:{}", t.host, t.port);
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            match code.as_str() {
                "28P01" | "28000" => CliError::config(
                    format!("{at} refused user {:?}: {cause}", t.user),
                    "check the user and password (OUTBOX_DATABASE__PASSWORD) and pg_hba.conf",
                ),
                "3D000" => CliError::config(
                    format!("{at} has no database {:?}: {cause}", t.database),
                    "create the database or fix the URL's database name",
                ),
                _ => CliError::unreachable(
                    format!("cannot connect to {at}: {cause}"),
                    "check the server's log",
                ),
            }
        }
        sqlx::Error::Io(io) => CliError::unreachable(
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
            "check that PostgreSQL is running and listening on that host and port",
        ),
        sqlx::Error::Tls(_) => CliError::unreachable(
            format!("TLS to {at} failed: {cause}"),
            "check sslmode and the server's certificate",
        ),
        _ => CliError::unreachable(
            format!("cannot connect to {at}: {cause}"),
            "check the database URL and that the server runs",
        ),
    }
}

/// Connects to the outbox's database, pool sized for `workers` relay loops.
pub async fn connect_outbox(config: &Config, pool_size: u32) -> Result<(PgPool, Target), CliError> {
    let url = config.database_url()?;
    let max = if config.database.max_connections > 0 {
        config.database.max_connections
    } else {
        pool_size
    };
    connect(
        url,
        &config.database.password,
        config.database.connect_timeout.0,
        max,
    )
    .await
}

/// A pool of the outbox's database that has not connected yet (nor will until used): for
/// checks of the configuration that must not touch the network.
pub fn lazy_outbox_pool(config: &Config) -> Result<PgPool, CliError> {
    let url = config.database_url()?;
    let (opts, _) = connect_options(url, &config.database.password)?;
    Ok(PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(opts))
}

/// The outbox store of the configuration.
pub fn outbox_store(config: &Config, pool: PgPool) -> Result<PostgresOutboxStore, CliError> {
    let o = &config.outbox;
    let mode = match o.claim_mode {
        ClaimModeName::Lease => ClaimMode::lease(o.lease.0).map_err(|e| {
            CliError::config(format!("outbox.lease: {}", e.0), "use a lease of 1 s..=1 h")
        })?,
        ClaimModeName::Locked => ClaimMode::LockedTransaction,
    };
    PostgresOutboxStore::builder(pool)
        .schema(o.schema.clone())
        .table(o.table.clone())
        .claim_mode(mode)
        .locked_max_hold(o.locked_max_hold.0)
        .gap_timeout(o.gap_timeout.0)
        .accept_first_version(o.accept_first_version)
        .archive(o.archive)
        .build()
        .map_err(|e| CliError::config(e.message, "fix the [outbox] section"))
}

/// What the preflight found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// Tables present at the expected version, privileges in place.
    Ready,
    /// Not ready; the error says why and what to do.
    NotReady(String),
}

/// Checks that the outbox tables exist at the version this CLI expects and that the current
/// role may read and write them. A failure is a permanent configuration problem
/// ([`CliError::not_ready`]) with the fix (for privileges, the exact `GRANT` statements); a
/// connection failure is [`CliError::unreachable`].
pub async fn preflight(pool: &PgPool, config: &Config) -> Result<(), CliError> {
    let o = &config.outbox;
    let table = qualified(&o.schema, &o.table);
    let map = |e: sqlx::Error| CliError::from_store(&outbox_postgres::map_sqlx_error(e), &table);
    let migrate = || {
        CliError::not_ready(
            format!("the outbox table {table} does not exist"),
            format!(
                "run `outbox migrate` (schema {:?}, table {:?}), or apply \
                 outbox_postgres::outbox_schema_sql with your migration tool",
                o.schema, o.table
            ),
        )
    };
    // From the catalogs, which a role without any privilege on the schema may read.
    let migrations_exist: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = 'outbox_schema_migrations')",
    )
    .bind(&o.schema)
    .fetch_one(pool)
    .await
    .map_err(map)?;
    if !migrations_exist {
        return Err(migrate());
    }
    let others = other_outboxes(pool, &o.schema, &o.table)
        .await
        .map_err(map)?;
    if let Some(e) = privilege_error(pool, config).await? {
        return Err(e);
    }
    let migrations = qualified(&o.schema, "outbox_schema_migrations");
    let version: Option<i32> = sqlx::query_scalar(&format!(
        "SELECT max(version) FROM {migrations} WHERE object = $1"
    ))
    .bind(format!("outbox:{}", o.table))
    .fetch_one(pool)
    .await
    .map_err(map)?;
    match version {
        None if !others.is_empty() => Err(crate::suggest::missing_table(
            &format!("schema {:?}", o.schema),
            &o.table,
            others,
        )),
        None => Err(migrate()),
        Some(v) if v < OUTBOX_SCHEMA_VERSION => Err(CliError::not_ready(
            format!(
                "the outbox table {table} is at schema version {v}, this outbox needs \
                 {OUTBOX_SCHEMA_VERSION}"
            ),
            "run `outbox migrate` to apply the missing migrations",
        )),
        Some(_) => Ok(()),
    }
}

/// The outbox tables of `schema` other than `table`: logged by a migration and present.
/// Read before the privilege check (a mistyped table would otherwise be reported as a
/// missing grant on it), from the log, which `outbox migrate` creates readable by the owner;
/// a role that may not read it sees none.
async fn other_outboxes(
    pool: &PgPool,
    schema: &str,
    table: &str,
) -> Result<Vec<String>, sqlx::Error> {
    let log = qualified(schema, "outbox_schema_migrations");
    let rows = sqlx::query_scalar::<_, String>(&format!(
        "SELECT DISTINCT substr(m.object, 8) FROM {log} m \
         WHERE m.object LIKE 'outbox:%' AND m.object <> $2 AND EXISTS ( \
           SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
           WHERE n.nspname = $1 AND c.relname = substr(m.object, 8) AND c.relkind IN ('r', 'p'))"
    ))
    .bind(schema)
    .bind(format!("outbox:{table}"))
    .fetch_all(pool)
    .await;
    match rows {
        Ok(r) => Ok(r),
        // No privilege on the log: the privilege check below says what to grant.
        Err(sqlx::Error::Database(d)) if d.code().as_deref() == Some("42501") => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// The privileges the relay (and every command that runs [`preflight`]) needs on one table of
/// the outbox, by table suffix.
const TABLE_PRIVILEGES: &[(&str, &[&str])] = &[
    ("", &["SELECT", "INSERT", "UPDATE", "DELETE"]),
    ("_aggregate", &["SELECT", "INSERT", "UPDATE", "DELETE"]),
    ("_audit", &["SELECT", "INSERT"]),
    // Topic facts recorded at each start (partition counts, partitioner).
    ("_topics", &["SELECT", "INSERT", "UPDATE"]),
    // Conflicts counted by the application, read for the metrics.
    ("_conflicts", &["SELECT"]),
    // The relay registry: each worker registers, heartbeats and deregisters.
    ("_relays", &["SELECT", "INSERT", "UPDATE", "DELETE"]),
];

/// What the role lacks on the outbox's schema and tables, as `(object, privileges)`; tables
/// that do not exist (yet) are left to the schema check. Reads only the catalogs, which needs
/// no privilege on the schema itself.
async fn missing_privileges(
    pool: &PgPool,
    config: &Config,
) -> Result<Vec<(String, Vec<&'static str>)>, sqlx::Error> {
    let o = &config.outbox;
    let mut missing = Vec::new();
    let usage: Option<bool> = sqlx::query_scalar(
        "SELECT has_schema_privilege(current_user, oid, 'USAGE') FROM pg_namespace WHERE nspname = $1",
    )
    .bind(&o.schema)
    .fetch_optional(pool)
    .await?;
    if usage == Some(false) {
        missing.push((
            format!("SCHEMA {}", outbox_postgres::quote_identifier(&o.schema)),
            vec!["USAGE"],
        ));
    }
    let mut tables: Vec<(String, Vec<&'static str>)> =
        vec![("outbox_schema_migrations".to_owned(), vec!["SELECT"])];
    for (suffix, privileges) in TABLE_PRIVILEGES {
        tables.push((format!("{}{suffix}", o.table), privileges.to_vec()));
    }
    if o.archive && config.cleanup.enabled {
        tables.push((format!("{}_archive", o.table), vec!["SELECT", "INSERT"]));
    }
    for (table, privileges) in tables {
        let mut lacking = Vec::new();
        for p in privileges {
            let ok: Option<bool> = sqlx::query_scalar(
                "SELECT has_table_privilege(current_user, c.oid, $3) FROM pg_class c \
                 JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relname = $2",
            )
            .bind(&o.schema)
            .bind(&table)
            .bind(p)
            .fetch_optional(pool)
            .await?
            .flatten();
            if ok == Some(false) {
                lacking.push(p);
            }
        }
        if !lacking.is_empty() {
            missing.push((outbox_postgres::qualified(&o.schema, &table), lacking));
        }
    }
    Ok(missing)
}

/// The error for a role that lacks privileges on the outbox, with the exact statements to run
/// (for its schema, tables and name), or `None` when it lacks none.
pub async fn privilege_error(pool: &PgPool, config: &Config) -> Result<Option<CliError>, CliError> {
    let o = &config.outbox;
    let table = qualified(&o.schema, &o.table);
    let map = |e: sqlx::Error| CliError::from_store(&outbox_postgres::map_sqlx_error(e), &table);
    let missing = missing_privileges(pool, config).await.map_err(map)?;
    if missing.is_empty() {
        return Ok(None);
    }
    let user: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(pool)
        .await
        .map_err(map)?;
    // Quoted for copying (a role's name need not be a plain identifier).
    let role = format!("\"{}\"", user.replace('"', "\"\""));
    let listed: Vec<String> = missing
        .iter()
        .map(|(t, p)| format!("{} ON {t}", p.join(", ")))
        .collect();
    let grants: Vec<String> = missing
        .iter()
        .map(|(t, p)| format!("    GRANT {} ON {t} TO {role};", p.join(", ")))
        .collect();
    Ok(Some(CliError::not_ready(
        format!(
            "role {user:?} lacks privileges on the outbox: {}",
            listed.join("; ")
        ),
        format!(
            "run as the owner of the tables (or a superuser):\n{}",
            grants.join("\n")
        ),
    )))
}

/// The `[[consumers]]` entry named `name`, or a usage error naming the configured ones.
pub fn consumer<'a>(config: &'a Config, name: &str) -> Result<&'a ConsumerConfig, CliError> {
    config
        .consumers
        .iter()
        .find(|c| c.name == name)
        .ok_or_else(|| {
            let known: Vec<&str> = config.consumers.iter().map(|c| c.name.as_str()).collect();
            CliError::config(
                format!(
                    "no consumer {name:?} in the configuration (configured: {})",
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                ),
                "add a [[consumers]] entry with name, inbox_schema and inbox_table (and \
                 database_url when its inbox is in another database), or fix --consumer",
            )
        })
}

/// The inbox store of consumer `c` with a fresh pool of `max` connections: its own database
/// when `database_url` is set, else the outbox's. Returns the store and its qualified table.
pub async fn inbox_store(
    config: &Config,
    c: &ConsumerConfig,
    max: u32,
) -> Result<(PostgresInboxStore, String), CliError> {
    let pool = if c.database_url.is_empty() {
        connect_outbox(config, max).await?.0
    } else {
        connect(
            &c.database_url,
            &Secret::default(),
            config.database.connect_timeout.0,
            max,
        )
        .await?
        .0
    };
    inbox_store_on(c, pool)
}

/// The inbox store of consumer `c` on `pool`.
pub fn inbox_store_on(
    c: &ConsumerConfig,
    pool: PgPool,
) -> Result<(PostgresInboxStore, String), CliError> {
    let store = PostgresInboxStore::builder(pool)
        .schema(c.inbox_schema.clone())
        .table(c.inbox_table.clone())
        .build()
        .map_err(|e| {
            CliError::config(
                format!("consumer {}: {}", c.name, e.message),
                "fix inbox_schema / inbox_table in its [[consumers]] entry",
            )
        })?;
    Ok((store, format!("{}.{}", c.inbox_schema, c.inbox_table)))
}

/// Maps a store error of consumer `c`'s inbox to an error with a fix: a missing table says
/// `outbox migrate --inbox`.
pub fn inbox_error(err: &outbox_core::StoreError, c: &ConsumerConfig, table: &str) -> CliError {
    if err.kind == outbox_core::StoreErrorKind::Schema {
        return CliError::not_ready(
            format!(
                "the inbox of consumer {} is missing or out of date ({table}): {}",
                c.name, err.message
            ),
            "run `outbox migrate --inbox` (with the same [[consumers]] inbox_schema and \
             inbox_table)",
        );
    }
    CliError::from_store(err, table)
}
