//! The backlog's current trend, from which `outbox_backlog_forecast_seconds` is computed.
//!
//! The relay samples the backlog (unpublished events) every `relay.stats_interval` and keeps
//! the samples of the last `status.trend_window` (default 1 min). The rate is the least-squares
//! slope of backlog over time across those samples: it follows a change within one window, and
//! a single batch drained or appended moves it little. An average over a long window (the
//! earlier 15-minute "created minus published" figure) lets a drain of older events cancel a
//! live outage: the forecast then read -1 ("not growing") while the backlog grew by 20 a
//! second. A least-squares slope over a short window was chosen over an exponentially
//! weighted rate because it forgets the past completely after one window, so an operator can
//! tell exactly which samples a reading comes from.
//!
//! `outbox status` computes its rate and forecast by the same rule over the same window: it
//! reconstructs the backlog at the same points from the table (see
//! `commands::status`), so the command and the metric agree.
//!
//! Plain functions of (samples, now): the relay feeds it, tests inject samples.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Backlog samples over a sliding window, and the slope through them.
#[derive(Clone, Debug)]
pub struct BacklogTrend {
    window: Duration,
    samples: VecDeque<(Instant, u64)>,
}

impl BacklogTrend {
    /// Keeps the samples of the last `window` (at least one second).
    pub fn new(window: Duration) -> Self {
        Self {
            window: window.max(Duration::from_secs(1)),
            samples: VecDeque::new(),
        }
    }

    /// Adds the backlog seen at `at`, forgetting samples older than the window before it. A
    /// sample older than the newest one is ignored (time does not go back).
    pub fn observe(&mut self, at: Instant, backlog: u64) {
        if self.samples.back().is_some_and(|(last, _)| at < *last) {
            return;
        }
        self.samples.push_back((at, backlog));
        while let Some((first, _)) = self.samples.front() {
            if at.duration_since(*first) > self.window {
                self.samples.pop_front();
            } else {
                break;
            }
        }
    }

    /// Growth of the backlog in events per second over the window (negative: draining);
    /// `None` until two samples at different times are known.
    pub fn rate_per_sec(&self) -> Option<f64> {
        let (t0, _) = *self.samples.front()?;
        let n = self.samples.len() as f64;
        let xs = || {
            self.samples
                .iter()
                .map(move |(t, b)| (t.duration_since(t0).as_secs_f64(), *b as f64))
        };
        let mean_x = xs().map(|(x, _)| x).sum::<f64>() / n;
        let mean_y = xs().map(|(_, y)| y).sum::<f64>() / n;
        let sxx: f64 = xs().map(|(x, _)| (x - mean_x) * (x - mean_x)).sum();
        if sxx <= f64::EPSILON {
            return None;
        }
        let sxy: f64 = xs().map(|(x, y)| (x - mean_x) * (y - mean_y)).sum();
        Some(sxy / sxx)
    }

    /// Samples held (for tests and logs).
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether no sample is held.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::backpressure::forecast;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    /// Feeds `(seconds since start, backlog)` samples.
    fn fed(window: u64, samples: &[(f64, u64)]) -> BacklogTrend {
        let start = Instant::now();
        let mut t = BacklogTrend::new(Duration::from_secs(window));
        for (s, b) in samples {
            t.observe(start + secs(*s), *b);
        }
        t
    }

    #[test]
    fn unknown_until_two_samples_at_different_times() {
        assert_eq!(fed(60, &[]).rate_per_sec(), None);
        assert_eq!(fed(60, &[(0.0, 10)]).rate_per_sec(), None);
        assert_eq!(fed(60, &[(0.0, 10), (0.0, 20)]).rate_per_sec(), None);
        assert_eq!(fed(60, &[(0.0, 10), (5.0, 20)]).rate_per_sec(), Some(2.0));
    }

    /// The trial: 14 minutes of draining 2,000 older events (a 15-minute average of created
    /// minus published is negative), then an outage 40 s old with the backlog growing 20 a
    /// second. The forecast must say when it is full, not "not growing".
    #[test]
    fn an_outage_after_a_long_drain_is_forecast_within_one_window() {
        let mut samples = Vec::new();
        // Draining from 2,000 to 0 over 840 s, sampled every 5 s.
        for i in 0..=168u64 {
            samples.push((i as f64 * 5.0, 2000 - (2000 * i / 168)));
        }
        // Then 40 s of outage: +20/s.
        for i in 1..=8u64 {
            samples.push((840.0 + i as f64 * 5.0, i * 100));
        }
        let t = fed(60, &samples);
        let rate = t.rate_per_sec().unwrap();
        assert!(rate > 0.0, "{rate}");
        assert!(t.len() <= 13, "only the last minute is held: {}", t.len());
        let f = forecast(1_000_000, 800, Some(rate)).expect("growing");
        assert!(f < Duration::from_secs(1_000_000 / 5), "{f:?}");
        // Once the window holds the outage only, the rate is the true 20/s.
        let mut samples2 = samples.clone();
        for i in 9..=20u64 {
            samples2.push((840.0 + i as f64 * 5.0, i * 100));
        }
        let rate = fed(60, &samples2).rate_per_sec().unwrap();
        assert!((rate - 20.0).abs() < 1e-9, "{rate}");
        let f = forecast(1_000_000, 2000, Some(rate)).unwrap().as_secs_f64();
        assert!((f - 49_900.0).abs() < 1.0, "{f}");
    }

    #[test]
    fn a_flat_or_draining_backlog_is_not_growing() {
        let flat = fed(60, &[(0.0, 50), (5.0, 50), (10.0, 50)]);
        assert_eq!(flat.rate_per_sec(), Some(0.0));
        assert_eq!(forecast(1000, 50, flat.rate_per_sec()), None);
        let draining = fed(60, &[(0.0, 500), (5.0, 400), (10.0, 300)]);
        assert_eq!(draining.rate_per_sec(), Some(-20.0));
        assert_eq!(forecast(1000, 300, draining.rate_per_sec()), None);
    }

    /// A batch drained between samples moves the slope less than the step between two samples
    /// would: the forecast does not flap with each batch.
    #[test]
    fn one_batch_moves_the_slope_little() {
        // Growing 10/s, one sample every 5 s, one batch of 500 drained in the middle.
        let mut samples: Vec<(f64, u64)> = (0..=12u64).map(|i| (i as f64 * 5.0, i * 50)).collect();
        samples[6].1 -= 40;
        let rate = fed(60, &samples).rate_per_sec().unwrap();
        assert!(rate > 9.0 && rate < 11.0, "{rate}");
    }

    #[test]
    fn old_samples_leave_the_window_and_time_does_not_go_back() {
        let start = Instant::now();
        let mut t = BacklogTrend::new(Duration::from_secs(10));
        t.observe(start, 1000);
        t.observe(start + secs(5.0), 0);
        t.observe(start + secs(20.0), 0);
        t.observe(start + secs(25.0), 50);
        assert_eq!(t.len(), 2);
        assert_eq!(t.rate_per_sec(), Some(10.0));
        t.observe(start + secs(1.0), 9999);
        assert_eq!(t.len(), 2);
        assert_eq!(
            BacklogTrend::new(Duration::ZERO).window,
            Duration::from_secs(1)
        );
    }
}
