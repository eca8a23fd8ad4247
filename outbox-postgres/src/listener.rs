//! LISTEN/NOTIFY wake-up for the relay driver.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use outbox_core::StoreError;

use crate::error::config;
use crate::outbox::PostgresOutboxStore;

const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(10);

fn jitter(d: Duration) -> Duration {
    // Full jitter; randomness from a v4 UUID (no extra RNG dependency).
    let r = (uuid::Uuid::new_v4().as_u128() % 1000) as u32;
    d.mul_f64(0.5 + f64::from(r) / 2000.0)
}

impl PostgresOutboxStore {
    /// Spawns a task that `LISTEN`s on the store's notify channel and wakes `notify` on every
    /// notification (appends `NOTIFY` at commit), so a relay driver reacts within milliseconds.
    /// From then on, a claim of this store that comes back empty arms the wake-up gate (see
    /// [`crate::OutboxSettings::wake_gate`]): appends notify while this store's relay waits.
    ///
    /// ```no_run
    /// # async fn demo(store: outbox_postgres::PostgresOutboxStore) -> Result<(), outbox_core::StoreError> {
    /// let wake = std::sync::Arc::new(tokio::sync::Notify::new());
    /// let listener = store.spawn_listener(wake.clone())?;
    /// // outbox_core::driver::run(relay, Some(wake), shutdown).await;
    /// listener.abort();
    /// # Ok(()) }
    /// ```
    ///
    /// The task reconnects with jittered backoff when the connection fails and wakes `notify`
    /// after every (re)connect, since notifications sent while it was away are lost. Polling in
    /// the driver stays the fallback. Abort the handle to stop it. Fails with `Configuration`
    /// when the store has no notify channel.
    ///
    /// `LISTEN` belongs to the server session that ran it: the store's pool must keep one
    /// session per connection (a direct connection, or a pooler in session mode; see the crate
    /// docs). Behind a pooler in transaction mode notifications may never arrive; the wake-up
    /// gate then turns itself off with a warning and the relay polls.
    pub fn spawn_listener(&self, notify: Arc<Notify>) -> Result<JoinHandle<()>, StoreError> {
        let channel = self
            .settings()
            .notify_channel
            .clone()
            .ok_or_else(|| config("the store has no notify channel"))?;
        let pool = self.pool().clone();
        self.set_listening();
        Ok(tokio::spawn(async move {
            let mut delay = RECONNECT_MIN;
            loop {
                let mut listener = match PgListener::connect_with(&pool).await {
                    Ok(l) => l,
                    Err(e) => {
                        warn!(error = %e, "outbox listener could not connect; retrying");
                        tokio::time::sleep(jitter(delay)).await;
                        delay = (delay * 2).min(RECONNECT_MAX);
                        continue;
                    }
                };
                if let Err(e) = listener.listen(&channel).await {
                    warn!(error = %e, channel, "outbox listener could not LISTEN; retrying");
                    tokio::time::sleep(jitter(delay)).await;
                    delay = (delay * 2).min(RECONNECT_MAX);
                    continue;
                }
                debug!(channel, "outbox listener connected");
                delay = RECONNECT_MIN;
                wake(&notify);
                loop {
                    match listener.try_recv().await {
                        Ok(Some(_)) => wake(&notify),
                        Ok(None) => {
                            // Connection lost; sqlx reconnects on the next call. Anything sent
                            // in between is lost: wake once to catch up.
                            warn!(channel, "outbox listener lost its connection; reconnecting");
                            wake(&notify);
                        }
                        Err(e) => {
                            warn!(error = %e, channel, "outbox listener failed; reconnecting");
                            break;
                        }
                    }
                }
                tokio::time::sleep(jitter(delay)).await;
                delay = (delay * 2).min(RECONNECT_MAX);
            }
        }))
    }
}

fn wake(notify: &Notify) {
    // Wake every driver waiting now, and leave a permit for one that is between cycles.
    notify.notify_waiters();
    notify.notify_one();
}
