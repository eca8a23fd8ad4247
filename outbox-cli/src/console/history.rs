//! The backlog over time, for the console's charts: samples of `console.history`, at most
//! [`MAX_SAMPLES`] of them, kept at least `history / MAX_SAMPLES` apart; the newest reading
//! is always shown (it replaces the previous newest while that one is closer than this to the
//! sample before it), and memory stays bounded whatever the sampling rate.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::OutboxStats;
use serde::Serialize;

/// Most samples held.
pub const MAX_SAMPLES: usize = 720;

/// One reading of the backlog.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Sample {
    /// When (UTC).
    pub at: DateTime<Utc>,
    /// Unpublished events (the backlog).
    pub unpublished: u64,
    /// Parked events.
    pub parked: u64,
    /// Age of the oldest claimable event, seconds (`None`: nothing claimable).
    pub oldest_claimable_age_seconds: Option<f64>,
}

/// Samples shared by whoever reads the backlog (the relay's monitor, `outbox console`'s
/// sampler, a page load) and the pages that draw them.
#[derive(Clone, Debug)]
pub struct History {
    window: Duration,
    samples: Arc<Mutex<VecDeque<Sample>>>,
}

impl History {
    /// Keeps the samples of the last `window` (at least a minute).
    pub fn new(window: Duration) -> Self {
        Self {
            window: window.max(Duration::from_secs(60)),
            samples: Arc::default(),
        }
    }

    /// How far back it looks.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Adds the reading `stats` taken at `at`.
    pub fn observe(&self, at: DateTime<Utc>, stats: &OutboxStats) {
        self.push(Sample {
            at,
            unpublished: stats.unpublished,
            parked: stats.parked,
            oldest_claimable_age_seconds: stats.oldest_claimable_age.map(|d| d.as_secs_f64()),
        });
    }

    /// Adds a sample (one older than the newest is ignored).
    pub fn push(&self, sample: Sample) {
        let mut samples = self
            .samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let spacing = self.window / MAX_SAMPLES as u32;
        if samples.back().is_some_and(|last| sample.at < last.at) {
            return;
        }
        // The newest sample stands in until the next one is `spacing` past the one before it.
        let n = samples.len();
        if n >= 2 && (sample.at - samples[n - 2].at).to_std().unwrap_or_default() < spacing {
            samples.pop_back();
        }
        samples.push_back(sample);
        let window = chrono::Duration::from_std(self.window).unwrap_or(chrono::Duration::MAX);
        while samples
            .front()
            .is_some_and(|s| sample.at - s.at > window || samples.len() > MAX_SAMPLES)
        {
            samples.pop_front();
        }
    }

    /// The samples, oldest first.
    pub fn samples(&self) -> Vec<Sample> {
        self.samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .copied()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000 + s, 0).unwrap()
    }

    fn sample(s: i64, n: u64) -> Sample {
        Sample {
            at: at(s),
            unpublished: n,
            parked: 0,
            oldest_claimable_age_seconds: None,
        }
    }

    #[test]
    fn samples_stay_spaced_the_newest_is_shown_and_old_ones_leave() {
        // An hour: samples at least 5 s apart.
        let h = History::new(Duration::from_secs(3600));
        let units = |h: &History| {
            h.samples()
                .iter()
                .map(|s| s.unpublished)
                .collect::<Vec<_>>()
        };
        h.push(sample(0, 1));
        h.push(sample(2, 2));
        // 4 s after the first kept one: it stands in for the newest.
        h.push(sample(4, 3));
        assert_eq!(units(&h), [1, 3]);
        // 6 s after it: kept beside.
        h.push(sample(6, 4));
        assert_eq!(units(&h), [1, 3, 4]);
        // Sampled fast, the newest moves and the kept ones stay 5 s apart.
        for i in 0..100 {
            h.push(sample(6 + i / 10, 5));
        }
        let times: Vec<i64> = h
            .samples()
            .iter()
            .map(|s| s.at.timestamp() - 1_700_000_000)
            .collect();
        assert_eq!(times.last(), Some(&15), "{times:?}");
        assert!(times.len() <= 5, "{times:?}");
        // Time does not go back.
        let n = h.samples().len();
        h.push(sample(1, 9));
        assert_eq!(h.samples().len(), n);
        // An hour and more later, the old ones are gone.
        h.push(sample(3610, 7));
        assert!(
            h.samples().iter().all(|s| s.at >= at(10)),
            "{:?}",
            h.samples()
        );
        assert_eq!(units(&h).last(), Some(&7));
        assert!(units(&h).len() >= 2);
    }

    #[test]
    fn never_more_than_the_bound() {
        let h = History::new(Duration::from_secs(60));
        for i in 0..5000 {
            h.push(sample(i / 100, 1));
        }
        assert!(h.samples().len() <= MAX_SAMPLES);
    }
}
