//! The plans the server chose for the store's own statements: a pool whose sessions load
//! `auto_explain` (every plan sent to the client as a NOTICE), and the notices sqlx reports
//! (tracing target `sqlx::postgres::notice`), collected for the whole test binary. Needs a
//! superuser (`LOAD`) at `DATABASE_URL`, like the other tests.
//!
//! Tests of one binary run at once and share the collector: each picks its plans by its own
//! schema's name (every statement of the store names its schema) and never clears the list.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};

/// Collects the message of every `sqlx::postgres::notice` event.
struct Notices(Arc<Mutex<Vec<String>>>);

struct Message(String);

impl tracing::field::Visit for Message {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.0 = value.to_owned();
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl tracing::Subscriber for Notices {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        metadata.target() == "sqlx::postgres::notice"
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut m = Message(String::new());
        event.record(&mut m);
        self.0.lock().unwrap().push(m.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// The binary's notice collector, installed as the global subscriber on first use.
fn notices() -> Arc<Mutex<Vec<String>>> {
    static NOTICES: OnceLock<Arc<Mutex<Vec<String>>>> = OnceLock::new();
    NOTICES
        .get_or_init(|| {
            let n = Arc::new(Mutex::new(Vec::new()));
            tracing::subscriber::set_global_default(Notices(n.clone()))
                .expect("no other global subscriber in a test binary that reads plans");
            n
        })
        .clone()
}

/// How `auto_explain` reports.
#[derive(Clone, Copy, Debug)]
pub enum Explain {
    /// The estimated plan, as text.
    Text,
    /// The executed plan (`ANALYZE`, without timing: actual rows, loops and rows removed),
    /// as JSON.
    AnalyzeJson,
}

/// A pool of at most `max` sessions that report the plan of every statement they run.
pub async fn explained_pool(max: u32, how: Explain) -> PgPool {
    notices();
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| super::DEFAULT_URL.to_owned());
    let settings = match how {
        Explain::Text => "SET auto_explain.log_format = 'text'",
        Explain::AnalyzeJson => {
            "SET auto_explain.log_format = 'json'; SET auto_explain.log_analyze = on; \
             SET auto_explain.log_timing = off"
        }
    };
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(move |conn, _| {
            Box::pin(async move {
                conn.execute(
                    format!(
                        "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; \
                         SET auto_explain.log_level = 'notice'; {settings}"
                    )
                    .as_str(),
                )
                .await?;
                Ok(())
            })
        })
        .connect(&url)
        .await
        .unwrap()
}

/// The marker of the completion statements (`complete_lease`, `complete_locked`).
pub const COMPLETION: &str = "SELECT ARRAY(SELECT id FROM upd) AS applied";

/// The plans reported so far of statements on `schema` whose text contains `marker`, oldest
/// first.
pub fn plans(schema: &str, marker: &str) -> Vec<String> {
    notices()
        .lock()
        .unwrap()
        .iter()
        .filter(|n| n.contains(schema) && n.contains(marker))
        .cloned()
        .collect()
}

/// The rows a plan node handled over all its executions: what it returned plus what its
/// filters removed, per loop, times its loops (EXPLAIN reports the per-loop averages).
fn handled(node: &serde_json::Value) -> f64 {
    let n = |key: &str| node.get(key).and_then(serde_json::Value::as_f64);
    let per_loop = n("Actual Rows").unwrap_or(0.0)
        + n("Rows Removed by Filter").unwrap_or(0.0)
        + n("Rows Removed by Join Filter").unwrap_or(0.0)
        + n("Rows Removed by Index Recheck").unwrap_or(0.0);
    per_loop * n("Actual Loops").unwrap_or(0.0)
}

/// The node of an executed plan (a JSON `auto_explain` notice: `duration: ... plan:` and the
/// plan object) that handled the most rows: (rows handled, a one-line description with its
/// path from the top). Panics when the notice holds no executed JSON plan.
pub fn busiest_node(notice: &str) -> (f64, String) {
    let start = notice.find('{').expect("a JSON plan in the notice");
    let doc: serde_json::Value = serde_json::from_str(notice[start..].trim_end())
        .unwrap_or_else(|e| panic!("the notice's plan is not JSON ({e}): {notice}"));
    let top = doc.get("Plan").expect("a Plan in the notice");
    assert!(
        top.get("Actual Loops").is_some(),
        "the plan was not executed under ANALYZE: {notice}"
    );
    let mut best = (0.0, String::new());
    let mut stack = vec![(top, String::new())];
    while let Some((node, path)) = stack.pop() {
        let s = |key: &str| node.get(key).and_then(serde_json::Value::as_str);
        let here = format!(
            "{path} > {}{}{}",
            s("Subplan Name").map_or(String::new(), |n| format!("[{n}] ")),
            s("Node Type").unwrap_or("?"),
            s("Relation Name")
                .or(s("CTE Name"))
                .map_or(String::new(), |r| format!(" on {r}")),
        );
        let h = handled(node);
        if h > best.0 {
            best = (
                h,
                format!(
                    "{here} (actual rows {} loops {}, removed by filter {}, by join filter {})",
                    node["Actual Rows"],
                    node["Actual Loops"],
                    node.get("Rows Removed by Filter")
                        .unwrap_or(&serde_json::Value::Null),
                    node.get("Rows Removed by Join Filter")
                        .unwrap_or(&serde_json::Value::Null),
                ),
            );
        }
        for child in node
            .get("Plans")
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
        {
            stack.push((child, here.clone()));
        }
    }
    best
}
