//! The in-process wake-up: MySQL has no LISTEN/NOTIFY, so a relay polls (with the jittered,
//! growing idle backoff of `outbox_core::driver`), and an append made through a store of the
//! same process can wake the relays of that process at once after its commit.
//!
//! The store cannot see the caller's commit, so the wake-up is explicit:
//! [`MySqlOutboxStore::commit_and_wake`] commits a transaction and wakes every subscribed
//! relay; [`MySqlOutboxStore::wake_relays`] wakes them after a commit made elsewhere. Waking
//! before the commit would be useless (the relay's claim cannot see uncommitted rows and it
//! would go back to sleep). Appends of other processes are found by the next poll.

use std::sync::{Arc, Mutex, Weak};

use sqlx::{MySql, Transaction};
use tokio::sync::Notify;

use outbox_core::StoreError;

use super::MySqlOutboxStore;
use crate::error::db;

/// The subscribed relays of one store (and of its clones).
#[derive(Debug, Default)]
pub(crate) struct Wakers {
    notifies: Mutex<Vec<Weak<Notify>>>,
}

/// A subscription made by [`MySqlOutboxStore::subscribe_wakeups`]; the relay is no longer
/// woken once it is dropped.
#[derive(Debug)]
#[must_use = "the subscription ends when dropped"]
pub struct WakeSubscription {
    notify: Arc<Notify>,
}

impl WakeSubscription {
    /// The notify to hand to `outbox_core::driver::run`.
    pub fn notify(&self) -> Arc<Notify> {
        self.notify.clone()
    }
}

impl MySqlOutboxStore {
    /// Subscribes `notify` (the one a relay driver waits on) to the wake-ups of this store and
    /// its clones. Keep the returned subscription alive as long as the relay runs.
    ///
    /// ```no_run
    /// # async fn demo(store: outbox_mysql::MySqlOutboxStore) -> Result<(), outbox_core::StoreError> {
    /// let wake = std::sync::Arc::new(tokio::sync::Notify::new());
    /// let _subscription = store.subscribe_wakeups(wake.clone());
    /// // outbox_core::driver::run(relay, Some(wake), shutdown).await;
    /// let mut tx = store.pool().begin().await.map_err(outbox_mysql::map_sqlx_error)?;
    /// // store.append_many(&mut *tx, &events).await?;
    /// store.commit_and_wake(tx).await?; // the relay claims at once
    /// # Ok(()) }
    /// ```
    pub fn subscribe_wakeups(&self, notify: Arc<Notify>) -> WakeSubscription {
        let mut list = self.inner.wakers.notifies.lock().expect("poisoned");
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&notify));
        WakeSubscription { notify }
    }

    /// Wakes every subscribed relay of this process (call it after a commit that appended
    /// events). Returns how many were woken.
    pub fn wake_relays(&self) -> usize {
        let live: Vec<Arc<Notify>> = {
            let mut list = self.inner.wakers.notifies.lock().expect("poisoned");
            list.retain(|w| w.strong_count() > 0);
            list.iter().filter_map(Weak::upgrade).collect()
        };
        for n in &live {
            // Wake a driver waiting now, and leave a permit for one between cycles.
            n.notify_waiters();
            n.notify_one();
        }
        live.len()
    }

    /// Commits `tx` and then wakes the subscribed relays of this process.
    pub async fn commit_and_wake(&self, tx: Transaction<'_, MySql>) -> Result<(), StoreError> {
        tx.commit().await.map_err(db)?;
        self.wake_relays();
        Ok(())
    }
}
