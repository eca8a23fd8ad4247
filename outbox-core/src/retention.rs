//! Retention must line up: the check that a consumer's deduplication window covers everything
//! the broker can deliver again.
//!
//! A redelivery re-applies an effect when the inbox has already forgotten the event. The
//! longest possible redelivery is
//!
//! ```text
//! topic retention (retention.ms)  +  largest tolerated consumer lag  +  manual replay window
//! ```
//!
//! (a consumer that lags by `max_lag` reads records that are up to `retention + max_lag` old
//! when the broker is about to delete them; an operator replay reaches `replay_window` further
//! back). The inbox's dedup retention must be at least that. The outbox's retention of
//! published rows is reported beside them: re-publishing from the outbox (re-issue, replay)
//! needs the rows to still be there.
//!
//! [`RetentionCheck::evaluate`] is pure: adapters read the figures (the topic's `retention.ms`
//! from the broker: `outbox_kafka::topic_retention`) and the engine or the operations command
//! decides what to do with the report. `Strictness::Refuse` turns a violation into an error,
//! `Strictness::Warn` only reports it.
//!
//! ```
//! use std::time::Duration;
//! use outbox_core::retention::{RetentionCheck, Strictness, TopicRetention};
//! let day = Duration::from_secs(86_400);
//! let check = RetentionCheck::new(Some(14 * day), TopicRetention::Limited(7 * day))
//!     .max_lag(day)
//!     .replay_window(2 * day);
//! let report = check.evaluate(Strictness::Refuse).expect("14 days cover 7 + 1 + 2");
//! assert_eq!(report.required, Some(10 * day));
//!
//! let too_short = RetentionCheck::new(Some(3 * day), TopicRetention::Limited(7 * day));
//! let err = too_short.evaluate(Strictness::Refuse).unwrap_err();
//! assert!(err.to_string().contains("dedup retention"));
//! ```

use std::fmt;
use std::time::Duration;

/// Kafka's default `retention.ms` (7 days), assumed when a broker does not report the topic's.
pub const KAFKA_DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 86_400);

/// A topic's retention as the broker reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TopicRetention {
    /// Records are deleted after this long (`retention.ms`).
    Limited(Duration),
    /// Records are never deleted by time (`retention.ms = -1`).
    Unlimited,
    /// The broker did not report it; Kafka's default ([`KAFKA_DEFAULT_RETENTION`]) is assumed
    /// and a warning says so.
    Unknown,
}

impl TopicRetention {
    /// From a `retention.ms` value (`-1` or any negative: unlimited).
    pub fn from_millis(ms: i64) -> Self {
        if ms < 0 {
            Self::Unlimited
        } else {
            Self::Limited(Duration::from_millis(ms as u64))
        }
    }
}

/// What to do with a violation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Strictness {
    /// A violation is an error (the default: refuse to start).
    #[default]
    Refuse,
    /// A violation is reported as a warning only.
    Warn,
}

/// How bad a finding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Severity {
    /// Worth knowing, nothing is at risk by itself.
    Warning,
    /// Effects can be applied twice (or replays can fail).
    Violation,
}

/// One finding of the check.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Finding {
    /// How bad.
    pub severity: Severity,
    /// What, in words an operator can act on.
    pub message: String,
}

/// The inputs of the check.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetentionCheck {
    /// The inbox's dedup retention (`None`: registrations are never cleaned up).
    pub dedup_retention: Option<Duration>,
    /// The topic's retention.
    pub topic_retention: TopicRetention,
    /// The largest consumer lag tolerated (time). Default zero.
    pub max_lag: Duration,
    /// How far back an operator may replay. Default zero.
    pub replay_window: Duration,
    /// The outbox's retention of published rows, reported beside the others (`None`: unknown
    /// or not applicable).
    pub outbox_retention: Option<Duration>,
    /// The topic is compacted (`cleanup.policy` contains `compact`).
    pub compacted: bool,
}

impl RetentionCheck {
    /// A check of `dedup_retention` against `topic_retention`, with no lag and no replay window.
    pub fn new(dedup_retention: Option<Duration>, topic_retention: TopicRetention) -> Self {
        Self {
            dedup_retention,
            topic_retention,
            max_lag: Duration::ZERO,
            replay_window: Duration::ZERO,
            outbox_retention: None,
            compacted: false,
        }
    }

    /// Sets the largest tolerated lag.
    pub fn max_lag(mut self, d: Duration) -> Self {
        self.max_lag = d;
        self
    }

    /// Sets the replay window.
    pub fn replay_window(mut self, d: Duration) -> Self {
        self.replay_window = d;
        self
    }

    /// Sets the outbox retention.
    pub fn outbox_retention(mut self, d: Option<Duration>) -> Self {
        self.outbox_retention = d;
        self
    }

    /// Marks the topic compacted.
    pub fn compacted(mut self, yes: bool) -> Self {
        self.compacted = yes;
        self
    }

    /// Evaluates the check.
    pub fn evaluate(&self, strictness: Strictness) -> Result<RetentionReport, RetentionError> {
        let mut findings = Vec::new();
        let topic = match self.topic_retention {
            TopicRetention::Limited(d) => Some(d),
            TopicRetention::Unlimited => None,
            TopicRetention::Unknown => {
                findings.push(Finding {
                    severity: Severity::Warning,
                    message: format!(
                        "the broker did not report the topic's retention.ms; assuming Kafka's \
                         default of {}",
                        human(KAFKA_DEFAULT_RETENTION)
                    ),
                });
                Some(KAFKA_DEFAULT_RETENTION)
            }
        };
        let required = topic.map(|t| t + self.max_lag + self.replay_window);
        match (self.dedup_retention, required) {
            (None, _) => {}
            (Some(dedup), None) => findings.push(Finding {
                severity: Severity::Violation,
                message: format!(
                    "dedup retention {} is finite but the topic keeps records forever \
                     (retention.ms = -1): any redelivery older than {} applies its effect again; \
                     never clean up the inbox, or limit the topic's retention",
                    human(dedup),
                    human(dedup)
                ),
            }),
            (Some(dedup), Some(req)) if dedup < req => findings.push(Finding {
                severity: Severity::Violation,
                message: format!(
                    "dedup retention {} is shorter than the longest possible redelivery {} \
                     (topic retention {} + max lag {} + replay window {}): raise the inbox \
                     retention to at least {}",
                    human(dedup),
                    human(req),
                    topic.map_or_else(|| "unlimited".into(), human),
                    human(self.max_lag),
                    human(self.replay_window),
                    human(req)
                ),
            }),
            _ => {}
        }
        if self.compacted {
            findings.push(Finding {
                severity: Severity::Warning,
                message: "the topic is compacted: intermediate events of an aggregate may vanish, \
                          which a consumer sees as version gaps"
                    .into(),
            });
        }
        if let Some(outbox) = self.outbox_retention {
            if outbox < self.replay_window {
                findings.push(Finding {
                    severity: Severity::Warning,
                    message: format!(
                        "outbox retention {} is shorter than the replay window {}: a replay from \
                         the outbox cannot reach that far back",
                        human(outbox),
                        human(self.replay_window)
                    ),
                });
            }
        }
        let report = RetentionReport {
            dedup_retention: self.dedup_retention,
            required,
            outbox_retention: self.outbox_retention,
            findings,
        };
        if strictness == Strictness::Refuse && report.has_violation() {
            return Err(RetentionError { report });
        }
        Ok(report)
    }
}

/// The outcome of a [`RetentionCheck`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetentionReport {
    /// The inbox's dedup retention (`None`: forever).
    pub dedup_retention: Option<Duration>,
    /// The longest possible redelivery (`None`: unbounded).
    pub required: Option<Duration>,
    /// The outbox's retention, as given.
    pub outbox_retention: Option<Duration>,
    /// What was found (violations are only here under [`Strictness::Warn`]).
    pub findings: Vec<Finding>,
}

impl RetentionReport {
    /// Whether any finding is a violation.
    pub fn has_violation(&self) -> bool {
        self.findings
            .iter()
            .any(|f| f.severity == Severity::Violation)
    }
}

impl fmt::Display for RetentionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dedup retention {}, longest redelivery {}, outbox retention {}",
            self.dedup_retention.map_or_else(|| "forever".into(), human),
            self.required.map_or_else(|| "unbounded".into(), human),
            self.outbox_retention
                .map_or_else(|| "not given".into(), human),
        )?;
        for finding in &self.findings {
            let tag = match finding.severity {
                Severity::Warning => "warning",
                Severity::Violation => "violation",
            };
            write!(f, "; {tag}: {}", finding.message)?;
        }
        Ok(())
    }
}

/// A retention check refused the configuration.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("retention check failed: {report}")]
pub struct RetentionError {
    /// The full report.
    pub report: RetentionReport,
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 86_400 && s.is_multiple_of(3_600) {
        let h = s / 3_600;
        if h.is_multiple_of(24) {
            format!("{}d", h / 24)
        } else {
            format!("{}d{}h", h / 24, h % 24)
        }
    } else if s >= 3_600 && s.is_multiple_of(60) {
        format!("{}h{}m", s / 3_600, (s % 3_600) / 60)
    } else if s >= 60 {
        format!("{}m{}s", s / 60, s % 60)
    } else {
        format!("{:?}", d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);
    const HOUR: Duration = Duration::from_secs(3_600);

    #[test]
    fn table() {
        use TopicRetention::*;
        // dedup, topic, lag, replay, violation, warnings
        type Case = (
            Option<Duration>,
            TopicRetention,
            Duration,
            Duration,
            bool,
            usize,
        );
        let cases: &[Case] = &[
            (
                Some(8 * DAY),
                Limited(7 * DAY),
                HOUR,
                Duration::ZERO,
                false,
                0,
            ),
            (
                Some(7 * DAY),
                Limited(7 * DAY),
                HOUR,
                Duration::ZERO,
                true,
                0,
            ),
            (
                Some(7 * DAY),
                Limited(7 * DAY),
                Duration::ZERO,
                Duration::ZERO,
                false,
                0,
            ),
            (Some(9 * DAY), Limited(7 * DAY), DAY, DAY, false, 0),
            (Some(9 * DAY - HOUR), Limited(7 * DAY), DAY, DAY, true, 0),
            (None, Unlimited, DAY, DAY, false, 0),
            (
                Some(365 * DAY),
                Unlimited,
                Duration::ZERO,
                Duration::ZERO,
                true,
                0,
            ),
            (
                Some(7 * DAY),
                Unknown,
                Duration::ZERO,
                Duration::ZERO,
                false,
                1,
            ),
            (
                Some(6 * DAY),
                Unknown,
                Duration::ZERO,
                Duration::ZERO,
                true,
                1,
            ),
        ];
        for (dedup, topic, lag, replay, violation, warnings) in cases {
            let check = RetentionCheck::new(*dedup, *topic)
                .max_lag(*lag)
                .replay_window(*replay);
            let report = check.evaluate(Strictness::Warn).unwrap();
            assert_eq!(report.has_violation(), *violation, "{check:?}: {report}");
            let warn_count = report
                .findings
                .iter()
                .filter(|f| f.severity == Severity::Warning)
                .count();
            assert_eq!(warn_count, *warnings, "{check:?}: {report}");
            assert_eq!(
                check.evaluate(Strictness::Refuse).is_err(),
                *violation,
                "{check:?}"
            );
        }
    }

    #[test]
    fn compaction_and_outbox_are_reported() {
        let r = RetentionCheck::new(None, TopicRetention::from_millis(-1))
            .compacted(true)
            .replay_window(2 * DAY)
            .outbox_retention(Some(DAY))
            .evaluate(Strictness::Refuse)
            .unwrap();
        assert_eq!(r.findings.len(), 2, "{r}");
        assert!(r.to_string().contains("compacted"), "{r}");
        assert!(r.to_string().contains("outbox retention 1d"), "{r}");
        assert_eq!(
            TopicRetention::from_millis(3_600_000),
            TopicRetention::Limited(HOUR)
        );
    }

    #[test]
    fn durations_read_as_an_operator_writes_them() {
        let s = Duration::from_secs;
        let table = [
            (Duration::from_millis(1500), "1.5s"),
            (s(59), "59s"),
            (s(60), "1m0s"),
            (s(90), "1m30s"),
            (s(3_599), "59m59s"),
            (s(3_600), "1h0m"),
            (s(3_601), "60m1s"),
            (s(5_400), "1h30m"),
            (s(86_340), "23h59m"),
            (s(86_400), "1d"),
            (s(86_401), "1440m1s"),
            (s(86_460), "24h1m"),
            (s(90_000), "1d1h"),
            (s(30 * 86_400), "30d"),
        ];
        for (d, text) in table {
            assert_eq!(human(d), text, "{d:?}");
        }
    }

    #[test]
    fn retention_ms_zero_is_limited_and_negative_unlimited() {
        assert_eq!(
            TopicRetention::from_millis(0),
            TopicRetention::Limited(Duration::ZERO)
        );
        assert_eq!(TopicRetention::from_millis(-1), TopicRetention::Unlimited);
        assert_eq!(TopicRetention::from_millis(-2), TopicRetention::Unlimited);
    }

    #[test]
    fn outbox_retention_may_equal_the_replay_window() {
        let check = |outbox: Duration| {
            RetentionCheck::new(None, TopicRetention::Unlimited)
                .replay_window(DAY)
                .outbox_retention(Some(outbox))
                .evaluate(Strictness::Refuse)
                .unwrap()
        };
        assert!(check(DAY).findings.is_empty());
        let short = check(DAY - Duration::from_secs(1));
        assert_eq!(short.findings.len(), 1);
        assert_eq!(short.findings[0].severity, Severity::Warning);
        assert!(short.findings[0].message.contains("replay window 1d"));
        assert!(!check(2 * DAY).has_violation());
    }

    #[test]
    fn the_report_reads_back_what_was_given() {
        let report = RetentionCheck::new(Some(8 * DAY), TopicRetention::Limited(7 * DAY))
            .max_lag(HOUR)
            .outbox_retention(Some(2 * DAY))
            .evaluate(Strictness::Refuse)
            .unwrap();
        assert_eq!(report.dedup_retention, Some(8 * DAY));
        assert_eq!(report.required, Some(7 * DAY + HOUR));
        assert_eq!(report.outbox_retention, Some(2 * DAY));
        assert_eq!(
            report.to_string(),
            "dedup retention 8d, longest redelivery 7d1h, outbox retention 2d"
        );
        let forever = RetentionCheck::new(None, TopicRetention::Unlimited)
            .evaluate(Strictness::Refuse)
            .unwrap();
        assert_eq!(forever.required, None);
        assert_eq!(
            forever.to_string(),
            "dedup retention forever, longest redelivery unbounded, outbox retention not given"
        );
        // Under `Warn` a violation is reported, tagged, instead of refused.
        let warned = RetentionCheck::new(Some(DAY), TopicRetention::Unlimited)
            .compacted(true)
            .evaluate(Strictness::Warn)
            .unwrap();
        let text = warned.to_string();
        assert!(
            text.contains("; violation: dedup retention 1d is finite"),
            "{text}"
        );
        assert!(text.contains("; warning: the topic is compacted"), "{text}");
        assert_eq!(
            warned
                .findings
                .iter()
                .map(|f| f.severity)
                .collect::<Vec<_>>(),
            [Severity::Violation, Severity::Warning]
        );
    }

    #[test]
    fn the_error_names_the_figures() {
        let err = RetentionCheck::new(Some(DAY), TopicRetention::Limited(7 * DAY))
            .max_lag(HOUR)
            .evaluate(Strictness::Refuse)
            .unwrap_err();
        let text = err.to_string();
        for part in [
            "dedup retention 1d",
            "7d1h",
            "max lag 1h0m",
            "at least 7d1h",
        ] {
            assert!(text.contains(part), "{part} missing in {text}");
        }
    }
}
