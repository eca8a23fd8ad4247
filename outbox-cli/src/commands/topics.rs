//! `outbox topics create|check`: the destinations the relay publishes to, made or compared.
//!
//! **Which topics.** Every topic of the configuration's routing: `kafka.topic` (aggregate
//! types without a route) and each `kafka.routes` value, once each ([`Config::topics`]), the
//! same list the relay checks at start.
//!
//! **With what.** Each topic is created with
//!
//! | setting | default | flag |
//! |---|---|---|
//! | partitions | 12 | `--partitions N` |
//! | replication factor | 3 | `--replication-factor N` |
//! | `min.insync.replicas` | 2 (at most the replication factor) | `--min-insync-replicas N` |
//! | `retention.ms` | by the retention rule, below | `--retention D` |
//! | `cleanup.policy` | `delete` (compaction loses intermediate events) | |
//!
//! **Retention by the rule** ([`outbox_core::retention`], the rule `outbox check` applies):
//! every consumer reading the topic must hold its dedup window over everything the broker
//! can deliver again, `dedup_retention >= retention.ms + retention.max_consumer_lag +
//! retention.replay_window`; and a consumer lagging by `retention.max_consumer_lag` must
//! still find its records, `retention.ms >= retention.max_consumer_lag`. The default is
//! Kafka's 7 days moved into that range (with the default configuration, 1 day lag, 3 days
//! replay, 14 days dedup: the range is 1 to 10 days, so 7 days). A `--retention` outside the
//! range, or a configuration with no such range, is refused (exit 2) with the figures.
//!
//! **Idempotent, never silent.** A missing topic is created; an existing one is compared and
//! never changed: matching settings are `ok`; a different partition count, replication
//! factor, `min.insync.replicas`, `retention.ms` or a compacting `cleanup.policy` is reported
//! with the command that would change it (adding partitions moves aggregates to other
//! partitions, so it is left to a deliberate `kafka-topics.sh --alter`), and the command exits
//! with code 1. Without `--retention`, any `retention.ms` within the rule's range matches
//! (the default is only what a new topic gets). A setting the broker does not report is said
//! to be unreported, not assumed. `topics check` compares without creating (exit 4 when a
//! topic is missing, as at the relay's start). `--dry-run` contacts no broker and prints the
//! equivalent `kafka-topics.sh` commands (`--if-not-exists`: they are idempotent too).
//!
//! **Other transports.** On NATS JetStream the destination is a stream that captures every
//! subject space of the publisher (`<subject_prefix>.>` and each route); `topics create`
//! makes it when none does: named after the prefix in upper case, file storage, limits
//! retention, discard old, `--replication-factor` replicas (default 3; a single server holds
//! 1, and says so: exit 2 with the flag to pass), a duplicate window of the claim
//! (`outbox.lease`) or NATS's default 2 minutes, whichever is longer, and `max_age` by the
//! retention rule above (or `--retention`). A stream that captures the subjects already is
//! left as it is (exit 0, `ok`); one that captures only part of them, or holds the name, is
//! not changed (the server's refusal is reported, exit 1). On RabbitMQ the destination is
//! the exchange: declared durable, of `rabbitmq.exchange_kind`, when missing (binding the
//! consumers' quorum queues stays the consumers' part); an existing one is never redeclared.
//! Both then run the relay's own start-up check and print its findings, as `topics check`
//! does (exit 4 when missing, 3 when unreachable). `--dry-run` prints the `nats stream add`
//! or `rabbitmqadmin declare exchange` command instead. Flags that do not apply to the
//! transport (`--partitions` beyond Kafka; `--min-insync-replicas` on NATS; any on RabbitMQ)
//! are refused (exit 2).

#[cfg(feature = "kafka")]
use std::collections::BTreeMap;
use std::time::Duration;

use outbox_core::retention::KAFKA_DEFAULT_RETENTION;
#[cfg(feature = "kafka")]
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
#[cfg(feature = "kafka")]
use rdkafka::client::DefaultClientContext;
#[cfg(feature = "kafka")]
use rdkafka::types::RDKafkaErrorCode;
use serde::Serialize;
use serde_json::json;

use crate::config::{Config, TransportKind};
use crate::error::{CliError, ErrorKind};
use crate::kafka::TopicFacts;
use crate::opt::{TopicsCommand, TopicsSpecOpts};
use crate::output::Output;

/// Partitions of a new topic unless `--partitions` says otherwise.
pub const DEFAULT_PARTITIONS: u32 = 12;
/// Replication factor of a new topic unless `--replication-factor` says otherwise.
pub const DEFAULT_REPLICATION_FACTOR: u32 = 3;
/// `min.insync.replicas` of a new topic (at most its replication factor).
pub const DEFAULT_MIN_INSYNC_REPLICAS: u32 = 2;

/// What every outbox topic should look like.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TopicSpec {
    /// Topic.
    pub topic: String,
    /// Partition count.
    pub partitions: u32,
    /// Replication factor.
    pub replication_factor: u32,
    /// `min.insync.replicas`.
    pub min_insync_replicas: u32,
    /// `retention.ms`.
    pub retention_ms: u64,
    /// Without `--retention`: the range of `retention.ms` the retention rule allows (lowest,
    /// highest; `None`: no upper bound, unlimited retention included). An existing topic
    /// within it matches. With `--retention`: `None`, the value must match exactly.
    #[serde(skip)]
    pub retention_range: Option<(u64, Option<u64>)>,
}

impl TopicSpec {
    /// The topic-level configuration set at creation.
    pub fn configs(&self) -> Vec<(&'static str, String)> {
        vec![
            ("min.insync.replicas", self.min_insync_replicas.to_string()),
            ("retention.ms", self.retention_ms.to_string()),
            ("cleanup.policy", "delete".to_owned()),
        ]
    }

    /// The equivalent `kafka-topics.sh` command.
    pub fn kafka_topics_command(&self, brokers: &str, command_config: bool) -> String {
        let mut c = format!(
            "kafka-topics.sh --bootstrap-server {brokers}{} --create --if-not-exists \
             --topic {} --partitions {} --replication-factor {}",
            if command_config {
                " --command-config client.properties"
            } else {
                ""
            },
            self.topic,
            self.partitions,
            self.replication_factor
        );
        for (k, v) in self.configs() {
            c.push_str(&format!(" --config {k}={v}"));
        }
        c
    }
}

/// How one existing topic differs from its spec: the differences (each with the command
/// that changes it) and what the broker did not report.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Comparison {
    /// Settings that differ, each with its fix.
    pub differences: Vec<String>,
    /// Settings the broker did not report (not assumed either way).
    pub unreported: Vec<&'static str>,
}

/// Compares a topic on the broker with its spec. `brokers` goes into the printed commands.
pub fn compare(spec: &TopicSpec, facts: &TopicFacts, brokers: &str) -> Comparison {
    let mut c = Comparison::default();
    let t = &spec.topic;
    let alter = |k: &str, v: &str| {
        format!(
            "kafka-configs.sh --bootstrap-server {brokers} --alter --entity-type topics \
             --entity-name {t} --add-config {k}={v}"
        )
    };
    if facts.partitions != spec.partitions as usize {
        c.differences.push(format!(
            "partitions: {} on the broker, {} requested; not changed: adding partitions moves \
             aggregates to other partitions (their order across the change is lost) and \
             partitions cannot be removed. Pass --partitions {} to accept the topic as it is, \
             or, when the consumers are ready, kafka-topics.sh --bootstrap-server {brokers} \
             --alter --topic {t} --partitions {}",
            facts.partitions, spec.partitions, facts.partitions, spec.partitions
        ));
    }
    if facts.replication_factor != spec.replication_factor as usize {
        c.differences.push(format!(
            "replication factor: {} on the broker, {} requested; not changed: reassign the \
             partitions' replicas (kafka-reassign-partitions.sh), or pass \
             --replication-factor {}",
            facts.replication_factor, spec.replication_factor, facts.replication_factor
        ));
    }
    match facts.min_insync_replicas {
        Some(m) if m != spec.min_insync_replicas => c.differences.push(format!(
            "min.insync.replicas: {m} on the broker, {} requested; not changed: {}",
            spec.min_insync_replicas,
            alter("min.insync.replicas", &spec.min_insync_replicas.to_string())
        )),
        Some(_) => {}
        None => c.unreported.push("min.insync.replicas"),
    }
    let retention_fits = |r: i64| match spec.retention_range {
        // The rule's range: unlimited (-1) only without an upper bound.
        Some((lo, hi)) => match hi {
            None => r < 0 || r as u64 >= lo,
            Some(hi) => r >= 0 && (lo..=hi).contains(&(r as u64)),
        },
        None => r == spec.retention_ms as i64,
    };
    match facts.retention_ms {
        Some(r) if !retention_fits(r) => c.differences.push(format!(
            "retention.ms: {r} on the broker, {} requested{}; not changed: {}",
            spec.retention_ms,
            match spec.retention_range {
                Some((lo, Some(hi))) => format!(" (the retention rule allows {lo}..={hi})"),
                Some((lo, None)) => format!(" (the retention rule allows at least {lo})"),
                None => String::new(),
            },
            alter("retention.ms", &spec.retention_ms.to_string())
        )),
        Some(_) => {}
        None => c.unreported.push("retention.ms"),
    }
    match &facts.cleanup_policy {
        Some(p) if p.contains("compact") => c.differences.push(format!(
            "cleanup.policy: {p} on the broker: compaction drops an aggregate's older events; \
             not changed: {}",
            alter("cleanup.policy", "delete")
        )),
        Some(_) => {}
        None => c.unreported.push("cleanup.policy"),
    }
    c
}

/// The topic retention by the rule (see the module docs): `requested`, or Kafka's default
/// moved into the allowed range; a configuration error when it falls outside or no range
/// exists.
pub fn retention_for(
    config: &Config,
    topic: &str,
    requested: Option<Duration>,
) -> Result<Duration, CliError> {
    let lag = config.retention.max_consumer_lag.0;
    let replay = config.retention.replay_window.0;
    let d = |d: Duration| humantime::format_duration(d).to_string();
    // The tightest consumer of the topic bounds it from above.
    let tightest = config
        .consumers
        .iter()
        .filter(|c| c.topics.is_empty() || c.topics.iter().any(|t| t == topic))
        .min_by_key(|c| c.dedup_retention.0);
    let upper = tightest.map(|c| c.dedup_retention.0.saturating_sub(lag + replay));
    let rule = |c: &crate::config::ConsumerConfig| {
        format!(
            "consumer {}'s dedup window ({}) must cover {topic}'s retention + \
             retention.max_consumer_lag ({}) + retention.replay_window ({})",
            c.name,
            c.dedup_retention,
            d(lag),
            d(replay)
        )
    };
    if let (Some(c), Some(upper)) = (tightest, upper) {
        if upper < lag {
            return Err(CliError::config(
                format!(
                    "no retention of topic {topic} satisfies the retention rule: {}, and the \
                     retention must be at least retention.max_consumer_lag ({}) so that a \
                     lagging consumer still finds its records",
                    rule(c),
                    d(lag)
                ),
                format!(
                    "raise consumers.dedup_retention of {} to at least {} (2 x max_consumer_lag \
                     + replay_window), or shorten retention.max_consumer_lag / \
                     retention.replay_window",
                    c.name,
                    d(2 * lag + replay)
                ),
            ));
        }
    }
    match requested {
        Some(r) => {
            if r < lag {
                return Err(CliError::config(
                    format!(
                        "--retention {} is shorter than retention.max_consumer_lag ({}): a \
                         consumer lagging that much loses records to retention",
                        d(r),
                        d(lag)
                    ),
                    format!("use at least --retention {}", d(lag)),
                ));
            }
            if let (Some(c), Some(upper)) = (tightest, upper) {
                if r > upper {
                    return Err(CliError::config(
                        format!(
                            "--retention {} breaks the retention rule on {topic}: {}",
                            d(r),
                            rule(c)
                        ),
                        format!(
                            "use at most --retention {}, or raise consumers.dedup_retention",
                            d(upper)
                        ),
                    ));
                }
            }
            Ok(r)
        }
        None => Ok(KAFKA_DEFAULT_RETENTION
            .max(lag)
            .min(upper.unwrap_or(Duration::MAX))),
    }
}

/// The range of topic retention the rule allows for `topic` (see the module docs): at least
/// `retention.max_consumer_lag`, at most the tightest reading consumer's `dedup_retention` -
/// `max_consumer_lag` - `replay_window` (`None`: no consumer bounds it).
fn retention_range(config: &Config, topic: &str) -> (Duration, Option<Duration>) {
    let lag = config.retention.max_consumer_lag.0;
    let replay = config.retention.replay_window.0;
    let upper = config
        .consumers
        .iter()
        .filter(|c| c.topics.is_empty() || c.topics.iter().any(|t| t == topic))
        .map(|c| c.dedup_retention.0.saturating_sub(lag + replay))
        .min();
    (lag, upper)
}

/// The specs of every configured topic from the flags, validated without the network.
pub fn specs(config: &Config, opts: &TopicsSpecOpts) -> Result<Vec<TopicSpec>, CliError> {
    let partitions = opts.partitions.unwrap_or(DEFAULT_PARTITIONS);
    if partitions == 0 {
        return Err(CliError::config(
            "--partitions 0: a topic needs at least one partition",
            format!(
                "pass --partitions N with N >= 1 (default {DEFAULT_PARTITIONS}); the consumers \
                 of a topic read in parallel up to its partition count"
            ),
        ));
    }
    let rf = opts
        .replication_factor
        .unwrap_or(DEFAULT_REPLICATION_FACTOR);
    if rf == 0 {
        return Err(CliError::config(
            "--replication-factor 0: a topic needs at least one replica",
            format!(
                "pass --replication-factor N with N >= 1 (default {DEFAULT_REPLICATION_FACTOR}; \
                 1 only for a single-broker development cluster)"
            ),
        ));
    }
    let min_isr = opts
        .min_insync_replicas
        .unwrap_or(DEFAULT_MIN_INSYNC_REPLICAS.min(rf));
    if min_isr == 0 || min_isr > rf {
        return Err(CliError::config(
            format!("--min-insync-replicas {min_isr} with replication factor {rf}"),
            format!(
                "use 1..={rf} (with acks=all a write needs that many replicas: {} tolerates one \
                 broker loss without losing acknowledged events)",
                DEFAULT_MIN_INSYNC_REPLICAS.min(rf)
            ),
        ));
    }
    let requested = match &opts.retention {
        Some(r) => Some(super::parse_duration("--retention", r)?.0),
        None => None,
    };
    config
        .topics()
        .into_iter()
        .map(|topic| {
            let retention = retention_for(config, &topic, requested)?;
            let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
            let (lo, hi) = retention_range(config, &topic);
            Ok(TopicSpec {
                retention_ms: ms(retention),
                retention_range: requested.is_none().then(|| (ms(lo), hi.map(ms))),
                topic,
                partitions,
                replication_factor: rf,
                min_insync_replicas: min_isr,
            })
        })
        .collect()
}

/// Runs `outbox topics ...`.
pub async fn run(config: &Config, command: TopicsCommand, out: &Output) -> Result<(), CliError> {
    let (create, dry_run, spec_opts) = match command {
        TopicsCommand::Create(o) => (true, o.dry_run, o.spec),
        TopicsCommand::Check(o) => (false, false, o),
    };
    match crate::transport::kind(config)? {
        #[cfg(feature = "kafka")]
        TransportKind::Kafka => kafka(config, create, dry_run, &spec_opts, out).await,
        other => other_transport(config, other, create, dry_run, &spec_opts, out).await,
    }
}

/// One topic's outcome.
#[cfg(feature = "kafka")]
#[derive(Clone, Debug, Serialize)]
struct Row {
    #[serde(flatten)]
    spec: TopicSpec,
    /// `created`, `ok`, `differs`, `missing` (check), `would_create` (dry run).
    action: &'static str,
    /// What the broker has, when the topic exists.
    on_broker: Option<TopicFacts>,
    differences: Vec<String>,
    unreported: Vec<&'static str>,
}

#[cfg(feature = "kafka")]
async fn kafka(
    config: &Config,
    create: bool,
    dry_run: bool,
    opts: &TopicsSpecOpts,
    out: &Output,
) -> Result<(), CliError> {
    let specs = specs(config, opts)?;
    let brokers = config.brokers()?.to_owned();
    let secured = config.kafka.producer.0.keys().any(|k| {
        ["security.", "sasl.", "ssl."]
            .iter()
            .any(|p| k.starts_with(p))
    });
    if dry_run {
        let commands: Vec<String> = specs
            .iter()
            .map(|s| s.kafka_topics_command(&brokers, secured))
            .collect();
        if out.json {
            out.json(&json!({
                "transport": "kafka",
                "dry_run": true,
                "brokers": brokers,
                "topics": specs,
                "commands": commands,
            }));
        } else {
            println!(
                "# outbox topics create --dry-run: nothing was sent to {brokers}; these \
                 commands create the same topics (--if-not-exists: existing ones are left as \
                 they are)"
            );
            if secured {
                println!(
                    "# client.properties: the [kafka] producer's security.*, sasl.* and ssl.* \
                     settings"
                );
            }
            for c in commands {
                println!("{c}");
            }
        }
        return Ok(());
    }
    let names: Vec<String> = specs.iter().map(|s| s.topic.clone()).collect();
    let mut facts = crate::kafka::describe_topics(config, &names).await?;
    let mut created = Vec::new();
    if create {
        let missing: Vec<&TopicSpec> = specs
            .iter()
            .filter(|s| matches!(facts.get(&s.topic), Some(None)))
            .collect();
        if !missing.is_empty() {
            create_topics(config, &brokers, &missing).await?;
            created = missing.iter().map(|s| s.topic.clone()).collect();
            facts = wait_for(config, &names, &created).await?;
        }
    }
    let rows: Vec<Row> = specs
        .into_iter()
        .map(|spec| {
            let on_broker = facts.get(&spec.topic).cloned().flatten();
            let was_created = created.contains(&spec.topic);
            let (action, cmp) = match &on_broker {
                None => ("missing", Comparison::default()),
                Some(f) => {
                    let cmp = compare(&spec, f, &brokers);
                    let action = match (was_created, cmp.differences.is_empty()) {
                        (_, false) => "differs",
                        (true, true) => "created",
                        (false, true) => "ok",
                    };
                    (action, cmp)
                }
            };
            Row {
                spec,
                action,
                on_broker,
                differences: cmp.differences,
                unreported: cmp.unreported,
            }
        })
        .collect();
    let differs = rows.iter().filter(|r| r.action == "differs").count();
    let missing = rows.iter().filter(|r| r.action == "missing").count();
    if out.json {
        out.json(&json!({
            "transport": "kafka",
            "dry_run": false,
            "brokers": brokers,
            "topics": rows,
        }));
    } else {
        let shown = |v: Option<String>| v.unwrap_or_else(|| "not reported".into());
        let table_rows = rows
            .iter()
            .map(|r| {
                let b = r.on_broker.as_ref();
                vec![
                    r.spec.topic.clone(),
                    r.action.to_owned(),
                    b.map_or("-".into(), |f| f.partitions.to_string()),
                    b.map_or("-".into(), |f| f.replication_factor.to_string()),
                    b.map_or("-".into(), |f| {
                        shown(f.min_insync_replicas.map(|v| v.to_string()))
                    }),
                    b.map_or("-".into(), |f| shown(f.retention_ms.map(|v| v.to_string()))),
                ]
            })
            .collect();
        println!(
            "{}",
            out.table_keeping(
                &[
                    "topic",
                    "state",
                    "partitions",
                    "replication",
                    "min.insync.replicas",
                    "retention.ms"
                ],
                table_rows,
                &[0]
            )
        );
        for r in &rows {
            for d in &r.differences {
                println!("{}: {d}", r.spec.topic);
            }
            if !r.unreported.is_empty() && r.action != "missing" {
                println!(
                    "{}: the broker does not report {} (requested: {}); check them with \
                     kafka-configs.sh --describe",
                    r.spec.topic,
                    r.unreported.join(", "),
                    r.spec
                        .configs()
                        .iter()
                        .filter(|(k, _)| r.unreported.contains(k))
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
    }
    if missing > 0 {
        return Err(CliError::not_ready(
            format!("{missing} topic(s) missing on the broker at {brokers}"),
            "run `outbox topics create` (or `outbox topics create --dry-run` for the \
             kafka-topics.sh commands)",
        )
        .reported_if(out.json));
    }
    if differs > 0 {
        return Err(CliError::new(
            ErrorKind::Failed,
            format!(
                "{differs} existing topic(s) differ from the requested settings; nothing was \
                 changed"
            ),
            Some("see each difference and its command above".into()),
        )
        .reported_if(out.json));
    }
    Ok(())
}

/// Creates `missing` through the admin API; a topic another process created meanwhile
/// counts as existing (it is compared next).
#[cfg(feature = "kafka")]
async fn create_topics(
    config: &Config,
    brokers: &str,
    missing: &[&TopicSpec],
) -> Result<(), CliError> {
    let timeout = config.kafka.metadata_timeout.0;
    let admin: AdminClient<DefaultClientContext> = crate::kafka::client_config(config)?
        .create()
        .map_err(|e| CliError::config(format!("Kafka client: {e}"), "fix [kafka]"))?;
    // Broker count: a replication factor above it cannot be met.
    let md = admin.inner().fetch_metadata(None, timeout).map_err(|e| {
        CliError::unreachable(
            format!("cannot reach the Kafka broker(s) at {brokers}: {e}"),
            "check that the brokers run and that kafka.brokers (KAFKA_BROKERS) names them",
        )
    })?;
    let count = md.brokers().len();
    if let Some(s) = missing
        .iter()
        .find(|s| count > 0 && s.replication_factor as usize > count)
    {
        return Err(CliError::config(
            format!(
                "replication factor {} for {}: the cluster at {brokers} has {count} broker(s)",
                s.replication_factor, s.topic
            ),
            format!(
                "pass --replication-factor {count} (and --min-insync-replicas {}) for this \
                 cluster; production clusters run 3 brokers for a replication factor of 3",
                DEFAULT_MIN_INSYNC_REPLICAS.min(count as u32)
            ),
        ));
    }
    let configs: Vec<Vec<(&'static str, String)>> = missing.iter().map(|s| s.configs()).collect();
    let new: Vec<NewTopic<'_>> = missing
        .iter()
        .zip(&configs)
        .map(|(s, configs)| {
            let mut t = NewTopic::new(
                &s.topic,
                s.partitions as i32,
                TopicReplication::Fixed(s.replication_factor as i32),
            );
            for (k, v) in configs {
                t = t.set(k, v);
            }
            t
        })
        .collect();
    let opts = AdminOptions::new()
        .operation_timeout(Some(timeout))
        .request_timeout(Some(timeout));
    let results = tokio::time::timeout(
        timeout + Duration::from_secs(2),
        admin.create_topics(new.iter(), &opts),
    )
    .await
    .map_err(|_| {
        CliError::unreachable(
            format!("the broker at {brokers} did not answer the topic creation in time"),
            "raise kafka.metadata_timeout, then run `outbox topics create` again (it is \
             idempotent)",
        )
    })?
    .map_err(|e| {
        CliError::unreachable(
            format!("cannot create topics on {brokers}: {e}"),
            "check the brokers, then run `outbox topics create` again (it is idempotent)",
        )
    })?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                let hint = match code {
                    RDKafkaErrorCode::InvalidReplicationFactor
                    | RDKafkaErrorCode::InvalidPartitions
                    | RDKafkaErrorCode::InvalidConfig
                    | RDKafkaErrorCode::PolicyViolation => {
                        "fix the flag the broker refused (--partitions, --replication-factor, \
                         --min-insync-replicas, --retention)"
                    }
                    RDKafkaErrorCode::TopicAuthorizationFailed
                    | RDKafkaErrorCode::ClusterAuthorizationFailed => {
                        "grant CREATE on the cluster or the topics to this principal, or have \
                         an administrator run `outbox topics create --dry-run`'s commands"
                    }
                    _ => {
                        "see the broker's error; `outbox topics create` is idempotent: run it \
                          again once fixed"
                    }
                };
                let kind = match code {
                    RDKafkaErrorCode::TopicAuthorizationFailed
                    | RDKafkaErrorCode::ClusterAuthorizationFailed => ErrorKind::NotReady,
                    RDKafkaErrorCode::InvalidReplicationFactor
                    | RDKafkaErrorCode::InvalidPartitions
                    | RDKafkaErrorCode::InvalidConfig
                    | RDKafkaErrorCode::PolicyViolation => ErrorKind::Config,
                    _ => ErrorKind::Failed,
                };
                return Err(CliError::new(
                    kind,
                    format!("the broker at {brokers} refused to create topic {topic}: {code}"),
                    Some(hint.into()),
                ));
            }
        }
    }
    Ok(())
}

/// Describes `names` again until every one of `created` is visible (metadata propagates
/// after the creation is acknowledged), bounded by `kafka.metadata_timeout`.
#[cfg(feature = "kafka")]
async fn wait_for(
    config: &Config,
    names: &[String],
    created: &[String],
) -> Result<BTreeMap<String, Option<TopicFacts>>, CliError> {
    let deadline = tokio::time::Instant::now() + config.kafka.metadata_timeout.0;
    loop {
        let facts = crate::kafka::describe_topics(config, names).await?;
        let visible = created
            .iter()
            .all(|t| matches!(facts.get(t), Some(Some(_))));
        if visible || tokio::time::Instant::now() >= deadline {
            return Ok(facts);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// NATS and RabbitMQ: `create` makes the stream or exchange the relay's check wants (or,
/// with `--dry-run`, prints the command that does), `check` runs that check.
async fn other_transport(
    config: &Config,
    kind: TransportKind,
    create: bool,
    dry_run: bool,
    opts: &TopicsSpecOpts,
    out: &Output,
) -> Result<(), CliError> {
    if opts.partitions.is_some() {
        return Err(CliError::config(
            format!("--partitions applies to Kafka topics; transport.kind is {kind}"),
            "leave it out (NATS subjects and RabbitMQ routing keys have no partitions)",
        ));
    }
    if kind == TransportKind::RabbitMq
        && (opts.replication_factor.is_some()
            || opts.min_insync_replicas.is_some()
            || opts.retention.is_some())
    {
        return Err(CliError::config(
            "--replication-factor, --min-insync-replicas and --retention apply to Kafka topics \
             and NATS streams; on RabbitMQ the consumers' quorum queues hold the messages",
            "leave them out: `outbox topics create` declares the exchange only",
        ));
    }
    if kind == TransportKind::Nats && opts.min_insync_replicas.is_some() {
        return Err(CliError::config(
            "--min-insync-replicas applies to Kafka topics (a JetStream stream acknowledges \
             from a quorum of its replicas)",
            "leave it out",
        ));
    }
    let stream = nats_stream_spec(config, opts)?;
    let commands = other_commands(config, kind, &stream);
    let mut created = false;
    if create {
        if dry_run {
            if out.json {
                out.json(&json!({
                    "transport": kind.as_str(), "dry_run": true, "commands": commands,
                }));
            } else {
                println!(
                    "# outbox topics create --dry-run: nothing was sent; this creates the same"
                );
                for c in &commands {
                    println!("{c}");
                }
            }
            return Ok(());
        }
        created = create_other(config, kind, &stream).await?;
    }
    // The relay's own start-up check of the destination (exit 3 unreachable, 4 missing, with
    // its fix), then its findings as `outbox check` shows them.
    if let Err(e) = crate::transport::start(config, &[]).await {
        let hint = match e.kind {
            ErrorKind::NotReady => format!(
                "{}; `outbox topics create` makes it (--dry-run: {})",
                e.hint.clone().unwrap_or_default(),
                commands.join(" && ")
            ),
            _ => e.hint.clone().unwrap_or_default(),
        };
        return Err(e.with_hint(hint));
    }
    #[cfg_attr(not(any(feature = "nats", feature = "rabbitmq")), allow(unused_mut))]
    let mut findings: Vec<super::check::Finding> = Vec::new();
    match kind {
        #[cfg(feature = "nats")]
        TransportKind::Nats => crate::transport::nats_checks(config, &mut findings).await,
        #[cfg(feature = "rabbitmq")]
        TransportKind::RabbitMq => crate::transport::rabbit_checks(config, &mut findings).await,
        _ => {}
    }
    let action = match (create, created) {
        (true, true) => "created",
        _ => "ok",
    };
    if out.json {
        out.json(&json!({
            "transport": kind.as_str(),
            "dry_run": false,
            "action": action,
            "stream": (kind == TransportKind::Nats && created).then_some(&stream),
            "findings": findings,
            "commands": commands,
        }));
    } else {
        match (kind, created) {
            (TransportKind::Nats, true) => println!(
                "created stream {} capturing {:?} ({} replica(s), file storage, duplicate \
                 window {}, max age {})",
                stream.name,
                stream.subjects,
                stream.replicas,
                humantime::format_duration(stream.duplicate_window),
                humantime::format_duration(stream.max_age)
            ),
            (_, true) => println!(
                "declared exchange {:?} (durable, {})",
                config.rabbitmq.exchange,
                exchange_kind_name(config)
            ),
            _ if create => println!("exists already; not changed"),
            _ => {}
        }
        for f in &findings {
            let sev = match f.severity {
                super::check::Severity::Ok => "ok",
                super::check::Severity::Warning => "warning",
                super::check::Severity::Error => "error",
            };
            println!("{sev:>7} {}: {}", f.check, f.message);
            if let Some(fix) = &f.fix {
                println!("        fix: {fix}");
            }
        }
    }
    Ok(())
}

/// Makes the stream or the exchange; `Ok(false)` when it exists already.
#[allow(unused_variables)]
async fn create_other(
    config: &Config,
    kind: TransportKind,
    stream: &StreamSpec,
) -> Result<bool, CliError> {
    match kind {
        #[cfg(feature = "nats")]
        TransportKind::Nats => crate::transport::nats_create_stream(config, stream).await,
        #[cfg(feature = "rabbitmq")]
        TransportKind::RabbitMq => crate::transport::rabbit_declare_exchange(config).await,
        _ => Ok(false),
    }
}

#[cfg(feature = "nats")]
use crate::transport::NatsStreamSpec as StreamSpec;

/// Without NATS support: the same fields, for the printed command.
#[cfg(not(feature = "nats"))]
#[derive(Clone, Debug, Serialize)]
pub struct StreamSpec {
    name: String,
    subjects: Vec<String>,
    replicas: usize,
    duplicate_window: Duration,
    max_age: Duration,
}

/// The JetStream stream for the configured subjects: named after the subject prefix,
/// `--replication-factor` replicas (default 3), a duplicate window of the claim (lease) or
/// NATS's default 2 minutes, whichever is longer, `max_age` by the retention rule (or
/// `--retention`).
fn nats_stream_spec(config: &Config, opts: &TopicsSpecOpts) -> Result<StreamSpec, CliError> {
    let claim = match config.outbox.claim_mode {
        crate::config::ClaimModeName::Lease => config.outbox.lease.0,
        crate::config::ClaimModeName::Locked => config.outbox.locked_max_hold.0,
    };
    let replicas = opts
        .replication_factor
        .unwrap_or(DEFAULT_REPLICATION_FACTOR);
    if replicas == 0 {
        return Err(CliError::config(
            "--replication-factor 0: a stream needs at least one replica",
            "pass --replication-factor N with N >= 1 (1 for a single server)",
        ));
    }
    let requested = match &opts.retention {
        Some(r) => Some(super::parse_duration("--retention", r)?.0),
        None => None,
    };
    let max_age = match config.transport.kind {
        TransportKind::Nats => retention_for(config, "", requested)?,
        _ => stream_max_age(config),
    };
    #[cfg(feature = "nats")]
    let subjects = crate::transport::nats_subject_spaces(config);
    #[cfg(not(feature = "nats"))]
    let subjects = vec![format!("{}.>", config.nats.subject_prefix)];
    Ok(StreamSpec {
        name: config
            .nats
            .subject_prefix
            .to_uppercase()
            .replace(['.', '*', '>', ' '], "_"),
        subjects,
        replicas: replicas as usize,
        duplicate_window: claim.max(Duration::from_secs(120)),
        max_age,
    })
}

fn exchange_kind_name(config: &Config) -> String {
    serde_json::to_value(config.rabbitmq.exchange_kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| "topic".into())
}

/// The commands that make the NATS stream or the RabbitMQ exchange the relay expects.
pub fn other_commands(config: &Config, kind: TransportKind, stream: &StreamSpec) -> Vec<String> {
    let d = |d: Duration| humantime::format_duration(d).to_string().replace(' ', "");
    match kind {
        TransportKind::Nats => vec![format!(
            "nats --server {} stream add {} --subjects \"{}\" --storage file --replicas {} \
             --retention limits --discard old --dupe-window {} --max-age {} --defaults",
            config.nats.servers,
            stream.name,
            stream.subjects.join(","),
            stream.replicas,
            d(stream.duplicate_window),
            d(stream.max_age)
        )],
        TransportKind::RabbitMq => vec![format!(
            "rabbitmqadmin declare exchange name={} type={} durable=true",
            config.rabbitmq.exchange,
            exchange_kind_name(config)
        )],
        TransportKind::Kafka => Vec::new(),
    }
}

/// A stream's `max_age` by the retention rule (as a topic's `retention.ms`, see the module
/// docs): Kafka's 7 days moved into the allowed range, or the range's bound when the rule
/// leaves none.
pub fn stream_max_age(config: &Config) -> Duration {
    retention_for(config, "", None).unwrap_or(config.retention.max_consumer_lag.0)
}

impl CliError {
    /// [`CliError::reported`] when `json` (the command printed its document).
    #[cfg(feature = "kafka")]
    fn reported_if(self, json: bool) -> Self {
        if json {
            self.reported()
        } else {
            self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ConsumerConfig, Dur};

    fn day(n: u64) -> Duration {
        Duration::from_secs(n * 86_400)
    }

    fn consumer(name: &str, dedup_days: u64) -> ConsumerConfig {
        ConsumerConfig {
            name: name.into(),
            dedup_retention: Dur(day(dedup_days)),
            ..ConsumerConfig::default()
        }
    }

    #[test]
    fn the_default_retention_follows_the_rule() {
        let mut config = Config::default();
        // No consumer: Kafka's 7 days (at least the lag).
        assert_eq!(retention_for(&config, "t", None).unwrap(), day(7));
        // Default consumer (14 d dedup, 1 d lag, 3 d replay): 7 d fits below 10 d.
        config.consumers.push(consumer("a", 14));
        assert_eq!(retention_for(&config, "t", None).unwrap(), day(7));
        // A tighter consumer: 9 - 1 - 3 = 5 days.
        config.consumers.push(consumer("b", 9));
        assert_eq!(retention_for(&config, "t", None).unwrap(), day(5));
        // A consumer of another topic does not bound this one.
        config.consumers[1].topics = vec!["other".into()];
        assert_eq!(retention_for(&config, "t", None).unwrap(), day(7));
        // A long lag raises the floor.
        config.retention.max_consumer_lag = Dur(day(8));
        config.consumers.truncate(0);
        assert_eq!(retention_for(&config, "t", None).unwrap(), day(8));
    }

    #[test]
    fn a_retention_outside_the_rule_is_refused_with_the_figures() {
        let mut config = Config::default();
        config.consumers.push(consumer("billing", 14));
        let e = retention_for(&config, "t", Some(day(11))).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.message.contains("billing"), "{}", e.message);
        assert!(e.hint.unwrap().contains("at most --retention 10days"));
        let e = retention_for(&config, "t", Some(Duration::from_secs(3600))).unwrap_err();
        assert!(e.message.contains("max_consumer_lag"), "{}", e.message);
        assert_eq!(retention_for(&config, "t", Some(day(10))).unwrap(), day(10));
        // No range at all: dedup 4 d < 2 x 1 d lag + 3 d replay.
        config.consumers[0].dedup_retention = Dur(day(4));
        let e = retention_for(&config, "t", None).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.hint.unwrap().contains("5days"));
    }

    fn facts(partitions: usize, rf: usize, isr: Option<u32>, ret: Option<i64>) -> TopicFacts {
        TopicFacts {
            topic: "t".into(),
            partitions,
            replication_factor: rf,
            min_insync_replicas: isr,
            retention_ms: ret,
            cleanup_policy: Some("delete".into()),
            max_message_bytes: None,
        }
    }

    #[test]
    fn an_existing_topic_is_compared_never_assumed() {
        let spec = TopicSpec {
            topic: "t".into(),
            partitions: 6,
            replication_factor: 1,
            min_insync_replicas: 1,
            retention_ms: 1000,
            retention_range: None,
        };
        let same = compare(&spec, &facts(6, 1, Some(1), Some(1000)), "b:9092");
        assert_eq!(same, Comparison::default());
        let other = compare(&spec, &facts(3, 1, Some(1), Some(1000)), "b:9092");
        assert_eq!(other.differences.len(), 1);
        assert!(other.differences[0].starts_with("partitions: 3 on the broker, 6 requested"));
        assert!(other.differences[0].contains("--partitions 3"));
        let unreported = compare(&spec, &facts(6, 1, None, None), "b:9092");
        assert!(unreported.differences.is_empty());
        assert_eq!(
            unreported.unreported,
            vec!["min.insync.replicas", "retention.ms"]
        );
        let retention = compare(&spec, &facts(6, 1, Some(1), Some(5)), "b:9092");
        assert!(retention.differences[0].contains("--add-config retention.ms=1000"));
        // Without --retention, any retention the rule allows matches; unlimited only
        // without an upper bound.
        let ranged = TopicSpec {
            retention_range: Some((100, Some(2000))),
            ..spec.clone()
        };
        for (r, fits) in [
            (5, false),
            (100, true),
            (1500, true),
            (2000, true),
            (2001, false),
            (-1, false),
        ] {
            let c = compare(&ranged, &facts(6, 1, Some(1), Some(r)), "b:9092");
            assert_eq!(c.differences.is_empty(), fits, "{r}: {c:?}");
        }
        let open = TopicSpec {
            retention_range: Some((100, None)),
            ..spec
        };
        assert!(compare(&open, &facts(6, 1, Some(1), Some(-1)), "b:9092")
            .differences
            .is_empty());
        assert!(
            compare(&open, &facts(6, 1, Some(1), Some(99)), "b:9092").differences[0]
                .contains("allows at least 100")
        );
    }

    #[test]
    fn the_dry_run_command_is_complete() {
        let spec = TopicSpec {
            topic: "orders".into(),
            partitions: 12,
            replication_factor: 3,
            min_insync_replicas: 2,
            retention_ms: 604_800_000,
            retention_range: None,
        };
        assert_eq!(
            spec.kafka_topics_command("k1:9092,k2:9092", false),
            "kafka-topics.sh --bootstrap-server k1:9092,k2:9092 --create --if-not-exists \
             --topic orders --partitions 12 --replication-factor 3 --config \
             min.insync.replicas=2 --config retention.ms=604800000 --config \
             cleanup.policy=delete"
        );
        assert!(spec
            .kafka_topics_command("k:9092", true)
            .contains("--command-config client.properties"));
    }
}
