//! Virtual time for simulations and tests.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::Clock;

/// A clock that moves only when told to.
///
/// Clones share the same time, so one handle can be given to a store, a log and a relay while
/// the test keeps another to [`advance`](Self::advance) it.
///
/// ```
/// use std::time::Duration;
/// use outbox_core::Clock;
/// use outbox_testkit::ManualClock;
///
/// let clock = ManualClock::default();
/// let t0 = clock.now();
/// clock.advance(Duration::from_secs(5));
/// assert_eq!((clock.now() - t0).num_seconds(), 5);
/// ```
#[derive(Clone, Debug)]
pub struct ManualClock {
    now: Arc<Mutex<DateTime<Utc>>>,
}

impl ManualClock {
    /// The default start: 2026-01-01T00:00:00Z.
    pub fn epoch() -> DateTime<Utc> {
        DateTime::from_timestamp(1_767_225_600, 0).unwrap_or_default()
    }

    /// A clock showing `start`.
    pub fn new(start: DateTime<Utc>) -> Self {
        Self {
            now: Arc::new(Mutex::new(start)),
        }
    }

    /// Moves time forward by `by`.
    pub fn advance(&self, by: Duration) {
        let delta = chrono::Duration::from_std(by).unwrap_or(chrono::Duration::MAX);
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        *now = now.checked_add_signed(delta).unwrap_or(*now);
    }

    /// Sets the time (it may move backwards: clocks do).
    pub fn set(&self, at: DateTime<Utc>) {
        *self.now.lock().unwrap_or_else(|e| e.into_inner()) = at;
    }

    /// This clock as a shared [`Clock`] trait object.
    pub fn shared(&self) -> Arc<dyn Clock> {
        Arc::new(self.clone())
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new(Self::epoch())
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advance_and_set_are_shared_by_clones() {
        let a = ManualClock::default();
        let b = a.clone();
        a.advance(Duration::from_millis(1500));
        assert_eq!(
            b.now(),
            ManualClock::epoch() + chrono::Duration::milliseconds(1500)
        );
        b.set(ManualClock::epoch());
        assert_eq!(a.now(), ManualClock::epoch());
        let shared = a.shared();
        a.advance(Duration::from_secs(1));
        assert_eq!(
            shared.now(),
            ManualClock::epoch() + chrono::Duration::seconds(1)
        );
    }
}
