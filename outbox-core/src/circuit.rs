//! The relay's circuit breaker: when the transport fails as a whole (broker down, topic or
//! leader missing, every record of a batch timing out), the relay pauses with jittered, capped,
//! growing delays instead of spending the records' attempts, and resumes as soon as the broker
//! acknowledges a record again.
//!
//! A pure state machine of (cycle result, now, rng): the relay feeds it one cycle at a time
//! and sleeps for [`CircuitBreaker::pause`] while it is open.
//!
//! ```
//! use std::time::Duration;
//! use outbox_core::circuit::{CircuitBreaker, CircuitChange};
//! use rand::{rngs::StdRng, SeedableRng};
//!
//! let mut breaker = CircuitBreaker::new(Duration::from_millis(500), Duration::from_secs(30));
//! let mut rng = StdRng::seed_from_u64(1);
//! let t0 = chrono::Utc::now();
//! assert_eq!(breaker.on_cycle(0, 3, t0), Some(CircuitChange::Opened));
//! let pause = breaker.pause(&mut rng).unwrap();
//! assert!(pause >= Duration::from_millis(250) && pause <= Duration::from_millis(500));
//! let later = t0 + chrono::Duration::seconds(7);
//! assert_eq!(breaker.on_cycle(1, 0, later), Some(CircuitChange::Closed { open_for: Duration::from_secs(7) }));
//! assert!(breaker.pause(&mut rng).is_none());
//! ```

use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::Rng;

/// A change of the breaker's state, reported once per change (for logs and metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CircuitChange {
    /// The transport failed as a whole: the relay pauses.
    Opened,
    /// The broker acknowledged again after the breaker was open this long.
    Closed {
        /// How long it was open.
        open_for: Duration,
    },
}

/// Circuit breaker state. See the module docs.
#[derive(Clone, Debug)]
pub struct CircuitBreaker {
    base: Duration,
    max: Duration,
    /// Consecutive cycles that failed as a whole.
    failures: u32,
    open_since: Option<DateTime<Utc>>,
}

impl CircuitBreaker {
    /// A closed breaker whose pauses start at `base` and grow to at most `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max: max.max(base),
            failures: 0,
            open_since: None,
        }
    }

    /// Whether the relay should pause.
    pub fn is_open(&self) -> bool {
        self.open_since.is_some()
    }

    /// Consecutive cycles that failed as a whole.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Feeds one cycle: `acknowledged` records the broker acknowledged and
    /// `transport_failures` records that failed through no fault of their own. A cycle with
    /// an acknowledgement closes the breaker; a cycle with transport failures and no
    /// acknowledgement opens it (or keeps it open, with a longer pause); other cycles (empty,
    /// or only the records' own failures) change nothing.
    pub fn on_cycle(
        &mut self,
        acknowledged: usize,
        transport_failures: usize,
        now: DateTime<Utc>,
    ) -> Option<CircuitChange> {
        if acknowledged > 0 {
            self.failures = 0;
            return self.open_since.take().map(|since| CircuitChange::Closed {
                open_for: (now - since).to_std().unwrap_or_default(),
            });
        }
        if transport_failures == 0 {
            return None;
        }
        self.failures = self.failures.saturating_add(1);
        if self.open_since.is_none() {
            self.open_since = Some(now);
            return Some(CircuitChange::Opened);
        }
        None
    }

    /// Closes the breaker without an acknowledgement of its own, when the caller learned
    /// otherwise that the transport answers again (the relay does so while it has nothing to
    /// send and another relay of the process had a record acknowledged since this relay last
    /// failed). Reports [`CircuitChange::Closed`] if it was open.
    pub fn close(&mut self, now: DateTime<Utc>) -> Option<CircuitChange> {
        self.failures = 0;
        self.open_since.take().map(|since| CircuitChange::Closed {
            open_for: (now - since).to_std().unwrap_or_default(),
        })
    }

    /// While open: how long to pause before the next cycle, uniform in `[c/2, c]` where
    /// `c = min(max, base * 2^(failures-1))` (jittered so that relays that failed together do
    /// not probe together, never shorter than half the ceiling so a pause is a pause).
    pub fn pause<R: Rng + ?Sized>(&self, rng: &mut R) -> Option<Duration> {
        if !self.is_open() {
            return None;
        }
        let exp = self.failures.saturating_sub(1).min(31);
        let ceiling = self.base.saturating_mul(1u32 << exp).min(self.max);
        let hi = ceiling.as_micros().min(u64::MAX as u128) as u64;
        Some(Duration::from_micros(rng.random_range(hi / 2..=hi)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000 + s, 0).unwrap()
    }

    #[test]
    fn opens_on_a_cycle_that_failed_as_a_whole_and_reports_each_change_once() {
        let mut b = CircuitBreaker::new(Duration::from_millis(100), Duration::from_secs(2));
        assert_eq!(
            b.on_cycle(0, 0, t(0)),
            None,
            "an empty cycle changes nothing"
        );
        assert_eq!(b.on_cycle(5, 0, t(0)), None, "closed stays closed");
        assert_eq!(b.on_cycle(0, 4, t(1)), Some(CircuitChange::Opened));
        assert!(b.is_open());
        assert_eq!(b.failures(), 1);
        assert_eq!(b.on_cycle(0, 4, t(2)), None, "no second report while open");
        assert_eq!(b.failures(), 2, "each failed cycle counts");
        assert_eq!(b.on_cycle(0, 0, t(3)), None, "an empty cycle keeps it open");
        assert!(b.is_open());
        assert_eq!(
            b.on_cycle(1, 3, t(10)),
            Some(CircuitChange::Closed {
                open_for: Duration::from_secs(9)
            }),
            "one acknowledgement closes it"
        );
        assert!(!b.is_open());
        assert_eq!(b.failures(), 0);
    }

    #[test]
    fn close_reports_only_an_open_breaker_and_resets_the_pauses() {
        let mut b = CircuitBreaker::new(Duration::from_millis(100), Duration::from_secs(2));
        assert_eq!(b.close(t(0)), None, "closed stays closed");
        b.on_cycle(0, 1, t(1));
        b.on_cycle(0, 1, t(2));
        assert_eq!(
            b.close(t(4)),
            Some(CircuitChange::Closed {
                open_for: Duration::from_secs(3)
            })
        );
        assert!(!b.is_open());
        assert_eq!(b.failures(), 0);
        assert_eq!(b.close(t(5)), None, "reported once");
        assert_eq!(b.on_cycle(0, 1, t(6)), Some(CircuitChange::Opened));
    }

    #[test]
    fn pauses_grow_are_capped_and_jittered() {
        let mut b = CircuitBreaker::new(Duration::from_millis(100), Duration::from_secs(1));
        let mut rng = StdRng::seed_from_u64(5);
        assert_eq!(b.pause(&mut rng), None);
        let mut ceilings = Vec::new();
        for n in 0..8 {
            b.on_cycle(0, 1, t(n));
            let samples: Vec<Duration> = (0..200).map(|_| b.pause(&mut rng).unwrap()).collect();
            let max = *samples.iter().max().unwrap();
            let min = *samples.iter().min().unwrap();
            let ceiling = Duration::from_millis(100 * (1 << n)).min(Duration::from_secs(1));
            assert!(
                max <= ceiling && min >= ceiling / 2,
                "n={n} {min:?}..{max:?}"
            );
            assert!(max - min > ceiling / 4, "n={n}: not jittered");
            ceilings.push(ceiling);
        }
        assert_eq!(*ceilings.last().unwrap(), Duration::from_secs(1));
    }
}
