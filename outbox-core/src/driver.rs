//! A tokio driver for the relay (feature `tokio`).
//!
//! Loops over [`Relay::run_once`]: right after a cycle that found work, sleeps with jittered,
//! growing backoff after an idle one, and wakes early when the wake-up hook fires (e.g. a
//! PostgreSQL `NOTIFY` after a commit). A wake-up that arrives while a cycle runs is kept
//! (`Notify::notify_one` stores a permit when nobody waits): the sleep after that cycle ends at
//! once and the next claim starts, so a wake source must call `notify_one` (as the PostgreSQL and
//! MySQL wake-ups do), not only `notify_waiters`. While the relay's circuit breaker is open (the
//! transport fails as a whole) it waits for the breaker's pause instead; a relay with nothing to
//! send closes its breaker once another relay of the process is acknowledged again
//! ([`crate::telemetry`], circuit gauge). Shutdown finishes the batch in flight (bounded by the
//! publisher's delivery timeout) and releases a batch claimed but not yet sent.
//!
//! ```no_run
//! # async fn demo<S: outbox_core::OutboxStore + Clone + 'static, P: outbox_core::Publisher + 'static>(relay: outbox_core::Relay<S, P>) {
//! use std::sync::Arc;
//! let wake = Arc::new(tokio::sync::Notify::new());
//! let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
//! let task = tokio::spawn(outbox_core::driver::run(relay, Some(wake.clone()), async move { let _ = stop_rx.await; }));
//! wake.notify_one(); // after a commit that appended events
//! let _ = stop_tx.send(());
//! let _report = task.await;
//! # }
//! ```

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tracing::{debug, warn};

use crate::publisher::Publisher;
use crate::relay::Relay;
use crate::store::{MaintenanceStore, RelayStore};

/// Totals over a driver's life.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DriverReport {
    /// Cycles run.
    pub cycles: u64,
    /// Events published.
    pub published: u64,
    /// Events parked.
    pub parked: u64,
    /// Failed cycles (store errors).
    pub errors: u64,
}

/// How often the driver refreshes the backlog gauges.
const STATS_EVERY: Duration = Duration::from_secs(5);

/// How long the driver waits for its first statistics read before its first cycle.
const STATS_AT_START: Duration = Duration::from_secs(1);

/// Reads the store's statistics into the backlog gauges ([`crate::telemetry::record_stats`]).
async fn refresh_gauges<S: MaintenanceStore>(store: &S) {
    match store.stats().await {
        Ok(s) => crate::telemetry::record_stats(&s),
        Err(e) => warn!(error = %e, "could not read outbox stats"),
    }
}

/// Runs `relay` until `shutdown` completes. Returns totals.
///
/// The backlog gauges are read from the store before the first cycle (waited for up to 1 s),
/// then every 5 s by a task of their own beside the cycles (on a clone of the store: one more
/// pooled connection while it runs), so that a slow statistics read (tens of milliseconds on
/// a loaded server, more on a large table) never holds a claim back; a read still running
/// when the next one is due is not doubled.
pub async fn run<S, P, F>(
    mut relay: Relay<S, P>,
    wake: Option<Arc<Notify>>,
    shutdown: F,
) -> DriverReport
where
    S: RelayStore + MaintenanceStore + Clone + 'static,
    P: Publisher + 'static,
    F: Future<Output = ()> + Send,
{
    let signal = relay.shutdown_signal();
    let mut report = DriverReport::default();
    let mut failures = 0u32;
    // At start, awaited (for at most STATS_AT_START): a relay's dashboards have figures from
    // its first cycle on, and a store whose statistics hang does not keep the relay from work.
    let store = relay.store().clone();
    let mut gauges = tokio::spawn(async move { refresh_gauges(&store).await });
    let _ = tokio::time::timeout(STATS_AT_START, &mut gauges).await;
    let mut last_stats = tokio::time::Instant::now();
    tokio::pin!(shutdown);
    let never = Arc::new(Notify::new());
    let wake = wake.unwrap_or(never);
    loop {
        if signal.is_triggered() {
            break;
        }
        // Not doubled: while a read still runs, the next one waits until it has ended.
        if last_stats.elapsed() >= STATS_EVERY && gauges.is_finished() {
            last_stats = tokio::time::Instant::now();
            let store = relay.store().clone();
            gauges = tokio::spawn(async move { refresh_gauges(&store).await });
        }
        // The cycle itself is not raced against shutdown: a batch being published is finished
        // and recorded. The signal makes the cycle release a batch it has not sent yet.
        let result = {
            let cycle = relay.run_once();
            tokio::pin!(cycle);
            tokio::select! {
                r = &mut cycle => r,
                () = &mut shutdown => { signal.trigger(); cycle.await }
            }
        };
        report.cycles += 1;
        let delay = match result {
            Ok(c) => {
                failures = 0;
                // Counted whatever else the cycle did: a claim can park events (out of order,
                // a version gap held too long) and hand out nothing else.
                report.published += c.published as u64;
                report.parked += (c.parked + c.parked_at_claim) as u64;
                if let Some(pause) = c.pause {
                    // The transport fails as a whole: wait it out (wake-ups do not shorten this).
                    if signal.is_triggered() {
                        // Shutdown already completed during the cycle: never poll it again.
                        break;
                    }
                    tokio::select! {
                        () = tokio::time::sleep(pause) => {}
                        () = &mut shutdown => { signal.trigger(); }
                    }
                    continue;
                }
                if !c.is_idle() {
                    relay.reset_idle();
                    continue;
                }
                relay.idle_delay()
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                report.errors += 1;
                warn!(error = %e, failures, "relay cycle failed");
                relay.error_delay(failures)
            }
        };
        if signal.is_triggered() {
            break;
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = wake.notified() => { relay.reset_idle(); }
            () = &mut shutdown => { signal.trigger(); }
        }
    }
    gauges.abort();
    // A batch claimed ahead by the last cycle goes back to the store now rather than at lease
    // expiry.
    match relay.release_prefetched().await {
        Ok(true) => debug!("released the prefetched batch"),
        Ok(false) => {}
        Err(e) => warn!(error = %e, "could not release the prefetched batch; its claim expires"),
    }
    report
}
