//! Feature `prometheus`: one call exports the consumer's metrics on `/metrics`, and a scrape of a
//! consumer that applied, parked and lags carries every consumer series that the alert rules
//! (`deploy/prometheus/alerts.yml`) and the dashboard (`deploy/grafana/outbox.json`) name.
//! One test in this binary: the recorder is global to the process.
#![cfg(feature = "prometheus")]

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use outbox_core::{async_trait, Envelope, Publisher};
use outbox_inbox::prometheus::{serve, ExporterError};
use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
use outbox_testkit::{MemoryDb, MemoryInboxStore, MemoryLog, MemoryTx};

/// Applies everything except aggregate `bad`, which fails for good (parked).
struct Projector;

#[async_trait]
impl Handler<MemoryTx> for Projector {
    async fn handle(&self, tx: &mut MemoryTx, event: &Envelope) -> Result<(), HandlerError> {
        if event.aggregate_id == "bad" {
            return Err(HandlerError::permanent("cannot apply: unknown product"));
        }
        tx.put(
            "orders",
            &event.aggregate_id,
            serde_json::json!(event.aggregate_version),
        );
        Ok(())
    }
}

fn ev(agg: &str, v: i64) -> Envelope {
    Envelope::builder("order", agg, v, "order.changed")
        .build()
        .unwrap()
}

/// `GET path` on `addr`: (status code, body).
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).unwrap();
    let code = buf.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = buf.split_once("\r\n\r\n").unwrap().1.to_owned();
    (code, body)
}

/// The value of the first sample of `name` whose labels contain every one of `labels`.
fn value(body: &str, name: &str, labels: &[&str]) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, v) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        (n == name && labels.iter().all(|x| rest.contains(x))).then(|| v.parse().ok())?
    })
}

/// The `outbox_inbox_...` names a file mentions.
fn inbox_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("outbox_inbox_") {
        let end = text[i..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(text.len(), |e| i + e);
        out.insert(text[i..end].to_owned());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_call_exports_the_consumer_metrics_that_the_alerts_read() {
    // An address in use: the error says so, and nothing is installed yet.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    match serve(taken.local_addr().unwrap()).await {
        Err(ExporterError::Listen(_)) => {}
        other => panic!("expected a listen error, got {other:?}"),
    }
    let endpoint = serve("127.0.0.1:0").await.expect("serve");
    let addr = endpoint.local_addr();
    // A second recorder in the same process is refused.
    match serve("127.0.0.1:0").await {
        Err(ExporterError::Install(_)) => {}
        other => panic!("expected an install error, got {other:?}"),
    }

    let db = MemoryDb::default();
    let log = MemoryLog::new("orders", 2);
    let events = [
        ev("a", 1),
        ev("a", 2),
        ev("b", 1),
        ev("bad", 1),
        ev("bad", 2),
    ];
    for r in log.publish(&events.iter().collect::<Vec<_>>()).await {
        r.unwrap();
    }
    let processor = InboxProcessor::new("projector", MemoryInboxStore::new(&db), Projector);
    let source = log.consumer("projector", &["orders"]);
    let mut engine = ConsumerEngine::new(source, processor, EngineConfig::default(), 1).unwrap();
    let report = engine
        .run_until_quiet(Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(report.applied, 3, "{report:?}");
    // Three more events nobody consumed yet: the lag.
    let later = [ev("c", 1), ev("c", 2), ev("d", 1)];
    for r in log.publish(&later.iter().collect::<Vec<_>>()).await {
        r.unwrap();
    }
    engine.refresh_gauges().await;

    let (code, body) = get(addr, "/metrics");
    if std::env::var_os("OUTBOX_PRINT_SCRAPE").is_some() {
        eprintln!("{body}");
    }
    assert_eq!(code, 200, "{body}");
    assert!(endpoint.render().contains("outbox_inbox_parked{"), "{body}");
    let c = "consumer=\"projector\"";
    assert_eq!(
        value(&body, "outbox_inbox_parked", &[c]),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        value(&body, "outbox_inbox_waiting", &[c]),
        Some(1.0),
        "{body}"
    );
    let lag: f64 = body
        .lines()
        .filter(|l| l.starts_with("outbox_inbox_lag{") && l.contains(c))
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
        .sum();
    assert_eq!(lag, 3.0, "{body}");
    assert_eq!(
        value(
            &body,
            "outbox_inbox_processed_total",
            &[c, "result=\"applied\""]
        ),
        Some(3.0),
        "{body}"
    );
    assert_eq!(
        value(&body, "outbox_inbox_apply_latency_seconds_count", &[c]),
        Some(3.0),
        "{body}"
    );
    assert!(
        value(
            &body,
            "outbox_inbox_apply_errors_total",
            &[c, "kind=\"handler_permanent\""]
        )
        .is_some_and(|v| v >= 1.0),
        "{body}"
    );
    assert!(body.contains("# HELP outbox_inbox_lag"), "{body}");

    // Every consumer series the alert rules and the dashboard name is in this scrape.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let scraped: BTreeSet<String> = body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect();
    for file in ["deploy/prometheus/alerts.yml", "deploy/grafana/outbox.json"] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let names = inbox_names(&text);
        assert!(!names.is_empty(), "{file} names no consumer series");
        let missing: Vec<_> = names.difference(&scraped).collect();
        assert!(
            missing.is_empty(),
            "{file} names consumer series the consumer does not emit: {missing:?}\n{body}"
        );
    }

    // Other paths and methods.
    assert_eq!(get(addr, "/").0, 404);
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "POST /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).unwrap();
    assert!(buf.starts_with("HTTP/1.1 405"), "{buf}");
    endpoint.stop();
}
