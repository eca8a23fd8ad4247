//! Identifiers, the schema templates and the embedded migration runner.
//!
//! Table and schema names are configurable, so the embedded migrations are templates: every
//! configured name is validated ([`validate_identifier`]) and then written in double quotes.
//! Values never appear in SQL text; they travel as bound parameters.

use sqlx::{Executor, PgPool};

use outbox_core::StoreError;

use crate::error::{config, db};

const OUTBOX_V1: &str = include_str!("migrations/0001_outbox.sql");
const OUTBOX_V2: &str = include_str!("migrations/0002_outbox.sql");
const OUTBOX_V3: &str = include_str!("migrations/0003_outbox.sql");
const OUTBOX_V4: &str = include_str!("migrations/0004_outbox.sql");
const OUTBOX_V5: &str = include_str!("migrations/0005_outbox.sql");
const OUTBOX_V6: &str = include_str!("migrations/0006_outbox.sql");
const OUTBOX_V7: &str = include_str!("migrations/0007_outbox.sql");
const OUTBOX_V8: &str = include_str!("migrations/0008_outbox.sql");
const OUTBOX_V8_AFTER: &str = include_str!("migrations/0008_outbox_validate.sql");
const OUTBOX_V9: &str = include_str!("migrations/0009_outbox.sql");
const OUTBOX_V10: &str = include_str!("migrations/0010_outbox.sql");
const INBOX_V1: &str = include_str!("migrations/0001_inbox.sql");
const INBOX_V2: &str = include_str!("migrations/0002_inbox.sql");
const INBOX_V3: &str = include_str!("migrations/0003_inbox.sql");
const INBOX_V4: &str = include_str!("migrations/0004_inbox.sql");
const INBOX_V5: &str = include_str!("migrations/0005_inbox.sql");

/// Longest accepted table name: derived names (`<table>_audit_action_check`,
/// `<table>_unfinished_idx`, `<table>_aggregate`) must stay within PostgreSQL's 63-byte
/// identifier limit.
pub const MAX_TABLE_NAME_LEN: usize = 40;
/// Longest accepted schema or channel name (PostgreSQL's identifier limit).
pub const MAX_IDENTIFIER_LEN: usize = 63;

/// Checks a configured identifier: 1..=`max_len` bytes of lowercase ASCII letters, digits and
/// `_`, starting with a letter or `_`. Anything else (quotes, dots, spaces, upper case, SQL)
/// is a `Configuration` error, so a name can be quoted without escaping and never becomes SQL.
pub fn validate_identifier(what: &str, name: &str, max_len: usize) -> Result<(), StoreError> {
    let ok_first = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b == b'_');
    let ok_rest = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if !ok_first || !ok_rest || name.len() > max_len || name.starts_with("pg_") {
        return Err(config(format!(
            "invalid {what} name {name:?}: use 1..={max_len} lowercase ASCII letters, digits or \
             '_', starting with a letter or '_' (and not 'pg_')"
        )));
    }
    Ok(())
}

/// `"name"`: the one way a configured name is written into SQL, here and in the programs
/// built on this crate ([`qualified`] for `"schema"."name"`). Validate the name with
/// [`validate_identifier`] first (with the limit that applies to it, and to report a clear
/// error); then quoting needs no escaping and the name never becomes SQL.
///
/// # Panics
///
/// If `name` is not an identifier [`validate_identifier`] accepts (up to
/// [`MAX_IDENTIFIER_LEN`] bytes): an unvalidated name reaching SQL text is a bug, never input to
/// quote.
pub fn quote_identifier(name: &str) -> String {
    if let Err(e) = validate_identifier("identifier", name, MAX_IDENTIFIER_LEN) {
        panic!("quote_identifier() called with an unvalidated identifier: {e}");
    }
    format!("\"{name}\"")
}

/// `"schema"."name"`, each part through [`quote_identifier`] (same rules, same panic).
pub fn qualified(schema: &str, name: &str) -> String {
    format!("{}.{}", quote_identifier(schema), quote_identifier(name))
}

fn render(template: &str, schema: &str, table: &str) -> String {
    let seed = crate::sql::seed(schema, table);
    let (k1, k2) = crate::outbox::gate_keys(seed);
    // The store's default notify channel (`OutboxStoreBuilder::build`): `<schema>_<table>`
    // when that is a valid channel name, else none. Both names are validated identifiers, so
    // the literal needs no escaping.
    let channel = format!("{schema}_{table}");
    let channel = if channel.len() <= MAX_IDENTIFIER_LEN {
        format!("'{channel}'")
    } else {
        "NULL".to_owned()
    };
    template
        .replace("__SCHEMA__", schema)
        .replace("__TABLE__", table)
        .replace("__SEED__", &seed.to_string())
        .replace("__CHANNEL__", &channel)
        .replace("__GATE_K1__", &k1.to_string())
        .replace("__GATE_K2__", &k2.to_string())
}

/// The outbox schema (table, indexes, audit and archive tables) as plain SQL for the given
/// names, for teams that run their own migration tool. Validates the names.
pub fn outbox_schema_sql(schema: &str, table: &str) -> Result<String, StoreError> {
    validate_identifier("schema", schema, MAX_IDENTIFIER_LEN)?;
    validate_identifier("table", table, MAX_TABLE_NAME_LEN)?;
    Ok(render(
        &format!(
            "{OUTBOX_V1}{OUTBOX_V2}{OUTBOX_V3}{OUTBOX_V4}{OUTBOX_V5}{OUTBOX_V6}{OUTBOX_V7}\
             {OUTBOX_V8}{OUTBOX_V8_AFTER}{OUTBOX_V9}{OUTBOX_V10}"
        ),
        schema,
        table,
    ))
}

/// The inbox schema as plain SQL for the given names. Validates the names.
pub fn inbox_schema_sql(schema: &str, table: &str) -> Result<String, StoreError> {
    validate_identifier("schema", schema, MAX_IDENTIFIER_LEN)?;
    validate_identifier("table", table, MAX_TABLE_NAME_LEN)?;
    Ok(render(
        &format!("{INBOX_V1}{INBOX_V2}{INBOX_V3}{INBOX_V4}{INBOX_V5}"),
        schema,
        table,
    ))
}

pub(crate) enum Component {
    Outbox,
    Inbox,
}

/// One embedded migration.
struct Migration {
    version: i32,
    description: &'static str,
    template: &'static str,
    /// Tables (`<table><suffix>`) the migration rewrites from what it reads, or that relays
    /// of the previous version write while it reads them. They are locked (`ACCESS
    /// EXCLUSIVE`, with those of every other pending migration, before the first one runs),
    /// so it reads every committed write of a relay
    /// of the previous version running beside it and none lands meanwhile (issue 20, item 7:
    /// migration 3 used to derive `last_version` and copy leases from a snapshot taken
    /// before such a relay's completion or release committed).
    locks: &'static [&'static str],
    /// Run after the migrations' transaction committed, each time [`migrate`] succeeds (so
    /// it MUST be idempotent): work that should not hold the transaction's locks, such as
    /// validating a constraint added `NOT VALID`.
    after: Option<&'static str>,
}

const fn m(
    version: i32,
    description: &'static str,
    template: &'static str,
    locks: &'static [&'static str],
) -> Migration {
    Migration {
        version,
        description,
        template,
        locks,
        after: None,
    }
}

const OUTBOX_MIGRATIONS: &[Migration] = &[
    m(1, "outbox table, audit, archive", OUTBOX_V1, &[]),
    // Re-keys the leases from their event rows.
    m(
        2,
        "one index of unfinished rows per aggregate",
        OUTBOX_V2,
        &["", "_lease"],
    ),
    // Derives each aggregate's last version from the rows (and the archive, which cleanup
    // fills from the table), unblocks rows, copies live leases.
    m(
        3,
        "per-aggregate delivery state: last version, lease",
        OUTBOX_V3,
        &["", "_archive", "_lease"],
    ),
    m(
        4,
        "conflict counters, recorded topics, time indexes",
        OUTBOX_V4,
        &[],
    ),
    m(5, "one time index for published rows", OUTBOX_V5, &[]),
    // Rewrites last versions that claims write.
    m(
        6,
        "unknown last version until a publication or discard",
        OUTBOX_V6,
        &["_aggregate"],
    ),
    m(7, "append from SQL: <table>_append()", OUTBOX_V7, &[]),
    // Renames and adds columns of the table and its archive (ALTER TABLE takes both anyway;
    // locked first so the order is fixed).
    Migration {
        after: Some(OUTBOX_V8_AFTER),
        ..m(
            8,
            "transport-neutral acknowledgement columns",
            OUTBOX_V8,
            &["", "_archive"],
        )
    },
    m(9, "relay registry: <table>_relays", OUTBOX_V9, &[]),
    m(
        10,
        "index of held version gaps (cheap stats)",
        OUTBOX_V10,
        &[],
    ),
];

const INBOX_MIGRATIONS: &[Migration] = &[
    m(1, "inbox table", INBOX_V1, &[]),
    m(
        2,
        "aggregate versions, parked messages, audit",
        INBOX_V2,
        &[],
    ),
    m(
        3,
        "retry requests, per-consumer cleanup index",
        INBOX_V3,
        &[],
    ),
    m(4, "the aggregate of each registration", INBOX_V4, &[]),
    m(
        5,
        "parked messages keep their transport's own position",
        INBOX_V5,
        &[],
    ),
];

/// The outbox's migrations this crate brings, in order: (version, what it does). `outbox
/// migrate info` compares them with the migration log (`outbox_schema_migrations`, object
/// `outbox:<table>`).
pub fn outbox_migrations() -> Vec<(i32, &'static str)> {
    OUTBOX_MIGRATIONS
        .iter()
        .map(|m| (m.version, m.description))
        .collect()
}

/// The inbox's migrations this crate brings, in order: (version, what it does); logged as
/// object `inbox:<table>`.
pub fn inbox_migrations() -> Vec<(i32, &'static str)> {
    INBOX_MIGRATIONS
        .iter()
        .map(|m| (m.version, m.description))
        .collect()
}

/// How many times [`migrate`] runs its transaction when it fails on a lock conflict (a
/// deadlock with a relay of the previous version that took the tables in the other order: the
/// server aborts one of the two, here perhaps the migration, which then starts again).
const MIGRATE_ATTEMPTS: u32 = 5;

/// Applies the embedded migrations of `component` for `schema.table` that are not applied yet,
/// in one transaction, serialized across processes by an advisory lock. Returns the number of
/// migrations applied. A migration that rewrites data relays write first locks those tables
/// (see `Migration::locks`, taken by `lock_tables` without waiting while it holds one), so it
/// is safe to run beside relays of the previous version: they wait for it (it runs while no
/// transaction of theirs holds those tables); claims of this version wait for it on
/// [`migration_lock_key`]. A deadlock that still happens rolls the migration back, and it is
/// run again (up to `MIGRATE_ATTEMPTS` times).
pub(crate) async fn migrate(
    pool: &PgPool,
    component: Component,
    schema: &str,
    table: &str,
) -> Result<usize, StoreError> {
    let mut attempt = 1;
    loop {
        match migrate_once(pool, &component, schema, table).await {
            Ok(count) => {
                after_migrations(pool, &component, schema, table).await?;
                return Ok(count);
            }
            Err(e)
                if e.kind == outbox_core::StoreErrorKind::Conflict
                    && attempt < MIGRATE_ATTEMPTS =>
            {
                tracing::warn!(attempt, error = %e, "migration rolled back on a lock conflict; running it again");
                attempt += 1;
            }
            other => return other,
        }
    }
}

/// Runs the `after` step of every migration (all are applied once [`migrate_once`]
/// succeeded), each in its own transaction.
async fn after_migrations(
    pool: &PgPool,
    component: &Component,
    schema: &str,
    table: &str,
) -> Result<(), StoreError> {
    let migrations = match component {
        Component::Outbox => OUTBOX_MIGRATIONS,
        Component::Inbox => INBOX_MIGRATIONS,
    };
    for after in migrations.iter().filter_map(|m| m.after) {
        pool.execute(render(after, schema, table).as_str())
            .await
            .map_err(db)?;
    }
    Ok(())
}

async fn migrate_once(
    pool: &PgPool,
    component: &Component,
    schema: &str,
    table: &str,
) -> Result<usize, StoreError> {
    let mut tx = pool.begin().await.map_err(db)?;
    match apply(&mut tx, component, schema, table).await {
        Ok(count) => {
            tx.commit().await.map_err(db)?;
            Ok(count)
        }
        Err(e) => {
            // At once: a transaction merely dropped keeps its locks (the migration lock among
            // them) until its pooled connection is used again.
            if let Err(rollback) = tx.rollback().await {
                tracing::warn!(error = %rollback, "rollback of a failed migration failed; the connection is dropped");
            }
            Err(e)
        }
    }
}

/// The per-table advisory lock key that [`migrate`] holds exclusively while it applies
/// migrations, and that every claim of this version takes shared first: a claim waits for
/// pending migrations before it reads a table, instead of queueing for a table lock the
/// migration needs while holding another one, or running on the old schema.
pub(crate) fn migration_lock_key(seed: i64) -> i64 {
    // Apart from the aggregate keys (`hash ^ seed`) of the same table.
    seed.rotate_left(29) ^ 0x6d69_6772_6174_696f
}

/// Rounds of [`lock_tables`] that wait for one busy table alone before it falls back to
/// waiting for every table in order.
const LOCK_ROUNDS: u32 = 20;

/// Takes `ACCESS EXCLUSIVE` locks on `tables` without ever waiting while it holds one: each
/// round tries every table with `NOWAIT` inside a savepoint; when one is busy, the savepoint
/// is rolled back (every lock of the round released), and the next round first waits for that
/// table alone, then tries the others again. A relay of the previous version may hold one
/// table and want another (a locked claim reads the state table, its completion then writes
/// the event table): waiting for a second table while holding the first would deadlock with
/// it, and the server would abort one of the two, possibly the relay's completion (a
/// publication recorded nowhere, sent again). While the runner waits for a table, only that
/// table is queued behind it (appends wait as long as the transaction holding it lasts).
///
/// After [`LOCK_ROUNDS`] rounds (relays that keep the tables busy in turn), it waits for all
/// of them in order, as a plain `LOCK TABLE` does; a deadlock is then resolved by the server
/// (the migration runs again, or an old relay's transaction is rolled back: a duplicate, never
/// a loss), so the migration finishes.
async fn lock_tables(tx: &mut sqlx::PgConnection, tables: &[String]) -> Result<(), StoreError> {
    if tables.is_empty() {
        return Ok(());
    }
    let mut busy: Option<usize> = None;
    for round in 1..=LOCK_ROUNDS {
        tx.execute("SAVEPOINT outbox_migrate_locks")
            .await
            .map_err(db)?;
        if let Some(b) = busy {
            tx.execute(format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", tables[b]).as_str())
                .await
                .map_err(db)?;
        }
        let mut refused = None;
        for (i, name) in tables.iter().enumerate() {
            if busy == Some(i) {
                continue;
            }
            let nowait = format!("LOCK TABLE {name} IN ACCESS EXCLUSIVE MODE NOWAIT");
            match tx.execute(nowait.as_str()).await {
                Ok(_) => {}
                Err(e) if lock_not_available(&e) => {
                    refused = Some(i);
                    break;
                }
                Err(e) => return Err(db(e)),
            }
        }
        match refused {
            None => {
                tx.execute("RELEASE SAVEPOINT outbox_migrate_locks")
                    .await
                    .map_err(db)?;
                return Ok(());
            }
            Some(i) => {
                tx.execute("ROLLBACK TO SAVEPOINT outbox_migrate_locks")
                    .await
                    .map_err(db)?;
                tracing::debug!(round, table = %tables[i], "migration: table busy, waiting for it alone");
                busy = Some(i);
            }
        }
    }
    tracing::warn!(
        rounds = LOCK_ROUNDS,
        "migration: tables kept busy in turn; waiting for all of them in order"
    );
    tx.execute(format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", tables.join(", ")).as_str())
        .await
        .map_err(db)?;
    Ok(())
}

/// `55P03`: a `NOWAIT` lock request found the lock held.
fn lock_not_available(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "55P03")
}

async fn apply(
    tx: &mut sqlx::PgConnection,
    component: &Component,
    schema: &str,
    table: &str,
) -> Result<usize, StoreError> {
    let (name, migrations) = match component {
        Component::Outbox => ("outbox", OUTBOX_MIGRATIONS),
        Component::Inbox => ("inbox", INBOX_MIGRATIONS),
    };
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('outbox-postgres:migrate', 0))")
        .execute(&mut *tx)
        .await
        .map_err(db)?;
    let ddl = format!(
        "CREATE SCHEMA IF NOT EXISTS \"{schema}\";
         CREATE TABLE IF NOT EXISTS {} (
             object      text        NOT NULL,
             version     integer     NOT NULL,
             description text        NOT NULL,
             applied_at  timestamptz NOT NULL DEFAULT now(),
             PRIMARY KEY (object, version)
         );",
        qualified(schema, "outbox_schema_migrations")
    );
    (&mut *tx).execute(ddl.as_str()).await.map_err(db)?;
    let object = format!("{name}:{table}");
    let applied: Option<i32> = sqlx::query_scalar(&format!(
        "SELECT max(version) FROM {} WHERE object = $1",
        qualified(schema, "outbox_schema_migrations")
    ))
    .bind(&object)
    .fetch_one(&mut *tx)
    .await
    .map_err(db)?;
    let applied = applied.unwrap_or(0);
    let mut count = 0;
    let pending = migrations.iter().any(|m| m.version > applied);
    if pending {
        // Claims of this version wait for the migrations (`claim::begin_claim` takes this key
        // shared before it reads a table): none runs on the old schema meanwhile, and none
        // holds a table the migrations are waiting for.
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(migration_lock_key(crate::sql::seed(schema, table)))
            .execute(&mut *tx)
            .await
            .map_err(db)?;
    }
    // The tables of every pending migration are locked before the first one runs (taken one
    // migration after another, a relay of the previous version holding a table of a later
    // migration while it waits for one an earlier migration took would deadlock with the
    // migration). The event table comes first, then the others by name. A table an earlier
    // pending migration creates is not there yet (and invisible to others until the commit).
    let mut suffixes: Vec<&str> = migrations
        .iter()
        .filter(|m| m.version > applied)
        .flat_map(|m| m.locks.iter().copied())
        .collect();
    suffixes.sort_unstable();
    suffixes.dedup();
    let mut tables = Vec::with_capacity(suffixes.len());
    for suffix in suffixes {
        let name = qualified(schema, &format!("{table}{suffix}"));
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(&name)
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        if exists {
            tables.push(name);
        }
    }
    lock_tables(&mut *tx, &tables).await?;
    for migration in migrations.iter().filter(|m| m.version > applied) {
        let sql = render(migration.template, schema, table);
        (&mut *tx).execute(sql.as_str()).await.map_err(db)?;
        sqlx::query(&format!(
            "INSERT INTO {} (object, version, description) VALUES ($1, $2, $3)",
            qualified(schema, "outbox_schema_migrations")
        ))
        .bind(&object)
        .bind(migration.version)
        .bind(migration.description)
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        count += 1;
    }
    Ok(count)
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
            "x\"; DROP TABLE users; --",
            "o'brien",
            "pg_catalog",
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
        assert_eq!(qualified("shop", "effects"), "\"shop\".\"effects\"");
        assert_eq!(quote_identifier("shop"), "\"shop\"");
        for bad in ["x\"; DROP TABLE victim; --", "public.victim", "Upper", ""] {
            let schema = std::panic::catch_unwind(|| qualified(bad, "t"));
            assert!(schema.is_err(), "{bad:?} as schema");
            let name = std::panic::catch_unwind(|| qualified("s", bad));
            assert!(name.is_err(), "{bad:?} as name");
            assert!(std::panic::catch_unwind(|| quote_identifier(bad)).is_err());
        }
    }

    /// The plain SQL shipped in `sql/` is the template rendered with the default names.
    #[test]
    fn plain_sql_files_match_templates() {
        let outbox = outbox_schema_sql(crate::DEFAULT_SCHEMA, crate::DEFAULT_OUTBOX_TABLE).unwrap();
        let inbox = inbox_schema_sql(crate::DEFAULT_SCHEMA, crate::DEFAULT_INBOX_TABLE).unwrap();
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/sql");
        if std::env::var_os("OUTBOX_PG_WRITE_SQL").is_some() {
            std::fs::write(format!("{dir}/outbox.sql"), &outbox).unwrap();
            std::fs::write(format!("{dir}/inbox.sql"), &inbox).unwrap();
        }
        let on_disk = std::fs::read_to_string(format!("{dir}/outbox.sql")).unwrap();
        assert_eq!(on_disk, outbox, "regenerate with OUTBOX_PG_WRITE_SQL=1");
        let on_disk = std::fs::read_to_string(format!("{dir}/inbox.sql")).unwrap();
        assert_eq!(on_disk, inbox, "regenerate with OUTBOX_PG_WRITE_SQL=1");
    }
}
