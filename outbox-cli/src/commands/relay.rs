//! `outbox relay`: the daemon.
//!
//! Start-up fails fast, with a non-zero exit and the fix, on what no retry can cure. What needs
//! no network is checked first (values, producer properties, the lease against the delivery
//! timeout: exit 2 even while the database or the broker is down); then an unreachable
//! database (host, port and cause, within `database.connect_timeout`), a missing or outdated
//! schema (`outbox migrate`), a missing privilege (the exact `GRANT` statements for the
//! schema, tables and role), a missing topic. While running, a permanent store error (the table
//! dropped, a privilege revoked: the exact `GRANT` again) stops the relay the same way and
//! `/readyz` says why until it exits; transient errors (database or broker briefly gone) are
//! retried with backoff and logged once per change of state, never once per event.
//!
//! SIGTERM or SIGINT: each worker finishes the batch it is publishing (bounded by the delivery
//! timeout) and records it, releases a batch it claimed but has not sent, and releases its
//! prefetched batch; the exit report counts what happened, failures included. The exit code
//! says whether an operator is needed (see [`crate::error`]): 0 when nothing is left for one
//! (failures that recovered during the run included), 1 when events the run parked are still
//! parked or it was still failing when it stopped.
//!
//! The same daemon runs on MySQL / MariaDB when the database URL is `mysql://` or
//! `mariadb://`: the relay, the metrics, `/healthz` and `/readyz`, the scheduled cleanup, the
//! signals and the exit codes are the same code, over `outbox-mysql`'s store. What differs:
//! the start-up also reads the server's durability settings (`outbox_mysql::check_durability`:
//! refused with exit 4 and the statement that fixes each unsafe one, warnings logged); there is
//! no LISTEN/NOTIFY, so the workers poll with their jittered idle backoff
//! (`relay.idle_min`..`relay.idle_max`) and say so once at start; MySQL keeps no record of the
//! topics' partition counts, so a change is not reported; the table gauges are the row count
//! and size `outbox-mysql` reports (no dead tuples, no vacuum ages, no conflict counter).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use outbox_core::backpressure::{BacklogSnapshot, Backpressure, BackpressurePolicy};
use outbox_core::prelude::*;
use outbox_core::{
    async_trait, Classify, ErrorClass, Publisher, Relay, RelayConfig, RelayRegistration,
    RetryPolicy, StoreError, StoreErrorKind, SystemClock,
};
#[cfg(feature = "kafka")]
use outbox_kafka::KafkaPublisher;
use outbox_mysql::MySqlOutboxStore;
use outbox_postgres::PostgresOutboxStore;
#[cfg(feature = "kafka")]
use outbox_postgres::RecordedTopic;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use crate::config::Config;
use crate::db;
use crate::error::CliError;
use crate::health::Health;
use crate::metered::{Held, MeteredStore};
use crate::output::Output;
use crate::transport::{AnyPublisher, Transport};
use crate::trend::BacklogTrend;

/// Totals over the daemon's life, shared by the workers.
#[derive(Debug, Default)]
pub struct Totals {
    cycles: AtomicU64,
    claimed: AtomicU64,
    published: AtomicU64,
    retried: AtomicU64,
    deferred: AtomicU64,
    parked: AtomicU64,
    superseded: AtomicU64,
    released_batches: AtomicU64,
    store_errors: AtomicU64,
    cleaned: AtomicU64,
    /// The latest cycle of any worker failed with a store error (reset by any cycle the store
    /// answered).
    store_failing: AtomicBool,
    /// The latest batch of any worker that reached the broker was refused by the transport as
    /// a whole (reset by any batch with a publication).
    transport_failing: AtomicBool,
}

/// The exit report.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct RelayReport {
    /// Relay cycles run.
    pub cycles: u64,
    /// Events claimed.
    pub claimed: u64,
    /// Events acknowledged and marked published.
    pub published: u64,
    /// Attempts that failed on the record's own account and were scheduled again.
    pub retried: u64,
    /// Publications put back after a transport failure (no attempt spent).
    pub deferred: u64,
    /// Events parked (by a failed publication or by a claim for their version).
    pub parked: u64,
    /// Outcomes refused by fencing (the claim was superseded).
    pub superseded: u64,
    /// Batches released unsent (shutdown, or too little lease left).
    pub released_batches: u64,
    /// Failed cycles (store errors).
    pub store_errors: u64,
    /// Finished rows removed by the scheduled cleanup.
    pub cleaned: u64,
    /// Why the relay stopped: `signal` or `fatal`.
    pub stopped_by: String,
}

impl Totals {
    fn report(&self, stopped_by: &str) -> RelayReport {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RelayReport {
            cycles: g(&self.cycles),
            claimed: g(&self.claimed),
            published: g(&self.published),
            retried: g(&self.retried),
            deferred: g(&self.deferred),
            parked: g(&self.parked),
            superseded: g(&self.superseded),
            released_batches: g(&self.released_batches),
            store_errors: g(&self.store_errors),
            cleaned: g(&self.cleaned),
            stopped_by: stopped_by.to_owned(),
        }
    }
}

/// A permanent error seen by a worker: the relay stops with it.
type Fatal = Arc<std::sync::Mutex<Option<FatalError>>>;

/// The error a worker stopped the relay with.
#[derive(Debug)]
struct FatalError {
    error: CliError,
    /// A missing privilege: the exit names the exact grants, read from the catalogs.
    privilege: bool,
}

/// What the daemon needs of a store besides the relay and maintenance roles: the pool's
/// gauges, the application's conflict counter where the store keeps one, and the exact grants
/// for a privilege that went missing while running.
#[async_trait]
pub trait DaemonStore:
    RelayStore + MaintenanceStore + RelayRegistry + Clone + std::fmt::Debug + Send + Sync + 'static
{
    /// Sets `outbox_db_pool_connections`.
    fn record_pool(&self);
    /// Conflicts counted by the application per aggregate type (`None`: not kept).
    async fn conflict_counts(&self) -> Option<Vec<(String, u64)>>;
    /// The error naming the exact `GRANT` statements for what the user lacks now (`None`:
    /// nothing found lacking, or the catalogs could not be read).
    async fn privilege_error(&self, config: &Config) -> Option<CliError>;
    /// The same store for the web console.
    fn console_store(&self, config: &Config) -> crate::console::ConsoleStore;
}

#[async_trait]
impl DaemonStore for PostgresOutboxStore {
    fn record_pool(&self) {
        crate::metrics::record_pool(self.pool());
    }
    async fn conflict_counts(&self) -> Option<Vec<(String, u64)>> {
        PostgresOutboxStore::conflict_counts(self).await.ok()
    }
    async fn privilege_error(&self, config: &Config) -> Option<CliError> {
        db::privilege_error(self.pool(), config)
            .await
            .ok()
            .flatten()
    }
    fn console_store(&self, config: &Config) -> crate::console::ConsoleStore {
        crate::console::ConsoleStore::postgres(config, self.clone())
    }
}

#[async_trait]
impl DaemonStore for MySqlOutboxStore {
    fn record_pool(&self) {
        crate::metrics::record_pool_counts(self.pool().size(), self.pool().num_idle());
    }
    async fn conflict_counts(&self) -> Option<Vec<(String, u64)>> {
        None
    }
    async fn privilege_error(&self, config: &Config) -> Option<CliError> {
        crate::mysql::privilege_error(self.pool(), config)
            .await
            .ok()
            .flatten()
    }
    fn console_store(&self, config: &Config) -> crate::console::ConsoleStore {
        crate::console::ConsoleStore::mysql(config, self.clone())
    }
}

/// Runs the daemon until SIGTERM/SIGINT or a permanent error, on the store the database URL
/// names ([`crate::store::backend`]).
pub async fn run(config: &Config, out: &Output) -> Result<(), CliError> {
    let workers = config.relay.workers;
    // Per worker a claim (prefetch included) and a completion at once; plus the listener,
    // stats, cleanup and readiness.
    let pool_size = 2 * u32::from(workers) + 4;
    match crate::store::backend(config)? {
        crate::store::Backend::Postgres => run_postgres(config, out, pool_size).await,
        crate::store::Backend::MySql => run_mysql(config, out, pool_size).await,
    }
}

async fn run_postgres(config: &Config, out: &Output, pool_size: u32) -> Result<(), CliError> {
    validate_offline(
        config,
        db::outbox_store(config, db::lazy_outbox_pool(config)?)?,
    )?;
    let (pool, target) = db::connect_outbox(config, pool_size).await?;
    db::preflight(&pool, config).await?;
    let store = db::outbox_store(config, pool)?;
    let table = format!("{}.{}", config.outbox.schema, config.outbox.table);
    let recorded = store
        .recorded_topics()
        .await
        .map_err(|e| CliError::from_store(&e, &table))?;
    let transport = crate::transport::start(config, &recorded).await?;
    #[cfg(feature = "kafka")]
    if let Some(kafka) = transport.kafka() {
        record_topics(&store, kafka, &table).await?;
    }
    let listen = store.clone();
    let listen_table = table.clone();
    daemon(
        config,
        out,
        store,
        transport,
        target.to_string(),
        table,
        move |wake| {
            listen
                .spawn_listener(wake)
                .map(Some)
                .map_err(|e| CliError::from_store(&e, &listen_table))
        },
    )
    .await
}

async fn run_mysql(config: &Config, out: &Output, pool_size: u32) -> Result<(), CliError> {
    validate_offline(
        config,
        crate::mysql::outbox_store(config, crate::mysql::lazy_pool(config)?)?,
    )?;
    let (pool, target) = crate::mysql::connect(config, pool_size).await?;
    let store = crate::mysql::outbox_store(config, pool.clone())?;
    let table = crate::mysql::table_label(config);
    crate::mysql::preflight(&pool, &store, config).await?;
    let report = store
        .check_durability()
        .await
        .map_err(|e| crate::mysql::store_error(&e, &table))?;
    for warning in crate::mysql::durability_decision(&report)? {
        warn!("{warning}");
    }
    // No recorded topic facts on MySQL: a Kafka publisher compares the broker with none.
    let transport = crate::transport::start(config, &[]).await?;
    daemon(
        config,
        out,
        store,
        transport,
        target.to_string(),
        table,
        |_| {
            info!(
                idle_min = %config.relay.idle_min,
                idle_max = %config.relay.idle_max,
                "MySQL / MariaDB has no LISTEN/NOTIFY: idle workers poll with jittered backoff \
                 (no wake-up on commit)"
            );
            Ok(None)
        },
    )
    .await
}

/// The daemon over a connected, checked store and a started publisher; `listen` starts the
/// store's wake-up listener, if it has one, once every worker is built.
async fn daemon<S: DaemonStore>(
    config: &Config,
    out: &Output,
    store: S,
    transport: Transport,
    target: String,
    table: String,
    listen: impl FnOnce(Arc<Notify>) -> Result<Option<JoinHandle<()>>, CliError>,
) -> Result<(), CliError> {
    let workers = config.relay.workers;
    let transport_line = crate::transport::describe(config);
    info!(database = %target, outbox = %table, transport = %transport_line, workers, "relay starting");

    let health = Health::default();
    health.database(true, format!("{target}: schema and privileges in place"));
    health.broker(true, format!("{transport_line}: destinations present"));
    let prometheus = crate::metrics::install()?;
    let owner = config.owner();
    // The console's charts, fed by the monitor's stats reads.
    let history = crate::console::History::new(config.console.history.0);
    let http = if config.http.enabled {
        let console = config.console.enabled.then(|| {
            crate::console::router(crate::console::ConsoleState::new(
                config,
                store.console_store(config),
                history.clone(),
                Some((owner.clone(), health.clone())),
            ))
        });
        let with_console = console.is_some();
        let (addr, task) = crate::health::serve(
            &config.http.listen,
            prometheus.clone(),
            health.clone(),
            console,
        )
        .await?;
        if with_console {
            crate::console::warn_if_exposed(addr, config);
            info!(%addr, "serving /metrics, /healthz, /readyz and the console at /console");
        } else {
            info!(%addr, "serving /metrics, /healthz and /readyz");
        }
        Some(task)
    } else {
        None
    };

    // Build every worker before starting any, so a configuration error stops nothing half-way.
    let mut relays = Vec::new();
    for w in 0..workers {
        relays.push(build_relay(
            config,
            &store,
            transport.worker_publisher(w)?,
            &format!("{owner}-{w}"),
        )?);
    }

    // The registry: each worker's claim owner, registered before it claims anything, so that
    // `outbox status` lists it and `release-claims` refuses to end its claims while it runs.
    let registered: Vec<(String, Held)> = relays
        .iter()
        .map(|r| (r.config().owner.clone(), r.store().held.clone()))
        .collect();
    register_all(&store, config, &registered, &health).await;

    let totals = Arc::new(Totals::default());
    let fatal: Fatal = Arc::default();
    let (stop_tx, stop_rx) = watch::channel(false);
    let wake = Arc::new(Notify::new());
    let listener = listen(wake.clone())?;
    let mut tasks = Vec::new();
    for relay in relays {
        tasks.push(tokio::spawn(worker(
            relay,
            wake.clone(),
            stop_rx.clone(),
            totals.clone(),
            fatal.clone(),
            stop_tx.clone(),
            table.clone(),
        )));
    }
    health.update(|r| r.relaying = true);
    metrics::gauge!("outbox_relay_up").set(1.0);

    let gate = Arc::new(Backpressure::new(backpressure_policy(config)));
    let broker_watch = tokio::spawn(watch_broker(
        Arc::new(transport),
        health.clone(),
        config.clone(),
        stop_rx.clone(),
    ));
    let monitor = tokio::spawn(monitor(
        store.clone(),
        table.clone(),
        prometheus,
        health.clone(),
        gate,
        config.clone(),
        totals.clone(),
        history,
        stop_rx.clone(),
    ));
    let heartbeat = tokio::spawn(heartbeat_loop(
        store.clone(),
        config.clone(),
        registered.clone(),
        health.clone(),
        stop_rx.clone(),
    ));
    let cleanup = config.cleanup.enabled.then(|| {
        tokio::spawn(cleanup_loop(
            store.clone(),
            config.clone(),
            totals.clone(),
            stop_rx.clone(),
        ))
    });

    let mut stop_wait = stop_rx.clone();
    let stopped_by = tokio::select! {
        () = shutdown_signal() => "signal",
        () = stopped(&mut stop_wait) => "fatal",
    };
    let _ = stop_tx.send(true);
    let fatal_reason = fatal
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .map(|f| f.error.to_string());
    // Until the process exits, /readyz says why it stops.
    health.update(|r| {
        r.relaying = false;
        r.fatal = fatal_reason;
    });
    info!(
        stopped_by,
        "relay stopping: finishing or releasing the batches in flight"
    );
    let deadline = config.relay.shutdown_timeout.0;
    // A worker that ended abnormally or did not finish counts as failing at the stop.
    let mut failing_at_stop = false;
    for t in tasks {
        match tokio::time::timeout(deadline, t).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                error!(error = %e, "a worker ended abnormally");
                failing_at_stop = true;
            }
            Err(_) => {
                warn!(
                    "a worker did not finish within relay.shutdown_timeout; its claims end with \
                     their lease (or transaction)"
                );
                failing_at_stop = true;
            }
        }
    }
    monitor.abort();
    broker_watch.abort();
    heartbeat.abort();
    // Gone from the registry only now: until its batches were finished or released, the
    // workers still held claims.
    for (owner, _) in &registered {
        match tokio::time::timeout(Duration::from_secs(5), store.deregister_relay(owner)).await {
            Ok(Ok(())) => debug!(owner = %owner, "deregistered from the relay registry"),
            Ok(Err(e)) => {
                warn!(owner = %owner, error = %e, "could not deregister from the relay registry; the entry turns stale")
            }
            Err(_) => {
                warn!(owner = %owner, "deregistering from the relay registry got no answer; the entry turns stale")
            }
        }
    }
    if let Some(c) = cleanup {
        c.abort();
    }
    if let Some(l) = listener {
        l.abort();
    }
    if let Some(h) = http {
        h.abort();
    }
    metrics::gauge!("outbox_relay_up").set(0.0);
    failing_at_stop |= totals.store_failing.load(Ordering::Relaxed)
        || totals.transport_failing.load(Ordering::Relaxed);
    let report = totals.report(stopped_by);
    let failures = report.retried + report.deferred + report.parked + report.store_errors;
    eprintln!(
        "relay stopped ({stopped_by}): {} cycles, {} claimed, {} published, {} retried, {} \
         deferred (transport), {} parked, {} superseded, {} batches released unsent, {} store \
         errors, {} rows cleaned up; {failures} failures in all",
        report.cycles,
        report.claimed,
        report.published,
        report.retried,
        report.deferred,
        report.parked,
        report.superseded,
        report.released_batches,
        report.store_errors,
        report.cleaned,
    );
    if out.json {
        out.json(&serde_json::to_value(&report).unwrap_or_default());
    }
    // Of what this run parked, is anything still parked (an operator may have acted already)?
    let still_parked = if report.parked == 0 {
        0
    } else {
        match tokio::time::timeout(Duration::from_secs(5), store.stats()).await {
            Ok(Ok(s)) => s.parked,
            // Unknown: say what this run parked.
            _ => report.parked,
        }
    };
    let fatal = fatal.lock().unwrap_or_else(|p| p.into_inner()).take();
    match fatal {
        Some(FatalError {
            error,
            privilege: true,
        }) => match store.privilege_error(config).await {
            // The statements for what this role lacks now, table by table.
            Some(exact) => Err(exact),
            None => Err(error),
        },
        Some(f) => Err(f.error),
        None => match needs_operator(&report, still_parked, failing_at_stop) {
            // The report is the --json document already.
            Some(e) if out.json => Err(e.reported()),
            Some(e) => Err(e),
            None => Ok(()),
        },
    }
}

/// Checks everything that needs no network before the relay touches the database or the
/// broker, so that a configuration error exits 2 with its fix even while a service is down
/// (which would otherwise exit 3 and hide it): the database URL and the claim mode, every
/// producer property, the retry and relay settings, and the lease (or locked hold) against the
/// delivery timeout, checked by the very constructors the running relay uses, on a database
/// pool that has not connected and a producer that has not contacted the broker.
fn validate_offline<S: DaemonStore>(config: &Config, store: S) -> Result<(), CliError> {
    let delivery = crate::transport::validate_offline(config)?;
    build_relay(
        config,
        &store,
        crate::transport::OfflinePublisher(delivery),
        &config.owner(),
    )
    .map(drop)
}

/// Exit 1 after a signal when the run left something for an operator: events it parked that
/// are still parked (they block their aggregates until someone acts), or workers still failing
/// when it stopped (the database or the broker unreachable, a worker that did not finish).
/// Retries, deferrals and store errors that recovered during the run are not, nor events an
/// operator resolved before the stop: `None`, exit 0.
fn needs_operator(
    report: &RelayReport,
    still_parked: u64,
    failing_at_stop: bool,
) -> Option<CliError> {
    let mut what = Vec::new();
    if report.parked > 0 && still_parked > 0 {
        what.push(format!(
            "it parked {} event(s) during this run and {still_parked} event(s) are parked now, \
             blocking their aggregates",
            report.parked
        ));
    }
    if failing_at_stop {
        what.push(
            "it was still failing when it stopped (database or broker unreachable, or a worker \
             that did not finish)"
                .to_owned(),
        );
    }
    (!what.is_empty()).then(|| {
        CliError::failed(format!(
            "the relay stopped with work for an operator: {}",
            what.join("; ")
        ))
        .with_hint(
            "`outbox parked list` shows parked events and why (then retry, discard or reissue \
             them); `outbox status` shows the backlog; restarting the relay is safe",
        )
    })
}

#[cfg(feature = "kafka")]
async fn record_topics(
    store: &PostgresOutboxStore,
    publisher: &KafkaPublisher,
    table: &str,
) -> Result<(), CliError> {
    let Some(report) = publisher.topic_report() else {
        return Ok(());
    };
    for c in &report.partition_changes {
        warn!(topic = %c.topic, before = c.before, after = c.after, "partition count changed since the last recorded start: keys moved to other partitions, so order across the change is not guaranteed for aggregates in flight");
    }
    if let Some(c) = &report.partitioner_change {
        warn!(before = %c.before, after = %c.after, "partitioner changed since the last recorded start: keys moved to other partitions");
    }
    let facts: Vec<RecordedTopic> = report
        .topics
        .iter()
        .map(|t| RecordedTopic::new(&t.name, t.partitions as u32, report.partitioner.as_str()))
        .collect();
    store
        .record_topics(&facts)
        .await
        .map_err(|e| CliError::from_store(&e, table))
}

type CliRelay<S> = Relay<MeteredStore<S>, AnyPublisher>;

fn build_relay<S: DaemonStore, P: Publisher>(
    config: &Config,
    store: &S,
    publisher: P,
    owner: &str,
) -> Result<Relay<MeteredStore<S>, P>, CliError> {
    let relay_config = relay_config(config, owner)?;
    Relay::new(
        MeteredStore::new(store.clone()),
        publisher,
        relay_config,
        Arc::new(SystemClock),
        Box::new(StdRng::from_os_rng()),
    )
    .map_err(|e| {
        CliError::config(
            format!("relay configuration refused: {}", e.0),
            "the lease (outbox.lease, lease mode) or outbox.locked_max_hold (locked mode) must \
             outlive the transport's delivery timeout (kafka.delivery_timeout, \
             nats.delivery_timeout or rabbitmq.delivery_timeout) plus relay.lease_margin: raise \
             the lease or lower the delivery timeout",
        )
    })
}

/// The library's relay configuration of `[relay]`, for a worker named `owner`.
fn relay_config(config: &Config, owner: &str) -> Result<RelayConfig, CliError> {
    let r = &config.relay;
    let retry = RetryPolicy::builder()
        .base(r.retry_base.0)
        .max_delay(r.retry_max.0)
        .max_attempts(r.max_attempts)
        .build()
        .map_err(|e| CliError::config(format!("[relay] retry: {}", e.0), "fix [relay]"))?;
    RelayConfig::builder()
        .owner(owner)
        .batch_size(r.batch_size)
        .run(r.run)
        .run_budget(r.run_budget.0)
        .retry(retry)
        .idle(r.idle_min.0, r.idle_max.0)
        .lease_margin(r.lease_margin.0)
        .prefetch(r.prefetch)
        .early_claim(r.early_claim)
        .circuit_breaker(r.circuit_base.0, r.circuit_max.0)
        .build()
        .map_err(|e| CliError::config(format!("[relay]: {}", e.0), "fix [relay]"))
}

/// A store error no retry cures: the relay stops with the fix.
fn is_permanent(e: &StoreError) -> bool {
    e.class() == ErrorClass::Permanent
        && matches!(
            e.kind,
            StoreErrorKind::Schema | StoreErrorKind::Configuration
        )
}

async fn worker<S: DaemonStore>(
    mut relay: CliRelay<S>,
    wake: Arc<Notify>,
    mut stop: watch::Receiver<bool>,
    totals: Arc<Totals>,
    fatal: Fatal,
    stop_all: watch::Sender<bool>,
    table: String,
) {
    let owner = relay.config().owner.clone();
    let signal = relay.shutdown_signal();
    let mut failures = 0u32;
    loop {
        if *stop.borrow() {
            signal.trigger();
            break;
        }
        // The cycle is not raced against shutdown: a batch being published is finished and
        // recorded; the signal makes the cycle release a batch it has not sent yet.
        let result = {
            let cycle = relay.run_once();
            tokio::pin!(cycle);
            tokio::select! {
                r = &mut cycle => r,
                () = stopped(&mut stop) => { signal.trigger(); cycle.await }
            }
        };
        totals.cycles.fetch_add(1, Ordering::Relaxed);
        // Still failing at a stop? The latest answers of the store and of the transport, over
        // every worker: an idle cycle says nothing about the broker (the work went elsewhere),
        // and the events of a deferred batch are published later by some cycle, which resets it.
        match &result {
            Ok(c) => {
                totals.store_failing.store(false, Ordering::Relaxed);
                if c.published > 0 {
                    totals.transport_failing.store(false, Ordering::Relaxed);
                } else if c.deferred > 0 {
                    totals.transport_failing.store(true, Ordering::Relaxed);
                }
            }
            Err(_) => totals.store_failing.store(true, Ordering::Relaxed),
        }
        let delay = match result {
            Ok(c) => {
                if failures > 0 {
                    info!(owner = %owner, failed_cycles = failures, "the database answers again; relaying resumed");
                    failures = 0;
                    metrics::gauge!("outbox_relay_store_errors").set(0.0);
                }
                let add = |a: &AtomicU64, n: usize| {
                    a.fetch_add(n as u64, Ordering::Relaxed);
                };
                add(&totals.claimed, c.claimed);
                add(&totals.published, c.published);
                add(&totals.retried, c.retried);
                add(&totals.deferred, c.deferred);
                add(&totals.parked, c.parked + c.parked_at_claim);
                add(&totals.superseded, c.superseded);
                if c.released {
                    add(&totals.released_batches, 1);
                }
                if !c.is_idle() {
                    debug!(owner = %owner, claimed = c.claimed, published = c.published, retried = c.retried, deferred = c.deferred, parked = c.parked + c.parked_at_claim, gaps_held = c.gaps_held, superseded = c.superseded, released = c.released, "batch");
                }
                if let Some(pause) = c.pause {
                    tokio::select! {
                        () = tokio::time::sleep(pause) => {}
                        () = stopped(&mut stop) => {}
                    }
                    continue;
                }
                if !c.is_idle() {
                    relay.reset_idle();
                    continue;
                }
                relay.idle_delay()
            }
            Err(e) if is_permanent(&e) => {
                totals.store_errors.fetch_add(1, Ordering::Relaxed);
                let err = CliError::from_store(&e, &table);
                error!(owner = %owner, error = %e, "permanent store error; the relay stops");
                *fatal.lock().unwrap_or_else(|p| p.into_inner()) = Some(FatalError {
                    error: err,
                    privilege: crate::error::is_privilege(&e),
                });
                let _ = stop_all.send(true);
                break;
            }
            Err(e) => {
                totals.store_errors.fetch_add(1, Ordering::Relaxed);
                failures = failures.saturating_add(1);
                metrics::gauge!("outbox_relay_store_errors").set(f64::from(failures));
                if failures == 1 {
                    warn!(owner = %owner, error = %e, "relay cycle failed; retrying with backoff (logged again when it recovers)");
                } else {
                    debug!(owner = %owner, error = %e, failures, "relay cycle failed again");
                }
                relay.error_delay(failures)
            }
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = wake.notified() => relay.reset_idle(),
            () = stopped(&mut stop) => {}
        }
    }
    match relay.release_prefetched().await {
        Ok(true) => {
            totals.released_batches.fetch_add(1, Ordering::Relaxed);
            debug!(owner = %owner, "released the prefetched batch");
        }
        Ok(false) => {}
        Err(e) => {
            warn!(owner = %owner, error = %e, "could not release the prefetched batch; its claim expires")
        }
    }
}

/// The backpressure policy of the configuration.
pub fn backpressure_policy(config: &Config) -> BackpressurePolicy {
    let b = &config.backpressure;
    let mut p = BackpressurePolicy::default()
        .capacity(config.status.capacity)
        .critical_event_types(b.critical_event_types.clone());
    if let Some(n) = b.max_backlog {
        p = p.max_backlog(n);
    }
    if let Some(d) = b.max_age {
        p = p.max_age(d.0);
    }
    if let Some(d) = b.min_forecast {
        p = p.min_forecast(d.0, config.status.capacity);
    }
    p
}

/// Refreshes gauges, backpressure and readiness every `relay.stats_interval`; logs a summary
/// per minute when something moved.
#[allow(clippy::too_many_arguments)]
async fn monitor<S: DaemonStore>(
    store: S,
    table: String,
    prometheus: metrics_exporter_prometheus::PrometheusHandle,
    health: Health,
    gate: Arc<Backpressure>,
    config: Config,
    totals: Arc<Totals>,
    history: crate::console::History,
    mut stop: watch::Receiver<bool>,
) {
    let interval = config
        .relay
        .stats_interval
        .0
        .max(Duration::from_millis(100));
    let mut last_summary = tokio::time::Instant::now();
    let mut last_published = 0u64;
    // The current trend, not an average over status.window: a drain of older events must not
    // cancel a backlog that grows now (see `crate::trend`).
    let mut trend = BacklogTrend::new(config.status.trend_window.0);
    loop {
        match store.stats().await {
            Ok(stats) => {
                crate::metrics::record_stats(&stats);
                trend.observe(std::time::Instant::now(), stats.unpublished);
                history.observe(Utc::now(), &stats);
                let rate = trend.rate_per_sec();
                gate.observe(BacklogSnapshot::from_stats(&stats, rate), Utc::now());
                if let Some(c) = store.conflict_counts().await {
                    crate::metrics::record_conflicts(&c);
                }
                if !health.get().database.ok {
                    info!("database reachable again");
                }
                health.database(true, "reachable; last stats read succeeded");
            }
            Err(e) => {
                let was_ok = health.get().database.ok;
                let detail = CliError::from_store(&e, &table).to_string();
                if was_ok {
                    warn!(error = %e, "cannot read outbox stats; /readyz reports the database");
                }
                health.database(false, detail);
            }
        }
        store.record_pool();
        prometheus.run_upkeep();
        if last_summary.elapsed() >= Duration::from_secs(60) {
            last_summary = tokio::time::Instant::now();
            let r = totals.report("");
            if r.published != last_published {
                info!(
                    published = r.published,
                    retried = r.retried,
                    deferred = r.deferred,
                    parked = r.parked,
                    store_errors = r.store_errors,
                    "relay totals"
                );
                last_published = r.published;
            }
        }
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = stopped(&mut stop) => return,
        }
    }
}

/// Keeps the broker's side of `/readyz` to what the relay sees now: the transport's
/// destinations (Kafka topics through the admin API, NATS streams through the JetStream API,
/// the RabbitMQ exchange through a passive declare) are checked every `relay.stats_interval`,
/// each check bounded, in a task of its own so that a broker that does not answer delays
/// neither the backlog gauges nor the database's readiness. An outage shows within one
/// interval plus the bound, and so does the return of the broker or of its destinations.
async fn watch_broker(
    transport: Arc<Transport>,
    health: Health,
    config: Config,
    mut stop: watch::Receiver<bool>,
) {
    let interval = config
        .relay
        .stats_interval
        .0
        .max(Duration::from_millis(100));
    let bound = crate::transport::check_bound(&config);
    let target = crate::transport::describe(&config);
    loop {
        let check = tokio::time::timeout(bound, transport.health(&config)).await;
        let was_ok = health.get().broker.ok;
        match check {
            Ok(Ok(detail)) => {
                if !was_ok {
                    info!("broker reachable and destinations present again; /readyz reports ready");
                }
                health.broker(true, detail);
            }
            Ok(Err(err)) => {
                if was_ok {
                    warn!(error = %err.message, "broker check failed; /readyz reports the broker");
                }
                health.broker(false, err.to_string());
            }
            Err(_) => {
                if was_ok {
                    warn!("broker check got no answer; /readyz reports the broker");
                }
                health.broker(
                    false,
                    format!(
                        "no answer from {target} within {}",
                        humantime::format_duration(bound)
                    ),
                );
            }
        }
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = stopped(&mut stop) => return,
        }
    }
}

/// What this process registers for the worker `owner`.
fn registration(config: &Config, owner: &str) -> RelayRegistration {
    RelayRegistration::new(
        owner,
        crate::config::hostname(),
        std::process::id(),
        env!("CARGO_PKG_VERSION"),
        match config.outbox.claim_mode {
            crate::config::ClaimModeName::Lease => "lease",
            crate::config::ClaimModeName::Locked => "locked",
        },
        config.relay.heartbeat_interval.0,
    )
}

/// Registers every worker; a failure is reported on `/readyz` (the heartbeat loop registers
/// again), never fatal: the relay publishes without the registry.
async fn register_all<S: DaemonStore>(
    store: &S,
    config: &Config,
    registered: &[(String, Held)],
    health: &Health,
) {
    for (owner, _) in registered {
        if let Err(e) = store.register_relay(&registration(config, owner)).await {
            warn!(owner = %owner, error = %e, "cannot register in the relay registry; /readyz reports it (retried every relay.heartbeat_interval)");
            health.registry(false, registry_failure(&e));
            return;
        }
    }
    info!(
        workers = registered.len(),
        heartbeat_interval = %config.relay.heartbeat_interval,
        "registered in the relay registry"
    );
    health.registry(true, format!("{} worker(s) registered", registered.len()));
    if let Ok(entries) = store.relays().await {
        crate::metrics::record_relays(&entries);
    }
}

fn registry_failure(e: &StoreError) -> String {
    format!(
        "relay registry write failed: {e} (if the table is missing, run `outbox migrate`: the \
         registry is the outbox's <table>_relays)"
    )
}

/// Every `relay.heartbeat_interval`: each worker's heartbeat with the events it holds (an
/// entry removed meanwhile is registered again), and `outbox_relays{state}` from the
/// registry. A failed write is reported on `/readyz` until one succeeds.
async fn heartbeat_loop<S: DaemonStore>(
    store: S,
    config: Config,
    registered: Vec<(String, Held)>,
    health: Health,
    mut stop: watch::Receiver<bool>,
) {
    let interval = config.relay.heartbeat_interval.0;
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = stopped(&mut stop) => return,
        }
        let mut failure = None;
        for (owner, held) in &registered {
            let beat = match store.heartbeat_relay(owner, held.count()).await {
                Ok(true) => Ok(()),
                Ok(false) => {
                    info!(owner = %owner, "no entry in the relay registry (removed meanwhile); registering again");
                    store.register_relay(&registration(&config, owner)).await
                }
                Err(e) => Err(e),
            };
            if let Err(e) = beat {
                failure = Some(e);
                break;
            }
        }
        let was_ok = health.get().registry.ok;
        match failure {
            Some(e) => {
                if was_ok {
                    warn!(error = %e, "relay registry heartbeat failed; /readyz reports it");
                }
                health.registry(false, registry_failure(&e));
            }
            None => {
                if !was_ok {
                    info!("relay registry heartbeat written again");
                }
                health.registry(
                    true,
                    format!(
                        "{} worker(s) registered; heartbeat written",
                        registered.len()
                    ),
                );
            }
        }
        if let Ok(entries) = store.relays().await {
            crate::metrics::record_relays(&entries);
        }
    }
}

/// Deletes finished rows older than `cleanup.retention` every `cleanup.interval`, in batches
/// of `cleanup.batch_size` (one short transaction each).
async fn cleanup_loop<S: DaemonStore>(
    store: S,
    config: Config,
    totals: Arc<Totals>,
    mut stop: watch::Receiver<bool>,
) {
    let c = &config.cleanup;
    loop {
        tokio::select! {
            () = tokio::time::sleep(c.interval.0) => {}
            () = stopped(&mut stop) => return,
        }
        match store.cleanup(c.retention.0, c.batch_size).await {
            Ok(r) => {
                totals.cleaned.fetch_add(r.removed, Ordering::Relaxed);
                metrics::counter!("outbox_cleanup_removed_total").increment(r.removed);
                if r.removed > 0 {
                    info!(removed = r.removed, batches = r.batches, retention = %c.retention, archive = config.outbox.archive, "cleanup removed finished rows");
                }
            }
            Err(e) => {
                warn!(error = %e, "scheduled cleanup failed; it runs again at the next interval")
            }
        }
    }
}

/// Completes once `rx` says stop (or its sender is gone).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `relay.prefetch` and `relay.early_claim` reach the library's relay, both on by default.
    #[test]
    fn prefetch_and_the_early_claim_follow_the_configuration() {
        let mut config = Config::default();
        let c = relay_config(&config, "w-1").expect("valid");
        assert!(c.prefetch && c.early_claim, "{c:?}");
        config.relay.early_claim = false;
        let c = relay_config(&config, "w-1").expect("valid");
        assert!(c.prefetch && !c.early_claim, "{c:?}");
        config.relay.prefetch = false;
        config.relay.early_claim = true;
        let c = relay_config(&config, "w-1").expect("valid");
        assert!(!c.prefetch && c.early_claim, "{c:?}");
        assert_eq!(c.owner, "w-1");
    }
}
