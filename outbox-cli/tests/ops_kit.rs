//! The monitoring kit in `deploy/`: the Prometheus alert rules (`deploy/prometheus/alerts.yml`)
//! and the Grafana dashboard (`deploy/grafana/outbox.json`).
//!
//! * The rules load in Prometheus' own checker (`promtool check rules`) and their unit tests
//!   (`alerts.test.yml`) pass under `promtool test rules`; every alert has such a test that
//!   fires it, a `for:`, a severity, a summary, the command to run (an `outbox` subcommand
//!   that exists) and a runbook in `docs/runbooks` that names it. Every dashboard query parses.
//! * Every relay metric name the rules and the dashboard use is in a real scrape of `outbox
//!   relay` (on PostgreSQL and a NATS server of the test's own) after traffic, a poison event
//!   and a broker outage: a misspelled or renamed metric fails here, not silently in
//!   production. (The consumers' `outbox_inbox_*` names are checked against a consumer's
//!   scrape in `outbox-inbox/tests/prometheus.rs`.)
//!
//! Needs `promtool` (`PROMTOOL`, else on the `PATH`; `scripts/test` installs it), and for the
//! scrape `DATABASE_URL` and a `nats-server` binary, unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use common::TestEnv;
use outbox_core::Envelope;
use outbox_test_support::{nats_server_bin, NatsServer};

/// A file of this repository.
fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Where the runbook URLs of the rules point (the workspace's `repository`).
const RUNBOOK_BASE: &str = "https://example.invalid/outbox/blob/main/";

/// One alerting rule of `alerts.yml`: its name, expression and the other keys (`for`,
/// `severity`, annotations) as written.
#[derive(Debug, Default)]
struct Rule {
    alert: String,
    expr: String,
    keys: BTreeMap<String, String>,
}

/// Reads the rules of our own file's layout (`- alert:` starts a rule; `expr:` on one line or
/// as a `|` block; `key: value` elsewhere). promtool checks the YAML as Prometheus reads it.
fn parse_rules(text: &str) -> Vec<Rule> {
    let mut rules = Vec::new();
    let mut current: Option<Rule> = None;
    let mut block: Option<usize> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if let Some(at) = block {
            if indent > at {
                let rule = current.as_mut().expect("expr outside a rule");
                rule.expr.push(' ');
                rule.expr.push_str(trimmed.trim_end());
                continue;
            }
            block = None;
        }
        if let Some(name) = trimmed.strip_prefix("- alert:") {
            rules.extend(current.take());
            current = Some(Rule {
                alert: name.trim().to_owned(),
                ..Rule::default()
            });
            continue;
        }
        let (Some(rule), Some((key, value))) = (current.as_mut(), trimmed.split_once(':')) else {
            continue;
        };
        let value = value.trim();
        if key == "expr" {
            if value == "|" || value == ">" {
                block = Some(indent);
            } else {
                rule.expr = value.to_owned();
            }
        } else if !value.is_empty() {
            let unquoted = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(value);
            rule.keys.insert(key.to_owned(), unquoted.to_owned());
        }
    }
    rules.extend(current);
    rules
}

/// The `outbox_...` series names an expression reads.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = expr.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut i = 0;
    while let Some(found) = expr[i..].find("outbox_") {
        let start = i + found;
        let mut end = start;
        while end < bytes.len() && ident(bytes[end]) {
            end += 1;
        }
        // Inside a longer identifier (e.g. `foo_outbox_x`), or a label value (`"outbox_..."`):
        // not a series name.
        let before = start.checked_sub(1).map(|j| bytes[j]);
        if !before.is_some_and(|b| ident(b) || b == b'"') {
            names.insert(expr[start..end].to_owned());
        }
        i = end.max(start + 1);
    }
    names
}

/// Every `expr` of the dashboard's panels (rows and nested panels included).
fn dashboard_exprs(doc: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    fn walk(v: &serde_json::Value, out: &mut Vec<(String, String)>) {
        if let Some(panels) = v["panels"].as_array() {
            for p in panels {
                let title = p["title"].as_str().unwrap_or("?").to_owned();
                for t in p["targets"].as_array().into_iter().flatten() {
                    if let Some(e) = t["expr"].as_str() {
                        out.push((title.clone(), e.to_owned()));
                    }
                }
                walk(p, out);
            }
        }
    }
    walk(doc, &mut out);
    out
}

/// The promtool binary: `PROMTOOL`, else `promtool` on the `PATH`; `None` (after a printed
/// skip) only with the skip switch, else a panic saying how to install it.
fn promtool(test: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PROMTOOL").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("promtool"))
            .find(|p| p.is_file())
    });
    if on_path.is_some() {
        return on_path;
    }
    if outbox_test_support::skip_allowed() {
        outbox_test_support::report_skip(test, "no promtool (PROMTOOL, PATH)");
        return None;
    }
    panic!(
        "{test}: promtool is needed to check the alert rules: run `scripts/test` (it installs it), \
         install Debian's `prometheus` package, or set PROMTOOL; set {}=1 to skip on purpose",
        outbox_test_support::SKIP_VAR
    )
}

/// Runs promtool with `args` in `dir`; panics with its output unless it succeeds.
fn run_promtool(bin: &Path, dir: &Path, args: &[&str]) -> String {
    let out = Command::new(bin)
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

/// The subcommands `outbox-cli/docs/commands.md` documents (`| \`outbox NAME ...`).
fn documented_subcommands() -> BTreeSet<String> {
    read("outbox-cli/docs/commands.md")
        .lines()
        .filter_map(|l| l.strip_prefix("| `outbox "))
        .filter_map(|rest| rest.split([' ', '`']).next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn alert_rules_are_valid_and_their_unit_tests_pass() {
    let test = "alert_rules_are_valid_and_their_unit_tests_pass";
    let Some(promtool) = promtool(test) else {
        return;
    };
    let dir = repo("deploy/prometheus");
    let checked = run_promtool(&promtool, &dir, &["check", "rules", "alerts.yml"]);
    let rules = parse_rules(&read("deploy/prometheus/alerts.yml"));
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", rules.len())),
        "promtool and this test must read the same rules ({} here): {checked}",
        rules.len()
    );
    run_promtool(&promtool, &dir, &["test", "rules", "alerts.test.yml"]);

    let tests = read("deploy/prometheus/alerts.test.yml");
    let subcommands = documented_subcommands();
    let mut problems = Vec::new();
    for r in &rules {
        let name = &r.alert;
        for key in [
            "for",
            "severity",
            "summary",
            "description",
            "command",
            "runbook_url",
        ] {
            if !r.keys.contains_key(key) {
                problems.push(format!("{name}: no `{key}`"));
            }
        }
        let need = |key: &str| r.keys.get(key).cloned();
        if let Some(s) = need("severity") {
            if s != "warning" && s != "critical" {
                problems.push(format!(
                    "{name}: severity {s:?} is neither warning nor critical"
                ));
            }
        }
        if let Some(command) = need("command") {
            for part in command.split("&&").map(str::trim) {
                match part.strip_prefix("outbox ") {
                    Some(rest) => {
                        let sub = rest.split(' ').next().unwrap_or_default();
                        if !subcommands.contains(sub) {
                            problems.push(format!(
                                "{name}: `{part}`: `outbox {sub}` is not in outbox-cli/docs/commands.md"
                            ));
                        }
                    }
                    None if part.starts_with("curl ") => {}
                    None => problems.push(format!("{name}: `{part}` is not an outbox command")),
                }
            }
        }
        if let Some(url) = need("runbook_url") {
            match url.strip_prefix(RUNBOOK_BASE) {
                Some(rel) if rel.starts_with("docs/runbooks/") => {
                    match std::fs::read_to_string(repo(rel)) {
                        Ok(runbook) if runbook.contains(name.as_str()) => {}
                        Ok(_) => problems.push(format!("{name}: {rel} does not name the alert")),
                        Err(e) => problems.push(format!("{name}: runbook {rel}: {e}")),
                    }
                }
                _ => problems.push(format!(
                    "{name}: runbook_url {url} is not under {RUNBOOK_BASE}docs/runbooks/"
                )),
            }
        }
        // A unit test that expects the alert to fire (not only `exp_alerts: []`).
        let fires = tests
            .split(&format!("alertname: {name}\n"))
            .skip(1)
            .any(|after| {
                let mut lines = after.lines().map(str::trim);
                lines.next() == Some("exp_alerts:")
                    && lines.next().is_some_and(|l| l.starts_with("- exp_labels:"))
            });
        if !fires {
            problems.push(format!("{name}: no unit test in alerts.test.yml fires it"));
        }
    }
    assert!(problems.is_empty(), "alert rules:\n{}", problems.join("\n"));

    // The dashboard's queries parse (as recording rules, Grafana's variables filled in).
    let doc: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/outbox.json")).expect("dashboard JSON");
    let exprs = dashboard_exprs(&doc);
    assert!(exprs.len() > 10, "{exprs:?}");
    let mut file = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, e)) in exprs.iter().enumerate() {
        let filled = e
            .replace("$__rate_interval", "1m")
            .replace("$job", ".*")
            .replace("$instance", ".*")
            .replace("$consumer", ".*");
        file.push_str(&format!(
            "      - record: dashboard_query_{i}\n        expr: {}\n",
            serde_json::Value::String(filled)
        ));
    }
    let tmp = std::env::temp_dir().join(outbox_test_support::unique("dashboard_rules"));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("dashboard.yml"), file).unwrap();
    let checked = run_promtool(&promtool, &tmp, &["check", "rules", "dashboard.yml"]);
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", exprs.len())),
        "{checked}"
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn metric_names_are_read_from_expressions() {
    let names = metric_names(
        r#"sum by (le) (rate(outbox_publish_latency_seconds_bucket{job=~"$job", kind="outbox_x"}[5m])) / outbox_parked and up{job="outbox-relay"} > my_outbox_thing"#,
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["outbox_parked", "outbox_publish_latency_seconds_bucket"]
    );
    let rules = parse_rules(
        "groups:\n  - name: g\n    rules:\n      # c\n      - alert: A\n        expr: |\n          outbox_a\n            / outbox_b\n        for: 1m\n        labels:\n          severity: warning\n        annotations:\n          summary: \"x: y\"\n      - alert: B\n        expr: outbox_c > 0\n",
    );
    assert_eq!(rules.len(), 2);
    assert_eq!(rules[0].alert, "A");
    assert_eq!(rules[0].expr, " outbox_a / outbox_b");
    assert_eq!(rules[0].keys["for"], "1m");
    assert_eq!(rules[0].keys["severity"], "warning");
    assert_eq!(rules[0].keys["summary"], "x: y");
    assert_eq!(rules[1].expr, "outbox_c > 0");
}

/// The series names of a Prometheus text scrape.
fn scraped_names(body: &str) -> BTreeSet<String> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_alerts_and_the_dashboard_name_is_in_a_real_scrape() {
    let test = "every_metric_the_alerts_and_the_dashboard_name_is_in_a_real_scrape";
    let Some(env) = TestEnv::without_kafka(test).await else {
        return;
    };
    let Some(bin) = nats_server_bin(test) else {
        return;
    };
    // The names used, with where.
    let mut used: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for r in parse_rules(&read("deploy/prometheus/alerts.yml")) {
        for n in metric_names(&r.expr) {
            used.entry(n)
                .or_default()
                .insert(format!("alerts.yml {}", r.alert));
        }
    }
    let doc: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/outbox.json")).expect("dashboard JSON");
    for (title, e) in dashboard_exprs(&doc) {
        for n in metric_names(&e) {
            used.entry(n)
                .or_default()
                .insert(format!("outbox.json \"{title}\""));
        }
    }
    // The consumers' series come from consumer services, not from the relay: checked
    // against a consumer's scrape by outbox-inbox/tests/prometheus.rs.
    used.retain(|name, _| !name.starts_with("outbox_inbox_"));
    assert!(used.len() > 20, "{used:?}");

    // A NATS server of the test's own, so that it can be stopped; a stream whose messages
    // are at most 4 KiB, so that a bigger event is refused as too large (a poison event).
    let mut server = NatsServer::start(bin);
    let prefix = outbox_test_support::unique("opskit");
    let client = async_nats::connect(server.url()).await.expect("NATS");
    async_nats::jetstream::new(client)
        .create_stream(StreamConfig {
            name: prefix.to_uppercase(),
            subjects: vec![format!("{prefix}.>")],
            storage: StorageType::File,
            max_message_size: 4096,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .expect("create stream");
    let url = server.url();
    let vars = [
        ("OUTBOX_TRANSPORT__KIND", "nats"),
        ("NATS_URL", url.as_str()),
        ("OUTBOX_NATS__SUBJECT_PREFIX", prefix.as_str()),
        ("OUTBOX_NATS__CONNECT_TIMEOUT", "2s"),
    ];

    env.migrate();
    env.append(5, 4).await;
    let store = env.store();
    let poison = Envelope::builder("order", "poison", 1, "order.changed")
        .json(&serde_json::json!({ "blob": "x".repeat(8192) }))
        .unwrap()
        .build()
        .unwrap();
    let behind = Envelope::builder("order", "poison", 2, "order.changed")
        .build()
        .unwrap();
    store
        .append_many(&env.pool, &[poison, behind])
        .await
        .unwrap();

    let mut relay = env.spawn_relay_env(&vars, &[]);
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("published", 20, Duration::from_secs(60))
        .await;
    relay.wait_metric("outbox_parked", "", |v| v == 1.0, Duration::from_secs(30));

    // Broker outage: the circuit opens while events wait; it drains when the broker returns.
    server.stop();
    env.append_versions(5, 5..=6).await;
    relay.wait_metric(
        "outbox_relay_circuit_open",
        "",
        |v| v == 1.0,
        Duration::from_secs(60),
    );
    server.restart();
    env.wait_count("published", 30, Duration::from_secs(90))
        .await;
    relay.wait_metric(
        "outbox_relay_circuit_open",
        "",
        |v| v == 0.0,
        Duration::from_secs(30),
    );
    // The vacuum age is reported once the table was vacuumed.
    sqlx::raw_sql(&format!("VACUUM \"{}\".outbox_events", env.schema))
        .execute(&env.pool)
        .await
        .unwrap();
    relay.wait_metric(
        "outbox_store_last_vacuum_age_seconds",
        "",
        |v| v >= 0.0,
        Duration::from_secs(30),
    );

    let (code, body) = relay.get("/metrics").expect("scrape");
    assert_eq!(code, 200);
    let scraped = scraped_names(&body);
    let missing: Vec<String> = used
        .iter()
        .filter(|(n, _)| !scraped.contains(*n))
        .map(|(n, wh)| {
            format!(
                "{n} (used by {})",
                wh.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    assert!(
        missing.is_empty(),
        "names that the relay does not emit:\n{}\n\nscraped:\n{}",
        missing.join("\n"),
        scraped.iter().cloned().collect::<Vec<_>>().join("\n")
    );
    // The scenario went through what the rules watch: a parked event, deferred failures.
    let parked = common::metric_value(&body, "outbox_publish_failures_total", "action=\"parked\"");
    assert!(parked.is_some_and(|v| v >= 1.0), "{body}");
    assert_eq!(
        common::metric_value(&body, "outbox_relay_ready", ""),
        Some(1.0)
    );
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    // The poison event is still parked: exit 1 (something is left for an operator).
    assert_eq!(code, 1, "{stderr}");
    env.drop_schema().await;
}
