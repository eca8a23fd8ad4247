//! Output: human tables (comfy-table) or one JSON document on stdout, progress bars on stderr
//! (hidden when stderr is not a terminal or with `--json`), confirmations.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Duration;

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{ColumnConstraint, ContentArrangement, Table};
use indicatif::{ProgressBar, ProgressStyle};

use crate::error::{CliError, ErrorKind};

/// Where a command writes its result.
#[derive(Debug, Clone)]
pub struct Output {
    /// `--json`: one JSON document on stdout.
    pub json: bool,
    progress: bool,
    /// `--wide`: tables at their full width.
    wide: bool,
}

impl Output {
    /// Output for `--json` or human text.
    pub fn new(json: bool, color: &str) -> Self {
        let terminal = std::io::stderr().is_terminal();
        Self {
            json,
            progress: !json && terminal && color != "never",
            wide: false,
        }
    }

    /// With `wide`, tables are printed at their full width instead of fitting the screen.
    pub fn wide(mut self, wide: bool) -> Self {
        self.wide = wide;
        self
    }

    /// The width tables fit: the terminal's, else `$COLUMNS`; `None` (full width, one line
    /// per row) with `--wide` or when stdout is no terminal and `$COLUMNS` is not set, so
    /// output piped into `grep` or a file is never wrapped.
    pub fn width(&self) -> Option<u16> {
        if self.wide {
            return None;
        }
        if std::io::stdout().is_terminal() {
            if let Some((w, _)) = terminal_width() {
                return Some(w);
            }
        }
        std::env::var("COLUMNS")
            .ok()
            .and_then(|c| c.trim().parse::<u16>().ok())
            .filter(|w| *w >= 20)
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

    /// A table with `header` (human output), fitting [`width`](Self::width).
    pub fn table(&self, header: &[&str], rows: Vec<Vec<String>>) -> String {
        self.table_keeping(header, rows, &[])
    }

    /// [`table`](Self::table) whose columns `whole` (indexes) are never wrapped: ids an
    /// operator copies into the next command.
    pub fn table_keeping(
        &self,
        header: &[&str],
        rows: Vec<Vec<String>>,
        whole: &[usize],
    ) -> String {
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED)
            .set_header(header.to_vec());
        match self.width() {
            Some(w) => {
                t.set_content_arrangement(ContentArrangement::Dynamic)
                    .set_width(w);
            }
            None => {
                t.set_content_arrangement(ContentArrangement::Disabled);
            }
        }
        for r in rows {
            t.add_row(r);
        }
        for i in whole {
            if let Some(c) = t.column_mut(*i) {
                c.set_constraint(ColumnConstraint::ContentWidth);
            }
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

/// The terminal's size (columns, rows), when stdout is one.
fn terminal_width() -> Option<(u16, u16)> {
    let t = Table::new();
    // comfy-table asks the terminal (through crossterm) when it is one.
    t.width().map(|w| (w, 0))
}

/// The exit code of a command whose reader left (`outbox ... | head`): 128 + SIGPIPE, as a
/// shell reports a command killed by SIGPIPE.
pub const EXIT_BROKEN_PIPE: i32 = 141;

/// Whether a panic's message is a failed write to a closed stdout or stderr pipe (`println!`
/// and `clap_complete` panic on it): the binary then exits quietly with [`EXIT_BROKEN_PIPE`].
pub fn is_broken_pipe_panic(message: &str) -> bool {
    (message.starts_with("failed printing to stdout")
        || message.starts_with("failed printing to stderr"))
        && message.contains("Broken pipe")
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
