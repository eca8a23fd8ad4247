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
const OUTBOX_V4_INDEX: &str = include_str!("migrations/0004_outbox_index.sql");
const OUTBOX_V5: &str = include_str!("migrations/0005_outbox.sql");
const OUTBOX_V6: &str = include_str!("migrations/0006_outbox.sql");
const OUTBOX_V7: &str = include_str!("migrations/0007_outbox.sql");
const OUTBOX_V8: &str = include_str!("migrations/0008_outbox.sql");
const OUTBOX_V8_AFTER: &str = include_str!("migrations/0008_outbox_validate.sql");
const OUTBOX_V9: &str = include_str!("migrations/0009_outbox.sql");
const OUTBOX_V10: &str = include_str!("migrations/0010_outbox.sql");
const OUTBOX_V11: &str = include_str!("migrations/0011_outbox.sql");
const INBOX_V1: &str = include_str!("migrations/0001_inbox.sql");
const INBOX_V2: &str = include_str!("migrations/0002_inbox.sql");
const INBOX_V3: &str = include_str!("migrations/0003_inbox.sql");
const INBOX_V3_INDEX: &str = include_str!("migrations/0003_inbox_index.sql");
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
            "{OUTBOX_V1}{OUTBOX_V2}{OUTBOX_V3}{OUTBOX_V4}{OUTBOX_V4_INDEX}{OUTBOX_V5}{OUTBOX_V6}\
             {OUTBOX_V7}{OUTBOX_V8}{OUTBOX_V8_AFTER}{OUTBOX_V9}{OUTBOX_V10}{OUTBOX_V11}"
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
        &format!("{INBOX_V1}{INBOX_V2}{INBOX_V3}{INBOX_V3_INDEX}{INBOX_V4}{INBOX_V5}"),
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
    /// An index the migration builds (after its `template`). The runner does not build it in
    /// the migrations' transaction when the table exists: there the build would hold a
    /// `SHARE` lock on the table for a full scan, and every append (a business transaction)
    /// would wait for it. The transaction runs the migration's `template` and records it;
    /// [`build_indexes`] then builds the index with `CREATE INDEX CONCURRENTLY` after the
    /// commit, each time [`migrate`] succeeds (a build interrupted by a crash or a cancel
    /// leaves an invalid index, built again by the next run). When the transaction creates
    /// the table (a new installation), the index is built in it (the table is empty, and
    /// nobody else sees it yet). No later migration may depend on the index (it may not exist
    /// yet when they run).
    index: Option<IndexStep>,
}

/// The index of an index migration: `<table><suffix>`, built by `template`, one plain
/// `CREATE INDEX IF NOT EXISTS` statement (its unit test checks that), run after the
/// migration's own `template` in plain SQL ([`outbox_schema_sql`]).
struct IndexStep {
    suffix: &'static str,
    template: &'static str,
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
        index: None,
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
    // Its index of creation times is built concurrently on an existing table (issue 25).
    Migration {
        index: Some(IndexStep {
            suffix: "_created_at_idx",
            template: OUTBOX_V4_INDEX,
        }),
        ..m(
            4,
            "conflict counters, recorded topics, time indexes",
            OUTBOX_V4,
            &[],
        )
    },
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
    // Built concurrently after the transaction (issue 25): appends go on meanwhile.
    Migration {
        index: Some(IndexStep {
            suffix: "_held_idx",
            template: OUTBOX_V10,
        }),
        ..m(10, "index of held version gaps (cheap stats)", "", &[])
    },
    m(
        11,
        "run claims: the last version of a lease's run",
        OUTBOX_V11,
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
    // Its index of the registrations is built concurrently on an existing table (issue 25).
    Migration {
        index: Some(IndexStep {
            suffix: "_consumer_at_idx",
            template: INBOX_V3_INDEX,
        }),
        ..m(
            3,
            "retry requests, per-consumer cleanup index",
            INBOX_V3,
            &[],
        )
    },
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
                build_indexes(pool, &component, schema, table).await?;
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

/// The plain index statement of an index migration (`Migration::index`) as
/// `CREATE INDEX CONCURRENTLY` (its unit test checks every such template holds exactly one).
fn concurrent_index_sql(template: &str) -> String {
    template.replacen(PLAIN_INDEX, "CREATE INDEX CONCURRENTLY IF NOT EXISTS ", 1)
}

const PLAIN_INDEX: &str = "CREATE INDEX IF NOT EXISTS ";

/// The per-table advisory lock key a runner holds (at session level, on one connection) while
/// it builds the indexes of index migrations: two runners never build, or drop as invalid, the
/// same index at once (one would drop the other's build in progress, which looks invalid).
fn index_lock_key(seed: i64) -> i64 {
    // Apart from the aggregate keys (`hash ^ seed`) and `migration_lock_key`.
    seed.rotate_left(43) ^ 0x696e_6465_785f_6275
}

/// How long a runner waits before it asks again for the index lock another runner holds.
const INDEX_LOCK_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// `Some(valid)` when the index `schema.name` exists (an index being built concurrently, or
/// left by an interrupted build, is not valid).
async fn index_state(
    conn: &mut sqlx::PgConnection,
    schema: &str,
    name: &str,
) -> Result<Option<bool>, StoreError> {
    sqlx::query_scalar(
        "SELECT i.indisvalid FROM pg_catalog.pg_index i WHERE i.indexrelid = to_regclass($1)",
    )
    .bind(qualified(schema, name))
    .fetch_optional(&mut *conn)
    .await
    .map_err(db)
}

/// Builds the index of every index migration (`Migration::index`; all are recorded as applied
/// once [`migrate_once`] succeeded) that is missing or invalid, with `CREATE INDEX
/// CONCURRENTLY`, outside any transaction: appends, claims and completions go on during the
/// build (it takes a `SHARE UPDATE EXCLUSIVE` lock, which they do not conflict with). An index
/// left invalid by an interrupted build is dropped (`DROP INDEX CONCURRENTLY`) and built
/// again. A valid index is left alone, without taking any lock: the usual run costs one
/// catalog read per index.
///
/// A concurrent build waits for every transaction of the database that is older than its
/// snapshots, so it lasts at least as long as the longest one running beside it. The builds
/// are serialized across runners by a session advisory lock ([`index_lock_key`]), asked for
/// without blocking (`pg_try_advisory_lock`, again every [`INDEX_LOCK_POLL`]): a runner that
/// waited inside a statement would hold a snapshot the other runner's build waits for. The
/// lock belongs to the server session, so the runner needs a direct connection or a pooler in
/// session mode (as the relay does); behind a pooler in transaction mode its release may land
/// on another session, which is reported as an error.
async fn build_indexes(
    pool: &PgPool,
    component: &Component,
    schema: &str,
    table: &str,
) -> Result<(), StoreError> {
    let migrations = match component {
        Component::Outbox => OUTBOX_MIGRATIONS,
        Component::Inbox => INBOX_MIGRATIONS,
    };
    for migration in migrations {
        let Some(index) = &migration.index else {
            continue;
        };
        let name = format!("{table}{}", index.suffix);
        let mut conn = pool.acquire().await.map_err(db)?;
        if index_state(&mut conn, schema, &name).await? == Some(true) {
            continue;
        }
        let key = index_lock_key(crate::sql::seed(schema, table));
        let started = std::time::Instant::now();
        let mut reported = std::time::Duration::ZERO;
        loop {
            let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                .bind(key)
                .fetch_one(&mut *conn)
                .await
                .map_err(db)?;
            if got {
                break;
            }
            if started.elapsed() >= reported + std::time::Duration::from_secs(30) {
                reported = started.elapsed();
                tracing::info!(index = %name, waited_s = reported.as_secs(), "migration: another runner builds this table's indexes; waiting for it");
            }
            tokio::time::sleep(INDEX_LOCK_POLL).await;
        }
        let sql = render(&concurrent_index_sql(index.template), schema, table);
        let built = build_index(&mut conn, schema, &name, &sql).await;
        let released = sqlx::query_scalar::<_, bool>("SELECT pg_advisory_unlock($1)")
            .bind(key)
            .fetch_one(&mut *conn)
            .await;
        let released = match released {
            Ok(true) => Ok(()),
            Ok(false) => Err(config(format!(
                "migration: the index build lock of {schema}.{table} was not held by the \
                 session releasing it: run migrations over a direct connection or a pooler in \
                 session mode, not in transaction mode"
            ))),
            Err(e) => {
                // The lock goes with the session: close it rather than return it to the pool.
                drop(conn.detach());
                Err(db(e))
            }
        };
        // The build's own error first (a failed release is then most likely its consequence).
        built?;
        released?;
    }
    Ok(())
}

/// Under the index lock: drops an invalid `schema.name` and builds it concurrently (`sql`).
async fn build_index(
    conn: &mut sqlx::PgConnection,
    schema: &str,
    name: &str,
    sql: &str,
) -> Result<(), StoreError> {
    match index_state(conn, schema, name).await? {
        Some(true) => return Ok(()), // built by another runner meanwhile
        Some(false) => {
            tracing::warn!(index = %name, "migration: dropping the invalid index an interrupted build left, and building it again");
            conn.execute(
                format!(
                    "DROP INDEX CONCURRENTLY IF EXISTS {}",
                    qualified(schema, name)
                )
                .as_str(),
            )
            .await
            .map_err(db)?;
        }
        None => {}
    }
    tracing::info!(index = %name, "migration: building an index concurrently");
    conn.execute(sql).await.map_err(db)?;
    match index_state(conn, schema, name).await? {
        Some(true) => Ok(()),
        _ => Err(config(format!(
            "migration: index {schema}.{name} is not valid after its concurrent build"
        ))),
    }
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
    // A table this transaction creates is empty and invisible to others: its index migrations
    // build their index here, as plain SQL does. On an existing table they are built after
    // the commit, concurrently (`build_indexes`).
    let fresh: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NULL")
        .bind(qualified(schema, table))
        .fetch_one(&mut *tx)
        .await
        .map_err(db)?;
    for migration in migrations.iter().filter(|m| m.version > applied) {
        if !migration.template.is_empty() {
            let sql = render(migration.template, schema, table);
            (&mut *tx).execute(sql.as_str()).await.map_err(db)?;
        }
        if let (true, Some(index)) = (fresh, &migration.index) {
            let sql = render(index.template, schema, table);
            (&mut *tx).execute(sql.as_str()).await.map_err(db)?;
        }
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

    /// Every index migration's template is exactly one plain `CREATE INDEX IF NOT EXISTS` of
    /// the index it names (besides comments), so its concurrent form is that one statement.
    #[test]
    fn index_migrations_are_one_plain_index_statement() {
        let all = OUTBOX_MIGRATIONS.iter().chain(INBOX_MIGRATIONS);
        let mut seen = 0;
        for m in all {
            let Some(index) = &m.index else { continue };
            let suffix = index.suffix;
            seen += 1;
            let code: String = index
                .template
                .lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n");
            let code = code.trim();
            let head = format!("{PLAIN_INDEX}\"__TABLE__{suffix}\"");
            assert!(code.starts_with(&head), "migration {}: {code}", m.version);
            assert_eq!(code.matches(';').count(), 1, "migration {}", m.version);
            assert!(code.ends_with(';'), "migration {}", m.version);
            let concurrent = concurrent_index_sql(index.template);
            assert!(concurrent.contains(&format!(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS \"__TABLE__{suffix}\""
            )));
            assert!(!concurrent.contains(PLAIN_INDEX));
        }
        assert!(seen >= 1);
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
