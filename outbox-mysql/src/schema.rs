//! Identifiers, the schema templates and the embedded migration runner.
//!
//! Database and table names are configurable, so the embedded migrations are templates: every
//! configured name is validated ([`validate_identifier`]) and then written in backquotes.
//! Values never appear in SQL text; they travel as bound parameters.
//!
//! MySQL commits every DDL statement at once (there is no transactional DDL), so the
//! migrations are written to be run again from the top after a failure (`IF NOT EXISTS`
//! everywhere), and two `migrate` runs are serialized by a named lock (`GET_LOCK`) held on one
//! connection for the whole run: named locks belong to the session, so the connection is
//! closed, never handed back to the pool, when the lock could not be released.

use sqlx::{Connection, Executor, MySqlPool};

use outbox_core::StoreError;

use crate::error::{config, db};

/// A migration: its version, what it does, and its template.
type Migration = (i32, &'static str, &'static str);

/// The outbox's migrations, in order.
const OUTBOX_MIGRATIONS: &[Migration] = &[
    (
        1,
        "outbox table, per-aggregate state, audit, archive",
        include_str!("migrations/0001_outbox.sql"),
    ),
    (
        2,
        "transport-neutral acknowledgement columns",
        include_str!("migrations/0002_outbox.sql"),
    ),
    (
        3,
        "lease mode: claim token on the event row, one lease row per claim",
        include_str!("migrations/0003_outbox.sql"),
    ),
    (
        4,
        "relay registry: <table>_relays",
        include_str!("migrations/0004_outbox.sql"),
    ),
];

/// The inbox's migrations, in order.
const INBOX_MIGRATIONS: &[Migration] = &[
    (
        1,
        "inbox table, aggregate versions, parked messages, audit",
        include_str!("migrations/0001_inbox.sql"),
    ),
    (
        2,
        "registrations keep their aggregate",
        include_str!("migrations/0002_inbox.sql"),
    ),
    (
        3,
        "parked messages deduplicated per aggregate",
        include_str!("migrations/0003_inbox.sql"),
    ),
    (
        4,
        "parked messages keep their transport's own position",
        include_str!("migrations/0004_inbox.sql"),
    ),
];

/// Longest accepted table name: derived names (`<table>_aggregates`,
/// `<table>_parked_status_chk`) must stay within MySQL's 64-character identifier limit.
pub const MAX_TABLE_NAME_LEN: usize = 40;
/// Longest accepted database name (MySQL's identifier limit).
pub const MAX_IDENTIFIER_LEN: usize = 64;

/// The name of the migration lock (`GET_LOCK`), one per server.
pub const MIGRATION_LOCK: &str = "outbox-mysql:migrate";

/// How long a `migrate` waits for another one to finish.
const MIGRATION_LOCK_WAIT_SECS: i64 = 120;

/// How long a migration's DDL statement waits for the metadata lock of its table (the
/// session's `lock_wait_timeout` during a `migrate`). An `ALTER TABLE` waits for the
/// transactions open on the table at its start, and every later statement on the table waits
/// behind it: with the server's default (a year), one transaction a client left open would
/// stall every relay or consumer on the table for as long. With this bound the migration fails
/// (a transient `Conflict`, run it again) and the traffic goes on.
pub const MIGRATION_DDL_WAIT_SECS: u32 = 10;

/// Databases that are never an outbox's.
const SYSTEM_DATABASES: &[&str] = &["mysql", "information_schema", "performance_schema", "sys"];

/// Checks a configured identifier: 1..=`max_len` bytes of lowercase ASCII letters, digits and
/// `_`, starting with a letter or `_`, and not a system database. Lowercase only, so the name
/// means the same table whatever the server's `lower_case_table_names`. Anything else
/// (quotes, backquotes, dots, spaces, upper case, SQL) is a `Configuration` error.
pub fn validate_identifier(what: &str, name: &str, max_len: usize) -> Result<(), StoreError> {
    let ok_first = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b == b'_');
    let ok_rest = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if !ok_first || !ok_rest || name.len() > max_len || SYSTEM_DATABASES.contains(&name) {
        return Err(config(format!(
            "invalid {what} name {name:?}: use 1..={max_len} lowercase ASCII letters, digits or \
             '_', starting with a letter or '_' (and not a system database)"
        )));
    }
    Ok(())
}

/// `` `name` ``: the one way a configured name is written into SQL.
///
/// # Panics
///
/// If `name` is not an identifier [`validate_identifier`] accepts: an unvalidated name
/// reaching SQL text is a bug, never input to quote.
pub fn quote_identifier(name: &str) -> String {
    if let Err(e) = validate_identifier("identifier", name, MAX_IDENTIFIER_LEN) {
        panic!("quote_identifier() called with an unvalidated identifier: {e}");
    }
    format!("`{name}`")
}

/// `` `database`.`name` ``, or `` `name` `` without a database (the connection's current one),
/// each part through [`quote_identifier`].
pub fn qualified(database: Option<&str>, name: &str) -> String {
    match database {
        Some(d) => format!("{}.{}", quote_identifier(d), quote_identifier(name)),
        None => quote_identifier(name),
    }
}

fn render(template: &str, database: Option<&str>, table: &str) -> String {
    let prefix = database.map_or_else(String::new, |d| format!("{}.", quote_identifier(d)));
    template
        .replace("__Q__", &prefix)
        .replace("__TABLE__", table)
}

fn validate_names(database: Option<&str>, table: &str) -> Result<(), StoreError> {
    if let Some(d) = database {
        validate_identifier("database", d, MAX_IDENTIFIER_LEN)?;
    }
    validate_identifier("table", table, MAX_TABLE_NAME_LEN)
}

/// Every migration of `migrations`, rendered for the names, one after the other.
fn render_all(migrations: &[Migration], database: Option<&str>, table: &str) -> String {
    migrations
        .iter()
        .map(|(_, _, template)| render(template, database, table))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The outbox schema (table, per-aggregate state, audit and archive tables; every migration
/// in order) as plain SQL for the given names, for teams that run their own migration tool.
/// Validates the names.
pub fn outbox_schema_sql(database: Option<&str>, table: &str) -> Result<String, StoreError> {
    validate_names(database, table)?;
    Ok(render_all(OUTBOX_MIGRATIONS, database, table))
}

/// The inbox schema (every migration in order) as plain SQL for the given names. Validates
/// the names. Its `ALTER TABLE` statements are not idempotent on MySQL: apply each migration
/// once, as migration tools do.
pub fn inbox_schema_sql(database: Option<&str>, table: &str) -> Result<String, StoreError> {
    validate_names(database, table)?;
    Ok(render_all(INBOX_MIGRATIONS, database, table))
}

/// The statements of a rendered migration (comments dropped, split at `;` line ends).
pub(crate) fn statements(sql: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in sql.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with("--") || trimmed.is_empty() {
            continue;
        }
        current.push_str(line);
        current.push('\n');
        if trimmed.ends_with(';') {
            let stmt = current.trim().trim_end_matches(';').trim().to_owned();
            if !stmt.is_empty() {
                out.push(stmt);
            }
            current.clear();
        }
    }
    if !current.trim().is_empty() {
        out.push(current.trim().to_owned());
    }
    out
}

/// Which migrations to run.
pub(crate) enum Component {
    Outbox,
    Inbox,
}

/// Applies the embedded migrations of `component` for `database.table` that are not applied
/// yet, serialized across processes by the named lock [`MIGRATION_LOCK`]. Returns the number
/// applied.
pub(crate) async fn migrate(
    pool: &MySqlPool,
    component: Component,
    database: Option<&str>,
    table: &str,
) -> Result<usize, StoreError> {
    let (name, migrations) = match component {
        Component::Outbox => ("outbox", OUTBOX_MIGRATIONS),
        Component::Inbox => ("inbox", INBOX_MIGRATIONS),
    };
    let mut conn = pool.acquire().await.map_err(db)?;
    let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
        .bind(MIGRATION_LOCK)
        .bind(MIGRATION_LOCK_WAIT_SECS)
        .fetch_one(&mut *conn)
        .await
        .map_err(db)?;
    if locked != Some(1) {
        return Err(StoreError::new(
            outbox_core::StoreErrorKind::Conflict,
            format!(
                "another migration held the lock {MIGRATION_LOCK:?} for over \
                 {MIGRATION_LOCK_WAIT_SECS} s"
            ),
        ));
    }
    // A SET cannot take a bind parameter; the value is a constant integer.
    let bounded = format!("SET SESSION lock_wait_timeout = {MIGRATION_DDL_WAIT_SECS}");
    let result = match conn.execute(bounded.as_str()).await {
        Ok(_) => run_migrations(&mut conn, name, migrations, database, table).await,
        Err(e) => Err(db(e)),
    };
    let released: Result<Option<i64>, _> = sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
        .bind(MIGRATION_LOCK)
        .fetch_one(&mut *conn)
        .await;
    let reset = conn
        .execute("SET SESSION lock_wait_timeout = DEFAULT")
        .await;
    if !matches!(released, Ok(Some(1))) || reset.is_err() {
        // The session may still hold the lock, or a short lock wait: it must not go back to
        // the pool.
        let _ = conn.detach().close().await;
    }
    result
}

async fn run_migrations(
    conn: &mut sqlx::MySqlConnection,
    name: &str,
    migrations: &[Migration],
    database: Option<&str>,
    table: &str,
) -> Result<usize, StoreError> {
    if let Some(d) = database {
        let ddl = format!(
            "CREATE DATABASE IF NOT EXISTS {} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
            quote_identifier(d)
        );
        conn.execute(ddl.as_str()).await.map_err(db)?;
    }
    let log = qualified(database, "outbox_schema_migrations");
    let ddl = format!(
        "CREATE TABLE IF NOT EXISTS {log} (
             object      VARCHAR(255) NOT NULL,
             version     INT          NOT NULL,
             description TEXT         NOT NULL,
             applied_at  DATETIME(6)  NOT NULL,
             PRIMARY KEY (object, version)
         ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
    );
    conn.execute(ddl.as_str()).await.map_err(db)?;
    let object = format!("{name}:{table}");
    let applied: Option<i32> =
        sqlx::query_scalar(&format!("SELECT MAX(version) FROM {log} WHERE object = ?"))
            .bind(&object)
            .fetch_one(&mut *conn)
            .await
            .map_err(db)?;
    let applied = applied.unwrap_or(0);
    let mut count = 0;
    for (version, description, template) in migrations {
        if *version <= applied {
            continue;
        }
        for stmt in statements(&render(template, database, table)) {
            match conn.execute(stmt.as_str()).await {
                Ok(_) => {}
                // Applied by an earlier run that failed before it was logged (DDL commits at
                // once; MySQL has no ADD COLUMN / ADD INDEX IF NOT EXISTS).
                Err(e) if already_applied(&stmt, &e) => {}
                Err(e) => return Err(db(e)),
            }
        }
        let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(db)?;
        sqlx::query(&format!(
            "INSERT INTO {log} (object, version, description, applied_at) \
             VALUES (?, ?, ?, UTC_TIMESTAMP(6))"
        ))
        .bind(&object)
        .bind(version)
        .bind(description)
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        tx.commit().await.map_err(db)?;
        count += 1;
    }
    Ok(count)
}

/// The outbox's migrations this crate brings, in order: (version, what it does).
pub fn outbox_migrations() -> Vec<(i32, &'static str)> {
    OUTBOX_MIGRATIONS.iter().map(|m| (m.0, m.1)).collect()
}

/// The inbox's migrations this crate brings, in order: (version, what it does).
pub fn inbox_migrations() -> Vec<(i32, &'static str)> {
    INBOX_MIGRATIONS.iter().map(|m| (m.0, m.1)).collect()
}

/// Where a store's schema stands on the server: what `migrate` has applied and what it would
/// still apply ([`crate::MySqlOutboxStore::migration_status`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationStatus {
    /// The latest version applied (0: none, also when the migration log does not exist).
    pub applied: i32,
    /// The latest version this crate brings.
    pub expected: i32,
    /// The migrations not applied yet, in order: (version, what it does).
    pub pending: Vec<(i32, &'static str)>,
}

impl MigrationStatus {
    /// `true` when every migration this crate brings is applied.
    pub fn up_to_date(&self) -> bool {
        self.pending.is_empty()
    }
}

/// Reads the migration log of `component` for `database.table`. A missing log
/// (`NO_SUCH_TABLE`) is "nothing applied"; any other error (a missing privilege, the server
/// gone) is returned.
pub(crate) async fn migration_status(
    pool: &MySqlPool,
    component: Component,
    database: Option<&str>,
    table: &str,
) -> Result<MigrationStatus, StoreError> {
    let (name, migrations) = match component {
        Component::Outbox => ("outbox", OUTBOX_MIGRATIONS),
        Component::Inbox => ("inbox", INBOX_MIGRATIONS),
    };
    let log = qualified(database, "outbox_schema_migrations");
    let applied: i32 = match sqlx::query_scalar::<_, Option<i32>>(&format!(
        "SELECT MAX(version) FROM {log} WHERE object = ?"
    ))
    .bind(format!("{name}:{table}"))
    .fetch_one(pool)
    .await
    {
        Ok(v) => v.unwrap_or(0),
        Err(e) if crate::error::error_number(&e) == Some(crate::error::codes::NO_SUCH_TABLE) => 0,
        Err(e) => return Err(db(e)),
    };
    Ok(MigrationStatus {
        applied,
        expected: migrations.last().map_or(0, |m| m.0),
        pending: migrations
            .iter()
            .filter(|m| m.0 > applied)
            .map(|m| (m.0, m.1))
            .collect(),
    })
}

/// An `ALTER TABLE` that failed because what it adds exists already (a duplicate column, 1060,
/// or index, 1061) or what it drops is gone already (1091).
fn already_applied(stmt: &str, e: &sqlx::Error) -> bool {
    use crate::error::codes;
    let alter = stmt
        .trim_start()
        .get(..11)
        .is_some_and(|p| p.eq_ignore_ascii_case("ALTER TABLE"));
    let code = crate::error::error_number(e);
    alter
        && (matches!(
            code,
            Some(
                codes::DUP_FIELDNAME
                    | codes::DUP_KEYNAME
                    | codes::CANT_DROP_FIELD_OR_KEY
                    | codes::CONSTRAINT_NOT_FOUND
                    | codes::CHECK_CONSTRAINT_DUP_NAME
                    | codes::DUP_CONSTRAINT_NAME
            )
        )
            // A rename that ran before: the old column is gone (only ever a rename's error:
            // another statement naming a missing column is a bug to report).
            || (code == Some(codes::BAD_FIELD_ERROR) && stmt.contains("RENAME COLUMN")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifier_table() {
        let good = ["outbox", "_x", "a1_b2", &"a".repeat(40)];
        for name in good {
            assert!(validate_identifier("table", name, 40).is_ok(), "{name}");
        }
        let bad = [
            "",
            "Outbox",
            "1abc",
            "a-b",
            "a b",
            "a.b",
            "x`; DROP TABLE users; --",
            "o'brien",
            "mysql",
            "information_schema",
            "événement",
            &"a".repeat(41),
        ];
        for name in bad {
            let err = validate_identifier("table", name, 40).expect_err(name);
            assert_eq!(
                err.kind,
                outbox_core::StoreErrorKind::Configuration,
                "{name}"
            );
        }
    }

    #[test]
    fn qualified_quotes_validated_names_and_refuses_others() {
        assert_eq!(qualified(Some("shop"), "effects"), "`shop`.`effects`");
        assert_eq!(qualified(None, "effects"), "`effects`");
        for bad in ["x`; DROP TABLE victim; --", "db.victim", "Upper", ""] {
            assert!(std::panic::catch_unwind(|| qualified(Some(bad), "t")).is_err());
            assert!(std::panic::catch_unwind(|| qualified(Some("s"), bad)).is_err());
        }
    }

    #[test]
    fn templates_render_and_split_into_statements() {
        let sql = outbox_schema_sql(Some("shop"), "events").unwrap();
        assert!(!sql.contains("__"), "placeholders left: {sql}");
        let stmts = statements(&sql);
        // Migration 1: 4 statements; migration 2 (acknowledgement columns): 10; migration 3
        // (claim token, lease table): 2; migration 4 (relay registry): 1.
        assert_eq!(stmts.len(), 17, "{stmts:#?}");
        assert!(stmts[0].starts_with("CREATE TABLE IF NOT EXISTS `shop`.`events` ("));
        assert!(stmts[1].starts_with("CREATE TABLE IF NOT EXISTS `shop`.`events_aggregate` ("));
        assert!(stmts[4]
            .starts_with("ALTER TABLE `shop`.`events` DROP CONSTRAINT events_published_chk"));
        assert!(stmts[13]
            .starts_with("ALTER TABLE `shop`.`events` ADD CONSTRAINT events_published_chk CHECK"));
        assert!(stmts[14].starts_with("ALTER TABLE `shop`.`events`\n    ADD COLUMN claim_token"));
        assert!(stmts[15].starts_with("CREATE TABLE IF NOT EXISTS `shop`.`events_lease` ("));
        assert!(stmts[16].starts_with("CREATE TABLE IF NOT EXISTS `shop`.`events_relays` ("));
        let unqualified = inbox_schema_sql(None, "processed").unwrap();
        let stmts = statements(&unqualified);
        assert_eq!(stmts.len(), 9, "{stmts:#?}");
        assert!(stmts[4].starts_with("ALTER TABLE `processed` ADD COLUMN aggregate"));
        assert!(stmts[7].starts_with("ALTER TABLE `processed_parked` DROP KEY dedup_key"));
        assert!(
            stmts[8].starts_with("ALTER TABLE `processed_parked`\n    ADD COLUMN native_transport")
        );
        assert!(stmts[0].starts_with("CREATE TABLE IF NOT EXISTS `processed` ("));
        assert!(outbox_schema_sql(Some("Shop"), "events").is_err());
        assert!(inbox_schema_sql(None, &"t".repeat(41)).is_err());
    }
}
