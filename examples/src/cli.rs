//! Pieces shared by the example processes and their tests.

/// Parses a `key=value` command-line argument (librdkafka properties).
pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

/// Parses a PostgreSQL schema name argument (`value_parser` for clap): checked with the stores'
/// own [`outbox_postgres::validate_identifier`] while the arguments are parsed, so a hostile or
/// malformed name stops the program before it connects anywhere or runs any SQL. Programs then
/// write it into SQL only through [`outbox_postgres::qualified`] /
/// [`outbox_postgres::quote_identifier`].
pub fn parse_schema(s: &str) -> Result<String, String> {
    outbox_postgres::validate_identifier("schema", s, outbox_postgres::MAX_IDENTIFIER_LEN)
        .map(|()| s.to_owned())
        .map_err(|e| e.message)
}

/// Parses a Kafka topic name argument (`value_parser` for clap) with the publisher's own
/// [`outbox_kafka::validate_topic_name`].
pub fn parse_topic(s: &str) -> Result<String, String> {
    outbox_kafka::validate_topic_name("topic", s)
        .map(|()| s.to_owned())
        .map_err(|e| e.0)
}

/// Logs to stderr, filtered by `RUST_LOG` (default `warn`).
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
