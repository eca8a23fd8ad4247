//! Mapping of sqlx errors onto [`StoreError`], from typed signals only (error variants,
//! SQLSTATE codes, [`sqlx::error::ErrorKind`]); never from message text.

use outbox_core::{ErrorClass, StoreError, StoreErrorKind};
use sqlx::error::ErrorKind as DbKind;

/// Maps a SQLSTATE code (and sqlx's constraint kind) onto a store error kind and class.
///
/// Transient: serialization failure and deadlock (`40001`, `40P01`), lock not available
/// (`55P03`), connection exceptions (class `08`), operator intervention such as admin shutdown,
/// crash shutdown and "cannot connect now" (`57P01`..`57P03`), a session the server ended for
/// idling in a transaction (`25P03`: `idle_in_transaction_session_timeout`, which ends a
/// locked claim held past `locked_max_hold`), statement/lock timeouts and
/// cancellations (`57014`), insufficient resources (class `53`, e.g. `53300` too many
/// connections) and an aborted transaction (`25P02` is permanent for the transaction but the
/// operation can be retried: transient).
/// Permanent: integrity constraints (class `23`) as `Constraint`, a missing relation, column,
/// schema or function (`42P01`, `42703`, `3F000`, `42883`) as `Schema`, privileges (`42501`)
/// as `Configuration`, everything else as `Other`.
pub fn classify_sqlstate(code: &str, kind: DbKind) -> (StoreErrorKind, ErrorClass) {
    use StoreErrorKind as K;
    let class = |k: K| (k, k.default_class());
    match kind {
        DbKind::UniqueViolation
        | DbKind::ForeignKeyViolation
        | DbKind::NotNullViolation
        | DbKind::CheckViolation => return class(K::Constraint),
        _ => {}
    }
    match code {
        "40001" | "40P01" | "55P03" => class(K::Conflict),
        "25P02" => (K::Conflict, ErrorClass::Transient),
        "57P01" | "57P02" | "57P03" | "57P04" | "57P05" | "25P03" => class(K::Connection),
        "57014" => (K::Other, ErrorClass::Transient),
        "42P01" | "42703" | "3F000" | "42883" | "42704" => class(K::Schema),
        "42501" | "28000" | "28P01" => class(K::Configuration),
        c if c.starts_with("08") => class(K::Connection),
        c if c.starts_with("53") => (K::Connection, ErrorClass::Transient),
        c if c.starts_with("23") => class(K::Constraint),
        c if c.starts_with("40") => class(K::Conflict),
        _ => class(K::Other),
    }
}

/// Maps a sqlx error onto a [`StoreError`] (kind, class, message) keeping it as the source.
pub fn map_sqlx_error(err: sqlx::Error) -> StoreError {
    use StoreErrorKind as K;
    let (kind, class) = match &err {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            classify_sqlstate(&code, db.kind())
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

pub(crate) fn db(err: sqlx::Error) -> StoreError {
    map_sqlx_error(err)
}

pub(crate) fn config(message: impl Into<String>) -> StoreError {
    StoreError::new(StoreErrorKind::Configuration, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;

    #[derive(Debug)]
    struct FakeDbError {
        code: &'static str,
        kind: DbKind,
    }

    impl std::fmt::Display for FakeDbError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "fake {}", self.code)
        }
    }
    impl std::error::Error for FakeDbError {}

    impl sqlx::error::DatabaseError for FakeDbError {
        fn message(&self) -> &str {
            "fake"
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.code))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> DbKind {
            match self.kind {
                DbKind::UniqueViolation => DbKind::UniqueViolation,
                DbKind::ForeignKeyViolation => DbKind::ForeignKeyViolation,
                DbKind::NotNullViolation => DbKind::NotNullViolation,
                DbKind::CheckViolation => DbKind::CheckViolation,
                _ => DbKind::Other,
            }
        }
    }

    #[test]
    fn sqlstate_table() {
        use ErrorClass::*;
        use StoreErrorKind as K;
        let table: &[(&str, DbKind, K, ErrorClass)] = &[
            ("40001", DbKind::Other, K::Conflict, Transient),
            ("40P01", DbKind::Other, K::Conflict, Transient),
            ("55P03", DbKind::Other, K::Conflict, Transient),
            ("08000", DbKind::Other, K::Connection, Transient),
            ("08006", DbKind::Other, K::Connection, Transient),
            ("08P01", DbKind::Other, K::Connection, Transient),
            ("57P01", DbKind::Other, K::Connection, Transient),
            ("57P03", DbKind::Other, K::Connection, Transient),
            ("25P03", DbKind::Other, K::Connection, Transient),
            ("53300", DbKind::Other, K::Connection, Transient),
            ("53200", DbKind::Other, K::Connection, Transient),
            ("57014", DbKind::Other, K::Other, Transient),
            ("25P02", DbKind::Other, K::Conflict, Transient),
            ("23505", DbKind::UniqueViolation, K::Constraint, Permanent),
            (
                "23503",
                DbKind::ForeignKeyViolation,
                K::Constraint,
                Permanent,
            ),
            ("23502", DbKind::NotNullViolation, K::Constraint, Permanent),
            ("23514", DbKind::CheckViolation, K::Constraint, Permanent),
            ("23P01", DbKind::Other, K::Constraint, Permanent),
            ("42P01", DbKind::Other, K::Schema, Permanent),
            ("42703", DbKind::Other, K::Schema, Permanent),
            ("3F000", DbKind::Other, K::Schema, Permanent),
            ("42883", DbKind::Other, K::Schema, Permanent),
            ("42501", DbKind::Other, K::Configuration, Permanent),
            ("22P02", DbKind::Other, K::Other, Permanent),
            ("42601", DbKind::Other, K::Other, Permanent),
        ];
        for (code, kind, want_kind, want_class) in table {
            let fake = FakeDbError {
                code,
                kind: match kind {
                    DbKind::UniqueViolation => DbKind::UniqueViolation,
                    DbKind::ForeignKeyViolation => DbKind::ForeignKeyViolation,
                    DbKind::NotNullViolation => DbKind::NotNullViolation,
                    DbKind::CheckViolation => DbKind::CheckViolation,
                    _ => DbKind::Other,
                },
            };
            let err = map_sqlx_error(sqlx::Error::Database(Box::new(fake)));
            assert_eq!(err.kind, *want_kind, "{code}");
            assert_eq!(err.class, *want_class, "{code}");
            assert!(std::error::Error::source(&err).is_some(), "{code}");
        }
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
            (sqlx::Error::Protocol("x".into()), K::Connection, Transient),
            (sqlx::Error::RowNotFound, K::NotFound, Permanent),
            (
                sqlx::Error::ColumnNotFound("c".into()),
                K::Schema,
                Permanent,
            ),
            (
                sqlx::Error::TypeNotFound {
                    type_name: "t".into(),
                },
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
            assert_eq!(mapped.kind, kind, "{name}");
            assert_eq!(mapped.class, class, "{name}");
        }
    }
}
