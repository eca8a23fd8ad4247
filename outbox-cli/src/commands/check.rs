//! `outbox check`: validates the configuration as a whole and exits 1 on a violation.
//!
//! | check | violation (exit 1) | warning |
//! |---|---|---|
//! | `transport` | | (always ok: names the transport, its address and destinations) |
//! | `publisher` (NATS, RabbitMQ) | a `[nats]` / `[rabbitmq]` value the adapter refuses | |
//! | `stream` (NATS) | no stream captures a subject space, or the server does not answer | |
//! | `duplicate_window` (NATS) | | a stream's duplicate window shorter than the claim (`outbox.lease`, or `locked_max_hold`): re-sends stored twice |
//! | `storage`, `replication`, `stream_retention` (NATS) | | memory storage; one replica; interest or work-queue retention |
//! | `exchange` (RabbitMQ) | missing, not durable or of another type than `rabbitmq.exchange_kind`, or the broker does not answer | |
//! | `confirms` (RabbitMQ) | | (ok: publisher confirms and mandatory routing, always on) |
//! | `producer` (Kafka) | a producer property the publisher refuses (idempotence, acks, in-flight, a keyless partitioner, anything off the allow-list) | |
//! | `lease` | lease (or locked_max_hold) not above delivery timeout + lease margin (twice that in locked mode with prefetch) | |
//! | `database` | unreachable, schema missing or outdated, privileges missing | |
//! | `topic` | a topic missing | |
//! | `batch_size` | a topic's `max.message.bytes` below the producer's largest batch (the smaller of `batch.size` and `message.max.bytes`): the broker would refuse whole batches of records that each fit | the topic does not report `max.message.bytes` (nothing to compare) |
//! | `partitions` | partition count or partitioner differs from the one a relay recorded | |
//! | `replication` | | a critical topic (`kafka.critical_topics`) on one replica, or with `min.insync.replicas` < 2 |
//! | `compaction` | | a compacted topic (intermediate facts may vanish) |
//! | `durability` (MySQL / MariaDB) | a setting `outbox_mysql::judge` refuses: `innodb_flush_log_at_trx_commit` other than 1, `binlog_format = STATEMENT` with the binary log on, a table not on InnoDB, a server older than MySQL 8.0.13 / MariaDB 10.6; each with the statement that fixes it | `sync_binlog` other than 1 with the binary log on; `innodb_lock_wait_timeout` below 5 s (the server's default isolation and the READ COMMITTED the store's transactions use are reported as ok) |
//! | `retention` | the library's rule ([`outbox_core::retention::RetentionCheck`]): a consumer's dedup window shorter than topic `retention.ms` + `retention.max_consumer_lag` + `retention.replay_window`, or finite while the topic keeps records forever | `retention.ms` not reported by the broker (Kafka's default of 7 days assumed); `cleanup.retention` shorter than the replay window |

use std::time::Duration;

use outbox_core::retention::{
    RetentionCheck, Severity as RetentionSeverity, Strictness, TopicRetention,
};
use outbox_core::{ClaimMode, MAX_LEASE};
use serde::Serialize;
use serde_json::json;

use crate::config::{ClaimModeName, Config, TransportKind};
use crate::db;
use crate::error::{CliError, ErrorKind};
use crate::opt::CheckOpts;
use crate::output::Output;

/// Severity of a finding.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Fine.
    Ok,
    /// Worth a look; not a violation.
    Warning,
    /// A violation: `check` exits 1.
    Error,
}

/// One finding.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    /// Which check.
    pub check: &'static str,
    /// Severity.
    pub severity: Severity,
    /// What was found.
    pub message: String,
    /// What to do.
    pub fix: Option<String>,
}

fn f(
    check: &'static str,
    severity: Severity,
    message: impl Into<String>,
    fix: Option<&str>,
) -> Finding {
    Finding {
        check,
        severity,
        message: message.into(),
        fix: fix.map(str::to_owned),
    }
}

fn dur(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// The checks that need no connection.
pub fn static_checks(config: &Config) -> Vec<Finding> {
    let mut out = Vec::new();
    out.push(f(
        "transport",
        Severity::Ok,
        crate::transport::describe(config),
        None,
    ));
    let delivery = match config.transport.kind {
        #[cfg(feature = "nats")]
        TransportKind::Nats => crate::transport::nats_static(config, &mut out),
        #[cfg(feature = "rabbitmq")]
        TransportKind::RabbitMq => crate::transport::rabbit_static(config, &mut out),
        #[cfg(feature = "kafka")]
        _ => kafka_static(config, &mut out),
        // A kind this build lacks (the configuration's validation refuses it before).
        #[cfg(not(feature = "kafka"))]
        _ => {
            if let Err(e) = crate::transport::kind(config) {
                out.push(f(
                    "transport",
                    Severity::Error,
                    e.message,
                    e.hint.as_deref(),
                ));
            }
            return out;
        }
    };
    claim_checks(config, delivery, &mut out);
    // The outbox's retention against the replay window, by the library's rule (no topic or
    // dedup window involved, so it holds without a broker).
    let outbox_only = RetentionCheck::new(None, TopicRetention::Unlimited)
        .replay_window(config.retention.replay_window.0)
        .outbox_retention(Some(config.cleanup.retention.0));
    retention_findings(&outbox_only, "outbox", None, &mut out);
    out
}

/// The Kafka producer's safety (allow-list, guarded values); returns its delivery timeout.
#[cfg(feature = "kafka")]
fn kafka_static(config: &Config, out: &mut Vec<Finding>) -> Duration {
    let k = &config.kafka;
    // Producer safety: the publisher's own build applies the allow-list and the guarded values.
    let mut b = outbox_kafka::KafkaPublisher::builder(
        if k.brokers.trim().is_empty() {
            "127.0.0.1:9"
        } else {
            &k.brokers
        },
        &k.topic,
    )
    .delivery_timeout(k.delivery_timeout.0);
    for (agg, topic) in &k.routes {
        b = b.route_aggregate(agg, topic);
    }
    for (key, v) in &k.producer.0 {
        b = b.set(key, v);
    }
    match b.config().partitioner() {
        Err(e) => {
            out.push(f(
                "producer",
                Severity::Error,
                e.0,
                Some("use a key-hashing partitioner (default murmur2_random)"),
            ));
            k.delivery_timeout.0
        }
        Ok(_) => match b.build() {
            Ok(p) => {
                out.push(f(
                    "producer",
                    Severity::Ok,
                    format!(
                        "idempotent, acks=all, in-flight <= 5, partitioner {}, delivery timeout {}",
                        p.partitioner(),
                        dur(outbox_core::Publisher::delivery_timeout(&p))
                    ),
                    None,
                ));
                outbox_core::Publisher::delivery_timeout(&p)
            }
            Err(e) => {
                out.push(f(
                    "producer",
                    Severity::Error,
                    e.0,
                    Some("remove or fix the property named (kafka.producer)"),
                ));
                k.delivery_timeout.0
            }
        },
    }
}

/// The lease (or the locked claim's hold) against the transport's delivery timeout.
fn claim_checks(config: &Config, delivery: Duration, out: &mut Vec<Finding>) {
    let margin = config.relay.lease_margin.0;
    let need = delivery + margin;
    match config.outbox.claim_mode {
        ClaimModeName::Lease => match ClaimMode::lease(config.outbox.lease.0) {
            Err(e) => out.push(f(
                "lease",
                Severity::Error,
                e.0,
                Some("use a lease within 1 s..=1 h"),
            )),
            Ok(_) if config.outbox.lease.0 <= need => out.push(f(
                "lease",
                Severity::Error,
                format!(
                    "lease {} does not outlive delivery timeout {} + lease margin {}: a lease \
                     could expire while the broker still holds a record, and another relay \
                     could send the aggregate's next version",
                    config.outbox.lease,
                    dur(delivery),
                    dur(margin)
                ),
                Some("raise outbox.lease above the sum, or lower the transport's delivery_timeout"),
            )),
            Ok(_) => out.push(f(
                "lease",
                Severity::Ok,
                format!(
                    "lease {} > delivery timeout {} + margin {} (max {})",
                    config.outbox.lease,
                    dur(delivery),
                    dur(margin),
                    dur(MAX_LEASE)
                ),
                None,
            )),
        },
        ClaimModeName::Locked => {
            let claims = if config.relay.prefetch { 2 } else { 1 };
            let need = need * claims;
            if config.outbox.locked_max_hold.0 <= need {
                out.push(f(
                    "lease",
                    Severity::Error,
                    format!(
                        "outbox.locked_max_hold {} does not outlive {claims} x (delivery timeout {} + margin {})",
                        config.outbox.locked_max_hold, dur(delivery), dur(margin)
                    ),
                    Some("raise outbox.locked_max_hold, lower the transport's delivery_timeout, or set relay.prefetch = false"),
                ));
            } else {
                out.push(f(
                    "lease",
                    Severity::Ok,
                    format!(
                        "locked_max_hold {} > {claims} x (delivery timeout + margin)",
                        config.outbox.locked_max_hold
                    ),
                    None,
                ));
            }
        }
    }
}

/// Runs `outbox check`.
pub async fn run(config: &Config, opts: &CheckOpts, out: &Output) -> Result<(), CliError> {
    let mut findings = static_checks(config);
    let mut recorded = Vec::new();
    if crate::store::backend(config)? == crate::store::Backend::MySql {
        mysql_checks(config, &mut findings).await;
    } else {
        match db::connect_outbox(config, 2).await {
            Err(e) => findings.push(f("database", Severity::Error, e.message, e.hint.as_deref())),
            Ok((pool, target)) => match db::preflight(&pool, config).await {
                Err(e) => {
                    findings.push(f("database", Severity::Error, e.message, e.hint.as_deref()))
                }
                Ok(()) => {
                    findings.push(f(
                        "database",
                        Severity::Ok,
                        format!("{target}: schema and privileges in place"),
                        None,
                    ));
                    if let Ok(store) = db::outbox_store(config, pool) {
                        recorded = store.recorded_topics().await.unwrap_or_default();
                    }
                }
            },
        }
    }
    if !opts.no_broker {
        match config.transport.kind {
            #[cfg(feature = "nats")]
            TransportKind::Nats => crate::transport::nats_checks(config, &mut findings).await,
            #[cfg(feature = "rabbitmq")]
            TransportKind::RabbitMq => crate::transport::rabbit_checks(config, &mut findings).await,
            #[cfg(feature = "kafka")]
            _ => broker_checks(config, &recorded, &mut findings).await,
            #[cfg(not(feature = "kafka"))]
            _ => drop(recorded),
        }
    }
    let ok = !findings.iter().any(|x| x.severity == Severity::Error);
    if out.json {
        out.json(&json!({"ok": ok, "findings": findings}));
    } else {
        let rows = findings
            .iter()
            .map(|x| {
                vec![
                    x.check.to_owned(),
                    match x.severity {
                        Severity::Ok => "ok",
                        Severity::Warning => "WARNING",
                        Severity::Error => "VIOLATION",
                    }
                    .to_owned(),
                    x.message.clone(),
                    x.fix.clone().unwrap_or_default(),
                ]
            })
            .collect();
        println!(
            "{}",
            out.table(&["check", "result", "finding", "fix"], rows)
        );
    }
    if ok {
        Ok(())
    } else {
        let n = findings
            .iter()
            .filter(|x| x.severity == Severity::Error)
            .count();
        Err(CliError::new(ErrorKind::Failed, format!("{n} violation(s) found"), None).reported())
    }
}

/// The database checks on MySQL / MariaDB: reachable, schema at the version `outbox-mysql`
/// brings (pending migrations named), the privileges the relay needs (the exact `GRANT`
/// statements), and the server's durability settings judged by `outbox_mysql::judge`, each
/// unsafe one with the statement that fixes it. No topic facts are recorded on MySQL, so the
/// `partitions` check has nothing to compare with.
async fn mysql_checks(config: &Config, findings: &mut Vec<Finding>) {
    let (pool, target) = match crate::mysql::connect(config, 2).await {
        Ok(c) => c,
        Err(e) => {
            findings.push(f("database", Severity::Error, e.message, e.hint.as_deref()));
            return;
        }
    };
    let store = match crate::mysql::outbox_store(config, pool.clone()) {
        Ok(s) => s,
        Err(e) => {
            findings.push(f("database", Severity::Error, e.message, e.hint.as_deref()));
            return;
        }
    };
    match crate::mysql::preflight(&pool, &store, config).await {
        Ok(status) => findings.push(f(
            "database",
            Severity::Ok,
            format!(
                "{target}: outbox {} at schema version {} of {}, privileges in place",
                crate::mysql::table_label(config),
                status.applied,
                status.expected
            ),
            None,
        )),
        Err(e) => findings.push(f("database", Severity::Error, e.message, e.hint.as_deref())),
    }
    match store.check_durability().await {
        Ok(report) => findings.extend(durability_findings(&report)),
        Err(e) => {
            let e = crate::mysql::store_error(&e, &crate::mysql::table_label(config));
            findings.push(f(
                "durability",
                Severity::Error,
                e.message,
                e.hint.as_deref(),
            ));
        }
    }
}

/// The `durability` findings of a MySQL server's report: a refusal is a violation, a warning
/// a warning, each with the statement that fixes it; what is in order is reported ok.
pub fn durability_findings(report: &outbox_mysql::DurabilityReport) -> Vec<Finding> {
    report
        .findings
        .iter()
        .map(|x| {
            let severity = match x.severity {
                outbox_mysql::Severity::Refuse => Severity::Error,
                outbox_mysql::Severity::Warn => Severity::Warning,
                _ => Severity::Ok,
            };
            let fix = (severity != Severity::Ok)
                .then(|| crate::mysql::durability_fix(x))
                .flatten();
            f(
                "durability",
                severity,
                format!("{}: {}", x.check.as_str(), x.message),
                fix.as_deref(),
            )
        })
        .collect()
}

#[cfg(feature = "kafka")]
async fn broker_checks(
    config: &Config,
    recorded: &[outbox_postgres::RecordedTopic],
    findings: &mut Vec<Finding>,
) {
    if config.kafka.brokers.trim().is_empty() {
        findings.push(f(
            "topic",
            Severity::Error,
            "no Kafka brokers configured",
            Some("set KAFKA_BROKERS or kafka.brokers, or pass --no-broker"),
        ));
        return;
    }
    let topics = config.topics();
    let facts = match crate::kafka::describe_topics(config, &topics).await {
        Ok(f) => f,
        Err(e) => {
            findings.push(f("topic", Severity::Error, e.message, e.hint.as_deref()));
            return;
        }
    };
    let partitioner = outbox_kafka::KafkaPublisherConfig::new("x", "x");
    let mut pc = partitioner;
    pc.properties = {
        let mut p = outbox_kafka::Properties::default();
        for (k, v) in &config.kafka.producer.0 {
            p.set(k, v);
        }
        p
    };
    let configured = pc.partitioner().ok();
    let batch_bytes = pc.max_batch_bytes();
    for topic in &topics {
        let Some(Some(t)) = facts.get(topic) else {
            findings.push(f("topic", Severity::Error, format!("topic {topic:?} does not exist"), Some("create it: `outbox topics create` (automatic topic creation is not used), or fix kafka.topic / kafka.routes")));
            continue;
        };
        findings.push(f(
            "topic",
            Severity::Ok,
            format!(
                "{topic}: {} partition(s), replication factor {}",
                t.partitions, t.replication_factor
            ),
            None,
        ));
        batch_size_findings(topic, t.max_message_bytes, batch_bytes, findings);
        if let Some(r) = recorded.iter().find(|r| &r.topic == topic) {
            if r.partitions as usize != t.partitions {
                findings.push(f("partitions", Severity::Error, format!("{topic}: {} partitions now, {} recorded by the relay on {}: keys moved to other partitions", t.partitions, r.partitions, r.recorded_at.to_rfc3339()), Some("expect reordering for aggregates in flight across the change; restart the relays to record the new count once consumers are ready")));
            }
            if let (Some(now), Ok(before)) =
                (configured, outbox_kafka::Partitioner::parse(&r.partitioner))
            {
                if !now.maps_keys_like(before) {
                    findings.push(f("partitions", Severity::Error, format!("{topic}: partitioner {now} configured, {before} recorded: keys would move to other partitions"), Some("keep the recorded partitioner (kafka.producer.partitioner)")));
                }
            }
        }
        let critical = config.kafka.critical_topics.iter().any(|c| c == topic);
        if critical && t.replication_factor < 2 {
            findings.push(f("replication", Severity::Warning, format!("{topic} carries a critical flow on a single replica: one broker loss loses acknowledged events"), Some("raise the replication factor to 3 and min.insync.replicas to 2")));
        } else if critical && t.min_insync_replicas.is_some_and(|m| m < 2) {
            findings.push(f("replication", Severity::Warning, format!("{topic} carries a critical flow with min.insync.replicas={}: acks=all then waits for one replica only", t.min_insync_replicas.unwrap_or(1)), Some("set min.insync.replicas=2 on the topic")));
        }
        if let Some(p) = &t.cleanup_policy {
            if p.contains("compact") {
                findings.push(f("compaction", Severity::Warning, format!("{topic} is compacted (cleanup.policy={p}): older events of an aggregate may vanish for consumers that replay"), Some("use cleanup.policy=delete for event topics")));
            }
        }
        retention_checks(config, topic, t.retention_ms, findings);
    }
}

/// The producer's largest batch against `topic`'s `max.message.bytes`, by the library's rule
/// ([`outbox_kafka::check_batch_fits`], which the relay applies at start).
#[cfg(feature = "kafka")]
fn batch_size_findings(
    topic: &str,
    max_message_bytes: Option<u64>,
    batch_bytes: u64,
    findings: &mut Vec<Finding>,
) {
    let Some(limit) = max_message_bytes else {
        findings.push(f(
            "batch_size",
            Severity::Warning,
            format!(
                "{topic}: the broker does not report max.message.bytes, so the producer's batches \
                 (up to {batch_bytes} bytes) cannot be compared with it"
            ),
            Some("set max.message.bytes on the topic explicitly (Kafka's default is 1048588)"),
        ));
        return;
    };
    match outbox_kafka::check_batch_fits([(topic, Some(limit))], batch_bytes) {
        Ok(()) => findings.push(f(
            "batch_size",
            Severity::Ok,
            format!(
                "{topic}: producer batches of up to {batch_bytes} bytes fit max.message.bytes \
                 {limit}"
            ),
            None,
        )),
        Err(e) => findings.push(f(
            "batch_size",
            Severity::Error,
            e.to_string(),
            Some(
                format!(
                    "set kafka.producer \"batch.size\" = {limit} (or less), or raise the \
                     topic's max.message.bytes"
                )
                .as_str(),
            ),
        )),
    }
}

/// Maps the library's retention report onto findings: a violation is an error, a warning a
/// warning; `ok` (when given) is reported when nothing was found.
fn retention_findings(
    check: &RetentionCheck,
    subject: &str,
    ok: Option<String>,
    findings: &mut Vec<Finding>,
) {
    let report = match check.evaluate(Strictness::Warn) {
        Ok(r) => r,
        Err(e) => e.report,
    };
    for x in &report.findings {
        let (severity, fix) = match x.severity {
            RetentionSeverity::Violation => (
                Severity::Error,
                "raise the consumer's dedup_retention (its inbox cleanup) or shorten the \
                 topic's retention.ms / retention.max_consumer_lag / retention.replay_window",
            ),
            _ => (
                Severity::Warning,
                "see the finding; set retention.ms on the topic explicitly, raise \
                 cleanup.retention or shorten retention.replay_window",
            ),
        };
        findings.push(f(
            "retention",
            severity,
            format!("{subject}: {}", x.message),
            Some(fix),
        ));
    }
    if report.findings.is_empty() {
        if let Some(ok) = ok {
            findings.push(f("retention", Severity::Ok, ok, None));
        }
    }
}

/// The dedup window of every consumer of `topic` against the longest possible redelivery, by
/// the library's single rule ([`outbox_core::retention`]). The topic's `retention.ms` comes
/// from this command's own DescribeConfigs (which carries the `[kafka]` security settings);
/// `TopicRetention::from_millis` reads it as the library does, and a topic that does not report
/// it is `TopicRetention::Unknown` (Kafka's default assumed, with a warning). Compaction is
/// the `compaction` check's finding, not repeated here.
#[cfg(feature = "kafka")]
fn retention_checks(
    config: &Config,
    topic: &str,
    retention_ms: Option<i64>,
    findings: &mut Vec<Finding>,
) {
    let lag = config.retention.max_consumer_lag.0;
    let replay = config.retention.replay_window.0;
    let topic_retention = retention_ms.map_or(TopicRetention::Unknown, TopicRetention::from_millis);
    for c in &config.consumers {
        let reads = c.topics.is_empty() || c.topics.iter().any(|t| t == topic);
        if !reads {
            continue;
        }
        let check = RetentionCheck::new(Some(c.dedup_retention.0), topic_retention)
            .max_lag(lag)
            .replay_window(replay);
        let required = check
            .evaluate(Strictness::Warn)
            .ok()
            .and_then(|r| r.required);
        retention_findings(
            &check,
            &format!("consumer {} on {topic}", c.name),
            Some(format!(
                "consumer {}: dedup window {} covers {topic}'s retention + max consumer lag + \
                 replay window ({})",
                c.name,
                c.dedup_retention,
                required.map_or_else(|| "unbounded".into(), dur)
            )),
            findings,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_mysql::{judge, ServerSettings};

    /// What `check` makes of a server's settings (read, never set on a shared server): each
    /// unsafe one a violation or a warning with the statement that fixes it.
    #[test]
    fn durability_findings_name_the_fix() {
        let settings = ServerSettings {
            version: "8.0.36".into(),
            flush_at_commit: 2,
            log_bin: true,
            binlog_format: "ROW".into(),
            sync_binlog: 0,
            lock_wait_timeout: 50,
            isolation: "REPEATABLE-READ".into(),
            non_innodb_tables: Vec::new(),
        };
        let findings = durability_findings(&judge(&settings));
        let of = |severity| {
            findings
                .iter()
                .filter(|x| x.severity == severity)
                .collect::<Vec<_>>()
        };
        let errors = of(Severity::Error);
        assert_eq!(errors.len(), 1, "{findings:#?}");
        assert!(errors[0]
            .message
            .starts_with("innodb_flush_log_at_trx_commit: innodb_flush_log_at_trx_commit = 2"));
        assert!(errors[0]
            .fix
            .as_deref()
            .unwrap()
            .starts_with("SET GLOBAL innodb_flush_log_at_trx_commit = 1;"));
        let warnings = of(Severity::Warning);
        assert_eq!(warnings.len(), 1, "{findings:#?}");
        assert!(warnings[0]
            .fix
            .as_deref()
            .unwrap()
            .starts_with("SET GLOBAL sync_binlog = 1;"));
        assert!(of(Severity::Ok).iter().all(|x| x.fix.is_none()));
        assert!(
            !of(Severity::Ok).is_empty(),
            "version and isolation reported"
        );
    }
}
