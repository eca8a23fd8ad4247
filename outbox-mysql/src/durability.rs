//! The start-up check: what the server must guarantee for the outbox's promises to hold, read
//! from the server and reported as typed findings. A relay or `outbox check` refuses to start
//! on a [`Severity::Refuse`] finding and reports the warnings.
//!
//! PostgreSQL lets a store make each transaction durable (`synchronous_commit = on`); InnoDB's
//! flush policy is server-wide (`innodb_flush_log_at_trx_commit`), so the store cannot enforce
//! it per transaction and checks it instead.

use sqlx::{MySqlPool, Row};

use outbox_core::StoreError;

use crate::error::db;

/// How serious a finding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Severity {
    /// For information (what was checked and found in order).
    Info,
    /// The outbox works, with a weaker guarantee than the crate documents: start, and say so.
    Warn,
    /// A promise of the outbox would not hold (events could be lost, or claims would fail):
    /// do not start.
    Refuse,
}

/// What a finding is about (stable names for logs and `outbox check`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Check {
    /// The server: MySQL 8.0.13+ or MariaDB 10.6+ (`SKIP LOCKED`, CHECK constraints,
    /// generated columns).
    ServerVersion,
    /// `innodb_flush_log_at_trx_commit = 1`: every commit is on disk when it returns.
    FlushAtCommit,
    /// Binary logging with `binlog_format = STATEMENT` refuses READ COMMITTED writes to InnoDB.
    BinlogFormat,
    /// `sync_binlog = 1` when the binary log is on (a crash must not lose committed events from
    /// the log that replicas and point-in-time recovery read).
    SyncBinlog,
    /// The store's tables use InnoDB (row locks, crash recovery).
    StorageEngine,
    /// `innodb_lock_wait_timeout`: how long a completion or operator action waits for a locked
    /// aggregate (a locked claim holds it for a whole publication).
    LockWaitTimeout,
    /// The server's default isolation level (informational: the store sets READ COMMITTED on
    /// each of its transactions).
    Isolation,
}

impl Check {
    /// Stable name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::ServerVersion => "server_version",
            Self::FlushAtCommit => "innodb_flush_log_at_trx_commit",
            Self::BinlogFormat => "binlog_format",
            Self::SyncBinlog => "sync_binlog",
            Self::StorageEngine => "storage_engine",
            Self::LockWaitTimeout => "innodb_lock_wait_timeout",
            Self::Isolation => "isolation",
        }
    }
}

/// One finding of [`check_durability`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Finding {
    /// What was checked.
    pub check: Check,
    /// How serious.
    pub severity: Severity,
    /// What was found and what to do.
    pub message: String,
}

/// Which server answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Flavor {
    /// Oracle MySQL (or Percona).
    MySql,
    /// MariaDB.
    MariaDb,
}

/// The report of [`check_durability`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DurabilityReport {
    /// MySQL or MariaDB.
    pub flavor: Flavor,
    /// `SELECT VERSION()`.
    pub version: String,
    /// Every finding, refusals first.
    pub findings: Vec<Finding>,
}

impl DurabilityReport {
    /// `true` when a finding says not to start.
    pub fn refused(&self) -> bool {
        self.findings.iter().any(|f| f.severity == Severity::Refuse)
    }

    /// The findings of at least `severity`.
    pub fn at_least(&self, severity: Severity) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(move |f| f.severity >= severity)
    }
}

/// What the checks read from the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerSettings {
    /// `VERSION()`.
    pub version: String,
    /// `@@innodb_flush_log_at_trx_commit`.
    pub flush_at_commit: i64,
    /// `@@log_bin` (1: on).
    pub log_bin: bool,
    /// `@@binlog_format`.
    pub binlog_format: String,
    /// `@@sync_binlog`.
    pub sync_binlog: i64,
    /// `@@innodb_lock_wait_timeout` (seconds).
    pub lock_wait_timeout: i64,
    /// The server's default isolation (`@@tx_isolation` or `@@transaction_isolation`).
    pub isolation: String,
    /// Engines of the store's tables that are not InnoDB: (table, engine).
    pub non_innodb_tables: Vec<(String, String)>,
}

/// Reads the settings of the server behind `pool` and judges them ([`judge`]). `database`
/// and `tables`: the store's tables to check the engine of (unqualified names; `None`: the
/// connection's database).
pub async fn check_durability(
    pool: &MySqlPool,
    database: Option<&str>,
    tables: &[&str],
) -> Result<DurabilityReport, StoreError> {
    let row = sqlx::query(
        "SELECT VERSION() AS version, \
                CAST(@@innodb_flush_log_at_trx_commit AS SIGNED) AS flush, \
                CAST(@@log_bin AS SIGNED) AS log_bin, \
                CAST(@@binlog_format AS CHAR) AS binlog_format, \
                CAST(@@sync_binlog AS SIGNED) AS sync_binlog, \
                CAST(@@innodb_lock_wait_timeout AS SIGNED) AS lock_wait",
    )
    .fetch_one(pool)
    .await
    .map_err(db)?;
    // MariaDB names it tx_isolation (transaction_isolation from 11.1), MySQL 8
    // transaction_isolation.
    let isolation: String =
        match sqlx::query_scalar::<_, String>("SELECT CAST(@@transaction_isolation AS CHAR)")
            .fetch_one(pool)
            .await
        {
            Ok(v) => v,
            Err(_) => sqlx::query_scalar("SELECT CAST(@@tx_isolation AS CHAR)")
                .fetch_one(pool)
                .await
                .map_err(db)?,
        };
    let mut non_innodb = Vec::new();
    if !tables.is_empty() {
        let marks = vec!["?"; tables.len()].join(", ");
        let sql = format!(
            "SELECT TABLE_NAME, COALESCE(ENGINE, '') FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME IN ({marks}) \
               AND COALESCE(ENGINE, '') <> 'InnoDB'"
        );
        let mut q = sqlx::query_as::<_, (String, String)>(&sql).bind(database);
        for t in tables {
            q = q.bind(*t);
        }
        non_innodb = q.fetch_all(pool).await.map_err(db)?;
    }
    let settings = ServerSettings {
        version: row.try_get("version").map_err(db)?,
        flush_at_commit: row.try_get("flush").map_err(db)?,
        log_bin: row.try_get::<i64, _>("log_bin").map_err(db)? != 0,
        binlog_format: row
            .try_get::<Option<String>, _>("binlog_format")
            .map_err(db)?
            .unwrap_or_default(),
        sync_binlog: row.try_get("sync_binlog").map_err(db)?,
        lock_wait_timeout: row.try_get("lock_wait").map_err(db)?,
        isolation,
        non_innodb_tables: non_innodb,
    };
    Ok(judge(&settings))
}

/// `(major, minor, patch)` of a version string such as `10.11.19-MariaDB-0+deb12u1`.
fn parse_version(v: &str) -> Option<(u32, u32, u32)> {
    let core = v.split(['-', '+', ' ']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u32>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

/// Judges server settings (pure: the table-driven tests call it directly).
pub fn judge(s: &ServerSettings) -> DurabilityReport {
    let flavor = if s.version.to_ascii_lowercase().contains("mariadb") {
        Flavor::MariaDb
    } else {
        Flavor::MySql
    };
    let mut f = Vec::new();
    let mut add = |check, severity, message: String| {
        f.push(Finding {
            check,
            severity,
            message,
        })
    };
    let version = parse_version(&s.version);
    let (least, name) = match flavor {
        Flavor::MariaDb => ((10, 6, 0), "MariaDB 10.6"),
        Flavor::MySql => ((8, 0, 13), "MySQL 8.0.13"),
    };
    match version {
        Some(v) if v >= least => add(
            Check::ServerVersion,
            Severity::Info,
            format!("{} is at least {name}", s.version),
        ),
        _ => add(
            Check::ServerVersion,
            Severity::Refuse,
            format!(
                "{} is older than {name}: the claims need SKIP LOCKED and the schema needs \
                 CHECK constraints and stored generated columns",
                s.version
            ),
        ),
    }
    if s.flush_at_commit == 1 {
        add(
            Check::FlushAtCommit,
            Severity::Info,
            "innodb_flush_log_at_trx_commit = 1: every commit is flushed".to_owned(),
        );
    } else {
        add(
            Check::FlushAtCommit,
            Severity::Refuse,
            format!(
                "innodb_flush_log_at_trx_commit = {}: a crash of the server can lose \
                 transactions that reported a commit (appended events, a lease, a completion \
                 the consumer already saw, an operator's decision). Set it to 1",
                s.flush_at_commit
            ),
        );
    }
    if s.log_bin {
        if s.binlog_format.eq_ignore_ascii_case("STATEMENT") {
            add(
                Check::BinlogFormat,
                Severity::Refuse,
                "binlog_format = STATEMENT: InnoDB refuses writes under READ COMMITTED with \
                 statement-based logging (error 1665), and the store's transactions use READ \
                 COMMITTED. Use ROW (or MIXED)"
                    .to_owned(),
            );
        }
        if s.sync_binlog != 1 {
            add(
                Check::SyncBinlog,
                Severity::Warn,
                format!(
                    "sync_binlog = {} with the binary log on: a crash can lose committed \
                     transactions from the binary log (replicas and point-in-time recovery \
                     then miss appended events). Set it to 1",
                    s.sync_binlog
                ),
            );
        }
    }
    for (table, engine) in &s.non_innodb_tables {
        add(
            Check::StorageEngine,
            Severity::Refuse,
            format!(
                "table {table} uses {engine:?}, not InnoDB: no row locks, no SKIP LOCKED, no \
                 crash recovery"
            ),
        );
    }
    if s.lock_wait_timeout < 5 {
        add(
            Check::LockWaitTimeout,
            Severity::Warn,
            format!(
                "innodb_lock_wait_timeout = {} s: completions and operator actions that meet a \
                 busy aggregate fail (transient) after that long",
                s.lock_wait_timeout
            ),
        );
    }
    add(
        Check::Isolation,
        Severity::Info,
        format!(
            "server default isolation {}; the store runs its own transactions under READ \
             COMMITTED",
            s.isolation
        ),
    );
    f.sort_by_key(|x| std::cmp::Reverse(x.severity));
    DurabilityReport {
        flavor,
        version: s.version.clone(),
        findings: f,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> ServerSettings {
        ServerSettings {
            version: "10.11.19-MariaDB-0+deb12u1".into(),
            flush_at_commit: 1,
            log_bin: false,
            binlog_format: "MIXED".into(),
            sync_binlog: 0,
            lock_wait_timeout: 50,
            isolation: "REPEATABLE-READ".into(),
            non_innodb_tables: Vec::new(),
        }
    }

    #[test]
    fn judgement_table() {
        type Case = (
            &'static str,
            fn(&mut ServerSettings),
            Option<(Check, Severity)>,
        );
        let table: Vec<Case> = vec![
            ("defaults", |_| {}, None),
            ("mysql 8.0.36", |s| s.version = "8.0.36".into(), None),
            (
                "flush 2",
                |s| s.flush_at_commit = 2,
                Some((Check::FlushAtCommit, Severity::Refuse)),
            ),
            (
                "flush 0",
                |s| s.flush_at_commit = 0,
                Some((Check::FlushAtCommit, Severity::Refuse)),
            ),
            (
                "old mariadb",
                |s| s.version = "10.5.9-MariaDB".into(),
                Some((Check::ServerVersion, Severity::Refuse)),
            ),
            (
                "old mysql",
                |s| s.version = "5.7.44-log".into(),
                Some((Check::ServerVersion, Severity::Refuse)),
            ),
            (
                "statement binlog",
                |s| {
                    s.log_bin = true;
                    s.sync_binlog = 1;
                    s.binlog_format = "STATEMENT".into();
                },
                Some((Check::BinlogFormat, Severity::Refuse)),
            ),
            (
                "binlog not synced",
                |s| {
                    s.log_bin = true;
                    s.binlog_format = "ROW".into();
                },
                Some((Check::SyncBinlog, Severity::Warn)),
            ),
            (
                "myisam table",
                |s| s.non_innodb_tables = vec![("outbox_events".into(), "MyISAM".into())],
                Some((Check::StorageEngine, Severity::Refuse)),
            ),
            (
                "short lock wait",
                |s| s.lock_wait_timeout = 1,
                Some((Check::LockWaitTimeout, Severity::Warn)),
            ),
        ];
        for (name, change, want) in table {
            let mut s = good();
            change(&mut s);
            let report = judge(&s);
            let worst: Vec<(Check, Severity)> = report
                .at_least(Severity::Warn)
                .map(|f| (f.check, f.severity))
                .collect();
            assert_eq!(worst, want.into_iter().collect::<Vec<_>>(), "{name}");
            assert_eq!(
                report.refused(),
                want.is_some_and(|w| w.1 == Severity::Refuse),
                "{name}"
            );
        }
        assert_eq!(judge(&good()).flavor, Flavor::MariaDb);
        assert_eq!(parse_version("8.0.36-28"), Some((8, 0, 36)));
        assert_eq!(parse_version("11.4"), Some((11, 4, 0)));
        assert_eq!(parse_version("garbage"), None);
    }
}
