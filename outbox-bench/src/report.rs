//! Figures, their summary (median, min–max, ratio to the reference of the same run), the printed
//! table and the JSON file.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

/// One measured quantity of one contender, one sample per round.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Figure {
    /// The contender (what ran).
    pub(crate) contender: String,
    /// What was measured, e.g. `events/s` or `p99 ms`.
    pub(crate) metric: String,
    /// The samples, one per round, in round order.
    pub(crate) samples: Vec<f64>,
    /// The contender this one is compared with (same metric), if any.
    pub(crate) reference: Option<String>,
    /// Median of the samples.
    pub(crate) median: f64,
    /// Smallest sample.
    pub(crate) min: f64,
    /// Largest sample.
    pub(crate) max: f64,
    /// Median of this contender / median of the reference.
    pub(crate) ratio: Option<f64>,
}

/// A target from the issue and whether the run met it.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Target {
    /// What the target says.
    pub(crate) target: String,
    /// The measured value (a ratio or an absolute figure).
    pub(crate) measured: f64,
    /// The bound it is held against.
    pub(crate) bound: f64,
    /// `true` when met.
    pub(crate) met: bool,
}

/// Everything one scenario produced.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) scenario: String,
    pub(crate) started_at: String,
    pub(crate) rounds: usize,
    /// The parameters of the run (sizes, loads, settings).
    pub(crate) parameters: BTreeMap<String, serde_json::Value>,
    pub(crate) figures: Vec<Figure>,
    pub(crate) targets: Vec<Target>,
    /// Extra series or plans (e.g. the soak's samples over time).
    pub(crate) details: BTreeMap<String, serde_json::Value>,
}

/// Collects samples while the rounds run.
#[derive(Default)]
pub(crate) struct Samples {
    order: Vec<(String, String)>,
    values: BTreeMap<(String, String), Vec<f64>>,
    references: BTreeMap<(String, String), String>,
}

impl Samples {
    /// Records one sample of `metric` for `contender`.
    pub(crate) fn add(&mut self, contender: &str, metric: &str, value: f64) {
        let key = (contender.to_owned(), metric.to_owned());
        if !self.values.contains_key(&key) {
            self.order.push(key.clone());
        }
        self.values.entry(key).or_default().push(value);
    }

    /// Compares `contender`'s `metric` with `reference`'s.
    pub(crate) fn compare(&mut self, contender: &str, metric: &str, reference: &str) {
        self.references.insert(
            (contender.to_owned(), metric.to_owned()),
            reference.to_owned(),
        );
    }

    /// The median of a contender's metric, if measured.
    pub(crate) fn median(&self, contender: &str, metric: &str) -> Option<f64> {
        self.values
            .get(&(contender.to_owned(), metric.to_owned()))
            .map(|v| median(v))
    }

    /// The figures, in the order first recorded.
    pub(crate) fn figures(&self) -> Vec<Figure> {
        self.order
            .iter()
            .map(|key| {
                let samples = self.values[key].clone();
                let m = median(&samples);
                let reference = self.references.get(key).cloned();
                let ratio = reference.as_ref().and_then(|r| {
                    self.median(r, &key.1)
                        .filter(|base| *base != 0.0)
                        .map(|base| m / base)
                });
                Figure {
                    contender: key.0.clone(),
                    metric: key.1.clone(),
                    min: samples.iter().copied().fold(f64::INFINITY, f64::min),
                    max: samples.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                    median: m,
                    samples,
                    reference,
                    ratio,
                }
            })
            .collect()
    }
}

/// Median (mean of the middle two for an even count); 0 for no samples.
pub(crate) fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// The `q`-quantile (0..=1, nearest rank) of unsorted latencies, in milliseconds.
pub(crate) fn quantile_ms(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1e3
}

impl Report {
    pub(crate) fn new(scenario: &str, rounds: usize) -> Self {
        Self {
            scenario: scenario.to_owned(),
            started_at: chrono::Utc::now().to_rfc3339(),
            rounds,
            parameters: BTreeMap::new(),
            figures: Vec::new(),
            targets: Vec::new(),
            details: BTreeMap::new(),
        }
    }

    pub(crate) fn param(&mut self, name: &str, value: impl Serialize) {
        self.parameters.insert(
            name.to_owned(),
            serde_json::to_value(value).expect("serializable"),
        );
    }

    /// Adds a target: met when `measured >= bound` (`at_least`) or `measured <= bound`.
    pub(crate) fn target(
        &mut self,
        target: &str,
        measured: Option<f64>,
        bound: f64,
        at_least: bool,
    ) {
        let Some(measured) = measured else { return };
        let met = if at_least {
            measured >= bound
        } else {
            measured <= bound
        };
        self.targets.push(Target {
            target: target.to_owned(),
            measured,
            bound,
            met,
        });
    }

    /// Prints the table and the targets.
    pub(crate) fn print(&self) {
        println!(
            "\n== {} — {} round(s), contenders alternating; median [min–max] ==",
            self.scenario, self.rounds
        );
        for (k, v) in &self.parameters {
            println!("   {k} = {v}");
        }
        let width = self
            .figures
            .iter()
            .map(|f| f.contender.len())
            .max()
            .unwrap_or(10)
            .max(10);
        println!(
            "{:<width$}  {:<14} {:>12} {:>25}  ratio (to reference)",
            "contender", "metric", "median", "[min–max]"
        );
        for f in &self.figures {
            let ratio = match (&f.reference, f.ratio) {
                (Some(r), Some(x)) => format!("{x:.2} x {r}"),
                _ => String::new(),
            };
            println!(
                "{:<width$}  {:<14} {:>12} {:>25}  {ratio}",
                f.contender,
                f.metric,
                fmt(f.median),
                format!("[{}–{}]", fmt(f.min), fmt(f.max)),
            );
        }
        if !self.targets.is_empty() {
            println!("targets:");
            for t in &self.targets {
                println!(
                    "  [{}] {}: measured {} (bound {})",
                    if t.met { "met" } else { "MISSED" },
                    t.target,
                    fmt(t.measured),
                    fmt(t.bound)
                );
            }
        }
    }
}

fn fmt(x: f64) -> String {
    if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

/// Writes the reports as one JSON document.
pub(crate) fn write_json(path: &std::path::Path, reports: &[Report]) -> anyhow::Result<()> {
    let doc = serde_json::json!({
        "program": "outbox-bench",
        "reports": reports,
    });
    std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_quantiles() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        let ms: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(quantile_ms(&ms, 0.5), 50.0);
        assert_eq!(quantile_ms(&ms, 0.99), 99.0);
        assert_eq!(quantile_ms(&ms, 0.999), 100.0);
        assert!(quantile_ms(&[], 0.5).is_nan());
    }

    #[test]
    fn figures_carry_spread_and_ratio_to_their_reference() {
        let mut s = Samples::default();
        for (a, b) in [(10.0, 20.0), (12.0, 18.0), (11.0, 30.0)] {
            s.add("base", "events/s", a);
            s.add("fast", "events/s", b);
        }
        s.compare("fast", "events/s", "base");
        let f = s.figures();
        assert_eq!(f.len(), 2);
        assert_eq!((f[0].median, f[0].min, f[0].max), (11.0, 10.0, 12.0));
        assert_eq!(f[0].ratio, None);
        assert_eq!(f[1].median, 20.0);
        assert_eq!(f[1].ratio, Some(20.0 / 11.0));
        let mut r = Report::new("x", 3);
        r.target("fast >= 1.5 x base", f[1].ratio, 1.5, true);
        r.target("fast <= 1.5 x base", f[1].ratio, 1.5, false);
        r.target("absent", None, 1.0, true);
        assert_eq!(r.targets.len(), 2);
        assert!(r.targets[0].met);
        assert!(!r.targets[1].met);
    }
}
