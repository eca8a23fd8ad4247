//! Errors of the commands: each names the cause and the fix, and maps to a documented exit code.
//!
//! | exit code | meaning | what a supervisor of `outbox relay` should do |
//! |---|---|---|
//! | 0 | success; for the relay: stopped by SIGTERM/SIGINT with nothing left for an operator (retries, transport deferrals and store errors that recovered during the run are not failures of the run) | nothing; restart it if it should run |
//! | 1 | the command ran and found a problem: `check` violations, `reconcile` mismatches, an operator action refused by the store; for the relay: stopped by a signal after it parked events in this run that are still parked, or while it was still failing (database or broker unreachable, a worker that did not finish) | restart it (safe: nothing is lost) and alert a human: `outbox parked list`, `outbox status` |
//! | 2 | bad usage or configuration (flags, file, environment, values; an unknown `transport.kind`, the chosen transport's address missing or not a URL), checked before any service is contacted | do not restart in a loop: the same configuration fails the same way; alert a human to fix it |
//! | 3 | a service is unreachable (database, or the transport's broker: Kafka, NATS, RabbitMQ): host, port and cause are named | restart with a growing backoff; alert if it lasts |
//! | 4 | the database is reachable but not ready: schema missing or out of date (`outbox migrate`; `outbox migrate info` exits 4 while a migration is pending), a missing privilege (the exact `GRANT` statements are printed), a missing topic, a NATS subject no stream captures, a RabbitMQ exchange missing or not durable or of another type; for the relay also a permanent store error while running (table dropped, privilege revoked) | do not restart in a loop: run the printed fix (migrate, grant, create the topic), then restart |
//! | 5 | not used (earlier versions: "not available yet", for consumer-side parking, which exists now) | |
//! | 6 | aborted: a confirmation was declined | |

use std::fmt;

use outbox_core::{StoreError, StoreErrorKind};

/// Category of a [`CliError`], which decides the exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Exit 1: the command found a problem or an action was refused.
    Failed,
    /// Exit 2: usage or configuration.
    Config,
    /// Exit 3: database or broker unreachable.
    Unreachable,
    /// Exit 4: schema missing/out of date or privilege missing.
    NotReady,
    /// Exit 6: aborted by the operator.
    Aborted,
}

impl ErrorKind {
    /// The process exit code.
    pub const fn exit_code(self) -> u8 {
        match self {
            Self::Failed => 1,
            Self::Config => 2,
            Self::Unreachable => 3,
            Self::NotReady => 4,
            Self::Aborted => 6,
        }
    }

    /// Stable name, used in `--json` errors.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Failed => "failed",
            Self::Config => "config",
            Self::Unreachable => "unreachable",
            Self::NotReady => "not_ready",
            Self::Aborted => "aborted",
        }
    }
}

/// An error with its cause and the fix. Never carries a secret: messages are built from
/// redacted values.
#[derive(Debug)]
pub struct CliError {
    /// Category (exit code).
    pub kind: ErrorKind,
    /// What went wrong.
    pub message: String,
    /// What to do about it.
    pub hint: Option<String>,
    /// The command already wrote its `--json` document (which carries the findings): no
    /// second `{"error": ...}` document on stdout.
    pub reported: bool,
}

impl CliError {
    /// A new error.
    pub fn new(kind: ErrorKind, message: impl Into<String>, hint: Option<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            hint,
            reported: false,
        }
    }
    /// Usage or configuration (exit 2).
    pub fn config(message: impl Into<String>, hint: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, message, Some(hint.into()))
    }
    /// A finding or a refused action (exit 1).
    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Failed, message, None)
    }
    /// Unreachable service (exit 3).
    pub fn unreachable(message: impl Into<String>, hint: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unreachable, message, Some(hint.into()))
    }
    /// Schema or privilege missing (exit 4).
    pub fn not_ready(message: impl Into<String>, hint: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotReady, message, Some(hint.into()))
    }
    /// Adds or replaces the hint.
    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// Marks the findings as written already (see [`CliError::reported`]).
    pub fn reported(mut self) -> Self {
        self.reported = true;
        self
    }

    /// The process exit code.
    pub fn exit_code(&self) -> u8 {
        self.kind.exit_code()
    }

    /// `{"error": {"kind", "message", "hint"}}` for `--json`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "kind": self.kind.as_str(),
                "message": self.message,
                "hint": self.hint,
            }
        })
    }

    /// Maps a store error of an operation on `what` (the outbox table, qualified) to an error
    /// with a fix: a missing table says `outbox migrate`, a missing privilege names the grant.
    pub fn from_store(err: &StoreError, what: &str) -> Self {
        match err.kind {
            StoreErrorKind::Schema => Self::not_ready(
                format!(
                    "the outbox schema is missing or out of date ({what}): {}",
                    err.message
                ),
                "run `outbox migrate` (with the same [outbox] schema and table)",
            ),
            StoreErrorKind::Configuration if is_privilege(err) => Self::not_ready(
                format!("permission denied on {what}: {}", err.message),
                "run `outbox check` (or start `outbox relay`) as this role: it prints the \
                 exact GRANT statements for the tables it lacks rights on",
            ),
            StoreErrorKind::Connection => Self::unreachable(
                format!("database connection failed: {}", err.message),
                "check that the database server is running and reachable from here",
            ),
            StoreErrorKind::NotFound => Self::failed(err.message.clone()),
            StoreErrorKind::Conflict => {
                Self::failed(format!("{} (a concurrent change; try again)", err.message))
            }
            _ => Self::failed(format!("{what}: {}", err.message)),
        }
    }
}

/// Whether a `Configuration` store error is a missing privilege: PostgreSQL's "insufficient
/// privilege", or MySQL's / MariaDB's access denied to a database, table or operation.
pub fn is_privilege(err: &StoreError) -> bool {
    use outbox_mysql::codes;
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        if let Some(sqlx::Error::Database(db)) = s.downcast_ref::<sqlx::Error>() {
            if let Some(my) = db.try_downcast_ref::<outbox_mysql::sqlx::mysql::MySqlDatabaseError>()
            {
                return matches!(
                    my.number(),
                    codes::DBACCESS_DENIED
                        | codes::TABLEACCESS_DENIED
                        | codes::SPECIFIC_ACCESS_DENIED
                        | COLUMNACCESS_DENIED
                );
            }
            return db.code().as_deref() == Some("42501");
        }
        source = s.source();
    }
    false
}

/// MySQL's "command denied to user for column" (not among `outbox_mysql::codes`).
const COLUMNACCESS_DENIED: u16 = 1143;

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "error: {}", self.message)?;
        if let Some(h) = &self.hint {
            write!(f, "\n  hint: {h}")?;
        }
        Ok(())
    }
}

impl std::error::Error for CliError {}

impl From<outbox_core::ConfigError> for CliError {
    fn from(e: outbox_core::ConfigError) -> Self {
        Self::config(e.0, "fix the configuration value named above")
    }
}
