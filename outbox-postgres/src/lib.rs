//! PostgreSQL (sqlx) outbox and inbox stores.
