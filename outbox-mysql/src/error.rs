//! Mapping of sqlx's MySQL errors onto [`StoreError`], from typed signals only: the server's
//! error number ([`sqlx::mysql::MySqlDatabaseError::number`]), its SQLSTATE, sqlx's error
//! variants. Never from message text.

use outbox_core::{ErrorClass, StoreError, StoreErrorKind};

/// Error numbers the mapping names (MySQL 8 and MariaDB share them unless noted).
pub mod codes {
    /// `ER_DUP_KEY`.
    pub const DUP_KEY: u16 = 1022;
    /// `ER_DUP_ENTRY`: a unique key violated.
    pub const DUP_ENTRY: u16 = 1062;
    /// `ER_DUP_UNIQUE` (NDB).
    pub const DUP_UNIQUE: u16 = 1169;
    /// `ER_DUP_ENTRY_WITH_KEY_NAME`.
    pub const DUP_ENTRY_WITH_KEY_NAME: u16 = 1586;
    /// `ER_DUP_UNKNOWN_IN_INDEX`.
    pub const DUP_UNKNOWN_IN_INDEX: u16 = 1859;
    /// `ER_DUP_FIELDNAME`: a column of that name exists (an `ALTER TABLE` run twice).
    pub const DUP_FIELDNAME: u16 = 1060;
    /// `ER_DUP_KEYNAME`: an index of that name exists.
    pub const DUP_KEYNAME: u16 = 1061;
    /// `ER_CANT_DROP_FIELD_OR_KEY`: a dropped column or index does not exist.
    pub const CANT_DROP_FIELD_OR_KEY: u16 = 1091;
    /// `ER_BAD_FIELD_ERROR`: unknown column.
    pub const BAD_FIELD_ERROR: u16 = 1054;
    /// `ER_CONSTRAINT_NOT_FOUND` (MySQL): `DROP CONSTRAINT` of a missing one.
    pub const CONSTRAINT_NOT_FOUND: u16 = 3940;
    /// `ER_CHECK_CONSTRAINT_DUP_NAME` (MySQL): a CHECK of that name exists.
    pub const CHECK_CONSTRAINT_DUP_NAME: u16 = 3822;
    /// `ER_DUP_CONSTRAINT_NAME` (MariaDB): a constraint of that name exists.
    pub const DUP_CONSTRAINT_NAME: u16 = 1826;
    /// `ER_BAD_NULL_ERROR`.
    pub const BAD_NULL: u16 = 1048;
    /// `ER_NO_DEFAULT_FOR_FIELD`.
    pub const NO_DEFAULT_FOR_FIELD: u16 = 1364;
    /// `ER_NO_REFERENCED_ROW_2` (a foreign key).
    pub const NO_REFERENCED_ROW_2: u16 = 1452;
    /// `ER_ROW_IS_REFERENCED_2` (a foreign key).
    pub const ROW_IS_REFERENCED_2: u16 = 1451;
    /// `ER_CHECK_CONSTRAINT_VIOLATED` (MySQL 8).
    pub const CHECK_CONSTRAINT_VIOLATED: u16 = 3819;
    /// `ER_CONSTRAINT_FAILED` (MariaDB's CHECK violation).
    pub const MARIADB_CONSTRAINT_FAILED: u16 = 4025;
    /// `ER_DATA_TOO_LONG`: a value does not fit its column (strict mode).
    pub const DATA_TOO_LONG: u16 = 1406;
    /// `ER_LOCK_DEADLOCK`: the transaction was rolled back to break a deadlock.
    pub const LOCK_DEADLOCK: u16 = 1213;
    /// `ER_LOCK_WAIT_TIMEOUT`: `innodb_lock_wait_timeout` ran out (the statement is rolled
    /// back; the transaction too when `innodb_rollback_on_timeout` is on).
    pub const LOCK_WAIT_TIMEOUT: u16 = 1205;
    /// `ER_LOCK_NOWAIT` (MySQL 8: `NOWAIT` found a lock).
    pub const LOCK_NOWAIT: u16 = 3572;
    /// `ER_CHECKREAD`: "record has changed since last read" (MariaDB with
    /// `innodb_snapshot_isolation`).
    pub const CHECKREAD: u16 = 1020;
    /// `ER_ERROR_DURING_COMMIT` (e.g. a Galera certification failure).
    pub const ERROR_DURING_COMMIT: u16 = 1180;
    /// `ER_TOO_MANY_CONCURRENT_TRXS`.
    pub const TOO_MANY_CONCURRENT_TRXS: u16 = 1637;
    /// `ER_LOCK_TABLE_FULL`: the lock table ran out of memory.
    pub const LOCK_TABLE_FULL: u16 = 1206;
    /// `ER_CON_COUNT_ERROR`: too many connections.
    pub const CON_COUNT: u16 = 1040;
    /// `ER_TOO_MANY_USER_CONNECTIONS`.
    pub const TOO_MANY_USER_CONNECTIONS: u16 = 1203;
    /// `ER_USER_LIMIT_REACHED`.
    pub const USER_LIMIT_REACHED: u16 = 1226;
    /// `ER_SERVER_SHUTDOWN`.
    pub const SERVER_SHUTDOWN: u16 = 1053;
    /// `ER_ABORTING_CONNECTION`.
    pub const ABORTING_CONNECTION: u16 = 1152;
    /// `ER_NET_READ_ERROR`.
    pub const NET_READ_ERROR: u16 = 1158;
    /// `ER_NET_READ_INTERRUPTED`.
    pub const NET_READ_INTERRUPTED: u16 = 1159;
    /// `ER_NET_ERROR_ON_WRITE`.
    pub const NET_ERROR_ON_WRITE: u16 = 1160;
    /// `ER_NET_WRITE_INTERRUPTED`.
    pub const NET_WRITE_INTERRUPTED: u16 = 1161;
    /// `ER_QUERY_INTERRUPTED` (`KILL QUERY`).
    pub const QUERY_INTERRUPTED: u16 = 1317;
    /// `ER_CONNECTION_KILLED` (MariaDB: `KILL`).
    pub const CONNECTION_KILLED: u16 = 1927;
    /// `ER_STATEMENT_TIMEOUT` (MariaDB `max_statement_time`).
    pub const MARIADB_STATEMENT_TIMEOUT: u16 = 1969;
    /// `ER_QUERY_TIMEOUT` (MySQL `max_execution_time`).
    pub const QUERY_TIMEOUT: u16 = 3024;
    /// `ER_CLIENT_INTERACTION_TIMEOUT` (MySQL 8.0.24+: the server closed an idle session,
    /// `wait_timeout`; this is how a locked claim held past its hold ends).
    pub const CLIENT_INTERACTION_TIMEOUT: u16 = 4031;
    /// `CR_SERVER_GONE_ERROR` (client library code; proxies relay it).
    pub const CR_SERVER_GONE: u16 = 2006;
    /// `CR_SERVER_LOST` (client library code; proxies relay it).
    pub const CR_SERVER_LOST: u16 = 2013;
    /// `ER_BAD_DB_ERROR`: unknown database.
    pub const BAD_DB: u16 = 1049;
    /// `ER_BAD_FIELD_ERROR`: unknown column.
    pub const BAD_FIELD: u16 = 1054;
    /// `ER_NO_SUCH_TABLE`.
    pub const NO_SUCH_TABLE: u16 = 1146;
    /// `ER_SP_DOES_NOT_EXIST`: unknown function.
    pub const SP_DOES_NOT_EXIST: u16 = 1305;
    /// `ER_DBACCESS_DENIED_ERROR`.
    pub const DBACCESS_DENIED: u16 = 1044;
    /// `ER_ACCESS_DENIED_ERROR`.
    pub const ACCESS_DENIED: u16 = 1045;
    /// `ER_TABLEACCESS_DENIED_ERROR`.
    pub const TABLEACCESS_DENIED: u16 = 1142;
    /// `ER_SPECIFIC_ACCESS_DENIED_ERROR`.
    pub const SPECIFIC_ACCESS_DENIED: u16 = 1227;
    /// `ER_UNKNOWN_SYSTEM_VARIABLE`.
    pub const UNKNOWN_SYSTEM_VARIABLE: u16 = 1193;
    /// `ER_BINLOG_STMT_MODE_AND_ROW_ENGINE`-like refusal: statement-based binary logging with
    /// READ COMMITTED (`ER_BINLOG_LOGGING_IMPOSSIBLE`).
    pub const BINLOG_LOGGING_IMPOSSIBLE: u16 = 1665;
}

/// Maps a server error (number and SQLSTATE) onto a store error kind and class.
///
/// Transient: deadlock, lock wait timeout, `NOWAIT`, "record changed since last read", commit
/// failures, too many transactions (`Conflict`); lost or refused connections, server
/// shutdown, killed connections, an idle session closed by the server (`Connection`);
/// interrupted or timed-out statements and a full lock table (`Other`, transient).
/// Permanent: unique, foreign-key, NOT NULL and CHECK violations and values too long
/// (`Constraint`); unknown database, table, column or function (`Schema`); denied access and
/// statement-based binary logging under READ COMMITTED (`Configuration`); everything else
/// (`Other`). An unknown number falls back on its SQLSTATE class (`40` conflict, `08`
/// connection, `23` constraint, `42S0` schema).
pub fn classify_mysql_error(number: u16, sqlstate: Option<&str>) -> (StoreErrorKind, ErrorClass) {
    use codes::*;
    use StoreErrorKind as K;
    let class = |k: K| (k, k.default_class());
    match number {
        DUP_KEY
        | DUP_ENTRY
        | DUP_UNIQUE
        | DUP_ENTRY_WITH_KEY_NAME
        | DUP_UNKNOWN_IN_INDEX
        | BAD_NULL
        | NO_DEFAULT_FOR_FIELD
        | NO_REFERENCED_ROW_2
        | ROW_IS_REFERENCED_2
        | CHECK_CONSTRAINT_VIOLATED
        | MARIADB_CONSTRAINT_FAILED
        | DATA_TOO_LONG => class(K::Constraint),
        LOCK_DEADLOCK
        | LOCK_WAIT_TIMEOUT
        | LOCK_NOWAIT
        | CHECKREAD
        | ERROR_DURING_COMMIT
        | TOO_MANY_CONCURRENT_TRXS => (K::Conflict, ErrorClass::Transient),
        CON_COUNT
        | TOO_MANY_USER_CONNECTIONS
        | USER_LIMIT_REACHED
        | SERVER_SHUTDOWN
        | ABORTING_CONNECTION
        | NET_READ_ERROR
        | NET_READ_INTERRUPTED
        | NET_ERROR_ON_WRITE
        | NET_WRITE_INTERRUPTED
        | CONNECTION_KILLED
        | CLIENT_INTERACTION_TIMEOUT
        | CR_SERVER_GONE
        | CR_SERVER_LOST => (K::Connection, ErrorClass::Transient),
        QUERY_INTERRUPTED | MARIADB_STATEMENT_TIMEOUT | QUERY_TIMEOUT | LOCK_TABLE_FULL => {
            (K::Other, ErrorClass::Transient)
        }
        BAD_DB | BAD_FIELD | NO_SUCH_TABLE | SP_DOES_NOT_EXIST => class(K::Schema),
        DBACCESS_DENIED
        | ACCESS_DENIED
        | TABLEACCESS_DENIED
        | SPECIFIC_ACCESS_DENIED
        | BINLOG_LOGGING_IMPOSSIBLE => class(K::Configuration),
        _ => match sqlstate.unwrap_or("") {
            s if s.starts_with("40") => (K::Conflict, ErrorClass::Transient),
            s if s.starts_with("08") => (K::Connection, ErrorClass::Transient),
            s if s.starts_with("23") => class(K::Constraint),
            s if s.starts_with("42S0") => class(K::Schema),
            _ => class(K::Other),
        },
    }
}

/// Maps a sqlx error onto a [`StoreError`] (kind, class, message), keeping it as the source.
pub fn map_sqlx_error(err: sqlx::Error) -> StoreError {
    use StoreErrorKind as K;
    let (kind, class) = match &err {
        sqlx::Error::Database(db) => {
            match db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                Some(my) => classify_mysql_error(my.number(), my.code()),
                None => classify_mysql_error(0, db.code().as_deref()),
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed => (K::Connection, ErrorClass::Transient),
        sqlx::Error::RowNotFound => (K::NotFound, ErrorClass::Permanent),
        sqlx::Error::Configuration(_) | sqlx::Error::InvalidArgument(_) => {
            (K::Configuration, ErrorClass::Permanent)
        }
        sqlx::Error::TypeNotFound { .. }
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Migrate(_) => (K::Schema, ErrorClass::Permanent),
        _ => (K::Other, ErrorClass::Permanent),
    };
    StoreError::new(kind, err.to_string())
        .with_class(class)
        .with_source(err)
}

/// The server's error number of `err`, when it is a MySQL server error.
pub(crate) fn error_number(err: &sqlx::Error) -> Option<u16> {
    match err {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(sqlx::mysql::MySqlDatabaseError::number),
        _ => None,
    }
}

/// A duplicate key (a unique index refused the row).
pub(crate) fn is_duplicate(err: &sqlx::Error) -> bool {
    matches!(
        error_number(err),
        Some(codes::DUP_ENTRY | codes::DUP_KEY | codes::DUP_ENTRY_WITH_KEY_NAME)
    )
}

/// A deadlock or lock wait timeout: the transaction (or statement) was rolled back and can be
/// run again.
pub(crate) fn is_lock_conflict(err: &StoreError) -> bool {
    err.kind == StoreErrorKind::Conflict && err.class == ErrorClass::Transient && {
        let src = std::error::Error::source(err)
            .and_then(|s| s.downcast_ref::<sqlx::Error>())
            .and_then(error_number);
        matches!(
            src,
            Some(codes::LOCK_DEADLOCK | codes::LOCK_WAIT_TIMEOUT | codes::CHECKREAD)
        )
    }
}

/// A text column. Read as bytes: the store's tables are `utf8mb4_bin` (byte-wise comparison
/// whatever the server's default collation), and MySQL flags binary-collated columns as
/// BINARY, which sqlx will not decode as `String`.
pub(crate) fn text(row: &sqlx::mysql::MySqlRow, column: &str) -> Result<String, StoreError> {
    opt_text(row, column)?.ok_or_else(|| {
        StoreError::new(
            StoreErrorKind::Schema,
            format!("column {column} is NULL where text was expected"),
        )
    })
}

/// A nullable text column (see [`text`]).
pub(crate) fn opt_text(
    row: &sqlx::mysql::MySqlRow,
    column: &str,
) -> Result<Option<String>, StoreError> {
    use sqlx::Row;
    let bytes: Option<Vec<u8>> = row.try_get(column).map_err(db)?;
    bytes
        .map(|b| {
            String::from_utf8(b).map_err(|e| {
                StoreError::new(
                    StoreErrorKind::Schema,
                    format!("column {column} holds text that is not UTF-8: {e}"),
                )
            })
        })
        .transpose()
}

pub(crate) fn db(err: sqlx::Error) -> StoreError {
    map_sqlx_error(err)
}

pub(crate) fn config(message: impl Into<String>) -> StoreError {
    StoreError::new(StoreErrorKind::Configuration, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_error_table() {
        use codes::*;
        use ErrorClass::*;
        use StoreErrorKind as K;
        let table: &[(u16, &str, K, ErrorClass)] = &[
            (LOCK_DEADLOCK, "40001", K::Conflict, Transient),
            (LOCK_WAIT_TIMEOUT, "HY000", K::Conflict, Transient),
            (LOCK_NOWAIT, "HY000", K::Conflict, Transient),
            (CHECKREAD, "HY000", K::Conflict, Transient),
            (ERROR_DURING_COMMIT, "HY000", K::Conflict, Transient),
            (TOO_MANY_CONCURRENT_TRXS, "HY000", K::Conflict, Transient),
            (DUP_ENTRY, "23000", K::Constraint, Permanent),
            (DUP_KEY, "23000", K::Constraint, Permanent),
            (DUP_ENTRY_WITH_KEY_NAME, "23000", K::Constraint, Permanent),
            (BAD_NULL, "23000", K::Constraint, Permanent),
            (NO_DEFAULT_FOR_FIELD, "HY000", K::Constraint, Permanent),
            (NO_REFERENCED_ROW_2, "23000", K::Constraint, Permanent),
            (CHECK_CONSTRAINT_VIOLATED, "HY000", K::Constraint, Permanent),
            (MARIADB_CONSTRAINT_FAILED, "23000", K::Constraint, Permanent),
            (DATA_TOO_LONG, "22001", K::Constraint, Permanent),
            (CON_COUNT, "08004", K::Connection, Transient),
            (TOO_MANY_USER_CONNECTIONS, "42000", K::Connection, Transient),
            (SERVER_SHUTDOWN, "08S01", K::Connection, Transient),
            (ABORTING_CONNECTION, "08S01", K::Connection, Transient),
            (NET_READ_INTERRUPTED, "08S01", K::Connection, Transient),
            (CONNECTION_KILLED, "70100", K::Connection, Transient),
            (
                CLIENT_INTERACTION_TIMEOUT,
                "HY000",
                K::Connection,
                Transient,
            ),
            (CR_SERVER_GONE, "HY000", K::Connection, Transient),
            (CR_SERVER_LOST, "HY000", K::Connection, Transient),
            (QUERY_INTERRUPTED, "70100", K::Other, Transient),
            (MARIADB_STATEMENT_TIMEOUT, "70100", K::Other, Transient),
            (QUERY_TIMEOUT, "HY000", K::Other, Transient),
            (LOCK_TABLE_FULL, "HY000", K::Other, Transient),
            (NO_SUCH_TABLE, "42S02", K::Schema, Permanent),
            (BAD_FIELD, "42S22", K::Schema, Permanent),
            (BAD_DB, "42000", K::Schema, Permanent),
            (SP_DOES_NOT_EXIST, "42000", K::Schema, Permanent),
            (ACCESS_DENIED, "28000", K::Configuration, Permanent),
            (DBACCESS_DENIED, "42000", K::Configuration, Permanent),
            (TABLEACCESS_DENIED, "42000", K::Configuration, Permanent),
            (SPECIFIC_ACCESS_DENIED, "42000", K::Configuration, Permanent),
            (
                BINLOG_LOGGING_IMPOSSIBLE,
                "HY000",
                K::Configuration,
                Permanent,
            ),
            // A syntax error, a bad value: permanent.
            (1064, "42000", K::Other, Permanent),
            (1366, "HY000", K::Other, Permanent),
            // Unknown numbers fall back on the SQLSTATE class.
            (9999, "40001", K::Conflict, Transient),
            (9998, "08S01", K::Connection, Transient),
            (9997, "23000", K::Constraint, Permanent),
            (9996, "42S02", K::Schema, Permanent),
            (9995, "HY000", K::Other, Permanent),
        ];
        for (number, state, kind, class) in table {
            assert_eq!(
                classify_mysql_error(*number, Some(state)),
                (*kind, *class),
                "{number} / {state}"
            );
        }
        assert_eq!(
            classify_mysql_error(9999, None),
            (K::Other, ErrorClass::Permanent)
        );
    }

    #[test]
    fn sqlx_variant_table() {
        use ErrorClass::*;
        use StoreErrorKind as K;
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let table: Vec<(sqlx::Error, K, ErrorClass)> = vec![
            (sqlx::Error::Io(io), K::Connection, Transient),
            (sqlx::Error::PoolTimedOut, K::Connection, Transient),
            (sqlx::Error::PoolClosed, K::Connection, Transient),
            (sqlx::Error::WorkerCrashed, K::Connection, Transient),
            (sqlx::Error::BeginFailed, K::Connection, Transient),
            (sqlx::Error::Protocol("x".into()), K::Connection, Transient),
            (sqlx::Error::RowNotFound, K::NotFound, Permanent),
            (
                sqlx::Error::ColumnNotFound("c".into()),
                K::Schema,
                Permanent,
            ),
            (
                sqlx::Error::InvalidArgument("x".into()),
                K::Configuration,
                Permanent,
            ),
            (sqlx::Error::Decode("x".into()), K::Other, Permanent),
        ];
        for (err, kind, class) in table {
            let name = format!("{err:?}");
            let mapped = map_sqlx_error(err);
            assert_eq!((mapped.kind, mapped.class), (kind, class), "{name}");
            assert!(std::error::Error::source(&mapped).is_some(), "{name}");
        }
    }
}
