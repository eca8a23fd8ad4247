//! The consumer-side operator scenarios of the `outbox` binary (`parked ... --consumer`,
//! `status`'s consumer rows, `cleanup --inbox`), written once over [`InboxSide`] and run on
//! every store: PostgreSQL in `commands.rs`, MySQL / MariaDB in `mysql_ops.rs`. Each store
//! gives the binary its URL and configuration (one consumer `billing` on a migrated inbox) and
//! answers the few questions asked of its tables directly.

use std::process::{Command, Output, Stdio};

use outbox_core::{Envelope, EventId, InboxStore, LogPosition, ParkAs, ParkKind, ParkedId};
use serde_json::{json, Value};

use super::text;

/// One store's side of a consumer scenario.
#[outbox_core::async_trait]
pub trait InboxSide: Sync {
    /// The consumer's inbox store.
    type Inbox: InboxStore + Sync;

    /// `outbox <args>` with this test's database and `outbox.toml`, not started.
    fn command(&self, args: &[&str]) -> Command;

    /// `outbox <args>` run to completion.
    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run outbox")
    }

    /// Starts every `runs` at once, then waits for each.
    fn run_at_once(&self, runs: &[Vec<&str>]) -> Vec<Output> {
        let children: Vec<_> = runs
            .iter()
            .map(|args| {
                self.command(args)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn outbox")
            })
            .collect();
        children
            .into_iter()
            .map(|c| c.wait_with_output().expect("wait"))
            .collect()
    }

    /// The migrated inbox of consumer `billing`.
    fn inbox(&self) -> &Self::Inbox;

    /// Registrations of `event` by `consumer` in the inbox.
    async fn registered(&self, consumer: &str, event: EventId) -> i64;

    /// The version `consumer` counts as applied for aggregate `order`/`aggregate_id`.
    async fn applied_version(&self, consumer: &str, aggregate_id: &str) -> Option<i64>;

    /// Inserts `n` registrations of `consumer` with fresh event ids, `days` old.
    async fn insert_registrations(&self, consumer: &str, n: usize, days: i64);

    /// All registrations of `consumer`.
    async fn registrations(&self, consumer: &str) -> i64;

    /// `outbox --json <args>`: exit code, stdout parsed, stderr.
    fn json(&self, args: &[&str]) -> (i32, Value, String) {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.run(&all);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout of {args:?} is not JSON ({e}): {}\nstderr: {stderr}",
                String::from_utf8_lossy(&out.stdout)
            )
        });
        (out.status.code().unwrap_or(-1), value, stderr)
    }

    /// Runs `args`, asserting the exit code and that the output says `says`.
    fn refused(&self, args: &[&str], code: i32, says: &str) {
        let out = self.run(args);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {}", text(&out));
        assert!(text(&out).contains(says), "{args:?}: {}", text(&out));
    }
}

fn event(agg: &str, v: i64, t: &str) -> Envelope {
    Envelope::builder("order", agg, v, t)
        .json(&json!({"v": v}))
        .unwrap()
        .build()
        .unwrap()
}

/// Parks for `billing` as read at `offset` of `orders`[0].
async fn park<S: InboxSide>(
    side: &S,
    offset: i64,
    e: &Envelope,
    park_as: ParkAs,
    reason: &str,
) -> ParkedId {
    super::park_consumer_message(
        side.inbox(),
        "billing",
        "orders",
        offset,
        e,
        park_as,
        reason,
    )
    .await
}

/// `parked show --consumer` says where each message was read in its transport's own terms
/// (the JSON keeps `topic`/`partition`/`offset` and adds `native`): a Kafka offset, a
/// JetStream stream sequence with the consumer's delivery sequence, a RabbitMQ exchange and
/// routing key with the delivery tag and the redelivered flag.
pub async fn parked_messages_show_their_transports_position<S: InboxSide>(side: &S) {
    let head = ParkAs::Head(ParkKind::Unprocessable);
    let cases = [
        (
            LogPosition::new("orders", 2, 41),
            "orders[2] offset 41",
            "orders/2@41",
            json!({"transport": "kafka", "topic": "orders", "partition": 2, "offset": 41}),
        ),
        (
            LogPosition::jetstream("ORDERS", 42, 3, "billing-durable"),
            "stream ORDERS seq 42 (delivery 3, consumer billing-durable)",
            "ORDERS seq 42",
            json!({"transport": "nats", "stream": "ORDERS", "stream_sequence": 42,
                   "delivery_sequence": 3, "consumer": "billing-durable"}),
        ),
        (
            LogPosition::rabbitmq("orders-q", 7, "outbox", "order.placed", true),
            "queue orders-q tag 7 (exchange outbox, routing key order.placed, redelivered)",
            "outbox -> order.placed",
            json!({"transport": "rabbitmq", "queue": "orders-q", "exchange": "outbox",
                   "routing_key": "order.placed", "delivery_tag": 7, "redelivered": true}),
        ),
    ];
    for (i, (position, human, short, native)) in cases.into_iter().enumerate() {
        let e = event(&format!("n-{i}"), 1, "order.placed");
        let id = super::park_consumer_message_at(
            side.inbox(),
            "billing",
            position.clone(),
            &e,
            head,
            "unknown customer",
        )
        .await
        .to_string();
        let out = side.run(&["parked", "show", &id, "--consumer", "billing"]);
        assert!(out.status.success(), "{}", text(&out));
        let shown = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = shown
            .lines()
            .find(|l| l.contains("read at"))
            .unwrap_or_else(|| panic!("no read-at line: {shown}"));
        assert!(line.contains(human), "{human}: {shown}");
        let (code, sh, stderr) = side.json(&["parked", "show", &id, "--consumer", "billing"]);
        assert_eq!(code, 0, "{stderr}");
        assert_eq!(sh["parked"]["native"], native, "{sh}");
        assert_eq!(sh["parked"]["topic"], position.topic.as_str());
        assert_eq!(sh["parked"]["offset"], position.offset);
        let out = side.run(&["parked", "list", "--consumer", "billing"]);
        assert!(out.status.success(), "{}", text(&out));
        let listed = String::from_utf8_lossy(&out.stdout).into_owned();
        let row = listed
            .lines()
            .find(|l| l.contains(&format!("n-{i}")))
            .unwrap_or_else(|| panic!("n-{i} not listed: {listed}"));
        assert!(row.contains(short), "{short}: {listed}");
        let (_, l, _) = side.json(&["parked", "list", "--consumer", "billing"]);
        assert_eq!(l["parked"][i]["native"], native, "{l}");
    }
}

/// `parked list|show|discard|retry|reissue --consumer` and `status`'s consumer row: o-1 v1
/// parked with v2 waiting behind it, o-2 v1 parked alone. Listed oldest first without payloads,
/// counted by `status`, shown with what waits behind; each bad input refused with its exit code;
/// a discard of a head with nothing behind registers it and releases its aggregate, audited; a
/// discard of a head with a message behind it leaves that message parked (it needs the
/// consumer's handler), applied nothing; `--all` shows the resolved ones.
pub async fn parked_messages_are_listed_shown_discarded_and_counted<S: InboxSide>(side: &S) {
    let (o1v1, o1v2, o2v1) = (
        event("o-1", 1, "order.placed"),
        event("o-1", 2, "order.paid"),
        event("o-2", 1, "order.placed"),
    );
    let head = ParkAs::Head(ParkKind::Unprocessable);
    let id1 = park(side, 0, &o1v1, head, "unknown customer").await;
    let id2 = park(
        side,
        1,
        &o1v2,
        ParkAs::Waiting,
        "waits behind its aggregate",
    )
    .await;
    let id3 = park(side, 2, &o2v1, head, "unknown customer").await;

    // list: every open message, oldest first, never the payload.
    let (code, l, stderr) = side.json(&["parked", "list", "--consumer", "billing"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(l["side"], "consumer");
    let listed = l["parked"].as_array().unwrap();
    let ids: Vec<i64> = listed.iter().map(|m| m["id"].as_i64().unwrap()).collect();
    assert_eq!(ids, vec![id1.0, id2.0, id3.0]);
    assert_eq!(listed[0]["status"], "parked");
    assert_eq!(listed[0]["kind"], "unprocessable");
    assert_eq!(listed[0]["reason"], "unknown customer");
    assert_eq!(listed[0]["event_type"], "order.placed");
    assert_eq!(listed[0]["event_id"], o1v1.event_id.to_string());
    assert_eq!(listed[1]["status"], "waiting");
    assert_eq!(listed[1]["aggregate_version"], 2);
    assert!(listed.iter().all(|m| m.get("payload").is_none()));
    let human = side.run(&["parked", "list", "--consumer", "billing"]);
    assert!(human.status.success(), "{}", text(&human));
    let human = String::from_utf8_lossy(&human.stdout).into_owned();
    assert!(
        human.contains("waiting") && human.contains("order/o-1"),
        "{human}"
    );

    // status: parked and waiting counts and the oldest age, per consumer.
    let (code, st, stderr) = side.json(&["status", "--no-consumers"]);
    assert_eq!(code, 0, "{stderr}");
    let c = &st["consumers"][0];
    assert_eq!(c["name"], "billing", "{st}");
    assert_eq!(
        (c["parked"].as_u64(), c["waiting"].as_u64()),
        (Some(2), Some(1)),
        "{st}"
    );
    assert!(
        c["oldest_parked_age_seconds"].as_f64().unwrap() >= 0.0,
        "{st}"
    );
    assert!(
        st["warnings"]
            .to_string()
            .contains("parked list --consumer billing"),
        "{st}"
    );
    let human = side.run(&["status", "--no-consumers"]);
    assert!(
        String::from_utf8_lossy(&human.stdout).contains("2 (+1 waiting)"),
        "{}",
        text(&human)
    );

    // show: the message, what waits behind it, no audit yet.
    let id1s = id1.to_string();
    let (code, sh, _) = side.json(&["parked", "show", &id1s, "--consumer", "billing"]);
    assert_eq!(code, 0, "{sh}");
    assert_eq!(sh["parked"]["id"], id1.0);
    assert_eq!(sh["same_aggregate_open"], json!([id2.0]));
    assert_eq!(sh["audit"], json!([]));
    let human = side.run(&["parked", "show", &id1s, "--consumer", "billing"]);
    assert!(String::from_utf8_lossy(&human.stdout).contains("no operator action yet"));

    // Bad inputs, each with its exit code and the fix.
    side.refused(
        &["parked", "list", "--consumer", "shipping"],
        2,
        "no consumer \"shipping\" in the configuration (configured: billing)",
    );
    side.refused(
        &["parked", "show", "999999", "--consumer", "billing"],
        1,
        "has no parked message 999999",
    );
    side.refused(
        &["parked", "show", "not-a-number", "--consumer", "billing"],
        2,
        "not a parked message id",
    );
    side.refused(
        &["parked", "discard", &id1s, "--consumer", "billing"],
        2,
        "discard needs a reason",
    );
    side.refused(
        &[
            "parked",
            "discard",
            "999999",
            "--consumer",
            "billing",
            "--reason",
            "x",
        ],
        1,
        "has no parked message 999999",
    );
    side.refused(
        &["parked", "retry", "999999", "--consumer", "billing"],
        1,
        "has no parked message 999999",
    );
    side.refused(
        &[
            "parked",
            "reissue",
            &id1s,
            "--consumer",
            "billing",
            "--reason",
            "x",
            "--yes",
        ],
        2,
        "reissue does not apply",
    );
    side.refused(
        &["parked", "list", "--all"],
        2,
        "--all lists a consumer's resolved messages",
    );
    // Discarding a head with messages behind it asks first (no terminal here: refused).
    side.refused(
        &[
            "parked",
            "discard",
            &id1s,
            "--consumer",
            "billing",
            "--reason",
            "x",
        ],
        6,
        "--yes",
    );
    let (_, l, _) = side.json(&["parked", "list", "--consumer", "billing"]);
    assert_eq!(
        l["parked"].as_array().unwrap().len(),
        3,
        "nothing changed: {l}"
    );

    // discard of a head with nothing behind it: resolved, registered, aggregate released.
    let id3s = id3.to_string();
    let (code, d, stderr) = side.json(&[
        "parked",
        "discard",
        &id3s,
        "--consumer",
        "billing",
        "--reason",
        "customer deleted",
        "--actor",
        "alice",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(d["action"], "discard");
    assert_eq!(
        (d["discarded"].as_u64(), d["released"].as_bool()),
        (Some(1), Some(true)),
        "{d}"
    );
    assert!(d["still_parked"].is_null(), "{d}");
    assert_eq!(
        side.registered("billing", o2v1.event_id).await,
        1,
        "a discarded message is registered: a redelivery is a duplicate"
    );
    let (_, sh, _) = side.json(&["parked", "show", &id3s, "--consumer", "billing"]);
    assert_eq!(sh["parked"]["status"], "discarded");
    let audit = sh["audit"].as_array().unwrap();
    assert_eq!(audit.len(), 1, "{sh}");
    assert_eq!(audit[0]["action"], "discard");
    assert_eq!(audit[0]["actor"], "alice");
    assert_eq!(audit[0]["reason"], "customer deleted");
    side.refused(
        &["parked", "retry", &id3s, "--consumer", "billing"],
        1,
        "is discarded already",
    );
    side.refused(
        &[
            "parked",
            "discard",
            &id3s,
            "--consumer",
            "billing",
            "--reason",
            "again",
        ],
        1,
        "is discarded already",
    );
    // The discard changed only its own aggregate: o-1's messages are as they were.
    let (_, l, _) = side.json(&["parked", "list", "--consumer", "billing"]);
    let open: Vec<(i64, &str)> = l["parked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_i64().unwrap(), m["status"].as_str().unwrap()))
        .collect();
    assert_eq!(open, vec![(id1.0, "parked"), (id2.0, "waiting")], "{l}");
    assert_eq!(side.registered("billing", o1v1.event_id).await, 0);

    // discard of a head with a message behind it (confirmed): the waiting message needs the
    // consumer's handler, so it becomes the parked head, saying so; nothing is applied.
    let (code, d, stderr) = side.json(&[
        "parked",
        "discard",
        &id1s,
        "--consumer",
        "billing",
        "--reason",
        "order voided",
        "--yes",
        "--actor",
        "bob",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(d["still_parked"]["id"], id2.0, "{d}");
    assert_eq!(d["released"], false, "{d}");
    let (_, l, _) = side.json(&["parked", "list", "--consumer", "billing"]);
    let open = l["parked"].as_array().unwrap();
    assert_eq!(open.len(), 1, "{l}");
    assert_eq!(open[0]["id"], id2.0);
    assert_eq!(open[0]["status"], "parked");
    assert!(
        open[0]["reason"]
            .as_str()
            .unwrap()
            .contains("request a retry (`outbox parked retry ID --consumer NAME`)"),
        "{l}"
    );
    assert_eq!(
        side.registered("billing", o1v2.event_id).await,
        0,
        "the waiting message was not applied"
    );
    // --all shows the resolved ones too.
    let (_, all, _) = side.json(&["parked", "list", "--consumer", "billing", "--all"]);
    let statuses: Vec<&str> = all["parked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, vec!["discarded", "parked", "discarded"], "{all}");
    let (_, st, _) = side.json(&["status", "--no-consumers"]);
    let c = &st["consumers"][0];
    assert_eq!(
        (c["parked"].as_u64(), c["waiting"].as_u64()),
        (Some(1), Some(0)),
        "{st}"
    );
}

/// `parked discard --consumer --skip-to`: a discard never moves over versions that were not
/// seen unless the operator says how far; with `--skip-to` the applied version moves there and
/// the number of unseen versions swallowed is reported and audited. A skip below the message's
/// version, or on the producer side, is refused.
pub async fn a_discard_skips_versions_only_when_told_how_far<S: InboxSide>(side: &S) {
    let v5 = Envelope::builder("order", "o-3", 5, "order.paid")
        .build()
        .unwrap();
    let id = park(
        side,
        0,
        &v5,
        ParkAs::Head(ParkKind::VersionGap),
        "version gap",
    )
    .await
    .to_string();
    let args = |to: &str| {
        vec![
            "parked".to_owned(),
            "discard".to_owned(),
            id.clone(),
            "--consumer".to_owned(),
            "billing".to_owned(),
            "--reason".to_owned(),
            "v1..v4 lost upstream".to_owned(),
            "--skip-to".to_owned(),
            to.to_owned(),
        ]
    };
    let below: Vec<String> = args("3");
    let out = side.run(&below.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("below"), "{}", text(&out));
    side.refused(
        &[
            "parked",
            "discard",
            &v5.event_id.to_string(),
            "--reason",
            "x",
            "--skip-to",
            "7",
        ],
        2,
        "--skip-to is for a consumer",
    );
    let ok: Vec<String> = args("7");
    let (code, d, stderr) = side.json(&ok.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{stderr}");
    // Versions 1..=4, 6 and 7 were never seen: six swallowed.
    assert_eq!(d["skipped_versions"].as_i64(), Some(6), "{d}");
    assert_eq!(side.applied_version("billing", "o-3").await, Some(7));
    let (_, sh, _) = side.json(&["parked", "show", &id, "--consumer", "billing"]);
    let outcome = sh["audit"][0]["outcome"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(outcome.contains("6 version(s) never seen"), "{sh}");
}

/// A discard without `--skip-to` of a message parked behind a version gap (v3 with v1 and v2
/// never seen) moves the applied version over nothing it did not see: the aggregate's applied
/// version stays where it was, and a later v1 is not stale.
pub async fn a_discard_never_skips_unseen_versions<S: InboxSide>(side: &S) {
    let v3 = Envelope::builder("order", "o-4", 3, "order.paid")
        .build()
        .unwrap();
    let id = park(
        side,
        0,
        &v3,
        ParkAs::Head(ParkKind::VersionGap),
        "version gap",
    )
    .await
    .to_string();
    let (code, d, stderr) = side.json(&[
        "parked",
        "discard",
        &id,
        "--consumer",
        "billing",
        "--reason",
        "duplicate of a manual fix",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(d["skipped_versions"].as_i64(), Some(0), "{d}");
    let applied = side.applied_version("billing", "o-4").await;
    assert!(
        applied.unwrap_or(0) < 1,
        "v1 and v2 were never seen: the applied version may not pass them ({applied:?}; {d})"
    );
    assert_eq!(side.registered("billing", v3.event_id).await, 1, "{d}");
}

/// `parked retry --consumer`: an audited request, nothing applied by the command; `show` and
/// `status` report it pending; a second request replaces the first; an unknown id is refused.
/// Returns the ids of o-9 v1 (the head, requested) and v2 (waiting), for the store's test to
/// run the consumer's engine and then call [`retry_was_performed`].
pub async fn retry_is_requested<S: InboxSide>(side: &S) -> (ParkedId, ParkedId, [Envelope; 2]) {
    let v1 = Envelope::builder("order", "o-9", 1, "order.placed")
        .build()
        .unwrap();
    let v2 = Envelope::builder("order", "o-9", 2, "order.paid")
        .build()
        .unwrap();
    let id1 = park(
        side,
        0,
        &v1,
        ParkAs::Head(ParkKind::Unprocessable),
        "no customer",
    )
    .await;
    let id2 = park(side, 1, &v2, ParkAs::Waiting, "waits").await;
    let id1s = id1.to_string();
    let (code, r, stderr) = side.json(&[
        "parked",
        "retry",
        &id1s,
        "--consumer",
        "billing",
        "--actor",
        "alice",
        "--reason",
        "customer created",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(r["action"], "request_retry", "{r}");
    assert_eq!(r["id"], id1.0, "{r}");
    let (_, sh, _) = side.json(&["parked", "show", &id1s, "--consumer", "billing"]);
    assert_eq!(sh["parked"]["status"], "parked", "{sh}");
    assert_eq!(
        sh["parked"]["retry_request"]["requested_by"], "alice",
        "{sh}"
    );
    assert_eq!(
        sh["parked"]["retry_request"]["reason"], "customer created",
        "{sh}"
    );
    assert_eq!(sh["audit"][0]["action"], "request_retry", "{sh}");
    let human = side.run(&["parked", "show", &id1s, "--consumer", "billing"]);
    assert!(
        String::from_utf8_lossy(&human.stdout).contains("retry requested"),
        "{}",
        text(&human)
    );
    let human = side.run(&[
        "parked",
        "retry",
        &id1s,
        "--consumer",
        "billing",
        "--actor",
        "alice",
    ]);
    assert!(
        String::from_utf8_lossy(&human.stdout).contains("at its next check"),
        "a second request replaces the first: {}",
        text(&human)
    );
    assert_eq!(
        side.registered("billing", v1.event_id).await,
        0,
        "a request applies nothing by itself"
    );
    let (code, st, stderr) = side.json(&["status", "--no-consumers"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(st["consumers"][0]["retry_requested"], 1, "{st}");
    let human = side.run(&["status", "--no-consumers"]);
    assert!(
        String::from_utf8_lossy(&human.stdout).contains("1 retry requested"),
        "{}",
        text(&human)
    );
    (id1, id2, [v1, v2])
}

/// After the consumer's engine ran: both messages applied, the request cleared and audited as
/// the requester's retry; a resolved message takes no request.
pub async fn retry_was_performed<S: InboxSide>(side: &S, id1: ParkedId, id2: ParkedId) {
    let id1s = id1.to_string();
    let (_, sh, _) = side.json(&["parked", "show", &id1s, "--consumer", "billing"]);
    assert_eq!(sh["parked"]["status"], "applied", "{sh}");
    assert!(sh["parked"]["retry_request"].is_null(), "cleared: {sh}");
    let actions: Vec<&str> = sh["audit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["action"].as_str().unwrap())
        .collect();
    assert_eq!(
        actions,
        vec!["request_retry", "request_retry", "retry"],
        "{sh}"
    );
    assert_eq!(sh["audit"][2]["actor"], "alice", "{sh}");
    let (_, st, _) = side.json(&["status", "--no-consumers"]);
    assert_eq!(st["consumers"][0]["retry_requested"], 0, "{st}");
    let (_, sh2, _) = side.json(&["parked", "show", &id2.to_string(), "--consumer", "billing"]);
    assert_eq!(sh2["parked"]["status"], "applied", "{sh2}");
    side.refused(
        &["parked", "retry", &id1s, "--consumer", "billing"],
        1,
        "is applied already",
    );
}

/// `cleanup --inbox`, with `billing` (9 days) and `shipping` (15 days) sharing the inbox
/// table (`write_config` writes `[[consumers]]` entries of these names and `dedup_retention`s
/// to `outbox.toml` on the store's inbox; none: no consumer): each consumer cleans its
/// own registrations with its own window, in batches; a dry run changes nothing; parked
/// messages stay; `--retention` and a configuration without consumers are refused (exit 2).
pub async fn cleanup_inbox_removes_registrations_past_the_dedup_window<S: InboxSide>(
    side: &S,
    write_config: impl Fn(&[(&str, &str)]),
) {
    // Two consumers share the table: six registrations 20 days old and three 10 days old each.
    for consumer in ["billing", "shipping"] {
        side.insert_registrations(consumer, 6, 20).await;
        side.insert_registrations(consumer, 3, 10).await;
    }
    // A parked message is never cleaned up.
    let e = Envelope::builder("order", "o-1", 1, "order.placed")
        .build()
        .unwrap();
    park(side, 0, &e, ParkAs::Head(ParkKind::Unprocessable), "x").await;
    write_config(&[("billing", "9d"), ("shipping", "15d")]);
    let (code, v, stderr) = side.json(&["cleanup", "--inbox", "--dry-run"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(v["dry_run"], true);
    let inboxes = v["inboxes"].as_array().unwrap();
    assert_eq!(inboxes.len(), 2, "one entry per consumer: {v}");
    assert_eq!(
        (&inboxes[0]["consumer"], &inboxes[1]["consumer"]),
        (&json!("billing"), &json!("shipping"))
    );
    assert_eq!(inboxes[0]["retention"], "9days");
    assert_eq!(inboxes[1]["retention"], "15days");
    assert_eq!(inboxes[0]["would_remove"], 9, "{v}");
    assert_eq!(inboxes[1]["would_remove"], 6, "{v}");
    assert_eq!(
        (
            side.registrations("billing").await,
            side.registrations("shipping").await
        ),
        (9, 9),
        "a dry run changes nothing"
    );
    let human = side.run(&["cleanup", "--inbox", "--dry-run"]);
    let human_out = String::from_utf8_lossy(&human.stdout);
    assert!(
        human_out.contains("consumer billing")
            && human_out.contains("9 registration(s)")
            && human_out.contains("consumer shipping")
            && human_out.contains("6 registration(s)"),
        "{}",
        text(&human)
    );
    // Bad inputs.
    let out = side.run(&["cleanup", "--inbox", "--retention", "1d"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let (code, v, _) = side.json(&["cleanup", "--inbox", "--batch-size", "5"]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["inboxes"][0]["removed"], 9, "{v}");
    assert_eq!(v["inboxes"][0]["batches"], 2, "{v}");
    assert_eq!(v["inboxes"][1]["removed"], 6, "{v}");
    assert_eq!(v["inboxes"][1]["batches"], 2, "{v}");
    assert_eq!(
        (
            side.registrations("billing").await,
            side.registrations("shipping").await
        ),
        (0, 3),
        "shipping keeps the registrations inside its own, longer window"
    );
    let (_, l, _) = side.json(&["parked", "list", "--consumer", "billing"]);
    assert_eq!(
        l["parked"].as_array().unwrap().len(),
        1,
        "parked messages stay: {l}"
    );
    write_config(&[]);
    let out = side.run(&["cleanup", "--inbox"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "no consumers configured: {}",
        text(&out)
    );
}

/// Operators racing on consumer messages: two discards of one message at once, and a discard
/// beside a retry request on another: one discard lands (exit 0), the other is told the
/// message is discarded already (exit 1), with one discard in the audit trail; the request
/// either lands before the discard (and is refused after it) or is refused: never a request
/// left pending on a resolved message. Each action changes only its own aggregate.
pub async fn concurrent_consumer_actions_land_once<S: InboxSide>(side: &S) {
    let (a, b, c) = (
        event("c-a", 1, "order.placed"),
        event("c-b", 1, "order.placed"),
        event("c-c", 1, "order.placed"),
    );
    let head = ParkAs::Head(ParkKind::Unprocessable);
    let ida = park(side, 0, &a, head, "a").await.to_string();
    let idb = park(side, 1, &b, head, "b").await.to_string();
    let idc = park(side, 2, &c, head, "c").await.to_string();
    fn discard<'a>(id: &'a str, actor: &'a str) -> Vec<&'a str> {
        vec![
            "parked",
            "discard",
            id,
            "--consumer",
            "billing",
            "--reason",
            "dup",
            "--actor",
            actor,
        ]
    }
    let outs = side.run_at_once(&[discard(&ida, "alice"), discard(&ida, "bob")]);
    let mut codes: Vec<Option<i32>> = outs.iter().map(|o| o.status.code()).collect();
    codes.sort();
    assert_eq!(
        codes,
        vec![Some(0), Some(1)],
        "{}\n{}",
        text(&outs[0]),
        text(&outs[1])
    );
    let loser = outs.iter().find(|o| o.status.code() == Some(1)).unwrap();
    assert!(
        text(loser).contains("is discarded already"),
        "{}",
        text(loser)
    );
    let (_, sh, _) = side.json(&["parked", "show", &ida, "--consumer", "billing"]);
    assert_eq!(sh["parked"]["status"], "discarded", "{sh}");
    assert_eq!(sh["audit"].as_array().map(Vec::len), Some(1), "{sh}");
    assert_eq!(side.registered("billing", a.event_id).await, 1);

    let outs = side.run_at_once(&[
        discard(&idb, "carol"),
        vec![
            "parked",
            "retry",
            &idb,
            "--consumer",
            "billing",
            "--actor",
            "dave",
        ],
    ]);
    assert_eq!(outs[0].status.code(), Some(0), "{}", text(&outs[0]));
    let (_, sh, _) = side.json(&["parked", "show", &idb, "--consumer", "billing"]);
    assert_eq!(sh["parked"]["status"], "discarded", "{sh}");
    assert!(
        sh["parked"]["retry_request"].is_null(),
        "no request left on a resolved message: {sh}"
    );
    match outs[1].status.code() {
        Some(0) => {}
        Some(1) => assert!(
            text(&outs[1]).contains("is discarded already"),
            "{}",
            text(&outs[1])
        ),
        other => panic!("retry request exited {other:?}: {}", text(&outs[1])),
    }
    let (_, st, _) = side.json(&["status", "--no-consumers"]);
    assert_eq!(st["consumers"][0]["retry_requested"], 0, "{st}");
    // The same in sequence: a request, then a discard: the discard clears the request.
    let d = event("c-d", 1, "order.placed");
    let idd = park(side, 3, &d, head, "d").await.to_string();
    let out = side.run(&["parked", "retry", &idd, "--consumer", "billing"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let out = side.run(&discard(&idd, "erin"));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let (_, sh, _) = side.json(&["parked", "show", &idd, "--consumer", "billing"]);
    assert_eq!(sh["parked"]["status"], "discarded", "{sh}");
    assert!(sh["parked"]["retry_request"].is_null(), "{sh}");
    let (_, st, _) = side.json(&["status", "--no-consumers"]);
    assert_eq!(st["consumers"][0]["retry_requested"], 0, "{st}");
    // c-c was never acted on.
    let (_, sh, _) = side.json(&["parked", "show", &idc, "--consumer", "billing"]);
    assert_eq!(sh["parked"]["status"], "parked", "{sh}");
    assert_eq!(sh["audit"], json!([]), "{sh}");
    assert_eq!(side.registered("billing", c.event_id).await, 0);
}

/// The PostgreSQL side: the test's schema holds the outbox and consumer `billing`'s inbox.
pub struct PgInbox<'a> {
    /// The test's services.
    pub env: &'a super::TestEnv,
    /// The migrated inbox in the test's schema.
    pub inbox: outbox_postgres::PostgresInboxStore,
}

impl<'a> PgInbox<'a> {
    /// Migrates the inbox in `env`'s schema and configures consumer `billing` on it.
    pub async fn new(env: &'a super::TestEnv) -> Self {
        let inbox = super::inbox(&env.pool, &env.schema).await;
        let side = Self { env, inbox };
        side.write_config(&[("billing", "14d")]);
        side
    }

    /// `outbox.toml` with `consumers` (name, dedup_retention) on the test's schema.
    pub fn write_config(&self, consumers: &[(&str, &str)]) {
        let path = self.env.dir.join("outbox.toml");
        if consumers.is_empty() {
            let _ = std::fs::remove_file(path);
            return;
        }
        let toml: String = consumers
            .iter()
            .map(|(name, retention)| {
                format!(
                    "[[consumers]]\nname = \"{name}\"\ninbox_schema = \"{}\"\n\
                     dedup_retention = \"{retention}\"\n",
                    self.env.schema
                )
            })
            .collect();
        std::fs::write(path, toml).unwrap();
    }
}

#[outbox_core::async_trait]
impl InboxSide for PgInbox<'_> {
    type Inbox = outbox_postgres::PostgresInboxStore;

    fn command(&self, args: &[&str]) -> Command {
        let mut c = self.env.cmd();
        c.args(args);
        c
    }

    fn inbox(&self) -> &Self::Inbox {
        &self.inbox
    }

    async fn registered(&self, consumer: &str, event: EventId) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM \"{}\".processed_events WHERE consumer = $1 AND event_id = $2",
            self.env.schema
        ))
        .bind(consumer)
        .bind(event.as_uuid())
        .fetch_one(&self.env.pool)
        .await
        .unwrap()
    }

    async fn applied_version(&self, consumer: &str, aggregate_id: &str) -> Option<i64> {
        sqlx::query_scalar::<_, Option<i64>>(&format!(
            "SELECT applied_version FROM \"{}\".processed_events_aggregates \
             WHERE consumer = $1 AND aggregate_type = 'order' AND aggregate_id = $2",
            self.env.schema
        ))
        .bind(consumer)
        .bind(aggregate_id)
        .fetch_optional(&self.env.pool)
        .await
        .unwrap()
        .flatten()
    }

    async fn insert_registrations(&self, consumer: &str, n: usize, days: i64) {
        sqlx::query(&format!(
            "INSERT INTO \"{}\".processed_events (consumer, event_id, processed_at) \
             SELECT $1, gen_random_uuid(), now() - $3 * interval '1 day' \
             FROM generate_series(1, $2)",
            self.env.schema
        ))
        .bind(consumer)
        .bind(n as i32)
        .bind(days as f64)
        .execute(&self.env.pool)
        .await
        .unwrap();
    }

    async fn registrations(&self, consumer: &str) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM \"{}\".processed_events WHERE consumer = $1",
            self.env.schema
        ))
        .bind(consumer)
        .fetch_one(&self.env.pool)
        .await
        .unwrap()
    }
}
