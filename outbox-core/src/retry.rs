//! Retry and poison decisions as pure functions of (attempt, error, rng).
//!
//! ```
//! use std::time::Duration;
//! use outbox_core::RetryPolicy;
//! use rand::{rngs::StdRng, SeedableRng};
//!
//! let policy = RetryPolicy::builder()
//!     .base(Duration::from_millis(100))
//!     .max_delay(Duration::from_secs(10))
//!     .max_attempts(5)
//!     .build()
//!     .unwrap();
//! let mut rng = StdRng::seed_from_u64(7);
//! let d = policy.backoff(3, &mut rng);
//! assert!(d <= Duration::from_millis(800)); // full jitter: uniform in [0, base * 2^3]
//! ```

use std::time::Duration;

use rand::Rng;

use crate::delivery::{AckMetadata, ClaimedRecord, LastError, Outcome, ParkKind, ParkReason};
use crate::error::{Classify, ConfigError, ErrorClass, FailureScope, PublishError};

/// Exponential backoff with full jitter and an attempt limit.
///
/// Delay before attempt `n + 1` after `n` failures: uniform in `[0, min(max_delay, base * 2^(n-1))]`
/// (full jitter, so relays that failed together do not retry together). After `max_attempts`
/// failed attempts a transient failure parks the event.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// First backoff ceiling. Default 200 ms.
    pub base: Duration,
    /// Largest backoff ceiling. Default 60 s.
    pub max_delay: Duration,
    /// Failed attempts after which a transient failure parks the event. Default 12.
    pub max_attempts: u32,
    /// Smallest delay, so a failing record can never be retried in a hot loop. Default 10 ms.
    pub min_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(200),
            max_delay: Duration::from_secs(60),
            max_attempts: 12,
            min_delay: Duration::from_millis(10),
        }
    }
}

impl RetryPolicy {
    /// A builder starting from the defaults.
    pub fn builder() -> RetryPolicyBuilder {
        RetryPolicyBuilder(Self::default())
    }

    /// The ceiling of the delay after `failures` failed attempts (`failures >= 1`).
    pub fn ceiling(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(62);
        let factor = 1u64 << exp;
        let base_ms = self.base.as_millis().min(u64::MAX as u128) as u64;
        let ms = base_ms.saturating_mul(factor);
        Duration::from_millis(ms)
            .min(self.max_delay)
            .max(self.min_delay)
    }

    /// A jittered delay after `failures` failed attempts, never below `min_delay`.
    pub fn backoff<R: Rng + ?Sized>(&self, failures: u32, rng: &mut R) -> Duration {
        let ceiling = self.ceiling(failures);
        let ceiling_us = ceiling.as_micros().min(u64::MAX as u128) as u64;
        let jittered = Duration::from_micros(rng.random_range(0..=ceiling_us));
        jittered.max(self.min_delay)
    }

    /// Decides what to record for one claimed record given its publication result.
    ///
    /// * acknowledged: [`Outcome::Published`];
    /// * a transport failure ([`FailureScope::Transport`]): [`Outcome::Defer`], no attempt
    ///   spent, never parked;
    /// * the record's own permanent failure: parked ([`ParkKind::PermanentError`]);
    /// * the record's own transient failure: [`Outcome::Retry`] with backoff, parked
    ///   ([`ParkKind::AttemptsExhausted`]) once `max_attempts` failures are reached.
    pub fn decide<R: Rng + ?Sized>(
        &self,
        record: &ClaimedRecord,
        result: &Result<AckMetadata, PublishError>,
        rng: &mut R,
    ) -> Outcome {
        let event_id = record.envelope.event_id;
        match result {
            Ok(ack) => Outcome::Published {
                event_id,
                ack: ack.clone(),
            },
            Err(err) if err.scope == FailureScope::Transport => Outcome::Defer {
                event_id,
                // The relay's circuit breaker paces the relay as a whole; this only spreads
                // the records' return a little.
                delay: self.backoff(1, rng),
                error: LastError::from(err),
            },
            Err(err) => {
                let failures = record.attempts.saturating_add(1);
                let error = LastError::from(err);
                match err.class() {
                    ErrorClass::Permanent => Outcome::Park {
                        event_id,
                        reason: ParkReason {
                            kind: ParkKind::PermanentError,
                            error,
                        },
                    },
                    ErrorClass::Transient if failures >= self.max_attempts => Outcome::Park {
                        event_id,
                        reason: ParkReason {
                            kind: ParkKind::AttemptsExhausted,
                            error,
                        },
                    },
                    ErrorClass::Transient => Outcome::Retry {
                        event_id,
                        delay: self.backoff(failures, rng),
                        error,
                    },
                }
            }
        }
    }
}

/// Builder for [`RetryPolicy`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RetryPolicyBuilder(RetryPolicy);

impl RetryPolicyBuilder {
    /// First backoff ceiling.
    pub fn base(mut self, d: Duration) -> Self {
        self.0.base = d;
        self
    }
    /// Largest backoff ceiling.
    pub fn max_delay(mut self, d: Duration) -> Self {
        self.0.max_delay = d;
        self
    }
    /// Attempt limit.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.0.max_attempts = n;
        self
    }
    /// Smallest delay.
    pub fn min_delay(mut self, d: Duration) -> Self {
        self.0.min_delay = d;
        self
    }
    /// Validates: `max_attempts >= 1`, `base > 0`, `min_delay > 0`, `base <= max_delay`.
    pub fn build(self) -> Result<RetryPolicy, ConfigError> {
        let p = self.0;
        if p.max_attempts == 0 {
            return Err(ConfigError::new("max_attempts must be at least 1"));
        }
        if p.base.is_zero() || p.min_delay.is_zero() {
            return Err(ConfigError::new(
                "base and min_delay must be greater than zero (a zero delay allows hot loops)",
            ));
        }
        if p.base > p.max_delay {
            return Err(ConfigError::new("base must not exceed max_delay"));
        }
        Ok(p)
    }
}

/// Jittered exponential backoff of the relay's idle polling.
///
/// Each empty poll doubles the ceiling up to `max`; any work resets it. Delays are full-jitter
/// between `min` and the ceiling.
#[derive(Clone, Debug)]
pub struct IdleBackoff {
    min: Duration,
    max: Duration,
    empty_polls: u32,
}

impl IdleBackoff {
    /// Backoff between `min` and `max`.
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max: max.max(min),
            empty_polls: 0,
        }
    }

    /// Records a poll that found work.
    pub fn reset(&mut self) {
        self.empty_polls = 0;
    }

    /// Records an empty poll and returns how long to sleep.
    pub fn next_delay<R: Rng + ?Sized>(&mut self, rng: &mut R) -> Duration {
        self.empty_polls = self.empty_polls.saturating_add(1);
        let exp = (self.empty_polls - 1).min(30);
        let ceiling = self.min.saturating_mul(1u32 << exp.min(31)).min(self.max);
        let lo = self.min.as_micros() as u64;
        let hi = (ceiling.as_micros() as u64).max(lo);
        Duration::from_micros(rng.random_range(lo..=hi))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::Envelope;
    use crate::error::PublishErrorKind;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn base_may_equal_max_delay() {
        let p = RetryPolicy::builder()
            .base(Duration::from_secs(1))
            .max_delay(Duration::from_secs(1))
            .build()
            .expect("base == max_delay is a constant backoff");
        assert_eq!(p.ceiling(3), Duration::from_secs(1));
    }

    #[test]
    fn ceiling_doubles_and_caps() {
        let p = RetryPolicy::builder()
            .base(Duration::from_millis(100))
            .max_delay(Duration::from_secs(1))
            .build()
            .unwrap();
        let got: Vec<u128> = (1..=6).map(|n| p.ceiling(n).as_millis()).collect();
        assert_eq!(got, vec![100, 200, 400, 800, 1000, 1000]);
        assert_eq!(p.ceiling(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn backoff_stays_in_bounds_and_spreads() {
        let p = RetryPolicy::builder()
            .base(Duration::from_millis(100))
            .max_delay(Duration::from_secs(10))
            .min_delay(Duration::from_millis(1))
            .build()
            .unwrap();
        let mut rng = StdRng::seed_from_u64(42);
        for failures in 1..=10 {
            let ceiling = p.ceiling(failures);
            let samples: Vec<Duration> = (0..500).map(|_| p.backoff(failures, &mut rng)).collect();
            assert!(samples.iter().all(|d| *d <= ceiling && *d >= p.min_delay));
            // Full jitter: samples cover the range, not one point.
            let lo = samples.iter().filter(|d| **d < ceiling / 4).count();
            let hi = samples.iter().filter(|d| **d > ceiling * 3 / 4).count();
            assert!(lo > 50 && hi > 50, "failures={failures} lo={lo} hi={hi}");
        }
    }

    #[test]
    fn backoff_is_reproducible_with_a_seed() {
        let p = RetryPolicy::default();
        let a: Vec<_> = {
            let mut r = StdRng::seed_from_u64(9);
            (1..8).map(|n| p.backoff(n, &mut r)).collect()
        };
        let b: Vec<_> = {
            let mut r = StdRng::seed_from_u64(9);
            (1..8).map(|n| p.backoff(n, &mut r)).collect()
        };
        assert_eq!(a, b);
    }

    #[test]
    fn builder_rejects_unsafe_settings() {
        assert!(RetryPolicy::builder().max_attempts(0).build().is_err());
        assert!(RetryPolicy::builder().base(Duration::ZERO).build().is_err());
        assert!(RetryPolicy::builder()
            .min_delay(Duration::ZERO)
            .build()
            .is_err());
        assert!(RetryPolicy::builder()
            .base(Duration::from_secs(5))
            .max_delay(Duration::from_secs(1))
            .build()
            .is_err());
    }

    #[test]
    fn decide_table() {
        let p = RetryPolicy::builder().max_attempts(3).build().unwrap();
        let mut rng = StdRng::seed_from_u64(1);
        let rec = |attempts| {
            ClaimedRecord::new(
                Envelope::builder("a", "1", 1, "t").build().unwrap(),
                attempts,
            )
        };
        let ack = AckMetadata::kafka("t", 0, 5);
        let transient = PublishError::new(PublishErrorKind::Other, "flaky");
        let permanent = PublishError::new(PublishErrorKind::RecordTooLarge, "big");
        // Transport failures never spend attempts, whatever the count so far.
        for kind in [
            PublishErrorKind::Timeout,
            PublishErrorKind::BrokerUnavailable,
            PublishErrorKind::UnknownTopic,
            PublishErrorKind::Authorization,
        ] {
            match p.decide(&rec(2), &Err(PublishError::new(kind, "down")), &mut rng) {
                Outcome::Defer { delay, error, .. } => {
                    assert!(delay >= p.min_delay && delay <= p.ceiling(1));
                    assert_eq!(error.kind, kind.as_str());
                }
                o => panic!("{kind:?}: expected defer, got {o:?}"),
            }
        }
        assert!(matches!(
            p.decide(&rec(0), &Ok(ack), &mut rng),
            Outcome::Published { .. }
        ));
        assert!(matches!(
            p.decide(&rec(0), &Err(transient.clone()), &mut rng),
            Outcome::Retry { .. }
        ));
        assert!(matches!(
            p.decide(&rec(1), &Err(transient.clone()), &mut rng),
            Outcome::Retry { .. }
        ));
        // Third failure reaches the limit of 3.
        match p.decide(&rec(2), &Err(transient), &mut rng) {
            Outcome::Park { reason, .. } => {
                assert_eq!(reason.kind, ParkKind::AttemptsExhausted);
                assert_eq!(reason.error.kind, "other");
            }
            o => panic!("expected park, got {o:?}"),
        }
        match p.decide(&rec(0), &Err(permanent), &mut rng) {
            Outcome::Park { reason, .. } => assert_eq!(reason.kind, ParkKind::PermanentError),
            o => panic!("expected park, got {o:?}"),
        }
    }

    #[test]
    fn idle_backoff_grows_resets_and_jitters() {
        let mut b = IdleBackoff::new(Duration::from_millis(10), Duration::from_millis(1000));
        let mut rng = StdRng::seed_from_u64(3);
        let first = b.next_delay(&mut rng);
        assert_eq!(first, Duration::from_millis(10));
        let mut last = Duration::ZERO;
        for _ in 0..20 {
            last = b.next_delay(&mut rng);
            assert!(last <= Duration::from_millis(1000));
            assert!(last >= Duration::from_millis(10));
        }
        let spread: std::collections::HashSet<_> =
            (0..50).map(|_| b.next_delay(&mut rng)).collect();
        assert!(spread.len() > 10, "no jitter");
        let _ = last;
        b.reset();
        assert_eq!(b.next_delay(&mut rng), Duration::from_millis(10));
    }
}
