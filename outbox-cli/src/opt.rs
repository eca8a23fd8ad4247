//! Command-line options (clap derive). Flags override the environment, which overrides the
//! configuration file.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// The `outbox` command: operate a transactional outbox on PostgreSQL and Kafka.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, about, long_about = None, propagate_version = true)]
pub struct Opt {
    /// Global options.
    #[command(flatten)]
    pub global: GlobalOpts,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes.
#[derive(Debug, Args, Clone, Default)]
pub struct GlobalOpts {
    /// Configuration file (TOML). Default: ./outbox.toml when it exists.
    #[arg(long, short = 'c', env = "OUTBOX_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// PostgreSQL URL (overrides DATABASE_URL and the file; prefer OUTBOX_DATABASE__PASSWORD
    /// for the password).
    #[arg(long, global = true)]
    pub database_url: Option<String>,
    /// Kafka bootstrap servers (overrides KAFKA_BROKERS and the file).
    #[arg(long, global = true)]
    pub brokers: Option<String>,
    /// Schema of the outbox tables (default `outbox`).
    #[arg(long, global = true)]
    pub schema: Option<String>,
    /// Outbox table (default `outbox_events`).
    #[arg(long, global = true)]
    pub table: Option<String>,
    /// Machine-readable output on stdout (one JSON document; see the crate docs for each
    /// command's shape).
    #[arg(long, global = true)]
    pub json: bool,
    /// Log format on stderr: text or json.
    #[arg(long, global = true, value_parser = ["text", "json"])]
    pub log_format: Option<String>,
    /// Log filter (RUST_LOG syntax; RUST_LOG wins when set).
    #[arg(long, global = true)]
    pub log_level: Option<String>,
    /// Tables at their full width (no wrapping). By default tables fit the terminal, else
    /// $COLUMNS, wrapping long cells (ids are never broken); piped without $COLUMNS they are at
    /// full width already.
    #[arg(long, global = true)]
    pub wide: bool,
    /// Colour in logs and tables: auto (only on a terminal), always, never.
    #[arg(long, global = true, value_parser = ["auto", "always", "never"])]
    pub color: Option<String>,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the schema: outbox, per-aggregate state, audit, archive; the inboxes of configured
    /// consumers with --inbox.
    Migrate(MigrateOpts),
    /// Run the relay daemon until SIGTERM/SIGINT.
    Relay(RelayOpts),
    /// Backlog, ages, parked events, latency, forecast, backpressure and consumers.
    Status(StatusOpts),
    /// Inspect and work parked events.
    #[command(subcommand)]
    Parked(ParkedCommand),
    /// Re-publish already published events, marked as replays.
    Replay(ReplayOpts),
    /// Delete (or archive) finished rows now, in bounded batches.
    Cleanup(CleanupOpts),
    /// Validate the configuration as a whole against the database and the broker.
    Check(CheckOpts),
    /// Create or compare the destinations the relay publishes to: Kafka topics (partitions,
    /// replication, min.insync.replicas, retention.ms by the retention rule), the NATS
    /// JetStream stream, or the RabbitMQ exchange.
    #[command(subcommand)]
    Topics(TopicsCommand),
    /// Compare state transitions, outbox events, broker offsets and consumers' effects per
    /// interval and event type.
    Reconcile(ReconcileOpts),
    /// Serve the web console (backlog charts, parked events with audited actions, consumers)
    /// until SIGTERM/SIGINT. Read-only unless `console.operator_token` is set.
    Console(ConsoleOpts),
    /// Print the effective configuration (secrets redacted).
    Config,
    /// Print a shell completion script to stdout (no configuration or database needed).
    Completions(CompletionsOpts),
    /// Print the man page (roff) to stdout, or write one page per command into --dir.
    Man(ManOpts),
}

/// `outbox completions`
#[derive(Debug, Args)]
pub struct CompletionsOpts {
    /// The shell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// `outbox man`
#[derive(Debug, Args)]
pub struct ManOpts {
    /// Write `outbox.1` and one page per command (`outbox-migrate.1`, `outbox-parked-list.1`,
    /// ...) into this directory instead of printing `outbox.1`.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// `outbox migrate`
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct MigrateOpts {
    /// `info`: report instead of applying.
    #[command(subcommand)]
    pub action: Option<MigrateAction>,
    /// Also migrate the inbox of every configured consumer (in its own database when set).
    #[arg(long)]
    pub inbox: bool,
    /// Print the SQL instead of applying it (for your own migration tool).
    #[arg(long)]
    pub print_sql: bool,
}

/// `outbox migrate <action>`
#[derive(Debug, Subcommand)]
pub enum MigrateAction {
    /// Applied and pending migrations (version, description, applied at); changes nothing.
    /// Exit 0 when up to date, 4 when a migration is pending.
    Info(MigrateInfoOpts),
}

/// `outbox migrate info`
#[derive(Debug, Args)]
pub struct MigrateInfoOpts {
    /// Also the inbox of every configured consumer.
    #[arg(long)]
    pub inbox: bool,
}

/// `outbox relay`
#[derive(Debug, Args, Default)]
pub struct RelayOpts {
    /// Relay loops in this process.
    #[arg(long)]
    pub workers: Option<u16>,
    /// Most events per claim.
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Default topic.
    #[arg(long)]
    pub topic: Option<String>,
    /// Claim mode: lease or locked.
    #[arg(long, value_parser = ["lease", "locked"])]
    pub claim_mode: Option<String>,
    /// Lease duration, e.g. 45s.
    #[arg(long)]
    pub lease: Option<String>,
    /// Delivery timeout of the transport (`kafka.`, `nats.` or `rabbitmq.delivery_timeout`),
    /// e.g. 30s.
    #[arg(long)]
    pub delivery_timeout: Option<String>,
    /// Extra producer property `key=value` (repeatable; allow-listed).
    #[arg(long = "producer-property", value_parser = parse_kv)]
    pub producer_properties: Vec<(String, String)>,
    /// Address of /metrics, /healthz and /readyz (default 127.0.0.1:9464).
    #[arg(long)]
    pub listen: Option<String>,
    /// No HTTP endpoint.
    #[arg(long)]
    pub no_http: bool,
    /// No scheduled cleanup in this relay.
    #[arg(long)]
    pub no_cleanup: bool,
    /// Relay identity (default `<hostname>-<pid>`).
    #[arg(long)]
    pub owner: Option<String>,
    /// Do not claim the next batch while a full one is published.
    #[arg(long)]
    pub no_prefetch: bool,
}

/// `outbox console`
#[derive(Debug, Args, Default)]
pub struct ConsoleOpts {
    /// Listen address (default `console.listen`, 127.0.0.1:9465). A non-loopback address
    /// exposes the outbox's data to the network: see the console docs.
    #[arg(long)]
    pub listen: Option<String>,
}

/// `outbox status`
#[derive(Debug, Args)]
pub struct StatusOpts {
    /// Window of the latency percentiles and the created / published counts, e.g. 15m (the
    /// rate and forecast follow status.trend_window, as the relay's metric does).
    #[arg(long)]
    pub window: Option<String>,
    /// Skip the consumers' lag (no broker connection).
    #[arg(long)]
    pub no_consumers: bool,
    /// Redraw every INTERVAL (default 2s) until SIGINT (Ctrl-C) or SIGTERM, which end it with
    /// exit 0. With --json, one document per refresh.
    #[arg(long, value_name = "INTERVAL", num_args = 0..=1, default_missing_value = "2s")]
    pub watch: Option<String>,
}

/// `outbox parked ...`
#[derive(Debug, Subcommand)]
pub enum ParkedCommand {
    /// List parked events, oldest first.
    List(ParkedListOpts),
    /// One parked event with its error, earlier attempts and audit trail.
    Show(ParkedTarget),
    /// Make a parked event claimable again (after a fix).
    Retry(ParkedActionOpts),
    /// Remove a parked event from delivery; its aggregate's later events flow again.
    Discard(ParkedActionOpts),
    /// Replace a parked event by a copy with a new id (consumers dedupe the two as one).
    Reissue(ParkedActionOpts),
    /// End the claims (leases) of a relay that is gone; without OWNER, list the dead relays
    /// that still hold claims.
    ReleaseClaims(ReleaseClaimsOpts),
}

/// `outbox parked list`
#[derive(Debug, Args)]
pub struct ParkedListOpts {
    /// Most events to list.
    #[arg(long, default_value_t = 50)]
    pub limit: usize,
    /// A consumer's parked messages instead of the outbox's.
    #[arg(long)]
    pub consumer: Option<String>,
    /// With --consumer: resolved messages too (applied, skipped, discarded).
    #[arg(long)]
    pub all: bool,
}

/// An event id, producer side or a consumer's.
#[derive(Debug, Args)]
pub struct ParkedTarget {
    /// The event id (UUID); with --consumer, the parked message's id (a number).
    pub event_id: String,
    /// A consumer's parked message instead of the outbox's.
    #[arg(long)]
    pub consumer: Option<String>,
}

/// `outbox parked retry|discard|reissue`
#[derive(Debug, Args)]
pub struct ParkedActionOpts {
    /// The event id (UUID); with --consumer, the parked message's id (a number).
    pub event_id: String,
    /// Why: what was fixed, or why it goes (required for discard and reissue, optional for
    /// retry; recorded in the audit trail with the actor).
    #[arg(long)]
    pub reason: Option<String>,
    /// Who acts (recorded). Default: $OUTBOX_ACTOR, else $USER@host.
    #[arg(long, env = "OUTBOX_ACTOR")]
    pub actor: Option<String>,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// A consumer's parked message instead of the outbox's.
    #[arg(long)]
    pub consumer: Option<String>,
    /// Discard of a consumer's message only: also declare that the aggregate's versions up to
    /// and including VERSION that were never seen will never come (the applied version moves
    /// there; a later message at or below it is stale). Audited with the number of versions
    /// it swallows. Without it a discard never moves over a version that was not seen.
    #[arg(long, value_name = "VERSION")]
    pub skip_to: Option<i64>,
}

/// `outbox parked release-claims`
#[derive(Debug, Args)]
pub struct ReleaseClaimsOpts {
    /// The relay owner whose claims end: a worker's owner as `outbox status` lists it
    /// (`<relay.owner>-<n>`). Without it: list the dead (stale) relays that still hold claims,
    /// with the command for each; nothing is changed.
    pub owner: Option<String>,
    /// End the claims of a relay the registry lists as live. Releasing a running relay's
    /// claims hands its in-flight events to other relays: they are published twice, and an
    /// aggregate's next version can overtake the one still in flight.
    #[arg(long)]
    pub force: bool,
    /// Who acts (recorded).
    #[arg(long, env = "OUTBOX_ACTOR")]
    pub actor: Option<String>,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    pub yes: bool,
}

/// `outbox replay`
#[derive(Debug, Args)]
pub struct ReplayOpts {
    /// Only this aggregate type.
    #[arg(long)]
    pub aggregate_type: Option<String>,
    /// Only this aggregate id.
    #[arg(long)]
    pub aggregate_id: Option<String>,
    /// Only this event type.
    #[arg(long)]
    pub event_type: Option<String>,
    /// Created at or after: a time (RFC 3339) or a duration ago (`24h`).
    #[arg(long)]
    pub since: Option<String>,
    /// Created before: a time (RFC 3339) or a duration ago.
    #[arg(long)]
    pub until: Option<String>,
    /// Events per publish batch.
    #[arg(long, default_value_t = 500)]
    pub batch_size: usize,
    /// Count what would be replayed; publish nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    pub yes: bool,
}

/// `outbox cleanup`
#[derive(Debug, Args)]
pub struct CleanupOpts {
    /// Keep finished rows this long (default: cleanup.retention).
    #[arg(long)]
    pub retention: Option<String>,
    /// Rows per transaction (default: cleanup.batch_size).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Print what would go; delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Clean the inboxes of the configured consumers instead of the outbox: registrations
    /// older than each consumer's dedup_retention (the longest one of the consumers that share
    /// an inbox table).
    #[arg(long)]
    pub inbox: bool,
}

/// `outbox check`
#[derive(Debug, Args)]
pub struct CheckOpts {
    /// Skip the broker checks (topics, replication, retention.ms).
    #[arg(long)]
    pub no_broker: bool,
}

/// `outbox topics ...`
#[derive(Debug, Subcommand)]
pub enum TopicsCommand {
    /// Create every configured topic (kafka.topic and kafka.routes) that is missing; compare
    /// the existing ones and never change them (a difference exits 1 with the command that
    /// would change it). Idempotent. On NATS: the stream capturing the subjects (file
    /// storage, duplicate window >= the lease); on RabbitMQ: the durable exchange.
    Create(TopicsCreateOpts),
    /// Compare the configured topics with these settings; create nothing (exit 4 when one is
    /// missing, 1 when one differs). On NATS / RabbitMQ: the relay's check of the stream or
    /// exchange (exit 4 when missing).
    Check(TopicsSpecOpts),
}

/// The settings of the outbox's topics.
#[derive(Debug, Args, Clone, Default)]
pub struct TopicsSpecOpts {
    /// Partitions of each topic (default 12). Never changed on an existing topic.
    #[arg(long, value_name = "N")]
    pub partitions: Option<u32>,
    /// Replication factor, or a NATS stream's replicas (default 3; 1 only for a single-broker
    /// development cluster).
    #[arg(long, value_name = "N")]
    pub replication_factor: Option<u32>,
    /// min.insync.replicas (default 2, at most the replication factor).
    #[arg(long, value_name = "N")]
    pub min_insync_replicas: Option<u32>,
    /// retention.ms as a duration (default: Kafka's 7d moved into the range the retention
    /// rule allows: at least retention.max_consumer_lag, at most each consumer's
    /// dedup_retention - max_consumer_lag - replay_window).
    #[arg(long, value_name = "D")]
    pub retention: Option<String>,
}

/// `outbox topics create`
#[derive(Debug, Args)]
pub struct TopicsCreateOpts {
    /// The settings.
    #[command(flatten)]
    pub spec: TopicsSpecOpts,
    /// Contact no broker: print the equivalent commands (kafka-topics.sh with
    /// --if-not-exists, nats stream add, rabbitmqadmin declare exchange).
    #[arg(long)]
    pub dry_run: bool,
}

/// `outbox reconcile`
#[derive(Debug, Args)]
pub struct ReconcileOpts {
    /// Start: a time (RFC 3339) or a duration ago (`24h`).
    #[arg(long)]
    pub since: String,
    /// Interval of the report (default: reconcile.interval).
    #[arg(long)]
    pub interval: Option<String>,
}

/// Parses `key=value`.
pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}
