//! Adversary pass on the lease completion as rewritten by commit 7873128 (issue 25): the
//! release (`rel`) reads each aggregate's published prefix end from a JSON object built once
//! (`jsonb_object_agg(jsonb_build_array(k, type, id)::text, v)`), and the promote tests rows
//! and aggregates against `upd` with uncorrelated `NOT IN`s. Attacked here against the real
//! server, through the store's API, with raw SQL sessions only to freeze a completion at a
//! row lock or to stand in for another writer:
//!
//! - the map's key: names a text key could confuse (quotes, backslashes, commas, brackets,
//!   escapes written out, combining marks, trailing spaces, names of the longest length that
//!   differ in their last byte, one id under two types), each aggregate of a pair ending at its
//!   own prefix end, and an aggregate without a publication keeping its last version;
//! - `NOT IN` and NULL: what enters `upd` is never NULL (the columns are NOT NULL, the SQL
//!   append function refuses NULL), and the promote unblocks exactly the row after each
//!   published prefix, for events appended through that function;
//! - interleavings: an old relay's completion after its expired lease was claimed again; a
//!   completion frozen past its lease's expiry while a second relay claims and completes
//!   another aggregate; an operator's retry and discard waiting for a completion of the same
//!   aggregate; a run with a failed middle event; a run whose later version another writer
//!   published in between.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, Envelope, EnvelopeLimits, Outcome, MAX_AGGREGATE_NAME_BYTES};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::claim_run;
use sqlx::{Connection, PgConnection, PgPool};

use common::stand_in::{stand_in_pool, COLLIDING_KEYS};
use common::{claimed, lease, park, published, retry, Ctx};

fn modes() -> [ClaimMode; 2] {
    [lease(30.0), ClaimMode::LockedTransaction]
}

/// A store of `mode` on the test's schema that accepts names up to the store's key limit.
async fn store(ctx: &Ctx, mode: ClaimMode) -> PostgresOutboxStore {
    let s = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .limits(EnvelopeLimits::default().with_max_name_len(8192))
        .build()
        .unwrap();
    s.migrate().await.unwrap();
    s
}

/// [`store`] over sessions where every name containing `collide` has one aggregate key
/// (`common::stand_in::COLLIDING_KEYS`), so that only the type and id tell such aggregates
/// apart.
async fn colliding(ctx: &Ctx, mode: ClaimMode) -> PostgresOutboxStore {
    let pool = stand_in_pool(ctx, mode, COLLIDING_KEYS).await;
    PostgresOutboxStore::builder(pool)
        .schema(&ctx.schema)
        .claim_mode(mode)
        .limits(EnvelopeLimits::default().with_max_name_len(8192))
        .build()
        .unwrap()
}

fn ev(agg_type: &str, agg_id: &str, version: i64) -> Envelope {
    Envelope::builder(agg_type, agg_id, version, "order.changed")
        .limits(EnvelopeLimits::default().with_max_name_len(8192))
        .json(&serde_json::json!({ "v": version }))
        .unwrap()
        .build()
        .unwrap()
}

/// The aggregate's state row: last version, lease owner and token.
async fn agg_state(
    ctx: &Ctx,
    agg_type: &str,
    agg_id: &str,
) -> (Option<i64>, Option<String>, Option<uuid::Uuid>) {
    sqlx::query_as(&format!(
        "SELECT last_version, lease_owner, lease_token FROM \"{}\".outbox_events_aggregate \
         WHERE aggregate_type = $1 AND aggregate_id = $2",
        ctx.schema
    ))
    .bind(agg_type)
    .bind(agg_id)
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// (version, status, blocked, attempts) of every row of an aggregate, by version.
async fn rows(ctx: &Ctx, agg_type: &str, agg_id: &str) -> Vec<(i64, String, bool, i32)> {
    sqlx::query_as(&format!(
        "SELECT aggregate_version, status, blocked, attempts FROM \"{}\".outbox_events \
         WHERE aggregate_type = $1 AND aggregate_id = $2 ORDER BY aggregate_version, id",
        ctx.schema
    ))
    .bind(agg_type)
    .bind(agg_id)
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// A session of its own (not from the test's pool) and its backend pid.
async fn session() -> (PgConnection, i32) {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| common::DEFAULT_URL.to_owned());
    let mut c = PgConnection::connect(&url).await.unwrap();
    let pid = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut c)
        .await
        .unwrap();
    (c, pid)
}

/// The backend that waits on backend `holder` (there is one).
async fn waiting_on(pool: &PgPool, holder: i32) -> i32 {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)) LIMIT 1",
    )
    .bind(holder)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Opens a transaction on `conn` that holds the row lock of event `e`: a completion that
/// writes the row waits there, holding its aggregates' advisory locks.
async fn hold_row(ctx: &Ctx, conn: &mut PgConnection, e: &Envelope) {
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    let n = sqlx::query(&format!(
        "SELECT 1 FROM \"{}\".outbox_events WHERE event_id = $1 FOR UPDATE",
        ctx.schema
    ))
    .bind(e.event_id.as_uuid())
    .execute(&mut *conn)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1);
}

/// Waits until at least `at_least` backends wait on backend `holder`.
async fn wait_blocked_by(pool: &PgPool, holder: i32, at_least: i64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        )
        .bind(holder)
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting >= at_least {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{at_least} sessions never waited on backend {holder}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// What a completion does with one aggregate's run `2..=5` (its version 1 published before).
#[derive(Clone, Copy, Debug)]
enum Pattern {
    /// All four published: last 5, nothing left.
    All,
    /// The head retried: no publication, last stays 1, head 2.
    RetryHead,
    /// 2 published, 3 retried (4 and 5 released): last 2, head 3.
    OneThenRetry,
    /// 2 and 3 published (4 and 5 released): last 3, head 4.
    Two,
}

impl Pattern {
    fn of(i: usize) -> Self {
        [Self::All, Self::RetryHead, Self::OneThenRetry, Self::Two][i % 4]
    }
    fn last(self) -> i64 {
        match self {
            Self::All => 5,
            Self::RetryHead => 1,
            Self::OneThenRetry => 2,
            Self::Two => 3,
        }
    }
    fn outcome(self, e: &Envelope) -> Option<Outcome> {
        let v = e.aggregate_version;
        match (self, v) {
            (Self::All, _) | (Self::OneThenRetry, 2) | (Self::Two, 2 | 3) => Some(published(e, v)),
            (Self::RetryHead, 2) | (Self::OneThenRetry, 3) => Some(retry(e)),
            _ => None,
        }
    }
}

/// Pairs of aggregates (type, id) that a key could take for one: one aggregate key (under
/// [`colliding`] sessions); one id under two types; names joined by a comma, by nothing, or split at a quoted comma; quotes
/// and backslashes that escaping could fold together; a JSON escape written out (`\u0041`)
/// and the letter it spells; a precomposed letter and its decomposed form; a trailing space;
/// names of the store's longest length that differ in their last byte.
fn hostile_pairs() -> Vec<[(String, String); 2]> {
    let max = MAX_AGGREGATE_NAME_BYTES;
    let long = "x".repeat(max);
    let long_y = format!("{}y", "x".repeat(max - 1));
    let p = |a: &str, b: &str, c: &str, d: &str| {
        [(a.to_owned(), b.to_owned()), (c.to_owned(), d.to_owned())]
    };
    vec![
        p("order", "collide-1", "order", "collide-2"),
        p("order", "1", "invoice", "1"),
        p("a,b", "c", "a", "b,c"),
        p("ab", "c", "a", "bc"),
        p("a\", \"b", "c", "a", "b\", \"c"),
        p("q", "a\"b", "q", "a\\\"b"),
        p("q", "\\", "q", "\\\\"),
        p("q", "\\u0041", "q", "A"),
        p("q", "[1,\"x\"]", "[1", "\"x\"]"),
        p("q", "\u{e9}", "q", "e\u{301}"),
        p("q", "x", "q", "x "),
        p("q", " x\u{2028}", "q", "\u{1d11e}{\"k\":1}"),
        [
            (long.clone(), "1".to_owned()),
            (long_y.clone(), "1".to_owned()),
        ],
        [("q".to_owned(), long), ("q".to_owned(), long_y)],
    ]
}

/// Aggregates whose names collide under a careless text key each end at their own prefix end
/// (the two of a pair always differ), one without a publication keeps its last version, and
/// every lease is released: the next heads are right after each prefix.
#[tokio::test]
async fn hostile_names_each_end_at_their_own_prefix() {
    let ctx = ctx!(4);
    let store = colliding(&ctx, lease(30.0)).await;
    let aggs: Vec<((String, String), Pattern)> = hostile_pairs()
        .into_iter()
        .enumerate()
        .flat_map(|(p, pair)| {
            pair.into_iter()
                .enumerate()
                .map(move |(m, a)| (a, Pattern::of(2 * p + m)))
        })
        .collect();
    let evs: Vec<Envelope> = aggs
        .iter()
        .flat_map(|((t, i), _)| (1..=5).map(|v| ev(t, i, v)))
        .collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();

    let heads = claim_run(&store, "relay", 1000, 1).await;
    assert_eq!(heads.records.len(), aggs.len());
    common::publish_all(&store, &heads).await;
    for ((t, i), _) in &aggs {
        assert_eq!(agg_state(&ctx, t, i).await.0, Some(1), "{t:?}/{i:?}");
    }

    let b = claim_run(&store, "relay", 1000, 5).await;
    assert_eq!(b.records.len(), aggs.len() * 4, "every run 2..=5");
    let pattern_of = |e: &Envelope| {
        aggs.iter()
            .find(|((t, i), _)| *t == e.aggregate_type && *i == e.aggregate_id)
            .unwrap()
            .1
    };
    let outs: Vec<Outcome> = b
        .records
        .iter()
        .filter_map(|r| pattern_of(&r.envelope).outcome(&r.envelope))
        .collect();
    store.complete(&b.handle, &outs).await.unwrap();

    let mut want_heads = Vec::new();
    for ((t, i), pattern) in &aggs {
        let (last, owner, token) = agg_state(&ctx, t, i).await;
        assert_eq!(
            (last, owner, token),
            (Some(pattern.last()), None, None),
            "{t:?}/{i:?} ({pattern:?}): its own prefix end, its lease released"
        );
        if pattern.last() < 5 {
            want_heads.push((t.clone(), i.clone(), pattern.last() + 1));
        }
    }
    want_heads.sort();
    let next = claim_run(&store, "next", 1000, 1).await;
    assert_eq!(claimed(&next), want_heads);
    store.release(&next.handle).await.unwrap();
    ctx.drop().await;
}

/// What a promote reads from `upd` is never NULL: the event table's key columns are NOT NULL
/// and the SQL append function refuses NULL names. For aggregates appended through that
/// function (names with quotes, a comma, brackets, a backslash), claimed with runs and
/// completed with every kind of outcome at once, the promote unblocks exactly the row after
/// each published prefix: not after a prefix followed by an outcome, and nothing of a parked
/// head's aggregate. In both claim modes (the promote is shared). Were a NULL id or a row of
/// NULLs to enter `upd`, every `NOT IN` against it would be unknown and no promote would run
/// (the aggregate with the whole run published stalls behind a blocked row); a NULL in one
/// column of the aggregate's row alone would not matter (the other columns, the key first,
/// tell aggregates apart).
#[tokio::test]
async fn the_promote_unblocks_the_row_after_each_prefix_of_sql_appended_aggregates() {
    for mode in modes() {
        promote_after_sql_appends(mode).await;
    }
}

async fn promote_after_sql_appends(mode: ClaimMode) {
    let ctx = ctx!(4);
    let store = store(&ctx, mode).await;
    let s = &ctx.schema;
    let not_null: Vec<(String, bool)> = sqlx::query_as(&format!(
        "SELECT attname::text, attnotnull FROM pg_attribute \
         WHERE attrelid = '\"{s}\".outbox_events'::regclass \
           AND attname IN ('id', 'aggregate_type', 'aggregate_id', 'aggregate_version') \
         ORDER BY attname"
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(not_null.len(), 4);
    assert!(not_null.iter().all(|(_, nn)| *nn), "{not_null:?}");
    let append = format!(
        "SELECT \"{s}\".outbox_events_append($1, $2, $3, 'order.changed', '\\x7b7d'::bytea)"
    );
    for (t, i) in [(None, Some("x")), (Some("sql"), None)] {
        let err = sqlx::query(&append)
            .bind(t)
            .bind(i)
            .bind(1_i64)
            .execute(&ctx.pool)
            .await
            .unwrap_err();
        let code = err.as_database_error().and_then(|e| e.code());
        assert_eq!(code.as_deref(), Some("22004"), "{err}");
    }

    let t = "sql";
    let (all, prefix_retry, prefix, parked) = ("all\"published", "re,try", "[pre]", "park\\");
    for id in [all, prefix_retry, prefix, parked] {
        for v in 1..=5_i64 {
            sqlx::query(&append)
                .bind(t)
                .bind(id)
                .bind(v)
                .execute(&ctx.pool)
                .await
                .unwrap();
        }
    }
    // A first claim meets every row and blocks the followers (ended without outcomes, which
    // keeps what it wrote in both modes).
    let warm = claim_run(&store, "warm", 100, 1).await;
    assert_eq!(warm.records.len(), 4);
    store.complete(&warm.handle, &[]).await.unwrap();

    let b = claim_run(&store, "relay", 100, 3).await;
    assert_eq!(b.records.len(), 12, "runs 1..=3");
    let outs: Vec<Outcome> = b
        .records
        .iter()
        .filter_map(|r| {
            let e = &r.envelope;
            match (e.aggregate_id.as_str(), e.aggregate_version) {
                (id, _) if id == all => Some(published(e, 1)),
                (id, 1) if id == prefix_retry || id == prefix => Some(published(e, 1)),
                (id, 2) if id == prefix_retry => Some(retry(e)),
                (id, 1) if id == parked => Some(park(e)),
                _ => None,
            }
        })
        .collect();
    let rep = store.complete(&b.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, 3 + 2 + 1 + 1);

    let st = |v: i64, status: &str, blocked: bool, attempts: i32| {
        (v, status.to_owned(), blocked, attempts)
    };
    let (p, w) = ("published", "pending");
    assert_eq!(
        rows(&ctx, t, all).await,
        vec![
            st(1, p, false, 0),
            st(2, p, false, 0),
            st(3, p, false, 0),
            st(4, w, false, 0),
            st(5, w, true, 0)
        ],
        "after a whole run published, the next row is promoted"
    );
    assert_eq!(
        rows(&ctx, t, prefix_retry).await,
        vec![
            st(1, p, false, 0),
            st(2, w, false, 1),
            st(3, w, true, 0),
            st(4, w, true, 0),
            st(5, w, true, 0)
        ],
        "the retried row is the head; nothing after it is promoted"
    );
    assert_eq!(
        rows(&ctx, t, prefix).await,
        vec![
            st(1, p, false, 0),
            st(2, w, false, 0),
            st(3, w, true, 0),
            st(4, w, true, 0),
            st(5, w, true, 0)
        ],
        "the released row after the prefix is promoted"
    );
    assert_eq!(
        rows(&ctx, t, parked).await,
        vec![
            st(1, "parked", false, 1),
            st(2, w, true, 0),
            st(3, w, true, 0),
            st(4, w, true, 0),
            st(5, w, true, 0)
        ],
        "a parked head's aggregate stays blocked"
    );
    for (id, last) in [(all, 3), (prefix_retry, 1), (prefix, 1)] {
        assert_eq!(agg_state(&ctx, t, id).await.0, Some(last), "{id}");
    }
    let next = claim_run(&store, "next", 100, 1).await;
    let want: Vec<_> = [(all, 4), (prefix, 2), (prefix_retry, 2)]
        .iter()
        .map(|(id, v)| (t.to_owned(), (*id).to_owned(), *v))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(claimed(&next), want);
    store.release(&next.handle).await.unwrap();
    ctx.drop().await;
}

/// An old relay's completion that arrives after its expired lease was claimed again by another
/// relay (a new token): nothing applied, the new lease and the last version untouched; the
/// new relay's completion then applies its own prefix.
#[tokio::test]
async fn an_old_completion_after_a_new_claim_applies_nothing() {
    let ctx = ctx!(6);
    let old = store(&ctx, lease(0.3)).await;
    let new = store(&ctx, lease(30.0)).await;
    let evs: Vec<Envelope> = (1..=3)
        .map(|v| ev("order", "x", v))
        .chain([ev("order", "y", 1)])
        .collect();
    old.append_many(&ctx.pool, &evs).await.unwrap();
    let b_old = claim_run(&old, "old", 100, 3).await;
    assert_eq!(b_old.records.len(), 4);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let b_new = claim_run(&new, "new", 100, 3).await;
    assert_eq!(
        claimed(&b_new),
        claimed(&b_old),
        "the expired lease taken over"
    );
    let new_token = agg_state(&ctx, "order", "x").await.2;
    assert!(new_token.is_some());

    let outs: Vec<Outcome> = b_old
        .records
        .iter()
        .map(|r| published(&r.envelope, 1))
        .collect();
    let rep = old.complete(&b_old.handle, &outs).await.unwrap();
    assert_eq!((rep.applied, rep.superseded), (0, 4));
    for id in ["x", "y"] {
        let (last, owner, token) = agg_state(&ctx, "order", id).await;
        assert_eq!(
            (last, owner.as_deref(), token.is_some()),
            (None, Some("new"), true),
            "{id}: the new lease and no version"
        );
        assert!(rows(&ctx, "order", id)
            .await
            .iter()
            .all(|r| r.1 == "pending"));
    }
    assert_eq!(agg_state(&ctx, "order", "x").await.2, new_token);

    let outs: Vec<Outcome> = b_new
        .records
        .iter()
        .map(|r| {
            let e = &r.envelope;
            if e.aggregate_id == "x" && e.aggregate_version == 3 {
                retry(e)
            } else {
                published(e, 2)
            }
        })
        .collect();
    let rep = new.complete(&b_new.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, 4);
    assert_eq!(agg_state(&ctx, "order", "x").await, (Some(2), None, None));
    assert_eq!(agg_state(&ctx, "order", "y").await, (Some(1), None, None));
    ctx.drop().await;
}

/// A completion frozen (on a row lock) past its lease's expiry keeps its aggregate: a second
/// relay's claim meanwhile gets only another aggregate, and completes it while the first
/// still waits; the first then applies its run whole, to its end.
#[tokio::test]
async fn a_completion_frozen_past_its_lease_keeps_its_aggregate() {
    let ctx = ctx!(8);
    let first = store(&ctx, lease(1.0)).await;
    let second = store(&ctx, lease(30.0)).await;
    let xs: Vec<Envelope> = (1..=3).map(|v| ev("order", "x", v)).collect();
    first.append_many(&ctx.pool, &xs).await.unwrap();
    let b1 = claim_run(&first, "first", 100, 2).await;
    let claimed_at = Instant::now();
    assert_eq!(claimed(&b1).len(), 2, "x 1..=2");
    let zs: Vec<Envelope> = (1..=2).map(|v| ev("order", "z", v)).collect();
    first.append_many(&ctx.pool, &zs).await.unwrap();

    let (mut holder, pid) = session().await;
    hold_row(&ctx, &mut holder, &xs[1]).await;
    let outs: Vec<Outcome> = b1
        .records
        .iter()
        .map(|r| published(&r.envelope, 1))
        .collect();
    let (s1, h1) = (first.clone(), b1.handle.clone());
    let done = tokio::spawn(async move { s1.complete(&h1, &outs).await.unwrap() });
    wait_blocked_by(&ctx.pool, pid, 1).await;
    tokio::time::sleep(Duration::from_millis(1300).saturating_sub(claimed_at.elapsed())).await;

    // Bounded: a claim that took the aggregate over would wait on the frozen completion's
    // row locks (to mark its rows as possibly sent) while the test holds the freeze.
    let b2 = tokio::time::timeout(
        Duration::from_secs(10),
        claim_run(&second, "second", 100, 2),
    )
    .await
    .expect("the second relay's claim does not wait on the frozen completion");
    assert_eq!(
        claimed(&b2),
        vec![
            ("order".into(), "z".into(), 1),
            ("order".into(), "z".into(), 2)
        ],
        "the frozen completion's aggregate is not handed out"
    );
    common::publish_all(&second, &b2).await;
    assert_eq!(agg_state(&ctx, "order", "z").await, (Some(2), None, None));

    sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    let rep = done.await.unwrap();
    assert_eq!(rep.applied, 2);
    assert_eq!(agg_state(&ctx, "order", "x").await, (Some(2), None, None));
    let b3 = claim_run(&second, "second", 100, 2).await;
    assert_eq!(claimed(&b3), vec![("order".into(), "x".into(), 3)]);
    second.release(&b3.handle).await.unwrap();
    ctx.drop().await;
}

/// An operator's retry and discard of an event that a frozen completion is parking wait for
/// it (the aggregate's lock) and then find the event parked: the retry makes it the head
/// again, the discard raises the last version past it.
#[tokio::test]
async fn operator_actions_wait_for_a_completion_of_their_aggregate() {
    let ctx = ctx!(8);
    let store = store(&ctx, lease(30.0)).await;
    let rs: Vec<Envelope> = (1..=3).map(|v| ev("order", "r", v)).collect();
    let ds: Vec<Envelope> = (1..=3).map(|v| ev("order", "d", v)).collect();
    store.append_many(&ctx.pool, &rs).await.unwrap();
    store.append_many(&ctx.pool, &ds).await.unwrap();
    let b = claim_run(&store, "relay", 100, 3).await;
    assert_eq!(b.records.len(), 6);
    // r: the head parked. d: the head published, the next parked.
    let outs = vec![park(&rs[0]), published(&ds[0], 1), park(&ds[1])];
    let (mut holder, pid) = session().await;
    hold_row(&ctx, &mut holder, &ds[1]).await;
    let (s, h) = (store.clone(), b.handle.clone());
    let done = tokio::spawn(async move { s.complete(&h, &outs).await.unwrap() });
    wait_blocked_by(&ctx.pool, pid, 1).await;
    let (s, r0) = (store.clone(), rs[0].event_id);
    let retried = tokio::spawn(async move { s.retry_parked(r0, "op").await });
    let (s, d1) = (store.clone(), ds[1].event_id);
    let discarded = tokio::spawn(async move { s.discard_parked(d1, "op", "obsolete").await });
    // Both wait behind the completion (on its aggregates' locks).
    let completion = waiting_on(&ctx.pool, pid).await;
    wait_blocked_by(&ctx.pool, completion, 2).await;
    sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    assert_eq!(done.await.unwrap().applied, 3);
    retried
        .await
        .unwrap()
        .expect("the retry finds the event parked");
    discarded
        .await
        .unwrap()
        .expect("the discard finds the event parked");

    assert_eq!(agg_state(&ctx, "order", "d").await.0, Some(2));
    let next = claim_run(&store, "next", 100, 3).await;
    let mut want: Vec<(String, String, i64)> = (1..=3)
        .map(|v| ("order".to_owned(), "r".to_owned(), v))
        .collect();
    want.push(("order".into(), "d".into(), 3));
    want.sort();
    assert_eq!(claimed(&next), want);
    store.release(&next.handle).await.unwrap();
    ctx.drop().await;
}

/// A run whose middle event failed: the prefix before it is applied, the failed one gets its
/// retry (and is the head, unblocked), the rest is released unchanged and stays behind it;
/// the last version ends at the prefix; the next claim starts at the failed one. In both
/// claim modes.
#[tokio::test]
async fn a_run_with_a_failed_middle_event_ends_at_its_prefix() {
    for mode in modes() {
        failed_middle(mode).await;
    }
}

async fn failed_middle(mode: ClaimMode) {
    let ctx = ctx!(4);
    let store = store(&ctx, mode).await;
    let evs: Vec<Envelope> = (1..=5).map(|v| ev("order", "m", v)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let b = claim_run(&store, "relay", 100, 5).await;
    assert_eq!(b.records.len(), 5);
    let outs = vec![published(&evs[0], 1), published(&evs[1], 2), retry(&evs[2])];
    let rep = store.complete(&b.handle, &outs).await.unwrap();
    assert_eq!((rep.applied, rep.superseded), (3, 0));
    assert_eq!(agg_state(&ctx, "order", "m").await, (Some(2), None, None));
    let st = |v: i64, status: &str, blocked: bool, attempts: i32| {
        (v, status.to_owned(), blocked, attempts)
    };
    assert_eq!(
        rows(&ctx, "order", "m").await,
        vec![
            st(1, "published", false, 0),
            st(2, "published", false, 0),
            st(3, "pending", false, 1),
            st(4, "pending", true, 0),
            st(5, "pending", true, 0),
        ]
    );
    let next = claim_run(&store, "relay", 100, 5).await;
    assert_eq!(
        claimed(&next),
        (3..=5)
            .map(|v| ("order".to_owned(), "m".to_owned(), v))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        next.records.iter().map(|r| r.attempts).collect::<Vec<_>>(),
        vec![1, 0, 0]
    );
    store.release(&next.handle).await.unwrap();
    ctx.drop().await;
}

/// A run whose later version another writer published while the run was out: the completion
/// publishing the whole run applies the others, leaves that row and its acknowledgement as
/// they are, and ends the last version at the run's end.
#[tokio::test]
async fn a_run_version_published_in_between_keeps_its_ack() {
    let ctx = ctx!(4);
    let store = store(&ctx, lease(30.0)).await;
    let evs: Vec<Envelope> = (1..=5).map(|v| ev("order", "p", v)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let b = claim_run(&store, "relay", 100, 4).await;
    assert_eq!(b.records.len(), 4);
    let n = sqlx::query(&format!(
        "UPDATE \"{}\".outbox_events SET status = 'published', published_at = now(), \
                finished_at = now(), ack_transport = 'kafka', ack_destination = 'other', \
                ack_partition = 0, ack_position = 99, blocked = false \
          WHERE event_id = $1",
        ctx.schema
    ))
    .bind(evs[2].event_id.as_uuid())
    .execute(&ctx.pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1);
    let outs: Vec<Outcome> = evs[..4].iter().map(|e| published(e, 7)).collect();
    let rep = store.complete(&b.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, 3);
    assert_eq!(rep.superseded_events, vec![evs[2].event_id]);
    let ack: Vec<(i64, Option<i64>, String)> = sqlx::query_as(&format!(
        "SELECT aggregate_version, ack_position, ack_destination FROM \"{}\".outbox_events \
         WHERE aggregate_id = 'p' AND status = 'published' ORDER BY aggregate_version",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(
        ack,
        vec![
            (1, Some(7), "orders".to_owned()),
            (2, Some(7), "orders".to_owned()),
            (3, Some(99), "other".to_owned()),
            (4, Some(7), "orders".to_owned()),
        ]
    );
    assert_eq!(agg_state(&ctx, "order", "p").await, (Some(4), None, None));
    let next = claim_run(&store, "relay", 100, 4).await;
    assert_eq!(claimed(&next), vec![("order".into(), "p".into(), 5)]);
    store.release(&next.handle).await.unwrap();
    ctx.drop().await;
}
