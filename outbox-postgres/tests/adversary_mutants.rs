//! Adversarial tests found by `scripts/mutants-sql` (docs/mutants-sql.md): each one kills a SQL
//! mutant that survived every other suite, so each names the statement and the mutated text
//! it guards. They attack the store through its public API on the real PostgreSQL; where an
//! interleaving matters it is forced by holding a transaction open and waiting (through
//! `pg_blocking_pids`) until the other side is blocked behind it.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use outbox_core::prelude::*;
use std::time::Duration;

use outbox_core::{ClaimMode, ClaimRequest, Envelope, ErrorClass, LastError, Outcome, ParkKind};
use outbox_postgres::PostgresOutboxStore;
use sqlx::PgPool;

use common::stand_in::{colliding_store, stand_in_store};
use common::{claim, claimed, lease, park, publish_all, published};

fn modes() -> [ClaimMode; 2] {
    [lease(30.0), ClaimMode::LockedTransaction]
}

fn ev(agg_type: &str, agg_id: &str, version: i64) -> Envelope {
    Envelope::builder(agg_type, agg_id, version, "thing.changed")
        .json(&serde_json::json!({ "v": version }))
        .unwrap()
        .build()
        .unwrap()
}

/// The `last_version` of each aggregate with state, sorted by (type, id).
async fn last_versions(pool: &PgPool, schema: &str) -> Vec<(String, String, Option<i64>)> {
    sqlx::query_as(&format!(
        "SELECT aggregate_type, aggregate_id, last_version \
         FROM \"{schema}\".outbox_events_aggregate ORDER BY 1, 2"
    ))
    .fetch_all(pool)
    .await
    .unwrap()
}

/// One completion that publishes the heads of two aggregates with the same id and different
/// types advances each aggregate's last version to its own head, and the next version of each
/// is claimed next. Kills `complete_lease`'s ` AND ` → ` OR ` between the aggregate's type and
/// id in the lease release (`rel`): `key AND type OR id AND token` matches the other
/// aggregate's state row too (same id, same claim token), and an `UPDATE .. FROM` that joins a
/// target row twice applies one arbitrary joined row: one aggregate got the other's version
/// (its next version then parked as out of order, or held as a gap).
#[tokio::test]
async fn one_completion_of_two_aggregates_sharing_an_id_advances_each_its_own_last_version() {
    let ctx = ctx!(4);
    for (n, mode) in modes().into_iter().enumerate() {
        let store = ctx.store(mode).await;
        let id = format!("shared-{n}");
        // `order` is one version ahead of `invoice`, so that either's version in the other's
        // state row is wrong.
        let o1 = ev("order", &id, 1);
        store.append(&ctx.pool, &o1).await.unwrap();
        publish_all(&store, &claim(&store, "r", 100).await).await;
        let (i1, o2) = (ev("invoice", &id, 1), ev("order", &id, 2));
        store
            .append_many(&ctx.pool, &[i1.clone(), o2.clone()])
            .await
            .unwrap();
        let b = claim(&store, "r", 100).await;
        assert_eq!(
            claimed(&b),
            vec![
                ("invoice".into(), id.clone(), 1),
                ("order".into(), id.clone(), 2)
            ],
            "{mode:?}"
        );
        publish_all(&store, &b).await;
        let lasts: Vec<_> = last_versions(&ctx.pool, &ctx.schema)
            .await
            .into_iter()
            .filter(|(_, i, _)| *i == id)
            .map(|(t, _, l)| (t, l))
            .collect();
        assert_eq!(
            lasts,
            vec![("invoice".into(), Some(1)), ("order".into(), Some(2))],
            "{mode:?}: each aggregate's last version is its own"
        );
        let (i2, o3) = (ev("invoice", &id, 2), ev("order", &id, 3));
        store.append_many(&ctx.pool, &[i2, o3]).await.unwrap();
        let next = claim(&store, "r", 100).await;
        assert!(next.parked.is_empty(), "{mode:?}: {:?}", next.parked);
        assert_eq!(
            claimed(&next),
            vec![
                ("invoice".into(), id.clone(), 2),
                ("order".into(), id.clone(), 3)
            ],
            "{mode:?}"
        );
        publish_all(&store, &next).await;
    }
    ctx.drop().await;
}

/// A claimed head that no longer decodes (a row written by other means with a blank content
/// type) is parked as an invalid record and its aggregate's lease is released at once: after
/// an operator discards it, the next version is claimed right away, not when the lease would
/// have expired. Kills `park_undecodable`'s `aggregate_key = ANY($4)` → `<> ANY($4)` in the
/// lease release (with one parked row, `<> ANY` of its own key is false: the lease stayed).
#[tokio::test]
async fn an_undecodable_head_is_parked_and_its_lease_released_at_once() {
    let ctx = ctx!(4);
    for (n, mode) in modes().into_iter().enumerate() {
        let store = ctx.store(mode).await;
        let id = format!("undecodable-{n}");
        let (v1, v2) = (ev("order", &id, 1), ev("order", &id, 2));
        sqlx::query(&format!(
            "INSERT INTO \"{}\".outbox_events (event_id, aggregate_type, aggregate_id, \
               aggregate_version, event_type, schema_version, content_type, payload, created_at) \
             VALUES ($1, $2, $3, 1, $4, 1, ' ', $5, now())",
            ctx.schema
        ))
        .bind(v1.event_id.as_uuid())
        .bind(&v1.aggregate_type)
        .bind(&v1.aggregate_id)
        .bind(&v1.event_type)
        .bind(&v1.payload.bytes)
        .execute(&ctx.pool)
        .await
        .unwrap();
        store.append(&ctx.pool, &v2).await.unwrap();
        let b = claim(&store, "r", 100).await;
        assert!(b.records.is_empty(), "{mode:?}: {:?}", claimed(&b));
        let (status, kind): (String, Option<String>) = sqlx::query_as(&format!(
            "SELECT status, last_error_kind FROM \"{}\".outbox_events WHERE event_id = $1",
            ctx.schema
        ))
        .bind(v1.event_id.as_uuid())
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(
            (status.as_str(), kind.as_deref()),
            ("parked", Some("invalid_record")),
            "{mode:?}"
        );
        store
            .discard_parked(v1.event_id, "ops", "written by hand")
            .await
            .unwrap();
        let next = claim(&store, "r", 100).await;
        assert_eq!(
            claimed(&next),
            vec![("order".into(), id.clone(), 2)],
            "{mode:?}: the parked head's lease must not hold its aggregate"
        );
        publish_all(&store, &next).await;
    }
    ctx.drop().await;
}

async fn message_of(ctx: &common::Ctx, e: &Envelope) -> (String, String) {
    sqlx::query_as(&format!(
        "SELECT status, last_error_message FROM \"{}\".outbox_events WHERE event_id = $1",
        ctx.schema
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// A version parked as out of order says what it was measured against, in both claim modes:
/// the last version published or discarded when the aggregate has one, else (with
/// `accept_first_version`) the first version, one that may have reached the broker. Kills
/// `(a.last_version IS NOT NULL) AS known` → `IS NULL` and the `h.last + 1` → `+ 0`/`+ 2` of
/// the first-version message, in `claim_decide_lease` and `claim_decide_locked`: the operator
/// reads this message to decide what to do with the event.
#[tokio::test]
async fn a_stale_version_says_what_it_is_below() {
    let ctx = ctx!(4);
    for (n, mode) in modes().into_iter().enumerate() {
        // Known: version 1 published, a duplicate of it appended afterwards.
        let store = ctx.store(mode).await;
        let id = format!("known-{n}");
        store.append(&ctx.pool, &ev("order", &id, 1)).await.unwrap();
        publish_all(&store, &claim(&store, "r", 100).await).await;
        let twin = ev("order", &id, 1);
        store.append(&ctx.pool, &twin).await.unwrap();
        assert_eq!(claim(&store, "r", 100).await.parked.len(), 1, "{mode:?}");
        assert_eq!(
            message_of(&ctx, &twin).await,
            (
                "parked".into(),
                "version 1 is at or below 1, the last version published or discarded for its \
                 aggregate"
                    .into()
            ),
            "{mode:?}"
        );

        // Unknown: version 2 went out first and may be at the broker (a timeout), then
        // version 1 arrives.
        let first = PostgresOutboxStore::builder(ctx.pool.clone())
            .schema(&ctx.schema)
            .claim_mode(mode)
            .accept_first_version(true)
            .build()
            .unwrap();
        let id = format!("first-{n}");
        let v2 = ev("order", &id, 2);
        first.append(&ctx.pool, &v2).await.unwrap();
        let b = claim(&first, "r", 100).await;
        assert_eq!(
            claimed(&b),
            vec![("order".into(), id.clone(), 2)],
            "{mode:?}"
        );
        let timeout = Outcome::Retry {
            event_id: v2.event_id,
            delay: Duration::ZERO,
            error: LastError {
                class: ErrorClass::Transient,
                kind: "timeout".into(),
                message: "no acknowledgement".into(),
            },
        };
        assert_eq!(
            first.complete(&b.handle, &[timeout]).await.unwrap().applied,
            1
        );
        let v1 = ev("order", &id, 1);
        first.append(&ctx.pool, &v1).await.unwrap();
        let b = claim(&first, "r", 100).await;
        assert_eq!(
            claimed(&b),
            vec![("order".into(), id.clone(), 2)],
            "{mode:?}"
        );
        assert_eq!(
            message_of(&ctx, &v1).await,
            (
                "parked".into(),
                "version 1 is below 2, the first version of its aggregate (nothing of it \
                 published or discarded yet), which may have reached the broker already"
                    .into()
            ),
            "{mode:?}"
        );
        publish_all(&first, &b).await;
    }
    ctx.drop().await;
}

/// An event is due when its `next_attempt_at` is at or before the claim transaction's time
/// (`now()`), equal included: a deferred event whose delay ends at exactly the microsecond the
/// claim's transaction starts is claimed, and one due a moment later is not. The claim runs on
/// sessions where `now()` stands in for that coincidence: it returns the first event's
/// `next_attempt_at` (as a transaction that started at that instant would see it). Kills
/// `next_attempt_at <= now()` → `<` in the claim's step 1 (`claim_candidates`) and step 2 (`due`
/// in `claim_decide_lease` and `claim_decide_locked`): with `<` the event due now waits.
#[tokio::test]
async fn an_event_due_at_the_claims_own_time_is_claimed() {
    let ctx = ctx!(4);
    for (n, mode) in modes().into_iter().enumerate() {
        let store = ctx.store(mode).await;
        let (at, after) = (
            ev("order", &format!("due-at-{n}"), 1),
            ev("order", &format!("due-after-{n}"), 1),
        );
        store
            .append_many(&ctx.pool, &[at.clone(), after.clone()])
            .await
            .unwrap();
        let b = claim(&store, "r", 100).await;
        assert_eq!(b.records.len(), 2, "{mode:?}");
        let defer = |e: &Envelope, secs| Outcome::Defer {
            event_id: e.event_id,
            delay: Duration::from_secs(secs),
            error: LastError {
                class: ErrorClass::Transient,
                kind: "queue_full".into(),
                message: "later".into(),
            },
        };
        let outcomes = [defer(&at, 3600), defer(&after, 7200)];
        assert_eq!(
            store.complete(&b.handle, &outcomes).await.unwrap().applied,
            2
        );
        let s = &ctx.schema;
        let (_pool, at_due) = stand_in_store(
            &ctx,
            mode,
            false,
            &format!(
                "now() RETURNS timestamptz LANGUAGE sql STABLE AS $$ \
                   SELECT next_attempt_at FROM \"{s}\".outbox_events \
                   WHERE event_id = '{}' $$",
                at.event_id.as_uuid()
            ),
        )
        .await;
        let due = claim(&at_due, "r", 100).await;
        assert_eq!(
            claimed(&due),
            vec![("order".into(), format!("due-at-{n}"), 1)],
            "{mode:?}: the event due at the claim's time is claimed, the later one is not"
        );
        publish_all(&at_due, &due).await;
    }
    ctx.drop().await;
}

/// Two aggregates whose keys collide (of one type, then of one id) keep
/// separate orders, last versions, leases, parks and operator actions, in both claim modes.
/// Kills the mutants that drop an aggregate's type or id comparison next to its key (or turn
/// the `AND` before it into `OR`) where only a key collision tells them apart: in the claim's
/// lease probe, state lookup, follower check and promotion, the completion's fencing and
/// release, and the operator's state read and promotion.
#[tokio::test]
async fn aggregates_whose_keys_collide_keep_separate_orders() {
    let ctx = ctx!(4);
    for (n, mode) in modes().into_iter().enumerate() {
        let (pool, store) = colliding_store(&ctx, mode, false).await;
        // The same type (only the ids tell them apart), then the same id (only the types).
        let pairs = [
            (
                ("order", format!("collide-a-{n}")),
                ("order", format!("collide-b-{n}")),
            ),
            (
                ("invoice", format!("collide-x-{n}")),
                ("order", format!("collide-x-{n}")),
            ),
        ];
        for ((ta, ia), (tb, ib)) in pairs {
            let (a, b) = ((ta.to_owned(), ia), (tb.to_owned(), ib));
            let ver = |agg: &(String, String), v: i64| ev(&agg.0, &agg.1, v);
            let (a1, b1, a2, b2) = (ver(&a, 1), ver(&b, 1), ver(&a, 2), ver(&b, 2));
            store
                .append_many(&ctx.pool, &[a1, b1, a2, b2])
                .await
                .unwrap();
            let first = claim(&store, "r", 100).await;
            assert_eq!(
                claimed(&first),
                vec![(a.0.clone(), a.1.clone(), 1), (b.0.clone(), b.1.clone(), 1)],
                "{mode:?}: each aggregate's head"
            );
            publish_all(&store, &first).await;
            let lasts: Vec<_> = last_versions(&ctx.pool, &ctx.schema)
                .await
                .into_iter()
                .filter(|(t, i, _)| (t, i) == (&a.0, &a.1) || (t, i) == (&b.0, &b.1))
                .map(|(t, i, l)| ((t, i), l))
                .collect();
            assert_eq!(
                lasts,
                vec![(a.clone(), Some(1)), (b.clone(), Some(1))],
                "{mode:?}"
            );
            // One aggregate's head claimed alone: in lease mode its lease must not hold the
            // other (in locked mode the two share an advisory lock, by design of the key).
            let only_a = claim(&store, "r", 1).await;
            assert_eq!(
                claimed(&only_a),
                vec![(a.0.clone(), a.1.clone(), 2)],
                "{mode:?}"
            );
            if matches!(mode, ClaimMode::Lease { .. }) {
                let then_b = claim(&store, "r2", 100).await;
                assert_eq!(
                    claimed(&then_b),
                    vec![(b.0.clone(), b.1.clone(), 2)],
                    "{mode:?}: a's lease does not hold b"
                );
                publish_all(&store, &then_b).await;
                publish_all(&store, &only_a).await;
            } else {
                publish_all(&store, &only_a).await;
                let then_b = claim(&store, "r2", 100).await;
                assert_eq!(
                    claimed(&then_b),
                    vec![(b.0.clone(), b.1.clone(), 2)],
                    "{mode:?}"
                );
                publish_all(&store, &then_b).await;
            }
            // b's next version parked, a's published; then each aggregate's next version.
            let (a3, b3, a4, b4) = (ver(&a, 3), ver(&b, 3), ver(&a, 4), ver(&b, 4));
            store
                .append_many(&ctx.pool, &[a3.clone(), b3.clone()])
                .await
                .unwrap();
            let third = claim(&store, "r", 100).await;
            assert_eq!(
                claimed(&third),
                vec![(a.0.clone(), a.1.clone(), 3), (b.0.clone(), b.1.clone(), 3)],
                "{mode:?}"
            );
            let rep = store
                .complete(&third.handle, &[published(&a3, 7), park(&b3)])
                .await
                .unwrap();
            assert_eq!(rep.applied, 2, "{mode:?}");
            store
                .append_many(&ctx.pool, &[a4.clone(), b4.clone()])
                .await
                .unwrap();
            let fourth = claim(&store, "r", 100).await;
            assert_eq!(
                claimed(&fourth),
                vec![(a.0.clone(), a.1.clone(), 4)],
                "{mode:?}: b's next version waits behind its parked one, a's does not"
            );
            publish_all(&store, &fourth).await;
            store
                .discard_parked(b3.event_id, "ops", "not needed")
                .await
                .unwrap();
            let fifth = claim(&store, "r", 100).await;
            assert_eq!(
                claimed(&fifth),
                vec![(b.0.clone(), b.1.clone(), 4)],
                "{mode:?}: the discard let b's next version through"
            );
            publish_all(&store, &fifth).await;
            let lasts: Vec<_> = last_versions(&ctx.pool, &ctx.schema)
                .await
                .into_iter()
                .filter(|(t, i, _)| (t, i) == (&a.0, &a.1) || (t, i) == (&b.0, &b.1))
                .map(|(t, i, l)| ((t, i), l))
                .collect();
            assert_eq!(
                lasts,
                vec![(a.clone(), Some(4)), (b.clone(), Some(4))],
                "{mode:?}"
            );
        }
        drop(store);
        pool.close().await;
    }
    ctx.drop().await;
}

/// A retry and a deferral each wait their delay before the event is claimed again, and only
/// the retry counts an attempt, in both claim modes. Kills `complete_locked`'s
/// `o.kind IN ('retry', 'defer')` → `('defer', 'defer')` in `next_attempt_at` (a retried
/// event came straight back in locked mode) and its neighbours.
#[tokio::test]
async fn a_retry_and_a_deferral_wait_their_delay_in_both_modes() {
    let ctx = ctx!(4);
    for (n, mode) in modes().into_iter().enumerate() {
        let store = ctx.store(mode).await;
        for kind in ["retry", "defer"] {
            let e = ev("order", &format!("wait-{kind}-{n}"), 1);
            store.append(&ctx.pool, &e).await.unwrap();
            let b = claim(&store, "r", 100).await;
            assert_eq!(b.records.len(), 1, "{mode:?} {kind}");
            let error = LastError {
                class: ErrorClass::Transient,
                kind: "queue_full".into(),
                message: "later".into(),
            };
            let delay = Duration::from_secs(3600);
            let outcome = if kind == "retry" {
                Outcome::Retry {
                    event_id: e.event_id,
                    delay,
                    error,
                }
            } else {
                Outcome::Defer {
                    event_id: e.event_id,
                    delay,
                    error,
                }
            };
            assert_eq!(
                store.complete(&b.handle, &[outcome]).await.unwrap().applied,
                1
            );
            let again = claim(&store, "r", 100).await;
            assert!(
                again.records.is_empty(),
                "{mode:?} {kind}: claimed again before its delay: {:?}",
                claimed(&again)
            );
            let (wait_s, attempts): (f64, i32) = sqlx::query_as(&format!(
                "SELECT extract(epoch FROM next_attempt_at - clock_timestamp())::float8, \
                        attempts FROM \"{}\".outbox_events WHERE event_id = $1",
                ctx.schema
            ))
            .bind(e.event_id.as_uuid())
            .fetch_one(&ctx.pool)
            .await
            .unwrap();
            assert!(
                (3000.0..=3600.0).contains(&wait_s),
                "{mode:?} {kind}: due in {wait_s} s"
            );
            assert_eq!(attempts, i32::from(kind == "retry"), "{mode:?} {kind}");
        }
    }
    ctx.drop().await;
}

/// With `accept_first_version`, an operator's check of an event whose aggregate has no last
/// version counts from that aggregate's own first version, not from another aggregate whose
/// key collides with it and whose version may have reached the broker. Kills `event_state`'s
/// (first-version variant) ` AND ` → ` OR ` after the key comparison of the first-version rule
/// (`key = k OR status .. AND type .. AND id ..`: every row of the colliding key counted).
#[tokio::test]
async fn an_operator_retry_without_state_ignores_a_colliding_aggregate() {
    let ctx = ctx!(4);
    let (pool, store) = colliding_store(&ctx, lease(30.0), true).await;
    let (a5, b9) = (ev("order", "collide-p", 5), ev("order", "collide-q", 9));
    store.append(&ctx.pool, &a5).await.unwrap();
    let b = claim(&store, "r", 100).await;
    assert_eq!(claimed(&b), vec![("order".into(), "collide-p".into(), 5)]);
    assert_eq!(
        store
            .complete(&b.handle, &[park(&a5)])
            .await
            .unwrap()
            .applied,
        1
    );
    // The other aggregate's first version may be at the broker (a timeout).
    store.append(&ctx.pool, &b9).await.unwrap();
    let b = claim(&store, "r", 100).await;
    assert_eq!(claimed(&b), vec![("order".into(), "collide-q".into(), 9)]);
    let timeout = Outcome::Retry {
        event_id: b9.event_id,
        delay: Duration::from_secs(3600),
        error: LastError {
            class: ErrorClass::Transient,
            kind: "timeout".into(),
            message: "no acknowledgement".into(),
        },
    };
    assert_eq!(
        store.complete(&b.handle, &[timeout]).await.unwrap().applied,
        1
    );
    store
        .retry_parked(a5.event_id, "ops")
        .await
        .expect("version 5 is its aggregate's first: the retry is accepted");
    let b = claim(&store, "r", 100).await;
    assert_eq!(claimed(&b), vec![("order".into(), "collide-p".into(), 5)]);
    publish_all(&store, &b).await;
    drop(store);
    pool.close().await;
    ctx.drop().await;
}

/// With `accept_first_version`, a version that a lease relay claimed and may have sent (its
/// lease expired without an outcome) stays its aggregate's first for a locked-mode relay on
/// the same table: a lower version that arrives later is parked as out of order, not handed
/// out. Kills `claim_decide_locked`'s (first-version variant) `s.aggregate_key = ..` → `<>`
/// in the lookup of the aggregate's lease row (the rule then counted only rows already marked
/// as maybe delivered, and a lease that merely expired marks nothing).
#[tokio::test]
async fn a_locked_relay_counts_an_expired_lease_as_the_first_version() {
    let ctx = ctx!(4);
    ctx.store(lease(30.0)).await;
    let build = |mode| {
        PostgresOutboxStore::builder(ctx.pool.clone())
            .schema(&ctx.schema)
            .claim_mode(mode)
            .accept_first_version(true)
            .build()
            .unwrap()
    };
    let (leased, locked) = (build(lease(0.2)), build(ClaimMode::LockedTransaction));
    let (v5, v3) = (ev("order", "first", 5), ev("order", "first", 3));
    leased.append(&ctx.pool, &v5).await.unwrap();
    let b = claim(&leased, "crashes", 100).await;
    assert_eq!(claimed(&b), vec![("order".into(), "first".into(), 5)]);
    tokio::time::sleep(Duration::from_millis(400)).await;
    leased.append(&ctx.pool, &v3).await.unwrap();
    let b = claim(&locked, "r", 100).await;
    assert_eq!(
        claimed(&b),
        vec![("order".into(), "first".into(), 5)],
        "version 3 must not go out after version 5 may have"
    );
    assert!(b.records[0].is_resend());
    assert_eq!(b.parked.len(), 1);
    assert_eq!(b.parked[0].event_id, v3.event_id);
    publish_all(&locked, &b).await;
    ctx.drop().await;
}

/// A stale twin parked by a claim promotes the version blocked behind it even when an older
/// parked row of its aggregate (a stale duplicate of a version already published) sorts
/// first, in both claim modes. The aggregate: version 1 published, a duplicate of version 1
/// parked as out of order, then version 2, a twin of version 2 and version 3; the first claim
/// takes version 2 and blocks its twin and version 3; publishing version 2 promotes the twin;
/// the next claim parks the twin as stale and must promote version 3, which the claim after it
/// hands out. Kills the claim's promotion without ` AND b.blocked` (`claim_decide_locked`,
/// `claim_decide_lease`): the first unfinished row other than the twin is then the parked
/// duplicate, which is not blocked, so nothing is promoted and version 3 stays blocked for
/// good (no publication or operator action of that aggregate is left to promote it).
#[tokio::test]
async fn a_parked_twin_promotes_the_next_version_past_an_older_parked_duplicate() {
    let ctx = ctx!(4);
    for (n, mode) in modes().into_iter().enumerate() {
        let store = ctx.store(mode).await;
        let id = format!("twins-{n}");
        store.append(&ctx.pool, &ev("order", &id, 1)).await.unwrap();
        publish_all(&store, &claim(&store, "r", 100).await).await;
        let dup = ev("order", &id, 1);
        store.append(&ctx.pool, &dup).await.unwrap();
        let b = claim(&store, "r", 100).await;
        assert!(b.records.is_empty(), "{mode:?}: {:?}", claimed(&b));
        assert_eq!(b.parked.len(), 1, "{mode:?}");
        assert_eq!(b.parked[0].event_id, dup.event_id, "{mode:?}");

        let (v2, twin, v3) = (
            ev("order", &id, 2),
            ev("order", &id, 2),
            ev("order", &id, 3),
        );
        store
            .append_many(&ctx.pool, &[v2.clone(), twin.clone(), v3.clone()])
            .await
            .unwrap();
        let b = claim(&store, "r", 100).await;
        assert_eq!(b.records.len(), 1, "{mode:?}: {:?}", claimed(&b));
        assert_eq!(b.records[0].envelope.event_id, v2.event_id, "{mode:?}");
        publish_all(&store, &b).await;

        // The twin, promoted by the publication, is now stale.
        let b = claim(&store, "r", 100).await;
        assert!(b.records.is_empty(), "{mode:?}: {:?}", claimed(&b));
        assert_eq!(b.parked.len(), 1, "{mode:?}");
        assert_eq!(b.parked[0].event_id, twin.event_id, "{mode:?}");

        let b = claim(&store, "r", 100).await;
        assert_eq!(
            claimed(&b),
            vec![("order".into(), id.clone(), 3)],
            "{mode:?}: version 3 must be promoted when the twin before it is parked"
        );
        publish_all(&store, &b).await;
        let s = store.stats().await.unwrap();
        assert_eq!((s.parked, s.blocked, s.unpublished), (2, 0, 0), "{mode:?}");
        for e in [&dup, &twin] {
            store
                .discard_parked(e.event_id, "ops", "duplicate")
                .await
                .unwrap();
        }
    }
    ctx.drop().await;
}

/// An event whose aggregate id is longer than the store can key (written by plain SQL) is
/// parked by the claim that meets it as a permanent error of kind `invalid_record`, in both
/// claim modes, and that is what an operator reads of it (`parked_event`, `list_parked`), not
/// only what the claim reports. Kills `'bad_key'` → `'stale'` in the park kind of the claim's
/// `prk` (`CASE h.action WHEN 'stale' .. WHEN 'bad_key' THEN 'permanent_error' ELSE
/// 'version_gap'`), in `claim_decide_lease` and `claim_decide_locked`: the event was stored
/// as a version gap (`park_kind` and `last_error_kind` `version_gap`) while the claim reported
/// a permanent error.
#[tokio::test]
async fn an_over_long_aggregate_is_stored_as_a_permanent_error_in_both_modes() {
    let ctx = ctx!(4);
    let too_long = "x".repeat(outbox_core::MAX_AGGREGATE_NAME_BYTES + 1);
    for (n, mode) in modes().into_iter().enumerate() {
        let store = ctx.store(mode).await;
        // The builder refuses such a name: the event is a short one written under the long id.
        let long = ev("order", &format!("long-{n}"), 1);
        let long_id = format!("{n}{too_long}");
        sqlx::query(&format!(
            "INSERT INTO \"{}\".outbox_events (event_id, aggregate_type, aggregate_id, \
               aggregate_version, event_type, schema_version, content_type, payload, created_at) \
             VALUES ($1, $2, $3, 1, $4, 1, 'application/json', $5, now())",
            ctx.schema
        ))
        .bind(long.event_id.as_uuid())
        .bind(&long.aggregate_type)
        .bind(&long_id)
        .bind(&long.event_type)
        .bind(&long.payload.bytes)
        .execute(&ctx.pool)
        .await
        .unwrap();
        let b = claim(&store, "r", 100).await;
        assert!(b.records.is_empty(), "{mode:?}");
        assert_eq!(b.parked.len(), 1, "{mode:?}");
        assert_eq!(
            (b.parked[0].event_id, b.parked[0].kind),
            (long.event_id, ParkKind::PermanentError),
            "{mode:?}: the claim's report"
        );
        let p = store.parked_event(long.event_id).await.unwrap();
        assert_eq!(
            (
                p.reason.kind,
                p.reason.error.class,
                p.reason.error.kind.as_str()
            ),
            (
                ParkKind::PermanentError,
                ErrorClass::Permanent,
                "invalid_record"
            ),
            "{mode:?}: what is stored: {}",
            p.reason.error.message
        );
        assert!(
            p.reason.error.message.contains("longer than"),
            "{mode:?}: {}",
            p.reason.error.message
        );
        store
            .discard_parked(long.event_id, "ops", "too long")
            .await
            .unwrap();
    }
    ctx.drop().await;
}

/// A lease that ends at the very instant an operator's release reads the clock has expired:
/// `release_claims_of` neither releases nor counts nor audits it (a claim would take it over:
/// `lease_until <= clock_timestamp()`). The release runs on sessions where
/// `clock_timestamp()` stands in for that coincidence: the walk of the owner's leases
/// (`owner_leases`) sees the lease one microsecond before its end, the release itself
/// (`release_owner_lease`, told apart by its text) at its end. Kills `release_owner_lease`'s
/// `lease_until > clock_timestamp()` → `>=`: the expired lease was released, counted and
/// audited.
#[tokio::test]
async fn a_lease_ending_at_the_release_instant_is_not_released() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let e = ev("order", "ends-now", 1);
    store.append(&ctx.pool, &e).await.unwrap();
    let b = claim(&store, "gone", 100).await;
    assert_eq!(b.records.len(), 1);
    let s = &ctx.schema;
    let (_pool, at_end) = stand_in_store(
        &ctx,
        lease(30.0),
        false,
        &format!(
            "clock_timestamp() RETURNS timestamptz LANGUAGE sql VOLATILE AS $$ \
               SELECT CASE WHEN pg_catalog.current_query() LIKE '%lease_owner = $4%' \
                           THEN u ELSE u - interval '1 microsecond' END \
               FROM (SELECT lease_until AS u FROM \"{s}\".outbox_events_aggregate \
                     WHERE aggregate_id = 'ends-now') l $$"
        ),
    )
    .await;
    assert_eq!(at_end.release_claims_of("gone", "ops").await.unwrap(), 0);
    assert!(
        at_end
            .audit_trail(Some(e.event_id))
            .await
            .unwrap()
            .is_empty(),
        "an expired lease is not audited as released"
    );
    let (owner, row): (Option<String>, Option<i64>) = sqlx::query_as(&format!(
        "SELECT lease_owner, lease_row FROM \"{s}\".outbox_events_aggregate \
         WHERE aggregate_id = 'ends-now'"
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert!(
        owner.is_some() && row.is_some(),
        "the lease row is left as it was"
    );
    // With the real clock the lease is live and released.
    assert_eq!(store.release_claims_of("gone", "ops").await.unwrap(), 1);
    ctx.drop().await;
}

/// Two aggregates whose keys collide, both with a state row but no last version yet (a lease
/// claim took their first versions and was released), are claimed again, each at
/// its own first version, by a locked relay and by a lease relay with `accept_first_version`.
/// Kills ` AND ` → ` OR ` after the key comparison in the first-version rule's lookup of the
/// aggregate's lease row (`claim_decide_lease` and `claim_decide_locked`, `first_version`
/// variant): `key = .. OR type = .. AND id = ..` meets the colliding aggregate's state row too,
/// and the scalar subquery returns two rows: the claim fails.
#[tokio::test]
async fn colliding_aggregates_without_a_last_version_are_claimed_again_apart() {
    let ctx = ctx!(4);
    let (_lp, leased) = colliding_store(&ctx, lease(30.0), true).await;
    let (_kp, locked) = colliding_store(&ctx, ClaimMode::LockedTransaction, true).await;
    let (a, b) = (ev("order", "collide-a", 5), ev("order", "collide-b", 7));
    let want = vec![
        ("order".into(), "collide-a".into(), 5),
        ("order".into(), "collide-b".into(), 7),
    ];
    leased
        .append_many(&ctx.pool, &[a.clone(), b.clone()])
        .await
        .unwrap();
    let first = claim(&leased, "r", 100).await;
    assert_eq!(claimed(&first), want);
    // Released without outcome: nothing marks the rows as maybe delivered, so the rule looks
    // the lease row up (a row marked would satisfy the filter before the lookup runs).
    leased.release(&first.handle).await.unwrap();
    let lasts: Vec<_> = last_versions(&ctx.pool, &ctx.schema)
        .await
        .into_iter()
        .map(|(_, i, l)| (i, l))
        .collect();
    assert_eq!(
        lasts,
        vec![("collide-a".into(), None), ("collide-b".into(), None)],
        "two state rows without a last version"
    );
    let by_locked = locked
        .claim(&ClaimRequest::new("k", 100))
        .await
        .expect("a locked claim of colliding first versions");
    assert_eq!(claimed(&by_locked), want, "locked");
    locked.release(&by_locked.handle).await.unwrap();
    let again = leased
        .claim(&ClaimRequest::new("r", 100))
        .await
        .expect("a lease claim of colliding first versions");
    assert_eq!(claimed(&again), want, "lease");
    publish_all(&leased, &again).await;
    ctx.drop().await;
}

/// A lease that has expired is no longer a live claim of its owner: `live_claims_of` counts
/// it while it lasts and not after, and agrees with what `release_claims_of` would release.
/// Kills `owner_leases`'s ` AND a.lease_until > clock_timestamp()` dropped: the count (a
/// `count(*)` over that statement) then included the expired lease, which the release (whose
/// own statement checks the lease's end again) does not end.
#[tokio::test]
async fn an_expired_lease_is_not_a_live_claim() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(2.0)).await;
    store
        .append(&ctx.pool, &ev("order", "expires", 1))
        .await
        .unwrap();
    let b = claim(&store, "slow", 100).await;
    assert_eq!(b.records.len(), 1);
    assert_eq!(
        store.live_claims_of("slow").await.unwrap(),
        1,
        "while it lasts"
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        store.live_claims_of("slow").await.unwrap(),
        0,
        "an expired lease is not live"
    );
    assert_eq!(store.release_claims_of("slow", "ops").await.unwrap(), 0);
    ctx.drop().await;
}

/// Parking an undecodable head releases that head's lease only, not the live lease of another
/// aggregate whose key collides with it (the colliding stand-in): the other relay's claim
/// still holds and its completion applies. Kills ` AND ` → ` OR ` after the key list in
/// `park_undecodable`'s lease release (`aggregate_key = ANY($4) OR lease_token = ..`), which
/// released every lease of the key: the other relay's publication was refused.
#[tokio::test]
async fn parking_an_undecodable_head_keeps_a_colliding_aggregates_lease() {
    let ctx = ctx!(4);
    let (_pool, store) = colliding_store(&ctx, lease(30.0), false).await;
    store
        .append(&ctx.pool, &ev("order", "collide-b", 1))
        .await
        .unwrap();
    let held = claim(&store, "r1", 100).await;
    assert_eq!(
        claimed(&held),
        vec![("order".into(), "collide-b".into(), 1)]
    );
    let bad = ev("order", "collide-a", 1);
    sqlx::query(&format!(
        "INSERT INTO \"{}\".outbox_events (event_id, aggregate_type, aggregate_id, \
           aggregate_version, event_type, schema_version, content_type, payload, created_at) \
         VALUES ($1, $2, $3, 1, $4, 1, ' ', $5, now())",
        ctx.schema
    ))
    .bind(bad.event_id.as_uuid())
    .bind(&bad.aggregate_type)
    .bind(&bad.aggregate_id)
    .bind(&bad.event_type)
    .bind(&bad.payload.bytes)
    .execute(&ctx.pool)
    .await
    .unwrap();
    let b = claim(&store, "r2", 100).await;
    assert!(b.records.is_empty(), "{:?}", claimed(&b));
    assert_eq!(b.parked.len(), 1);
    assert_eq!(b.parked[0].event_id, bad.event_id);
    assert_eq!(
        store.live_claims_of("r1").await.unwrap(),
        1,
        "the colliding aggregate's lease is not released"
    );
    publish_all(&store, &held).await;
    ctx.drop().await;
}

/// Discarding an aggregate's parked head promotes that aggregate's next version, not the
/// blocked row of another aggregate of the same type whose key collides with it (the colliding
/// stand-in) and which sorts first. Kills `discard_parked`'s promotion without
/// ` AND b.aggregate_id = p.ai`: the other aggregate's row was promoted (and blocked again by
/// the next claim) while this one's next version stayed blocked.
#[tokio::test]
async fn a_discard_promotes_its_own_aggregate_under_a_key_collision() {
    let ctx = ctx!(4);
    let (_pool, store) = colliding_store(&ctx, ClaimMode::LockedTransaction, false).await;
    let (a1, b1) = (ev("order", "collide-a", 1), ev("order", "collide-b", 1));
    store
        .append_many(&ctx.pool, &[a1.clone(), b1.clone()])
        .await
        .unwrap();
    let first = claim(&store, "r", 100).await;
    assert_eq!(first.records.len(), 2);
    let rep = store
        .complete(&first.handle, &[park(&a1), park(&b1)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 2);
    // b's version 2 first: it sorts before a's among the rows of the colliding key.
    let (b2, a2) = (ev("order", "collide-b", 2), ev("order", "collide-a", 2));
    store
        .append_many(&ctx.pool, &[b2.clone(), a2.clone()])
        .await
        .unwrap();
    assert!(claim(&store, "r", 100).await.is_empty(), "both blocked");
    store
        .discard_parked(a1.event_id, "ops", "gone")
        .await
        .unwrap();
    let next = claim(&store, "r", 100).await;
    assert_eq!(
        claimed(&next),
        vec![("order".into(), "collide-a".into(), 2)],
        "the discard promotes its own aggregate's next version"
    );
    publish_all(&store, &next).await;
    ctx.drop().await;
}

/// Like the test above, with two versions behind the twin: the first claim takes version 2
/// and blocks its twin and versions 3 and 4; publishing version 2 promotes the twin; the claim
/// that parks the twin as stale must promote the *lowest* blocked version, 3, and the claims
/// after it hand out 3, then 4. Kills `ORDER BY b.aggregate_version` → `.. DESC` in the
/// claim's promotion after a park (`claim_decide_lease`, offset 4180; the same text in
/// `claim_decide_locked`): version 4 was promoted instead, so the next claim met version 4
/// above a last version of 2 while version 3 stayed blocked, and version 3 was not handed out
/// next.
#[tokio::test]
async fn a_twin_parked_as_stale_promotes_the_lowest_blocked_version() {
    let ctx = ctx!(4);
    for (n, mode) in modes().into_iter().enumerate() {
        let store = ctx.store(mode).await;
        let id = format!("twins-low-{n}");
        let (v2, twin, v3, v4) = (
            ev("order", &id, 2),
            ev("order", &id, 2),
            ev("order", &id, 3),
            ev("order", &id, 4),
        );
        store.append(&ctx.pool, &ev("order", &id, 1)).await.unwrap();
        publish_all(&store, &claim(&store, "r", 100).await).await;
        store
            .append_many(
                &ctx.pool,
                &[v2.clone(), twin.clone(), v3.clone(), v4.clone()],
            )
            .await
            .unwrap();
        let b = claim(&store, "r", 100).await;
        assert_eq!(b.records.len(), 1, "{mode:?}: {:?}", claimed(&b));
        assert_eq!(b.records[0].envelope.event_id, v2.event_id, "{mode:?}");
        publish_all(&store, &b).await;

        let b = claim(&store, "r", 100).await;
        assert!(b.records.is_empty(), "{mode:?}: {:?}", claimed(&b));
        assert_eq!(b.parked.len(), 1, "{mode:?}");
        assert_eq!(b.parked[0].event_id, twin.event_id, "{mode:?}");

        for want in [3, 4] {
            let b = claim(&store, "r", 100).await;
            assert_eq!(
                claimed(&b),
                vec![("order".into(), id.clone(), want)],
                "{mode:?}: version {want} must be handed out next"
            );
            assert!(b.parked.is_empty(), "{mode:?}: {:?}", b.parked);
            publish_all(&store, &b).await;
        }
        let s = store.stats().await.unwrap();
        assert_eq!((s.parked, s.blocked, s.unpublished), (1, 0, 0), "{mode:?}");
        store
            .discard_parked(twin.event_id, "ops", "duplicate")
            .await
            .unwrap();
    }
    ctx.drop().await;
}

/// A relay whose lease expired and was taken over by another relay releases its claim (it
/// stops, or its batch failed): the release ends only its own lease. The other relay's lease
/// stays, so a third relay gets nothing of that aggregate while it is in flight, and the
/// taker's completion applies. Kills ` AND ` → ` OR ` in `release_lease` (`aggregate_key =
/// ANY($2) AND lease_token = $1`): the release then cleared every state row of its keys,
/// including the taker's live lease, and the third relay claimed the aggregate's next version
/// while the taker still had the head in flight.
#[tokio::test]
async fn a_release_after_a_takeover_keeps_the_takers_lease() {
    let ctx = ctx!(6);
    let a = ctx.store(lease(0.2)).await;
    let b = ctx.store(lease(30.0)).await;
    let c = ctx.store(lease(30.0)).await;
    let (x1, x2) = (ev("order", "taken", 1), ev("order", "taken", 2));
    a.append_many(&ctx.pool, &[x1.clone(), x2.clone()])
        .await
        .unwrap();
    let old = claim(&a, "relay-a", 100).await;
    assert_eq!(claimed(&old), vec![("order".into(), "taken".into(), 1)]);
    tokio::time::sleep(Duration::from_millis(300)).await; // A's lease has expired
    let taken = claim(&b, "relay-b", 100).await;
    assert_eq!(
        claimed(&taken),
        vec![("order".into(), "taken".into(), 1)],
        "B takes the expired lease over"
    );
    a.release(&old.handle).await.unwrap();
    let third = claim(&c, "relay-c", 100).await;
    assert!(
        third.records.is_empty(),
        "A's release ended B's lease: C claimed {:?} while B has version 1 in flight",
        claimed(&third)
    );
    let rep = b
        .complete(&taken.handle, &[published(&x1, 1)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 1, "the taker's completion applies");
    let next = claim(&c, "relay-c", 100).await;
    assert_eq!(claimed(&next), vec![("order".into(), "taken".into(), 2)]);
    publish_all(&c, &next).await;
    ctx.drop().await;
}

/// A lease completion takes its aggregates' advisory locks in ascending key order, so two
/// completions (or a completion and a release) whose aggregates overlap never wait for each
/// other in a cycle. The completion runs on sessions where a stand-in for
/// `pg_advisory_xact_lock(bigint)` logs each key before taking the real lock. Kills dropping
/// `ORDER BY 1` in `lock_keys`: PostgreSQL plans the `DISTINCT` as a hash aggregate, whose
/// order is not the keys' (20 keys came out unsorted).
#[tokio::test]
async fn a_completion_locks_its_aggregates_in_key_order() {
    let ctx = ctx!(4);
    let s = ctx.schema.clone();
    let (_pool, store) = stand_in_store(
        &ctx,
        lease(30.0),
        false,
        &format!(
            "pg_advisory_xact_lock(k int8) RETURNS void LANGUAGE plpgsql AS $$ BEGIN \
               INSERT INTO \"{s}\".lock_log (k) VALUES (k); \
               PERFORM pg_catalog.pg_advisory_xact_lock(k); END $$"
        ),
    )
    .await;
    sqlx::query(&format!(
        "CREATE TABLE \"{s}\".lock_log (seq bigserial PRIMARY KEY, k int8 NOT NULL)"
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let evs: Vec<_> = (0..20).map(|i| ev("order", &format!("k{i}"), 1)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let b = claim(&store, "r", 100).await;
    assert_eq!(b.records.len(), 20);
    sqlx::query(&format!("TRUNCATE \"{s}\".lock_log"))
        .execute(&ctx.pool)
        .await
        .unwrap();
    publish_all(&store, &b).await;
    let keys: Vec<i64> =
        sqlx::query_scalar(&format!("SELECT k FROM \"{s}\".lock_log ORDER BY seq"))
            .fetch_all(&ctx.pool)
            .await
            .unwrap();
    assert_eq!(keys.len(), 20, "one lock per aggregate: {keys:?}");
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(keys, sorted, "the completion's locks in key order");
    ctx.drop().await;
}
