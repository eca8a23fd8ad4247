//! The operator commands of the `outbox` binary against MariaDB, as a user runs them with a
//! `mysql://` URL: `parked` on the outbox (through `outbox_core::OperatorStore`), a
//! consumer's parked messages (`parked ... --consumer`, through `outbox_inbox::ParkedMessages`
//! over `outbox_mysql::MySqlInboxStore`), `cleanup --inbox`, and `status`'s consumer rows.
//! The consumer scenarios are the PostgreSQL tests' own (`common::consumer_ops`), run here on
//! a MySQL inbox.
//!
//! Needs `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`); each test creates its own
//! database and drops it at the end. No broker: the relay's work is done here through the
//! store's relay role (claim and complete), as a relay would.

mod common;

use std::process::{Output, Stdio};
use std::time::Duration;

use common::consumer_ops::{self, InboxSide};
use common::mysql::Db;
use common::text;
use outbox_core::prelude::*;
use outbox_core::{
    AckMetadata, ClaimMode, ClaimRequest, Envelope, ErrorClass, EventId, LastError, Outcome,
    ParkKind, ParkReason,
};
use outbox_mysql::sqlx::{self, MySqlPool};
use outbox_mysql::{MySqlInboxStore, MySqlOutboxStore};
use serde_json::Value;

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(out)))
}

/// `outbox --json <args>` on `db`: exit code and the document.
fn run_json(db: &Db, args: &[&str]) -> (i32, Value) {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = db.outbox(&db.url(), &[], &all);
    (out.status.code().unwrap_or(-1), json(&out))
}

fn store(pool: &MySqlPool) -> MySqlOutboxStore {
    MySqlOutboxStore::builder(pool.clone())
        .claim_mode(ClaimMode::lease(Duration::from_secs(30)).unwrap())
        .build()
        .expect("store")
}

fn park(event: &Envelope, kind: ParkKind, class: ErrorClass, error: &str) -> Outcome {
    Outcome::Park {
        event_id: event.event_id,
        reason: ParkReason {
            kind,
            error: LastError {
                class,
                kind: error.into(),
                message: format!("{error} (test)"),
            },
        },
    }
}

fn published(event: &Envelope, offset: i64) -> Outcome {
    Outcome::Published {
        event_id: event.event_id,
        ack: AckMetadata::kafka("orders", 0, offset),
    }
}

/// Claims what is claimable for `owner` and completes it with `outcome` per event (events
/// without one are released by the lease's end, never here): what a relay does.
async fn relay_round(
    store: &MySqlOutboxStore,
    owner: &str,
    outcome: impl Fn(&Envelope) -> Option<Outcome>,
) -> Vec<EventId> {
    let batch = store
        .claim(&ClaimRequest::new(owner, 100))
        .await
        .expect("claim");
    let claimed: Vec<EventId> = batch.records.iter().map(|r| r.envelope.event_id).collect();
    let outcomes: Vec<Outcome> = batch
        .records
        .iter()
        .filter_map(|r| outcome(&r.envelope))
        .collect();
    if !batch.records.is_empty() {
        store
            .complete(&batch.handle, &outcomes)
            .await
            .expect("complete");
    }
    claimed
}

/// Every row of the outbox but those of aggregate `except`: (event id, status, attempts).
async fn rows_except(pool: &MySqlPool, except: &str) -> Vec<(String, String, i32)> {
    sqlx::query_as(
        "SELECT LOWER(HEX(event_id)), CAST(status AS CHAR), attempts FROM outbox_events \
         WHERE aggregate_id <> ? ORDER BY id",
    )
    .bind(except)
    .fetch_all(pool)
    .await
    .expect("rows")
}

fn ev(agg: &str, v: i64, t: &str) -> Envelope {
    Envelope::builder("order", agg, v, t)
        .json(&serde_json::json!({"note": "personal data", "v": v}))
        .unwrap()
        .build()
        .unwrap()
}

/// `parked list|show|retry|discard|reissue` on a MySQL outbox, mirroring the PostgreSQL test
/// (`commands.rs`, `parked_events_are_listed_shown_and_worked_with_an_audit_trail`): the poison
/// event `big` v1 (refused by the broker) with v2 blocked behind it, `late` v1 parked after a
/// timeout (maybe in the topic), and `other` (v1 parked, v2 blocked) which no action here may
/// touch. Listed and shown with their last errors, never a payload; bad inputs refused with
/// PostgreSQL's exit codes; a retry makes the event claimable again (and a second retry of it
/// is refused), a discard with a reason releases `big` v2, a re-issue replaces `late` v1 by a
/// copy; every action in the audit trail with actor and reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_events_on_mariadb_are_listed_shown_and_worked_with_an_audit_trail() {
    let Some(db) =
        Db::new("parked_events_on_mariadb_are_listed_shown_and_worked_with_an_audit_trail").await
    else {
        return;
    };
    let pool = db.pool().await;
    let store = store(&pool);
    store.migrate().await.expect("migrate");
    let (big1, big2, late, other1, other2) = (
        ev("big", 1, "order.placed"),
        ev("big", 2, "order.paid"),
        ev("late", 1, "order.placed"),
        ev("other", 1, "order.placed"),
        ev("other", 2, "order.paid"),
    );
    store
        .append_many(
            &pool,
            &[
                big1.clone(),
                big2.clone(),
                late.clone(),
                other1.clone(),
                other2.clone(),
            ],
        )
        .await
        .expect("append");
    let (b1, l1, o1) = (big1.event_id, late.event_id, other1.event_id);
    let claimed = relay_round(&store, "relay-1", |e| {
        Some(match e.event_id {
            id if id == b1 => park(
                e,
                ParkKind::PermanentError,
                ErrorClass::Permanent,
                "record_too_large",
            ),
            id if id == l1 => park(
                e,
                ParkKind::AttemptsExhausted,
                ErrorClass::Transient,
                "timeout",
            ),
            id if id == o1 => park(
                e,
                ParkKind::PermanentError,
                ErrorClass::Permanent,
                "invalid_record",
            ),
            _ => return None,
        })
    })
    .await;
    assert_eq!(claimed.len(), 3, "the three heads");
    let untouched = rows_except(&pool, "big").await;

    // status counts them.
    let (code, s) = run_json(&db, &["status"]);
    assert_eq!(code, 0, "{s}");
    assert_eq!(s["backlog"]["parked"], 3, "{s}");
    assert_eq!(s["backlog"]["blocked"], 2, "{s}");

    // list: oldest first, the last error, never the payload.
    let (code, l) = run_json(&db, &["parked", "list"]);
    assert_eq!(code, 0, "{l}");
    assert_eq!(l["side"], "producer");
    let parked = l["parked"].as_array().unwrap();
    assert_eq!(parked.len(), 3, "{l}");
    let ids: Vec<&str> = parked
        .iter()
        .map(|p| p["event_id"].as_str().unwrap())
        .collect();
    for id in [b1, l1, o1] {
        assert!(ids.contains(&id.to_string().as_str()), "{l}");
    }
    let big = parked
        .iter()
        .find(|p| p["event_id"] == b1.to_string())
        .unwrap();
    assert_eq!(big["park_kind"], "permanent_error");
    assert_eq!(big["error_class"], "permanent");
    assert_eq!(big["error_kind"], "record_too_large");
    assert_eq!(big["error_message"], "record_too_large (test)");
    assert_eq!(big["attempts"], 1);
    assert_eq!(big["aggregate_version"], 1);
    assert_eq!(big["delivery_uncertain"], false);
    let late_row = parked
        .iter()
        .find(|p| p["event_id"] == l1.to_string())
        .unwrap();
    assert_eq!(late_row["park_kind"], "attempts_exhausted");
    assert_eq!(late_row["error_class"], "transient");
    assert_eq!(late_row["delivery_uncertain"], true, "{l}");
    assert!(
        parked.iter().all(|p| p.get("payload").is_none()),
        "payloads are never printed"
    );
    assert!(!l.to_string().contains("personal data"), "{l}");
    let (code, one) = run_json(&db, &["parked", "list", "--limit", "1"]);
    assert_eq!(code, 0, "{one}");
    assert_eq!(one["parked"].as_array().unwrap().len(), 1, "{one}");
    let human = db.outbox(&db.url(), &[], &["parked", "list"]);
    assert!(human.status.success(), "{}", text(&human));
    let human = String::from_utf8_lossy(&human.stdout);
    assert!(
        human.contains("order/big") && human.contains("3 parked") && human.contains("timeout"),
        "{human}"
    );

    // show: the event, its last error, what is known of the attempts, no audit yet.
    let big_id = b1.to_string();
    let out = db.outbox(&db.url(), &[], &["parked", "show", &big_id]);
    assert!(out.status.success(), "{}", text(&out));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("record_too_large (permanent): record_too_large (test)")
            && shown.contains("the broker refused each one")
            && shown.contains("no operator action yet"),
        "{shown}"
    );
    let (code, sh) = run_json(&db, &["parked", "show", &l1.to_string()]);
    assert_eq!(code, 0, "{sh}");
    assert!(
        sh["earlier_attempts"]
            .as_str()
            .unwrap()
            .contains("it may already be in the topic"),
        "{sh}"
    );
    assert_eq!(sh["audit"], serde_json::json!([]));

    // Bad inputs, with PostgreSQL's exit codes.
    let bad = |args: &[&str], code: i32, says: &str| {
        let out = db.outbox(&db.url(), &[], args);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {}", text(&out));
        assert!(text(&out).contains(says), "{args:?}: {}", text(&out));
    };
    let unknown = EventId::now_v7().to_string();
    bad(&["parked", "show", &unknown], 1, "is not parked");
    bad(&["parked", "retry", &unknown], 1, "is not parked");
    bad(
        &["parked", "discard", &unknown, "--reason", "x"],
        1,
        "is not parked",
    );
    bad(&["parked", "show", "not-a-uuid"], 2, "is not an event id");
    bad(&["parked", "discard", &big_id], 2, "discard needs a reason");
    bad(&["parked", "reissue", &big_id], 2, "reissue needs a reason");
    bad(
        &["parked", "list", "--all"],
        2,
        "--all lists a consumer's resolved messages",
    );
    bad(
        &["parked", "retry", &big_id, "--skip-to", "3"],
        2,
        "--skip-to is for a consumer",
    );
    // reissue asks first, after saying what is known of the attempts (no terminal: refused).
    bad(
        &["parked", "reissue", &big_id, "--reason", "shrunk the note"],
        6,
        "broker refused",
    );
    // A consumer that is not configured is a usage error naming the fix.
    bad(
        &["parked", "list", "--consumer", "billing"],
        2,
        "no consumer \"billing\"",
    );
    let (_, l) = run_json(&db, &["parked", "list"]);
    assert_eq!(l["parked"].as_array().unwrap().len(), 3, "nothing changed");

    // retry: claimable again (v2 still behind it); a second retry of it is refused.
    let (code, r) = run_json(&db, &["parked", "retry", &big_id, "--actor", "alice"]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["action"], "retry");
    assert_eq!(r["actor"], "alice");
    bad(
        &["parked", "retry", &big_id, "--actor", "alice"],
        1,
        "is not parked",
    );
    // The relay claims it (only it: v2 waits for v1) and it fails again: parked again.
    let claimed = relay_round(&store, "relay-1", |e| {
        Some(park(
            e,
            ParkKind::PermanentError,
            ErrorClass::Permanent,
            "record_too_large",
        ))
    })
    .await;
    assert_eq!(claimed, vec![b1], "the retried head alone");
    let (code, d) = run_json(
        &db,
        &[
            "parked",
            "discard",
            &big_id,
            "--reason",
            "customer cancelled",
            "--actor",
            "bob",
        ],
    );
    assert_eq!(code, 0, "{d}");
    assert_eq!(d["action"], "discard");
    // Its follower flows now.
    let claimed = relay_round(&store, "relay-1", |e| Some(published(e, 7))).await;
    assert_eq!(claimed, vec![big2.event_id], "v2 after the discard of v1");
    let (code, shown) = run_json(&db, &["parked", "show", &big_id]);
    assert_eq!(code, 0, "{shown}");
    assert!(shown["parked"].is_null(), "no longer parked: {shown}");
    let audit = shown["audit"].as_array().unwrap();
    let actions: Vec<&str> = audit
        .iter()
        .map(|a| a["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, vec!["retry", "discard"]);
    assert_eq!(audit[0]["actor"], "alice");
    assert_eq!(audit[1]["actor"], "bob");
    assert_eq!(audit[1]["reason"], "customer cancelled");
    let human = db.outbox(&db.url(), &[], &["parked", "show", &big_id]);
    let human = String::from_utf8_lossy(&human.stdout);
    assert!(
        human.contains("is no longer parked") && human.contains("customer cancelled"),
        "{human}"
    );
    // The actions on `big` changed nothing of the other aggregates.
    assert_eq!(rows_except(&pool, "big").await, untouched);

    // reissue with --yes: a copy with a new id, the original discarded, audited.
    let late_id = l1.to_string();
    let (code, r) = run_json(
        &db,
        &["parked", "reissue", &late_id, "--reason", "copy", "--yes"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["delivery_uncertain"], true, "{r}");
    let copy = r["new_event_id"].as_str().expect("new id").to_owned();
    let (_, shown) = run_json(&db, &["parked", "show", &late_id]);
    assert_eq!(shown["audit"][0]["action"], "reissue");
    assert_eq!(shown["audit"][0]["new_event_id"], copy.as_str());
    let claimed = relay_round(&store, "relay-1", |e| Some(published(e, 8))).await;
    assert_eq!(
        claimed.iter().map(ToString::to_string).collect::<Vec<_>>(),
        vec![copy],
        "the copy is late's next version"
    );
    // `other` was never touched: still parked, v2 still behind it.
    let (_, l) = run_json(&db, &["parked", "list"]);
    let left: Vec<&str> = l["parked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(left, vec![o1.to_string().as_str()], "{l}");
    let other_rows = rows_except(&pool, "big").await;
    let other_status: Vec<(&str, i32)> = other_rows
        .iter()
        .filter(|(id, _, _)| {
            *id == other1.event_id.as_uuid().simple().to_string()
                || *id == other2.event_id.as_uuid().simple().to_string()
        })
        .map(|(_, s, a)| (s.as_str(), *a))
        .collect();
    assert_eq!(other_status, vec![("parked", 1), ("pending", 0)]);
    db.drop().await;
}

/// A retry of an event whose version is at or below what its aggregate published (here made
/// by hand: v1 published, a second v1 parked) is refused with PostgreSQL's message and exit 1,
/// and the hint to discard it; the discard works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_that_would_deliver_out_of_order_is_refused_on_mariadb() {
    let Some(db) = Db::new("a_retry_that_would_deliver_out_of_order_is_refused_on_mariadb").await
    else {
        return;
    };
    let pool = db.pool().await;
    let store = store(&pool);
    store.migrate().await.expect("migrate");
    let (v1, v2) = (ev("o-1", 1, "order.placed"), ev("o-1", 2, "order.paid"));
    store
        .append_many(&pool, &[v1.clone(), v2.clone()])
        .await
        .expect("append");
    // v1 and v2 published; then v1 is made parked by hand (out of order now).
    for _ in 0..2 {
        relay_round(&store, "relay-1", |e| Some(published(e, 1))).await;
    }
    let n = sqlx::query(
        "UPDATE outbox_events SET status = 'parked', park_kind = 'out_of_order', \
         parked_at = UTC_TIMESTAMP(6), last_error_class = 'permanent', \
         last_error_kind = 'out_of_order', last_error_message = 'v1 after v2' \
         WHERE event_id = ?",
    )
    .bind(v1.event_id.as_uuid())
    .execute(&pool)
    .await
    .expect("park by hand")
    .rows_affected();
    assert_eq!(n, 1);
    let id = v1.event_id.to_string();
    let out = db.outbox(&db.url(), &[], &["parked", "retry", &id]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("retry refused") && stderr.contains("discard it with a reason instead"),
        "{}",
        text(&out)
    );
    let (code, sh) = run_json(&db, &["parked", "show", &id]);
    assert_eq!(code, 0, "{sh}");
    assert_eq!(sh["audit"], serde_json::json!([]), "a refusal is no action");
    let (code, d) = run_json(&db, &["parked", "discard", &id, "--reason", "stale copy"]);
    assert_eq!(code, 0, "{d}");
    let (_, l) = run_json(&db, &["parked", "list"]);
    assert_eq!(l["parked"], serde_json::json!([]), "{l}");
    db.drop().await;
}

/// Two operators retry the same parked event at once, and two discard another at once: one
/// action each lands (exit 0), the other is told the event is not parked any more (exit 1),
/// and the audit trail holds exactly one entry per event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_operator_actions_on_mariadb_land_once() {
    let Some(db) = Db::new("concurrent_operator_actions_on_mariadb_land_once").await else {
        return;
    };
    let pool = db.pool().await;
    let store = store(&pool);
    store.migrate().await.expect("migrate");
    let (a, b) = (ev("a", 1, "order.placed"), ev("b", 1, "order.placed"));
    store
        .append_many(&pool, &[a.clone(), b.clone()])
        .await
        .expect("append");
    relay_round(&store, "relay-1", |e| {
        Some(park(
            e,
            ParkKind::PermanentError,
            ErrorClass::Permanent,
            "invalid_record",
        ))
    })
    .await;
    for (event, args) in [
        (a.event_id, vec!["parked", "retry"]),
        (b.event_id, vec!["parked", "discard", "--reason", "dup"]),
    ] {
        let id = event.to_string();
        let mut args = args.clone();
        args.push(&id);
        let children: Vec<_> = ["alice", "bob"]
            .iter()
            .map(|actor| {
                let mut all = args.clone();
                all.extend(["--actor", actor]);
                db.command(&db.url(), &[], &all)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn")
            })
            .collect();
        let outs: Vec<Output> = children
            .into_iter()
            .map(|c| c.wait_with_output().expect("wait"))
            .collect();
        let codes: Vec<Option<i32>> = outs.iter().map(|o| o.status.code()).collect();
        let mut sorted = codes.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            vec![Some(0), Some(1)],
            "{args:?}: {}\n{}",
            text(&outs[0]),
            text(&outs[1])
        );
        let loser = outs.iter().find(|o| o.status.code() == Some(1)).unwrap();
        assert!(text(loser).contains("is not parked"), "{}", text(loser));
        let (_, sh) = run_json(&db, &["parked", "show", &id]);
        assert_eq!(
            sh["audit"].as_array().map(Vec::len),
            Some(1),
            "one action recorded: {sh}"
        );
    }
    db.drop().await;
}

/// `parked release-claims OWNER` on MySQL: asks first (exit 6 without a terminal), then ends
/// the live lease of the relay that is gone (the aggregate is claimable by another relay at
/// once) and says how many; another owner's claims stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_claims_on_mariadb_ends_a_gone_relays_leases() {
    let Some(db) = Db::new("release_claims_on_mariadb_ends_a_gone_relays_leases").await else {
        return;
    };
    let pool = db.pool().await;
    let store = store(&pool);
    store.migrate().await.expect("migrate");
    let (a, b) = (ev("a", 1, "order.placed"), ev("b", 1, "order.placed"));
    store
        .append_many(&pool, std::slice::from_ref(&a))
        .await
        .expect("append");
    let gone = store
        .claim(&ClaimRequest::new("relay-gone", 10))
        .await
        .expect("claim");
    assert_eq!(gone.records.len(), 1);
    store
        .append_many(&pool, std::slice::from_ref(&b))
        .await
        .expect("append");
    let alive = store
        .claim(&ClaimRequest::new("relay-alive", 10))
        .await
        .expect("claim");
    assert_eq!(alive.records.len(), 1, "b");
    let out = db.outbox(&db.url(), &[], &["parked", "release-claims", "relay-gone"]);
    assert_eq!(out.status.code(), Some(6), "{}", text(&out));
    let (code, r) = run_json(
        &db,
        &[
            "parked",
            "release-claims",
            "relay-gone",
            "--yes",
            "--actor",
            "carol",
        ],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["released_aggregates"], 1, "{r}");
    assert_eq!(r["actor"], "carol", "{r}");
    let again = store
        .claim(&ClaimRequest::new("relay-new", 10))
        .await
        .expect("claim");
    let ids: Vec<EventId> = again.records.iter().map(|r| r.envelope.event_id).collect();
    assert_eq!(
        ids,
        vec![a.event_id],
        "a is claimable again, b stays relay-alive's"
    );
    // The release is in a's audit trail; b has none (and is not parked).
    let (code, sh) = run_json(&db, &["parked", "show", &a.event_id.to_string()]);
    assert_eq!(code, 0, "{sh}");
    assert!(sh["parked"].is_null(), "{sh}");
    assert_eq!(sh["audit"][0]["action"], "release_claim", "{sh}");
    assert_eq!(sh["audit"][0]["actor"], "carol", "{sh}");
    let out = db.outbox(&db.url(), &[], &["parked", "show", &b.event_id.to_string()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("has no audit trail"), "{}", text(&out));
    db.drop().await;
}

/// Without the outbox tables `parked` fails as on PostgreSQL (exit 4, `outbox migrate`); an
/// unreachable server exits 3; a consumer whose inbox is not migrated exits 4 naming
/// `outbox migrate --inbox`, for `parked --consumer`, `cleanup --inbox` and in `status`'s row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_on_mariadb_without_tables_or_server_fails_like_on_postgres() {
    let Some(db) =
        Db::new("parked_on_mariadb_without_tables_or_server_fails_like_on_postgres").await
    else {
        return;
    };
    let id = EventId::now_v7().to_string();
    for args in [
        vec!["parked", "list"],
        vec!["parked", "show", &id],
        vec!["parked", "retry", &id],
        vec!["parked", "release-claims", "r", "--yes"],
    ] {
        let out = db.outbox(&db.url(), &[], &args);
        assert_eq!(out.status.code(), Some(4), "{args:?}: {}", text(&out));
        assert!(
            text(&out).contains("outbox schema is missing") && text(&out).contains("outbox_events"),
            "{args:?}: {}",
            text(&out)
        );
    }
    let port = outbox_test_support::free_port();
    let nowhere = format!("mysql://root@127.0.0.1:{port}/test");
    std::fs::write(
        db.dir.join("outbox.toml"),
        "[[consumers]]\nname = \"billing\"\n",
    )
    .unwrap();
    for args in [
        vec!["parked", "list"],
        vec!["parked", "list", "--consumer", "billing"],
        vec!["cleanup", "--inbox"],
    ] {
        let out = db.outbox(&nowhere, &[], &args);
        assert_eq!(out.status.code(), Some(3), "{args:?}: {}", text(&out));
        assert!(
            text(&out).contains("cannot connect to MySQL"),
            "{args:?}: {}",
            text(&out)
        );
    }
    // The outbox migrated, the inbox not.
    store(&db.pool().await).migrate().await.expect("migrate");
    for args in [
        vec!["parked", "list", "--consumer", "billing"],
        vec!["parked", "show", "1", "--consumer", "billing"],
        vec!["parked", "retry", "1", "--consumer", "billing"],
        vec![
            "parked",
            "discard",
            "1",
            "--consumer",
            "billing",
            "--reason",
            "x",
        ],
        vec!["cleanup", "--inbox"],
        vec!["cleanup", "--inbox", "--dry-run"],
    ] {
        let out = db.outbox(&db.url(), &[], &args);
        assert_eq!(out.status.code(), Some(4), "{args:?}: {}", text(&out));
        assert!(
            text(&out).contains("outbox migrate --inbox"),
            "{args:?}: {}",
            text(&out)
        );
    }
    let (code, st) = run_json(&db, &["status"]);
    assert_eq!(code, 0, "{st}");
    let c = &st["consumers"][0];
    assert_eq!(c["name"], "billing", "{st}");
    assert!(c["parked"].is_null(), "{st}");
    assert!(
        c["parked_error"]
            .as_str()
            .unwrap_or_default()
            .contains("outbox migrate --inbox"),
        "{st}"
    );
    assert!(
        c["inbox_error"]
            .as_str()
            .unwrap_or_default()
            .contains("processed_events"),
        "{st}"
    );
    db.drop().await;
}

/// The MySQL side of the shared consumer scenarios: consumer `billing`'s inbox in the test's
/// database (the URL's; `inbox_schema` left at its default).
struct MyInbox<'a> {
    db: &'a Db,
    pool: MySqlPool,
    inbox: MySqlInboxStore,
}

impl<'a> MyInbox<'a> {
    /// Migrates the outbox and the inbox and configures consumer `billing`.
    async fn new(db: &'a Db) -> Self {
        let pool = db.pool().await;
        store(&pool).migrate().await.expect("migrate the outbox");
        let inbox = MySqlInboxStore::builder(pool.clone())
            .build()
            .expect("inbox");
        inbox.migrate().await.expect("migrate the inbox");
        let side = Self { db, pool, inbox };
        side.write_config(&[("billing", "14d")]);
        side
    }

    fn write_config(&self, consumers: &[(&str, &str)]) {
        let path = self.db.dir.join("outbox.toml");
        if consumers.is_empty() {
            let _ = std::fs::remove_file(path);
            return;
        }
        let toml: String = consumers
            .iter()
            .map(|(name, retention)| {
                format!("[[consumers]]\nname = \"{name}\"\ndedup_retention = \"{retention}\"\n")
            })
            .collect();
        std::fs::write(path, toml).unwrap();
    }
}

#[outbox_core::async_trait]
impl InboxSide for MyInbox<'_> {
    type Inbox = MySqlInboxStore;

    fn command(&self, args: &[&str]) -> std::process::Command {
        self.db.command(&self.db.url(), &[], args)
    }

    fn inbox(&self) -> &Self::Inbox {
        &self.inbox
    }

    async fn registered(&self, consumer: &str, event: EventId) -> i64 {
        sqlx::query_scalar(
            "SELECT COUNT(*) FROM processed_events WHERE consumer = ? AND event_id = ?",
        )
        .bind(consumer)
        .bind(event.as_uuid())
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    async fn applied_version(&self, consumer: &str, aggregate_id: &str) -> Option<i64> {
        sqlx::query_scalar::<_, Option<i64>>(
            "SELECT applied_version FROM processed_events_aggregates \
             WHERE consumer = ? AND aggregate_type = 'order' AND aggregate_id = ?",
        )
        .bind(consumer)
        .bind(aggregate_id)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
        .flatten()
    }

    async fn insert_registrations(&self, consumer: &str, n: usize, days: i64) {
        for _ in 0..n {
            sqlx::query(
                "INSERT INTO processed_events (consumer, event_id, processed_at) \
                 VALUES (?, ?, UTC_TIMESTAMP(6) - INTERVAL ? DAY)",
            )
            .bind(consumer)
            .bind(uuid::Uuid::new_v4())
            .bind(days)
            .execute(&self.pool)
            .await
            .unwrap();
        }
    }

    async fn registrations(&self, consumer: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM processed_events WHERE consumer = ?")
            .bind(consumer)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumers_parked_messages_on_mariadb_are_listed_shown_discarded_and_counted() {
    let Some(db) = Db::new("consumer_parked_on_mariadb").await else {
        return;
    };
    let side = MyInbox::new(&db).await;
    consumer_ops::parked_messages_are_listed_shown_discarded_and_counted(&side).await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumers_parked_message_on_mariadb_shows_its_transports_position() {
    let Some(db) = Db::new("consumer_parked_native_on_mariadb").await else {
        return;
    };
    let side = MyInbox::new(&db).await;
    consumer_ops::parked_messages_show_their_transports_position(&side).await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_discard_on_mariadb_skips_versions_only_when_told_how_far() {
    let Some(db) = Db::new("consumer_skip_to_on_mariadb").await else {
        return;
    };
    let side = MyInbox::new(&db).await;
    consumer_ops::a_discard_skips_versions_only_when_told_how_far(&side).await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_discard_on_mariadb_never_skips_unseen_versions() {
    let Some(db) = Db::new("consumer_no_skip_on_mariadb").await else {
        return;
    };
    let side = MyInbox::new(&db).await;
    consumer_ops::a_discard_never_skips_unseen_versions(&side).await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_consumer_actions_on_mariadb_land_once() {
    let Some(db) = Db::new("concurrent_consumer_actions_on_mariadb").await else {
        return;
    };
    let side = MyInbox::new(&db).await;
    consumer_ops::concurrent_consumer_actions_land_once(&side).await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_inbox_on_mariadb_removes_registrations_past_the_dedup_window() {
    let Some(db) = Db::new("cleanup_inbox_on_mariadb").await else {
        return;
    };
    let side = MyInbox::new(&db).await;
    consumer_ops::cleanup_inbox_removes_registrations_past_the_dedup_window(&side, |c| {
        side.write_config(c)
    })
    .await;
    db.drop().await;
}

/// The consumer's handler in the retry test: records what it applied, in the effect's
/// transaction on MariaDB.
struct Recorder;

#[outbox_core::async_trait]
impl outbox_inbox::Handler<sqlx::Transaction<'static, sqlx::MySql>> for Recorder {
    async fn handle(
        &self,
        tx: &mut sqlx::Transaction<'static, sqlx::MySql>,
        e: &Envelope,
    ) -> Result<(), outbox_inbox::HandlerError> {
        sqlx::query("INSERT INTO applied (aggregate_id, version) VALUES (?, ?)")
            .bind(&e.aggregate_id)
            .bind(e.aggregate_version)
            .execute(&mut **tx)
            .await
            .map_err(|err| outbox_inbox::HandlerError::transient(err.to_string()))?;
        Ok(())
    }
}

/// `parked retry --consumer` on a MySQL inbox records the request; the consumer service's
/// engine (here over the in-memory log, with a handler writing to MariaDB) performs it with
/// its handler, in order; then as on PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_retry_on_mariadb_is_requested_and_performed_by_the_consumer_engine() {
    let Some(db) = Db::new("consumer_retry_on_mariadb").await else {
        return;
    };
    let side = MyInbox::new(&db).await;
    sqlx::query(
        "CREATE TABLE applied (n BIGINT AUTO_INCREMENT PRIMARY KEY, aggregate_id TEXT, \
         version BIGINT)",
    )
    .execute(&side.pool)
    .await
    .unwrap();
    let (id1, id2, _) = consumer_ops::retry_is_requested(&side).await;
    let applied = || async {
        sqlx::query_as::<_, (String, i64)>("SELECT aggregate_id, version FROM applied ORDER BY n")
            .fetch_all(&side.pool)
            .await
            .unwrap()
    };
    assert_eq!(
        applied().await,
        vec![],
        "a request applies nothing by itself"
    );
    let log = outbox_testkit::MemoryLog::new("orders", 1);
    let processor = outbox_inbox::InboxProcessor::new("billing", side.inbox.clone(), Recorder);
    let mut engine = outbox_inbox::ConsumerEngine::new(
        log.consumer("billing", &["orders"]),
        processor,
        outbox_inbox::EngineConfig::default(),
        7,
    )
    .unwrap();
    let report = engine
        .run_until_quiet(Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(report.requested_retries, 1, "{report:?}");
    assert_eq!(
        applied().await,
        vec![("o-9".to_owned(), 1), ("o-9".to_owned(), 2)]
    );
    consumer_ops::retry_was_performed(&side, id1, id2).await;
    db.drop().await;
}

/// `status` on MySQL reads each consumer's inbox as on PostgreSQL: its registrations and the
/// last one's time, no lag without a broker (said so), the parked counts; a consumer whose
/// inbox is in another MySQL database (`database_url`) is read there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_on_mariadb_reads_the_consumers_inboxes() {
    let Some(db) = Db::new("status_on_mariadb_reads_the_consumers_inboxes").await else {
        return;
    };
    let side = MyInbox::new(&db).await;
    side.insert_registrations("billing", 2, 1).await;
    side.insert_registrations("shipping", 5, 1).await;
    // shipping's inbox: another database on the same server, its own URL.
    let Some(other) = Db::new("status_on_mariadb_reads_the_consumers_inboxes_2").await else {
        return;
    };
    let other_pool = other.pool().await;
    let other_inbox = MySqlInboxStore::builder(other_pool.clone())
        .build()
        .expect("inbox");
    other_inbox.migrate().await.expect("migrate");
    sqlx::query(
        "INSERT INTO processed_events (consumer, event_id, processed_at) \
         VALUES ('shipping', ?, UTC_TIMESTAMP(6))",
    )
    .bind(uuid::Uuid::new_v4())
    .execute(&other_pool)
    .await
    .unwrap();
    std::fs::write(
        db.dir.join("outbox.toml"),
        format!(
            "[[consumers]]\nname = \"billing\"\n\
             [[consumers]]\nname = \"shipping\"\ndatabase_url = \"{}\"\n",
            other.url()
        ),
    )
    .unwrap();
    let (code, st) = run_json(&db, &["status"]);
    assert_eq!(code, 0, "{st}");
    let consumers = st["consumers"].as_array().unwrap();
    assert_eq!(consumers.len(), 2, "{st}");
    let billing = &consumers[0];
    assert_eq!(billing["name"], "billing");
    assert_eq!(billing["inbox_registrations"], 2, "{st}");
    assert!(billing["last_applied_at"].as_str().is_some(), "{st}");
    assert!(billing["lag"].is_null(), "{st}");
    assert_eq!(billing["lag_error"], "not read (no broker)", "{st}");
    assert_eq!(billing["parked"], 0, "{st}");
    assert_eq!(billing["waiting"], 0, "{st}");
    assert!(billing["inbox_error"].is_null(), "{st}");
    let shipping = &consumers[1];
    assert_eq!(
        shipping["inbox_registrations"], 1,
        "read in its own database, not the outbox's 5: {st}"
    );
    assert!(
        !st["warnings"].to_string().contains("not read for a MySQL"),
        "{st}"
    );
    let human = db.outbox(&db.url(), &[], &["status"]);
    assert!(human.status.success(), "{}", text(&human));
    let human = String::from_utf8_lossy(&human.stdout);
    assert!(
        human.contains("billing") && human.contains("shipping") && human.contains("0 (+0 waiting)"),
        "{human}"
    );
    other.drop().await;
    db.drop().await;
}

/// `reconcile` on MySQL compares the consumers' effects as on PostgreSQL: three events
/// published, `billing` registered one of them: a mismatch (exit 1) naming the consumer and
/// the counts; once it parked the second and registered the third, the interval reconciles
/// (exit 0) with the parked one shown, not counted as missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_on_mariadb_compares_the_consumers_effects() {
    let Some(db) = Db::new("reconcile_on_mariadb_compares_the_consumers_effects").await else {
        return;
    };
    let side = MyInbox::new(&db).await;
    let store = store(&side.pool);
    let events = [
        ev("a", 1, "order.created"),
        ev("b", 1, "order.created"),
        ev("c", 1, "order.created"),
    ];
    store
        .append_many(&side.pool, &events)
        .await
        .expect("append");
    let claimed = relay_round(&store, "relay-1", |e| Some(published(e, 1))).await;
    assert_eq!(claimed.len(), 3);
    let register = |e: &Envelope| {
        sqlx::query(
            "INSERT INTO processed_events (consumer, event_id, processed_at) \
             VALUES ('billing', ?, UTC_TIMESTAMP(6))",
        )
        .bind(e.event_id.as_uuid())
        .execute(&side.pool)
    };
    register(&events[0]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let grace = [("OUTBOX_RECONCILE__GRACE", "10ms")];
    let args = ["--json", "reconcile", "--since", "1h", "--interval", "1h"];
    let out = db.outbox(&db.url(), &grace, &args);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let doc = json(&out);
    let row = &doc["rows"][0];
    assert_eq!(row["published"], 3, "{doc:#}");
    assert_eq!(
        row["effects"],
        serde_json::json!([{"consumer": "billing", "expected": 3, "applied": 1, "parked": 0, "within_grace": 0, "within_grace_applied": 0}]),
        "{doc:#}"
    );
    assert!(
        row["mismatches"]
            .to_string()
            .contains("consumer billing applied 1 of 3 published event(s)"),
        "{doc:#}"
    );

    common::park_consumer_message(
        &side.inbox,
        "billing",
        "orders",
        1,
        &events[1],
        outbox_core::ParkAs::Head(ParkKind::Unprocessable),
        "unknown customer",
    )
    .await;
    register(&events[2]).await.unwrap();
    let out = db.outbox(&db.url(), &grace, &args);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let doc = json(&out);
    assert_eq!(doc["ok"], true, "{doc:#}");
    assert_eq!(
        doc["rows"][0]["effects"],
        serde_json::json!([{"consumer": "billing", "expected": 3, "applied": 2, "parked": 1, "within_grace": 0, "within_grace_applied": 0}]),
        "{doc:#}"
    );
    db.drop().await;
}

/// `status` on MySQL reads a consumer's lag from its group's committed offsets, as on
/// PostgreSQL (`status_reports_consumer_lag_from_committed_offsets_and_inbox_counts`): four
/// records in the topic, the group committed offset 2: lag 2, committed 2 on partition 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_on_mariadb_reports_consumer_lag_from_committed_offsets() {
    use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let test = "status_on_mariadb_reports_consumer_lag_from_committed_offsets";
    let Some(brokers) = outbox_test_support::brokers(test) else {
        return;
    };
    let Some(db) = Db::new(test).await else {
        return;
    };
    let side = MyInbox::new(&db).await;
    side.insert_registrations("billing", 2, 0).await;
    let topic = outbox_test_support::unique("lag").replace('_', "-");
    common::create_topic(&brokers, &topic, 1, &[]).await;
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    for i in 0..4 {
        producer
            .send(
                FutureRecord::to(&topic).key("k").payload(&format!("{i}")),
                Duration::from_secs(10),
            )
            .await
            .expect("produce");
    }
    let group = format!("g-{topic}");
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition_offset(&topic, 0, rdkafka::Offset::Offset(2))
        .unwrap();
    consumer.commit(&tpl, CommitMode::Sync).unwrap();
    drop(consumer);
    std::fs::write(
        db.dir.join("outbox.toml"),
        format!("[[consumers]]\nname = \"billing\"\ngroup = \"{group}\"\ntopics = [\"{topic}\"]\n"),
    )
    .unwrap();
    let out = db.outbox(
        &db.url(),
        &[("KAFKA_BROKERS", brokers.as_str())],
        &["--json", "status"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let v = json(&out);
    let c = &v["consumers"][0];
    assert_eq!(c["name"], "billing", "{v}");
    assert_eq!(c["group"], group.as_str(), "{v}");
    assert_eq!(c["inbox_registrations"], 2, "{v}");
    assert_eq!(c["partitions"][0]["committed"], 2, "{v}");
    assert_eq!(c["lag"], 2, "{v}");
    assert!(c["lag_error"].is_null(), "{v}");
    assert_eq!(c["parked"], 0, "{v}");
    let human = db.outbox(
        &db.url(),
        &[("KAFKA_BROKERS", brokers.as_str())],
        &["status"],
    );
    assert!(
        String::from_utf8_lossy(&human.stdout).contains(&group),
        "{}",
        text(&human)
    );
    db.drop().await;
}

/// A MariaDB user that may read the outbox but not change it: a retry or discard fails with
/// exit 4 "permission denied", as a missing privilege does on PostgreSQL (before: exit 1, as if
/// the store had refused the action), and changes nothing; reading works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_user_without_write_privileges_is_told_so() {
    let Some(db) = Db::new("a_mariadb_user_without_write_privileges_is_told_so").await else {
        return;
    };
    let pool = db.pool().await;
    let store = store(&pool);
    store.migrate().await.expect("migrate");
    let e = ev("a", 1, "order.placed");
    store
        .append_many(&pool, std::slice::from_ref(&e))
        .await
        .expect("append");
    relay_round(&store, "relay-1", |e| {
        Some(park(
            e,
            ParkKind::PermanentError,
            ErrorClass::Permanent,
            "invalid_record",
        ))
    })
    .await;
    // A user of this test only, dropped at the end.
    let user = format!("ro_{}", &db.name[db.name.len().saturating_sub(20)..]);
    for sql in [
        format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'pw-{user}'"),
        format!("GRANT SELECT ON `{}`.* TO '{user}'@'%'", db.name),
    ] {
        sqlx::query(&sql).execute(&db.admin).await.expect(&sql);
    }
    let url = db.url().replacen("root@", &format!("{user}:pw-{user}@"), 1);
    assert_ne!(url, db.url(), "MYSQL_URL names root: {}", db.url());
    let id = e.event_id.to_string();
    let out = db.outbox(&url, &[], &["--json", "parked", "list"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(json(&out)["parked"].as_array().map(Vec::len), Some(1));
    let outs: Vec<(Vec<&str>, Output)> = [
        vec!["parked", "retry", &id],
        vec!["parked", "discard", &id, "--reason", "x"],
    ]
    .into_iter()
    .map(|args| {
        let out = db.outbox(&url, &[], &args);
        (args, out)
    })
    .collect();
    // Dropped before any assertion, so that a failure leaves no user behind.
    sqlx::query(&format!("DROP USER '{user}'@'%'"))
        .execute(&db.admin)
        .await
        .expect("drop user");
    for (args, out) in outs {
        assert_eq!(out.status.code(), Some(4), "{args:?}: {}", text(&out));
        assert!(
            text(&out).contains("permission denied") && !text(&out).contains(&format!("pw-{user}")),
            "{args:?}: {}",
            text(&out)
        );
    }
    let (_, l) = run_json(&db, &["parked", "list"]);
    assert_eq!(l["parked"].as_array().map(Vec::len), Some(1), "unchanged");
    db.drop().await;
}

/// Registrations of exactly `consumer` (a binary comparison: `=` on MariaDB's `utf8mb4_bin`
/// ignores trailing spaces).
async fn registrations_exactly(pool: &MySqlPool, consumer: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM processed_events WHERE BINARY consumer = BINARY ?")
        .bind(consumer)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Adversary: two consumers whose names differ only by a trailing space, `billing` and
/// `billing ` (distinct consumers on PostgreSQL). MariaDB's `utf8mb4_bin` is a PAD SPACE
/// collation, so `consumer = 'billing '` matched `billing`'s rows: `parked list --consumer
/// 'billing '` listed `billing`'s parked message (and a discard by its id would have
/// resolved it), and `cleanup --inbox` removed `billing`'s registrations with `billing `'s
/// shorter window (duplicate effects for `billing` on redelivery). A consumer name the store
/// cannot tell apart is now refused on MySQL (exit 2) before anything is read or changed.
/// Failed before the fix: the list showed `billing`'s message and cleanup removed its three
/// registrations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_named_with_a_trailing_space_never_acts_on_another_consumer() {
    let Some(db) = Db::new("consumer_trailing_space_on_mariadb").await else {
        return;
    };
    let side = MyInbox::new(&db).await;
    side.insert_registrations("billing", 3, 5).await;
    let e = ev("o-1", 1, "order.placed");
    common::park_consumer_message(
        side.inbox(),
        "billing",
        "orders",
        0,
        &e,
        outbox_core::ParkAs::Head(ParkKind::Unprocessable),
        "x",
    )
    .await;
    side.write_config(&[("billing", "30d"), ("billing ", "1d")]);

    let out = side.run(&["--json", "parked", "list", "--consumer", "billing "]);
    let listed_others = out.status.code() == Some(0)
        && json(&out)["parked"]
            .as_array()
            .is_some_and(|a| !a.is_empty());
    assert!(
        !listed_others,
        "'billing ' listed billing's parked message: {}",
        text(&out)
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("trailing space"), "{}", text(&out));

    let out = side.run(&["cleanup", "--inbox"]);
    assert_eq!(
        registrations_exactly(&side.pool, "billing").await,
        3,
        "cleanup for 'billing ' (1d) must not remove billing's registrations (30d): {}",
        text(&out)
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));

    // Without the look-alike, billing's own actions are unaffected.
    side.write_config(&[("billing", "30d")]);
    let (code, l, stderr) = side.json(&["parked", "list", "--consumer", "billing"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(l["parked"].as_array().map(Vec::len), Some(1), "{l}");
    db.drop().await;
}

/// Adversary: `parked release-claims 'relay-1 '` (a trailing space, another owner on
/// PostgreSQL) ended the live leases of `relay-1`: MariaDB compared `lease_owner` in the PAD
/// SPACE collation `utf8mb4_bin`. Then another relay could claim `relay-1`'s aggregate while
/// `relay-1` still publishes it. Owners are now compared byte for byte. Failed before the fix
/// (`released_aggregates` 1, the aggregate claimable by another relay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_claims_on_mariadb_matches_the_owner_exactly() {
    let Some(db) = Db::new("release_claims_owner_exactly").await else {
        return;
    };
    let pool = db.pool().await;
    let store = store(&pool);
    store.migrate().await.expect("migrate");
    let a = ev("a", 1, "order.placed");
    store
        .append_many(&pool, std::slice::from_ref(&a))
        .await
        .expect("append");
    let held = store
        .claim(&ClaimRequest::new("relay-1", 10))
        .await
        .expect("claim");
    assert_eq!(held.records.len(), 1);
    for other in ["relay-1 ", "relay-1  "] {
        let (code, r) = run_json(&db, &["parked", "release-claims", other, "--yes"]);
        assert_eq!(code, 0, "{r}");
        assert_eq!(r["released_aggregates"], 0, "{other:?} is not relay-1: {r}");
    }
    let stolen = store
        .claim(&ClaimRequest::new("relay-2", 10))
        .await
        .expect("claim");
    assert!(
        stolen.is_empty(),
        "relay-1's lease stays: {:?}",
        stolen.records.len()
    );
    // The owner itself still releases.
    let (code, r) = run_json(&db, &["parked", "release-claims", "relay-1", "--yes"]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["released_aggregates"], 1, "{r}");
    db.drop().await;
}

/// Adversary: aggregates whose ids differ only by case or a trailing space (`a`, `A`, `a `:
/// equal or not under MariaDB's collations, three aggregates on PostgreSQL). Each has v1
/// parked and v2 blocked behind it; a discard of `a` v1 releases `a` v2 only, a retry of `A`
/// v1 makes `A` v1 claimable only, and `a ` stays parked and blocked throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_actions_on_mariadb_change_only_their_own_look_alike_aggregate() {
    let Some(db) = Db::new("look_alike_aggregates_on_mariadb").await else {
        return;
    };
    let pool = db.pool().await;
    let store = store(&pool);
    store.migrate().await.expect("migrate");
    let ids = ["a", "A", "a "];
    let v1: Vec<Envelope> = ids.iter().map(|id| ev(id, 1, "order.placed")).collect();
    let v2: Vec<Envelope> = ids.iter().map(|id| ev(id, 2, "order.paid")).collect();
    store
        .append_many(&pool, &[v1.clone(), v2.clone()].concat())
        .await
        .expect("append");
    let claimed = relay_round(&store, "relay-1", |e| {
        Some(park(
            e,
            ParkKind::PermanentError,
            ErrorClass::Permanent,
            "invalid_record",
        ))
    })
    .await;
    let mut want: Vec<EventId> = v1.iter().map(|e| e.event_id).collect();
    let mut got = claimed.clone();
    want.sort();
    got.sort();
    assert_eq!(got, want, "the three heads, each its own aggregate");

    let (code, r) = run_json(
        &db,
        &[
            "parked",
            "discard",
            &v1[0].event_id.to_string(),
            "--reason",
            "x",
            "--yes",
        ],
    );
    assert_eq!(code, 0, "{r}");
    let claimed = relay_round(&store, "relay-1", |e| Some(published(e, 1))).await;
    assert_eq!(claimed, vec![v2[0].event_id], "a v2 alone is released");

    let (code, r) = run_json(&db, &["parked", "retry", &v1[1].event_id.to_string()]);
    assert_eq!(code, 0, "{r}");
    let claimed = relay_round(&store, "relay-1", |e| Some(published(e, 2))).await;
    assert_eq!(claimed, vec![v1[1].event_id], "A v1 alone is claimable");
    let claimed = relay_round(&store, "relay-1", |e| Some(published(e, 3))).await;
    assert_eq!(claimed, vec![v2[1].event_id], "then A v2");

    let (code, l) = run_json(&db, &["parked", "list"]);
    assert_eq!(code, 0, "{l}");
    let parked: Vec<&str> = l["parked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        parked,
        vec![v1[2].event_id.to_string()],
        "'a ' v1 stays parked"
    );
    assert!(
        relay_round(&store, "relay-1", |e| Some(published(e, 4)))
            .await
            .is_empty(),
        "'a ' v2 stays behind its parked head"
    );
    db.drop().await;
}
