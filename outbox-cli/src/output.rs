//! Output: human tables (comfy-table) or one JSON document on stdout, progress bars on stderr
//! (hidden when stderr is not a terminal or with `--json`), confirmations.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Duration;

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{ContentArrangement, Table};
use indicatif::{ProgressBar, ProgressStyle};

use crate::error::{CliError, ErrorKind};

/// Where a command writes its result.
#[derive(Debug, Clone)]
pub struct Output {
    /// `--json`: one JSON document on stdout.
    pub json: bool,
    progress: bool,
}

impl Output {
    /// Output for `--json` or human text.
    pub fn new(json: bool, color: &str) -> Self {
        let terminal = std::io::stderr().is_terminal();
        Self {
            json,
            progress: !json && terminal && color != "never",
        }
    }

    /// Prints one JSON document.
    pub fn json(&self, value: &serde_json::Value) {
        let mut out = std::io::stdout().lock();
        let _ = serde_json::to_writer_pretty(&mut out, value);
        let _ = writeln!(out);
    }

    /// Prints a line of human output (ignored with `--json`).
    pub fn line(&self, s: impl AsRef<str>) {
        if !self.json {
            println!("{}", s.as_ref());
        }
    }

    /// A table with `header` (human output).
    pub fn table(&self, header: &[&str], rows: Vec<Vec<String>>) -> String {
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED)
            .set_content_arrangement(ContentArrangement::Dynamic)
            .set_header(header.to_vec());
        for r in rows {
            t.add_row(r);
        }
        t.to_string()
    }

    /// A progress bar of `len` steps on stderr; hidden when not on a terminal or with `--json`.
    pub fn progress(&self, len: u64, what: &str) -> ProgressBar {
        if !self.progress {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new(len);
        bar.set_style(
            ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({per_sec}, eta {eta})")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_message(what.to_owned());
        bar.enable_steady_tick(Duration::from_millis(200));
        bar
    }

    /// Asks `question` on the terminal unless `yes`; without a terminal, refuses and says to
    /// pass `--yes`.
    pub fn confirm(&self, question: &str, yes: bool) -> Result<(), CliError> {
        if yes {
            return Ok(());
        }
        if !std::io::stdin().is_terminal() {
            return Err(CliError::new(
                ErrorKind::Aborted,
                format!("{question} needs a confirmation and no terminal is attached"),
                Some("pass --yes to confirm non-interactively".into()),
            ));
        }
        eprint!("{question} [y/N] ");
        let _ = std::io::stderr().flush();
        let mut answer = String::new();
        let _ = std::io::stdin().lock().read_line(&mut answer);
        if matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes") {
            Ok(())
        } else {
            Err(CliError::new(
                ErrorKind::Aborted,
                "not confirmed; nothing was changed",
                None,
            ))
        }
    }
}

/// `1.234 s`, `3 min 4 s`, or `-` for none.
pub fn age(d: Option<Duration>) -> String {
    match d {
        None => "-".to_owned(),
        Some(d) if d < Duration::from_secs(60) => format!("{:.3} s", d.as_secs_f64()),
        Some(d) => humantime::format_duration(Duration::from_secs(d.as_secs())).to_string(),
    }
}

/// Seconds as JSON (`null` for none).
pub fn secs(d: Option<Duration>) -> serde_json::Value {
    d.map_or(serde_json::Value::Null, |d| {
        serde_json::json!(d.as_secs_f64())
    })
}
