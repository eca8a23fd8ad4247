//! The consumer's queue check against the real broker (`AMQP_URL`, else the local one), one
//! queue of the test's own per case: [`describe_queue`] reads what a declare compares,
//! [`judge_queue`] says what is wrong, [`check_queue`] (the consumer's start-up) refuses what
//! loses events. Each queue is deleted when its test ends.

mod common;

use std::time::Duration;

use common::{require, unique};
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::Connection;
use outbox_rabbitmq::{
    check_queue, describe_queue, judge_queue, ArgValue, QueueSeverity, RabbitSource, TopologyError,
};

const T: Duration = Duration::from_secs(5);

/// A queue of the test's own, declared with `opts` and `args`; deleted when dropped.
struct Queue {
    url: String,
    name: String,
    conn: Connection,
}

impl Queue {
    async fn declare(url: &str, opts: QueueDeclareOptions, args: &[(&str, AMQPValue)]) -> Self {
        let conn = common::connect(url).await;
        let ch = conn.create_channel().await.unwrap();
        let name = unique("qcheck");
        let mut table = FieldTable::default();
        for (k, v) in args {
            table.insert((*k).into(), v.clone());
        }
        ch.queue_declare(&name, opts, table)
            .await
            .expect("declare the test's queue");
        let _ = ch.close(200, "declared").await;
        Self {
            url: url.to_owned(),
            name,
            conn,
        }
    }

    /// A durable queue with `args`.
    async fn durable(url: &str, args: &[(&str, AMQPValue)]) -> Self {
        Self::declare(
            url,
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
    }

    async fn problems(&self) -> Vec<(QueueSeverity, String)> {
        let facts = describe_queue(&self.conn, &self.name, T)
            .await
            .expect("describe");
        judge_queue(&facts)
            .into_iter()
            .map(|p| (p.severity, p.message))
            .collect()
    }

    /// `check_queue`'s refusal (the consumer's start-up), as text.
    async fn refusal(&self) -> String {
        match check_queue(&self.conn, &self.name, T).await {
            Err(e @ TopologyError::Inequivalent { .. }) => e.to_string(),
            other => panic!("{}: expected a refusal, got {other:?}", self.name),
        }
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async move {
                    let Ok(conn) = tokio::time::timeout(T, common::connect(&url)).await else {
                        return;
                    };
                    if let Ok(ch) = conn.create_channel().await {
                        let _ = ch.queue_delete(&name, QueueDeleteOptions::default()).await;
                    }
                    let _ = conn.close(200, "done").await;
                })
        })
        .join();
    }
}

fn quorum() -> (&'static str, AMQPValue) {
    ("x-queue-type", AMQPValue::LongString("quorum".into()))
}

fn sac() -> (&'static str, AMQPValue) {
    ("x-single-active-consumer", AMQPValue::Boolean(true))
}

fn long(key: &'static str, v: i64) -> (&'static str, AMQPValue) {
    (key, AMQPValue::LongLongInt(v))
}

fn text(key: &'static str, v: &str) -> (&'static str, AMQPValue) {
    (key, AMQPValue::LongString(v.into()))
}

fn refuses(problems: &[(QueueSeverity, String)], needle: &str) -> bool {
    problems
        .iter()
        .any(|(s, m)| *s == QueueSeverity::Refuse && m.contains(needle))
}

fn warns(problems: &[(QueueSeverity, String)], needle: &str) -> bool {
    problems
        .iter()
        .any(|(s, m)| *s == QueueSeverity::Warn && m.contains(needle))
}

/// A durable quorum queue with single active consumer: described as declared, nothing to
/// say, accepted at start-up with its counts.
#[tokio::test]
async fn a_quorum_queue_with_single_active_consumer_passes() {
    let url = require!(common::amqp_url("qcheck_good"));
    let q = Queue::durable(&url, &[quorum(), sac()]).await;
    let facts = describe_queue(&q.conn, &q.name, T).await.unwrap();
    assert!(facts.durable && !facts.auto_delete, "{facts:?}");
    assert_eq!(facts.queue_type(), "quorum");
    assert!(facts.single_active_consumer());
    assert_eq!(facts.dead_letter_exchange(), None);
    assert!(judge_queue(&facts).is_empty(), "{:?}", judge_queue(&facts));
    let report = check_queue(&q.conn, &q.name, T).await.unwrap();
    assert!(report.quorum && report.single_active_consumer);
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
}

/// Without single active consumer: a warning (two members would split an aggregate), not a
/// refusal at this level (the source refuses it unless told it runs alone).
#[tokio::test]
async fn a_quorum_queue_without_single_active_consumer_is_a_warning() {
    let url = require!(common::amqp_url("qcheck_nosac"));
    let q = Queue::durable(&url, &[quorum()]).await;
    let problems = q.problems().await;
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        warns(&problems, "no single active consumer"),
        "{problems:?}"
    );
    let report = check_queue(&q.conn, &q.name, T).await.unwrap();
    assert!(!report.single_active_consumer);
    assert_eq!(report.warnings.len(), 1);
}

/// A classic queue, even with single active consumer: refused, saying why.
#[tokio::test]
async fn a_classic_queue_with_single_active_consumer_is_refused() {
    let url = require!(common::amqp_url("qcheck_classic_sac"));
    let q = Queue::durable(&url, &[sac()]).await;
    let facts = describe_queue(&q.conn, &q.name, T).await.unwrap();
    assert_eq!(facts.queue_type(), "classic");
    assert!(facts.single_active_consumer());
    let problems = judge_queue(&facts)
        .into_iter()
        .map(|p| (p.severity, p.message))
        .collect::<Vec<_>>();
    assert!(
        refuses(&problems, "is a classic queue (with single active consumer"),
        "{problems:?}"
    );
    assert!(q.refusal().await.contains("needs a quorum queue"));
}

/// A plain classic queue: refused, and the warning about single active consumer too.
#[tokio::test]
async fn a_plain_classic_queue_is_refused() {
    let url = require!(common::amqp_url("qcheck_classic"));
    let q = Queue::durable(&url, &[]).await;
    let problems = q.problems().await;
    assert!(
        refuses(&problems, "is a classic queue, not a durable quorum queue"),
        "{problems:?}"
    );
    assert!(
        warns(&problems, "no single active consumer"),
        "{problems:?}"
    );
}

/// A transient queue (and an auto-delete one): refused, the broker would delete it.
#[tokio::test]
async fn a_transient_or_auto_delete_queue_is_refused() {
    let url = require!(common::amqp_url("qcheck_transient"));
    let q = Queue::declare(&url, QueueDeclareOptions::default(), &[sac()]).await;
    let facts = describe_queue(&q.conn, &q.name, T).await.unwrap();
    assert!(!facts.durable, "{facts:?}");
    assert!(q.refusal().await.contains("is not durable"));
    let q = Queue::declare(
        &url,
        QueueDeclareOptions {
            durable: true,
            auto_delete: true,
            ..Default::default()
        },
        &[sac()],
    )
    .await;
    let problems = q.problems().await;
    assert!(refuses(&problems, "is auto-delete"), "{problems:?}");
}

/// A message TTL: refused (events expire unconsumed), and the dead-letter exchange is named
/// when there is one.
#[tokio::test]
async fn a_message_ttl_is_refused() {
    let url = require!(common::amqp_url("qcheck_ttl"));
    let q = Queue::durable(&url, &[quorum(), sac(), long("x-message-ttl", 60_000)]).await;
    let problems = q.problems().await;
    assert!(
        refuses(
            &problems,
            "x-message-ttl = 60000 ms: an event not consumed in time is dropped"
        ),
        "{problems:?}"
    );
    let q = Queue::durable(
        &url,
        &[
            quorum(),
            sac(),
            long("x-message-ttl", 1_000),
            text("x-dead-letter-exchange", "dlx"),
        ],
    )
    .await;
    let facts = describe_queue(&q.conn, &q.name, T).await.unwrap();
    assert_eq!(facts.dead_letter_exchange(), Some("dlx"));
    assert_eq!(
        facts.arguments.get("x-message-ttl"),
        Some(&ArgValue::Int(1_000))
    );
    assert!(q
        .refusal()
        .await
        .contains("dead-lettered to exchange \"dlx\""));
}

/// A queue that expires: refused.
#[tokio::test]
async fn an_expiring_queue_is_refused() {
    let url = require!(common::amqp_url("qcheck_expires"));
    let q = Queue::durable(&url, &[quorum(), sac(), long("x-expires", 3_600_000)]).await;
    assert!(q.refusal().await.contains("x-expires = 3600000 ms"));
}

/// A length limit that drops the oldest events is refused; one that refuses publications
/// is a warning (events wait in the outbox).
#[tokio::test]
async fn a_length_limit_is_refused_when_it_drops_and_warned_when_it_rejects() {
    let url = require!(common::amqp_url("qcheck_length"));
    let q = Queue::durable(&url, &[quorum(), sac(), long("x-max-length", 1000)]).await;
    let problems = q.problems().await;
    assert!(
        refuses(&problems, "x-max-length = 1000 with overflow drop-head"),
        "{problems:?}"
    );
    let q = Queue::durable(
        &url,
        &[
            quorum(),
            sac(),
            long("x-max-length-bytes", 1 << 20),
            text("x-overflow", "reject-publish"),
        ],
    )
    .await;
    let problems = q.problems().await;
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        warns(&problems, "with overflow reject-publish"),
        "{problems:?}"
    );
    // A warning only: the consumer starts.
    check_queue(&q.conn, &q.name, T).await.expect("accepted");
}

/// A delivery limit drops a message delivered that often: refused without a dead-letter
/// exchange, a warning with one.
#[tokio::test]
async fn a_delivery_limit_is_refused_unless_it_dead_letters() {
    let url = require!(common::amqp_url("qcheck_delivery_limit"));
    let q = Queue::durable(&url, &[quorum(), sac(), long("x-delivery-limit", 5)]).await;
    let problems = q.problems().await;
    assert!(
        refuses(
            &problems,
            "x-delivery-limit = 5 and no dead-letter exchange"
        ),
        "{problems:?}"
    );
    let q = Queue::durable(
        &url,
        &[
            quorum(),
            sac(),
            long("x-delivery-limit", 5),
            text("x-dead-letter-exchange", "parked"),
        ],
    )
    .await;
    let problems = q.problems().await;
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        warns(&problems, "dead-lettered to exchange \"parked\""),
        "{problems:?}"
    );
}

/// A missing queue is `Missing`, permanent.
#[tokio::test]
async fn a_missing_queue_is_reported_missing() {
    let url = require!(common::amqp_url("qcheck_missing"));
    let conn = common::connect(&url).await;
    let name = unique("qcheck-missing");
    let e = describe_queue(&conn, &name, T).await.unwrap_err();
    assert!(matches!(e, TopologyError::Missing { .. }), "{e:?}");
    assert!(!e.is_transient());
}

/// The consumer's start-up goes through the same judgement: a queue that drops events is
/// refused before anything is consumed, as a permanent error.
#[tokio::test]
async fn the_source_refuses_a_queue_that_drops_events_at_start() {
    let url = require!(common::amqp_url("qcheck_source"));
    let q = Queue::durable(&url, &[quorum(), sac(), long("x-message-ttl", 5_000)]).await;
    let err = RabbitSource::builder(&url, &q.name)
        .start()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("x-message-ttl"), "{err}");
    assert!(!outbox_core::Classify::is_transient(&err));
}
