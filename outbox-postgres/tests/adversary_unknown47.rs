//! Adversary pass (helper unknown47) over the per-aggregate read of `unknown_last`: with
//! `accept_first_version(true)` the last version of an aggregate without state
//! (`unknown_last`) is read once per aggregate of the claim window (the decision's `c` reads
//! the candidates grouped by aggregate, the state row and that read once per group) instead
//! of once per candidate row. The semantics must be exactly as before.
//!
//! Attacked here:
//! 1. a differential oracle: the four decision statements of an `accept_first_version` store
//!    are read back as the server prepared them (`pg_prepared_statements`), and the statement
//!    before the change is rebuilt from them (`c`'s grouped source replaced by the per-row
//!    one, its last version read per candidate again).
//!    Both run on the same data in one transaction (each under a savepoint, rolled back), on
//!    id lists of every shape (all rows, candidates, reversed with duplicates, random subsets,
//!    blocked and finished rows), with a gap timeout of an hour and of zero; their returned
//!    decisions and everything they write (event rows, state rows) must be equal;
//! 2. exact expected decisions of hand-built windows: aggregates with state, with a state row
//!    without last version, without state, twins differing only in type, names at and over
//!    `MAX_AGGREGATE_NAME_BYTES`; an expired lease naming v5 while v3 and v4 are appended
//!    later; `maybe_delivered` rows after a locked takeover, parked; copies; gaps;
//! 3. crash points: a locked claim whose connection the server terminated, a decision
//!    statement terminated mid-way (slowed parks);
//! 4. a randomized mix (seed `UNK47_SEED`, default 47; `UNK47_SECS`, default 40) of producers
//!    whose lower versions commit after higher ones, lease and locked relays (concurrent
//!    claims, runs, abandoned claims, terminated connections), completions and operator
//!    actions, checked against the ledger of `common/ledger45.rs` after each step (and every
//!    re-handout of an event of an abandoned lease flagged `maybe_sent_before`), with the
//!    differential oracle every few steps.
#![allow(dead_code)]

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, ClaimRequest, ClaimedBatch, CompletionReport, Envelope, EventId, Outcome, ParkKind,
    StoreError, MAX_AGGREGATE_NAME_BYTES,
};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::claim_run;
use sqlx::Row as _;
use uuid::Uuid;

use common::{event, lease, published, retry, Ctx};

include!("common/ledger45.rs");

// ---------------------------------------------------------------------------------------------
// The differential oracle.
// ---------------------------------------------------------------------------------------------

/// One decision statement: as prepared (`new`) and rebuilt as before the change (`old`), with
/// the schema written `{S}`.
struct Stmt {
    lease: bool,
    runs: bool,
    new: String,
    old: String,
}

struct Texts(Vec<Stmt>);

/// The text between `start` (included) and the next `end` (excluded) of `s`, after `from`.
fn between<'a>(s: &'a str, from: usize, start: &str, end: &str) -> (usize, &'a str) {
    let a = from
        + s[from..]
            .find(start)
            .unwrap_or_else(|| panic!("{start} in {s}"));
    let b = a + s[a..]
        .find(end)
        .unwrap_or_else(|| panic!("{end} after {start}"));
    (a, &s[a..b])
}

/// The statement before the change: `c` reads each candidate with its state row and its
/// aggregate's last version per row, as before (`unknown_last` of alias `r`, rebuilt from the
/// grouped read's `unknown_last` of alias `g`).
fn old_of(new: &str) -> String {
    let (a, grouped) = between(
        new,
        0,
        "FROM (SELECT g.k, g.ids, COALESCE(s.last_version, ",
        "), h AS MATERIALIZED",
    );
    let e = a + grouped.len();
    let (_, unknown_g) = between(
        grouped,
        0,
        "COALESCE(s.last_version, ",
        ") AS last, s.last_version",
    );
    let unknown_r = unknown_g["COALESCE(s.last_version, ".len()..]
        .replace("g.aggregate_type", "r.aggregate_type")
        .replace("g.aggregate_id", "r.aggregate_id");
    let (_, t) = between(grouped, 0, "r.aggregate_id FROM ", " r WHERE r.id = x.id");
    let t = &t["r.aggregate_id FROM ".len()..];
    let (at, _) = between(grouped, 0, " s WHERE s.aggregate_key = g.k", " ");
    let state_from = grouped[..at].rfind("FROM ").expect("the state table");
    let state = &grouped[state_from + "FROM ".len()..at];
    let source = format!(
        "FROM UNNEST($1::int8[]) AS x(id) CROSS JOIN LATERAL (SELECT * FROM {t} r \
         WHERE r.id = x.id AND r.status = 'pending' AND NOT r.blocked OFFSET 0) r \
         LEFT JOIN LATERAL (SELECT a.last_version, a.lease_until, a.lease_row, a.lease_upto, \
         a.lease_token FROM {state} a WHERE a.aggregate_key = \
         hashtextextended(r.aggregate_type || chr(31) || r.aggregate_id, 0) \
         AND a.aggregate_type = r.aggregate_type AND a.aggregate_id = r.aggregate_id LIMIT 1) \
         a ON true"
    );
    let s = format!("{}{source}{}", &new[..a], &new[e..]);
    assert_eq!(
        s.matches("a.last AS last,").count(),
        1,
        "c's last version: {s}"
    );
    let s = s.replacen(
        "a.last AS last,",
        &format!("COALESCE(a.last_version, {unknown_r}) AS last,"),
        1,
    );
    assert!(
        !s.contains("g.ids") && !s.contains("g.aggregate"),
        "the grouped read left in the old statement: {s}"
    );
    s
}

/// The four decision statements of an `accept_first_version` store, read back from the
/// server after a claim of each kind on a probe schema.
async fn texts() -> Option<Texts> {
    let probe = Ctx::new(2).await?;
    let pool = common::pool(1).await?;
    let mk = |mode| {
        PostgresOutboxStore::builder(pool.clone())
            .schema(&probe.schema)
            .claim_mode(mode)
            .accept_first_version(true)
            .build()
            .unwrap()
    };
    let ls = mk(lease(30.0));
    ls.migrate().await.unwrap();
    let ks = mk(ClaimMode::LockedTransaction);
    let mut tx = pool.begin().await.unwrap();
    ls.append(&mut *tx, &event("probe", 1)).await.unwrap();
    tx.commit().await.unwrap();
    for (s, run) in [(&ls, 1), (&ls, 3), (&ks, 1), (&ks, 3)] {
        let b = claim_run(s, "probe", 10, run).await;
        assert_eq!(b.records.len(), 1);
        s.release(&b.handle).await.unwrap();
    }
    let got: Vec<String> = sqlx::query_scalar(
        "SELECT statement FROM pg_prepared_statements \
         WHERE statement LIKE '%array_agg(x.id) AS ids%' \
           AND statement NOT LIKE '%pg_prepared_statements%'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut stmts: Vec<Stmt> = got
        .iter()
        .map(|t| {
            let new = t.replace(&probe.schema, "{S}");
            Stmt {
                lease: !new.contains("unlease_mark AS"),
                runs: new.contains("run0 AS MATERIALIZED"),
                old: old_of(&new),
                new,
            }
        })
        .collect();
    stmts.sort_by_key(|s| (s.lease, s.runs));
    stmts.dedup_by_key(|s| (s.lease, s.runs));
    assert_eq!(
        stmts.len(),
        4,
        "four decision statements prepared: {got:#?}"
    );
    pool.close().await;
    probe.drop().await;
    Some(Texts(stmts))
}

type Decided = (
    i64,
    i64,
    i64,
    String,
    Option<i64>,
    Option<bool>,
    (Option<bool>, Option<bool>),
);

#[derive(Debug, PartialEq)]
struct Decision {
    /// (head, pos, id, action, last, resend, (claimed, lease_left)), sorted.
    rows: Vec<Decided>,
    /// The event rows after the statement.
    table: Vec<String>,
    /// The state rows after the statement.
    state: Vec<String>,
}

async fn decide_once(
    conn: &mut sqlx::PgConnection,
    schema: &str,
    sql: &str,
    st: &Stmt,
    ids: &[i64],
    gap_us: i64,
) -> Result<Decision, String> {
    let recheck = gap_us.min(1_000_000);
    let mut q = sqlx::query(sql).bind(ids.to_vec());
    q = if st.lease {
        q.bind("diff")
            .bind(Uuid::from_u128(47))
            .bind(30_000_000i64)
            .bind(gap_us)
            .bind(recheck)
    } else {
        q.bind(gap_us).bind(recheck)
    };
    if st.runs {
        q = q.bind(3i64).bind(10i64);
    }
    let got = q.fetch_all(&mut *conn).await.map_err(|e| e.to_string())?;
    let mut rows: Vec<Decided> = got
        .iter()
        .map(|r| {
            (
                r.try_get::<i64, _>("head").unwrap(),
                r.try_get::<i64, _>("pos").unwrap(),
                r.try_get::<i64, _>("id").unwrap(),
                r.try_get::<String, _>("action").unwrap(),
                r.try_get::<Option<i64>, _>("last").unwrap(),
                r.try_get::<Option<bool>, _>("resend").unwrap(),
                (
                    r.try_get::<Option<bool>, _>("claimed").unwrap(),
                    r.try_get::<Option<bool>, _>("lease_left").ok().flatten(),
                ),
            )
        })
        .collect();
    rows.sort();
    let table: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT format('%s %s %s %s %s %s %s %s held=%s', id, aggregate_version, status, \
                blocked, maybe_delivered, park_kind, last_error_kind, last_error_message, \
                held_since IS NOT NULL) \
         FROM \"{schema}\".outbox_events ORDER BY id"
    ))
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| e.to_string())?;
    let state: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT format('%s %s %s %s %s %s %s', aggregate_type, md5(aggregate_id), \
                last_version, lease_row, lease_upto, lease_token, lease_owner) \
         FROM \"{schema}\".outbox_events_aggregate ORDER BY 1"
    ))
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| e.to_string())?;
    Ok(Decision { rows, table, state })
}

/// Runs each statement before and after the change on `ids`; returns the rows decided, or
/// the first difference.
async fn diff_checked(ctx: &Ctx, texts: &Texts, ids: &[i64], what: &str) -> Result<usize, String> {
    let mut tx = ctx.pool.begin().await.unwrap();
    let mut decided = 0;
    for st in &texts.0 {
        let new = st.new.replace("{S}", &ctx.schema);
        let old = st.old.replace("{S}", &ctx.schema);
        for gap in [3_600_000_000i64, 0] {
            let mut out = Vec::new();
            for sql in [&old, &new] {
                sqlx::query("SAVEPOINT d").execute(&mut *tx).await.unwrap();
                out.push(decide_once(&mut tx, &ctx.schema, sql, st, ids, gap).await);
                sqlx::query("ROLLBACK TO SAVEPOINT d")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
            }
            if out[0] != out[1] {
                tx.rollback().await.unwrap();
                return Err(format!(
                    "{what}: lease={} runs={} gap={gap} ids={ids:?}: before and after the                      change decide differently:\nbefore {:#?}\nafter {:#?}",
                    st.lease, st.runs, out[0], out[1]
                ));
            }
            if let Ok(d) = &out[1] {
                decided += d.rows.len();
            }
        }
    }
    tx.rollback().await.unwrap();
    Ok(decided)
}

async fn diff(ctx: &Ctx, texts: &Texts, ids: &[i64], what: &str) -> usize {
    let mut attempt = 0;
    loop {
        match diff_checked(ctx, texts, ids, what).await {
            Ok(n) => return n,
            // A lease that ends between the two statements (`clock_timestamp()`) is no
            // difference of theirs: decided again once it has ended.
            Err(_) if attempt < 3 && lease_ending(ctx).await => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// A lease ends within a second of now (or just ended).
async fn lease_ending(ctx: &Ctx) -> bool {
    sqlx::query_scalar(&format!(
        "SELECT EXISTS (SELECT 1 FROM \"{}\".outbox_events_aggregate \
         WHERE lease_until BETWEEN clock_timestamp() - interval '1 second' \
                               AND clock_timestamp() + interval '1 second')",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, pct: usize) -> bool {
        self.below(100) < pct
    }
}

/// The differential oracle on id lists of every shape; returns the rows decided.
async fn diff_all(ctx: &Ctx, texts: &Texts, rng: &mut Rng, what: &str) -> usize {
    let all: Vec<(i64, bool, bool)> = sqlx::query_as(&format!(
        "SELECT id, status = 'pending' AND NOT blocked, status = 'pending' \
         FROM \"{}\".outbox_events ORDER BY id",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    if all.is_empty() {
        return 0;
    }
    let ids: Vec<i64> = all.iter().map(|r| r.0).collect();
    let cand: Vec<i64> = all.iter().filter(|r| r.1).map(|r| r.0).collect();
    let pending: Vec<i64> = all.iter().filter(|r| r.2).map(|r| r.0).collect();
    let mut sets = vec![ids.clone(), cand.clone()];
    let mut rev: Vec<i64> = cand.iter().rev().flat_map(|i| [*i, *i]).collect();
    rev.truncate(66);
    sets.push(rev);
    for _ in 0..3 {
        let from = if rng.chance(50) { &pending } else { &ids };
        if from.is_empty() {
            continue;
        }
        let n = 1 + rng.below(from.len().min(33));
        let mut s: Vec<i64> = (0..n).map(|_| from[rng.below(from.len())]).collect();
        if rng.chance(50) {
            s.sort();
            s.dedup();
        }
        sets.push(s);
    }
    let mut n = 0;
    for s in sets.iter().filter(|s| !s.is_empty()) {
        n += diff(ctx, texts, s, what).await;
    }
    n
}

// ---------------------------------------------------------------------------------------------
// Helpers of the hand-built cases.
// ---------------------------------------------------------------------------------------------

fn ev(ty: &str, id: &str, v: i64) -> Envelope {
    Envelope::builder(ty, id, v, "order.changed")
        .json(&serde_json::json!({ "v": v }))
        .unwrap()
        .build()
        .unwrap()
}

/// Appends `evs` in one transaction (one statement: versions above the lowest of an
/// aggregate are blocked at insert).
async fn put(ctx: &Ctx, store: &PostgresOutboxStore, evs: &[Envelope]) {
    let mut tx = ctx.pool.begin().await.unwrap();
    store.append_many(&mut *tx, evs).await.unwrap();
    tx.commit().await.unwrap();
}

/// Writes an event under names the builder refuses (longer than the bound), by plain SQL.
async fn put_raw(ctx: &Ctx, ty: &str, id: &str, v: i64) -> Uuid {
    let e = event("raw", v);
    sqlx::query(&format!(
        "INSERT INTO \"{}\".outbox_events (event_id, aggregate_type, aggregate_id, \
           aggregate_version, event_type, schema_version, content_type, payload, created_at) \
         VALUES ($1, $2, $3, $4, $5, 1, 'application/json', $6, now())",
        ctx.schema
    ))
    .bind(e.event_id.as_uuid())
    .bind(ty)
    .bind(id)
    .bind(v)
    .bind(&e.event_type)
    .bind(&e.payload.bytes)
    .execute(&ctx.pool)
    .await
    .unwrap();
    e.event_id.as_uuid()
}

fn name(s: &str) -> String {
    if s.len() > 24 {
        format!("<{} bytes of {}>", s.len(), &s[..1])
    } else {
        s.to_owned()
    }
}

/// (type, id, version, maybe_sent_before) of each record, sorted.
fn got(b: &ClaimedBatch) -> Vec<(String, String, i64, bool)> {
    let mut v: Vec<_> = b
        .records
        .iter()
        .map(|r| {
            (
                name(&r.envelope.aggregate_type),
                name(&r.envelope.aggregate_id),
                r.envelope.aggregate_version,
                r.maybe_sent_before,
            )
        })
        .collect();
    v.sort();
    v
}

/// (type, id, version, kind) of each park reported, sorted.
fn parked_of(b: &ClaimedBatch) -> Vec<(String, String, i64, ParkKind)> {
    let mut v: Vec<_> = b
        .parked
        .iter()
        .map(|p| {
            (
                name(&p.aggregate_type),
                name(&p.aggregate_id),
                p.aggregate_version,
                p.kind,
            )
        })
        .collect();
    v.sort_by(|a, b| (&a.0, &a.1, a.2).cmp(&(&b.0, &b.1, b.2)));
    v
}

fn rec(ty: &str, id: &str, v: i64, ms: bool) -> (String, String, i64, bool) {
    (name(ty), name(id), v, ms)
}

fn prk(ty: &str, id: &str, v: i64, k: ParkKind) -> (String, String, i64, ParkKind) {
    (name(ty), name(id), v, k)
}

fn configs() -> Vec<(ClaimMode, usize)> {
    vec![
        (lease(30.0), 1),
        (lease(30.0), 3),
        (ClaimMode::LockedTransaction, 1),
        (ClaimMode::LockedTransaction, 3),
    ]
}

/// Claims until nothing is handed out, publishing everything; checks that each aggregate's
/// versions go out in order, one after the other (from the first handed out here).
async fn drain_in_order(store: &PostgresOutboxStore, what: &str) {
    let mut last: HashMap<(String, String), i64> = HashMap::new();
    for _ in 0..50 {
        let b = claim_run(store, "drain", 10, 2).await;
        if b.records.is_empty() {
            store.release(&b.handle).await.unwrap();
            if b.parked.is_empty() && b.gaps_held == 0 {
                return;
            }
            continue;
        }
        for r in &b.records {
            let k = (
                r.envelope.aggregate_type.clone(),
                r.envelope.aggregate_id.clone(),
            );
            let v = r.envelope.aggregate_version;
            if let Some(p) = last.insert(k.clone(), v) {
                assert_eq!(v, p + 1, "{what}: {} v{v} after v{p}", name(&k.1));
            }
        }
        common::publish_all(store, &b).await;
    }
    panic!("{what}: never drained");
}

async fn parked_message(store: &PostgresOutboxStore, id: EventId) -> String {
    store.parked_event(id).await.unwrap().reason.error.message
}

async fn exec(ctx: &Ctx, sql: &str) {
    sqlx::query(&sql.replace("{s}", &ctx.schema))
        .execute(&ctx.pool)
        .await
        .unwrap();
}

/// A pool of its own (application name `app`).
async fn own_pool(max: u32, app: &str) -> sqlx::PgPool {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| common::DEFAULT_URL.to_owned());
    let opts: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(opts.application_name(app))
        .await
        .unwrap()
}

/// Terminates the backends of `app` in `state`; returns how many.
async fn terminate(ctx: &Ctx, app: &str, state: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND state = $2) t",
    )
    .bind(app)
    .bind(state)
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

// ---------------------------------------------------------------------------------------------
// 1. A window of many kinds of aggregates.
// ---------------------------------------------------------------------------------------------

/// One window: an aggregate with state (v1 published), one whose state row has no last
/// version (a lease claim released), twins of both differing only in type (no state: first
/// versions 7 and 4 accepted), one without state (a batch 3..5), names of exactly
/// `MAX_AGGREGATE_NAME_BYTES` (type or id), and names one byte over (parked, `bad_key`).
async fn many_kinds(mode: ClaimMode, run: usize) {
    let ctx = ctx!(6);
    let Some(texts) = texts().await else { return };
    let what = format!("{mode:?} run={run}");
    let prep = store_with(&ctx, lease(30.0), true, LONG_GAP);
    prep.migrate().await.unwrap();
    put(&ctx, &prep, &[ev("order", "known", 1)]).await;
    let b = claim_run(&prep, "prep", 10, 1).await;
    assert_eq!(b.records.len(), 1);
    common::publish_all(&prep, &b).await;
    put(&ctx, &prep, &[ev("order", "nulls", 1)]).await;
    let b = claim_run(&prep, "prep", 10, 1).await;
    assert_eq!(b.records.len(), 1);
    prep.release(&b.handle).await.unwrap();
    put(&ctx, &prep, &[ev("order", "known", 2)]).await;
    put(&ctx, &prep, &[ev("order", "known", 3)]).await;
    put(&ctx, &prep, &[ev("invoice", "nulls", 7)]).await;
    put(&ctx, &prep, &[ev("invoice", "known", 4)]).await;
    put(
        &ctx,
        &prep,
        &[
            ev("order", "none", 3),
            ev("order", "none", 4),
            ev("order", "none", 5),
        ],
    )
    .await;
    let at = "l".repeat(MAX_AGGREGATE_NAME_BYTES);
    let at_t = "t".repeat(MAX_AGGREGATE_NAME_BYTES);
    // (The builder's default limits refuse such names: written by plain SQL.)
    put_raw(&ctx, "order", &at, 2).await;
    put_raw(&ctx, &at_t, "x", 1).await;
    let over = "b".repeat(MAX_AGGREGATE_NAME_BYTES + 1);
    let over_t = "u".repeat(MAX_AGGREGATE_NAME_BYTES + 1);
    put_raw(&ctx, "order", &over, 1).await;
    put_raw(&ctx, &over_t, "y", 1).await;
    let mut rng = Rng(1);
    assert!(diff_all(&ctx, &texts, &mut rng, &what).await > 0);

    let store = store_with(&ctx, mode, true, LONG_GAP);
    let b = claim_run(&store, "y", 50, run).await;
    let r = run > 1;
    let mut want = vec![
        rec("order", "known", 2, false),
        rec("order", "nulls", 1, false),
        rec("invoice", "nulls", 7, false),
        rec("invoice", "known", 4, false),
        rec("order", "none", 3, false),
        rec("order", &at, 2, false),
        rec(&at_t, "x", 1, false),
    ];
    if r {
        want.push(rec("order", "known", 3, false));
        want.push(rec("order", "none", 4, false));
        want.push(rec("order", "none", 5, false));
    }
    want.sort();
    assert_eq!(got(&b), want, "{what}");
    assert_eq!(
        parked_of(&b),
        vec![
            prk(&over_t, "y", 1, ParkKind::PermanentError),
            prk("order", &over, 1, ParkKind::PermanentError)
        ],
        "{what}"
    );
    assert_eq!(b.gaps_held, 0, "{what}");
    // (No oracle while a locked claim is open: its row locks would make it wait.)
    common::publish_all(&store, &b).await;
    diff_all(&ctx, &texts, &mut rng, &what).await;
    drain_in_order(&store, &what).await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_of_many_kinds_of_aggregates() {
    for (mode, run) in configs() {
        many_kinds(mode, run).await;
    }
}

// ---------------------------------------------------------------------------------------------
// 2. An expired lease names a version above versions appended later.
// ---------------------------------------------------------------------------------------------

/// Relay x (lease 0.2 s) claims e v5 (v6 too with `x_run` 2) and never ends its claim; e v3
/// and v4 are appended after the lease expired, and invoice/e v2 (same id, other type, no
/// state). The next claim's last version of e is 4 (one below the lease's row): v3 and v4 are
/// parked out of order (never handed out after v5), v5 goes out possibly sent (and v6, with
/// runs, possibly sent when x's run covered it); invoice/e v2 is its own aggregate.
async fn expired_lease(mode: ClaimMode, run: usize, x_run: usize) {
    let ctx = ctx!(6);
    let Some(texts) = texts().await else { return };
    let what = format!("{mode:?} run={run} x_run={x_run}");
    let x = store_with(&ctx, lease(0.2), true, LONG_GAP);
    x.migrate().await.unwrap();
    put(&ctx, &x, &[ev("order", "e", 5), ev("order", "e", 6)]).await;
    let bx = claim_run(&x, "x", 10, x_run).await;
    assert_eq!(bx.records.len(), x_run, "{what}");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let v3 = ev("order", "e", 3);
    put(&ctx, &x, std::slice::from_ref(&v3)).await;
    put(&ctx, &x, &[ev("order", "e", 4)]).await;
    put(&ctx, &x, &[ev("invoice", "e", 2)]).await;
    let mut rng = Rng(2);
    assert!(diff_all(&ctx, &texts, &mut rng, &what).await > 0);

    let y = store_with(&ctx, mode, true, LONG_GAP);
    let b = claim_run(&y, "y", 20, run).await;
    let mut want = vec![rec("order", "e", 5, true), rec("invoice", "e", 2, false)];
    if run > 1 {
        want.push(rec("order", "e", 6, x_run > 1));
    }
    want.sort();
    assert_eq!(got(&b), want, "{what}");
    assert_eq!(
        parked_of(&b),
        vec![
            prk("order", "e", 3, ParkKind::OutOfOrder),
            prk("order", "e", 4, ParkKind::OutOfOrder)
        ],
        "{what}"
    );
    let msg = parked_message(&y, v3.event_id).await;
    assert!(msg.contains("below 5"), "{what}: {msg}");
    common::publish_all(&y, &b).await;
    diff_all(&ctx, &texts, &mut rng, &what).await;
    if run == 1 {
        let b = claim_run(&y, "y", 20, 1).await;
        // v6 possibly sent when x's run covered it (its mark survives the promotion).
        assert_eq!(got(&b), vec![rec("order", "e", 6, x_run > 1)], "{what}");
        common::publish_all(&y, &b).await;
    }
    // x's late completion is refused: the versions were taken over.
    let outs: Vec<Outcome> = bx
        .records
        .iter()
        .map(|r| published(&r.envelope, 0))
        .collect();
    let rep = x.complete(&bx.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, 0, "{what}: {rep:?}");
    drain_in_order(&y, &what).await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_names_a_version_above_later_appends() {
    for (mode, run) in configs() {
        for x_run in [1, 2] {
            expired_lease(mode, run, x_run).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. `maybe_delivered` rows after a locked takeover, parked.
// ---------------------------------------------------------------------------------------------

/// x (lease 0.2 s) claims m v5..v7 in a run and never ends it; a locked claim takes over v5
/// (possibly sent; v6 and v7 marked) and parks it (a permanent error); m v4 is appended. No
/// lease is left, but v5 (parked, `maybe_delivered`) still counts: m's last version is 4, v4
/// is parked out of order, nothing of m goes out; after the operator retries v5 it goes out
/// possibly sent, and its run too.
async fn takeover_marks(mode: ClaimMode, run: usize) {
    let ctx = ctx!(6);
    let Some(texts) = texts().await else { return };
    let what = format!("{mode:?} run={run}");
    let x = store_with(&ctx, lease(0.2), true, LONG_GAP);
    x.migrate().await.unwrap();
    let k = locked_store(&ctx, true, Duration::from_secs(30));
    let m5 = ev("order", "m", 5);
    put(
        &ctx,
        &x,
        &[m5.clone(), ev("order", "m", 6), ev("order", "m", 7)],
    )
    .await;
    put(&ctx, &x, &[ev("order", "other", 1)]).await;
    let bx = claim_run(&x, "x", 10, 3).await;
    assert_eq!(bx.records.len(), 4, "{what}");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let bk = claim_run(&k, "k", 1, 1).await;
    assert_eq!(got(&bk), vec![rec("order", "m", 5, true)], "{what}");
    k.complete(&bk.handle, &[common::park(&bk.records[0].envelope)])
        .await
        .unwrap();
    let m4 = ev("order", "m", 4);
    put(&ctx, &x, std::slice::from_ref(&m4)).await;
    let mut rng = Rng(3);
    assert!(diff_all(&ctx, &texts, &mut rng, &what).await > 0);

    let y = store_with(&ctx, mode, true, LONG_GAP);
    let b = claim_run(&y, "y", 20, run).await;
    assert_eq!(got(&b), vec![rec("order", "other", 1, true)], "{what}");
    assert_eq!(
        parked_of(&b),
        vec![prk("order", "m", 4, ParkKind::OutOfOrder)],
        "{what}"
    );
    common::publish_all(&y, &b).await;
    diff_all(&ctx, &texts, &mut rng, &what).await;
    let b = claim_run(&y, "y", 20, run).await;
    assert!(b.records.is_empty(), "{what}: {:?}", got(&b));
    y.release(&b.handle).await.unwrap();
    y.retry_parked(m5.event_id, "op").await.unwrap();
    diff_all(&ctx, &texts, &mut rng, &what).await;
    let b = claim_run(&y, "y", 20, run).await;
    let mut want = vec![rec("order", "m", 5, true)];
    if run > 1 {
        want.push(rec("order", "m", 6, true));
        want.push(rec("order", "m", 7, true));
    }
    assert_eq!(got(&b), want, "{what}");
    assert!(b.parked.is_empty(), "{what}: {:?}", parked_of(&b));
    common::publish_all(&y, &b).await;
    drain_in_order(&y, &what).await;
    let msg = parked_message(&y, m4.event_id).await;
    assert!(msg.contains("below 5"), "{what}: {msg}");
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_maybe_delivered_rows_after_a_locked_takeover_still_count() {
    for (mode, run) in configs() {
        takeover_marks(mode, run).await;
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Copies and gaps.
// ---------------------------------------------------------------------------------------------

/// Two copies of c v1 (no state) and c v2: the first copy goes out alone; after it, the
/// second is parked out of order and v2 goes out. g: v1 published, v3 held, then parked after
/// the gap timeout; v2 goes out, and v3 after the operator's retry.
async fn copies_and_gaps(mode: ClaimMode, run: usize) {
    let ctx = ctx!(6);
    let Some(texts) = texts().await else { return };
    let what = format!("{mode:?} run={run}");
    let s = store_with(&ctx, mode, true, Duration::from_millis(300));
    s.migrate().await.unwrap();
    let mut rng = Rng(4);
    put(&ctx, &s, &[ev("order", "g", 1)]).await;
    let b = claim_run(&s, "s", 10, run).await;
    common::publish_all(&s, &b).await;
    let c1 = ev("order", "c", 1);
    let c1b = ev("order", "c", 1);
    put(&ctx, &s, std::slice::from_ref(&c1)).await;
    put(&ctx, &s, std::slice::from_ref(&c1b)).await;
    put(&ctx, &s, &[ev("order", "c", 2)]).await;
    let g3 = ev("order", "g", 3);
    put(&ctx, &s, std::slice::from_ref(&g3)).await;
    assert!(diff_all(&ctx, &texts, &mut rng, &what).await > 0);
    let b = claim_run(&s, "s", 10, run).await;
    assert_eq!(got(&b), vec![rec("order", "c", 1, false)], "{what}");
    assert_eq!(b.records[0].envelope.event_id, c1.event_id, "{what}");
    assert_eq!(b.gaps_held, 1, "{what}");
    common::publish_all(&s, &b).await;
    diff_all(&ctx, &texts, &mut rng, &what).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    diff_all(&ctx, &texts, &mut rng, &what).await;
    // The completion made c's second copy a candidate again: parked out of order (at or
    // below the last version now known), g v3 parked after the gap timeout.
    let b = claim_run(&s, "s", 10, run).await;
    assert!(b.records.is_empty(), "{what}: {:?}", got(&b));
    assert_eq!(
        parked_of(&b),
        vec![
            prk("order", "c", 1, ParkKind::OutOfOrder),
            prk("order", "g", 3, ParkKind::VersionGap)
        ],
        "{what}"
    );
    s.release(&b.handle).await.unwrap();
    let msg = parked_message(&s, c1b.event_id).await;
    assert!(msg.contains("at or below 1"), "{what}: {msg}");
    diff_all(&ctx, &texts, &mut rng, &what).await;
    let b = claim_run(&s, "s", 10, run).await;
    assert_eq!(got(&b), vec![rec("order", "c", 2, false)], "{what}");
    common::publish_all(&s, &b).await;
    put(&ctx, &s, &[ev("order", "g", 2)]).await;
    diff_all(&ctx, &texts, &mut rng, &what).await;
    let b = claim_run(&s, "s", 10, run).await;
    assert_eq!(got(&b), vec![rec("order", "g", 2, false)], "{what}");
    common::publish_all(&s, &b).await;
    s.retry_parked(g3.event_id, "op").await.unwrap();
    diff_all(&ctx, &texts, &mut rng, &what).await;
    let b = claim_run(&s, "s", 10, run).await;
    assert_eq!(got(&b), vec![rec("order", "g", 3, false)], "{what}");
    common::publish_all(&s, &b).await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_and_gaps_of_aggregates_with_and_without_state() {
    for (mode, run) in configs() {
        copies_and_gaps(mode, run).await;
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Crash points.
// ---------------------------------------------------------------------------------------------

/// x's lease (0.2 s, run of v5 and v6) expires; a locked claim takes it over and the server
/// terminates its connection: the takeover rolls back, x's lease still names v5. v4 appended
/// after: parked out of order; v5 goes out possibly sent (and v6 with runs).
async fn terminated_takeover(mode: ClaimMode, run: usize) {
    let ctx = ctx!(6);
    let Some(texts) = texts().await else { return };
    let what = format!("{mode:?} run={run}");
    let x = store_with(&ctx, lease(0.2), true, LONG_GAP);
    x.migrate().await.unwrap();
    let app = format!("unk47-k-{}", &ctx.schema[ctx.schema.len() - 6..]);
    let kpool = own_pool(2, &app).await;
    let k = PostgresOutboxStore::builder(kpool.clone())
        .schema(&ctx.schema)
        .claim_mode(ClaimMode::LockedTransaction)
        .accept_first_version(true)
        .gap_timeout(LONG_GAP)
        .build()
        .unwrap();
    put(&ctx, &x, &[ev("order", "t", 5), ev("order", "t", 6)]).await;
    let bx = claim_run(&x, "x", 10, 2).await;
    assert_eq!(bx.records.len(), 2);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let bk = claim_run(&k, "k", 10, 1).await;
    assert_eq!(got(&bk), vec![rec("order", "t", 5, true)], "{what}");
    assert_eq!(terminate(&ctx, &app, "idle in transaction").await, 1);
    let outs = vec![published(&bk.records[0].envelope, 0)];
    assert!(k.complete(&bk.handle, &outs).await.is_err(), "{what}");
    let _ = k.release(&bk.handle).await;
    put(&ctx, &x, &[ev("order", "t", 4)]).await;
    let mut rng = Rng(5);
    assert!(diff_all(&ctx, &texts, &mut rng, &what).await > 0);
    let y = store_with(&ctx, mode, true, LONG_GAP);
    let b = claim_run(&y, "y", 10, run).await;
    let mut want = vec![rec("order", "t", 5, true)];
    if run > 1 {
        want.push(rec("order", "t", 6, true));
    }
    assert_eq!(got(&b), want, "{what}");
    assert_eq!(
        parked_of(&b),
        vec![prk("order", "t", 4, ParkKind::OutOfOrder)],
        "{what}"
    );
    common::publish_all(&y, &b).await;
    drain_in_order(&y, &what).await;
    kpool.close().await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_locked_takeover_leaves_the_lease_counting() {
    for (mode, run) in configs() {
        terminated_takeover(mode, run).await;
    }
}

/// A decision statement terminated mid-way (its parks slowed by a trigger): nothing of it
/// stays; the next claim decides as the first would have.
async fn terminated_decision(mode: ClaimMode) {
    let ctx = ctx!(6);
    let Some(texts) = texts().await else { return };
    let what = format!("{mode:?}");
    let x = store_with(&ctx, lease(0.2), true, LONG_GAP);
    x.migrate().await.unwrap();
    put(&ctx, &x, &[ev("order", "d", 5), ev("order", "d", 6)]).await;
    let bx = claim_run(&x, "x", 10, 1).await;
    assert_eq!(bx.records.len(), 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    put(&ctx, &x, &[ev("order", "d", 3)]).await;
    put(&ctx, &x, &[ev("order", "f", 2)]).await;
    exec(
        &ctx,
        "CREATE FUNCTION \"{s}\".unk47_slow() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(5); RETURN NEW; END $$",
    )
    .await;
    exec(
        &ctx,
        "CREATE TRIGGER unk47_slow BEFORE UPDATE ON \"{s}\".outbox_events FOR EACH ROW \
         WHEN (NEW.status = 'parked' AND OLD.status = 'pending') \
         EXECUTE FUNCTION \"{s}\".unk47_slow()",
    )
    .await;
    let app = format!("unk47-y-{}", &ctx.schema[ctx.schema.len() - 6..]);
    let ypool = own_pool(2, &app).await;
    let y = PostgresOutboxStore::builder(ypool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .accept_first_version(true)
        .gap_timeout(LONG_GAP)
        .build()
        .unwrap();
    let y2 = y.clone();
    let task = tokio::spawn(async move { y2.claim(&ClaimRequest::new("y", 10).with_run(2)).await });
    let deadline = Instant::now() + Duration::from_secs(4);
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if terminate(&ctx, &app, "active").await > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{what}: the claim never ran");
    }
    assert!(task.await.unwrap().is_err(), "{what}");
    exec(&ctx, "DROP TRIGGER unk47_slow ON \"{s}\".outbox_events").await;
    let mut rng = Rng(6);
    assert!(diff_all(&ctx, &texts, &mut rng, &what).await > 0);
    let z = store_with(&ctx, mode, true, LONG_GAP);
    let b = claim_run(&z, "z", 10, 2).await;
    assert_eq!(
        got(&b),
        vec![
            rec("order", "d", 5, true),
            rec("order", "d", 6, false),
            rec("order", "f", 2, false)
        ],
        "{what}"
    );
    assert_eq!(
        parked_of(&b),
        vec![prk("order", "d", 3, ParkKind::OutOfOrder)],
        "{what}"
    );
    common::publish_all(&z, &b).await;
    drain_in_order(&z, &what).await;
    ypool.close().await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_terminated_mid_statement_leaves_nothing() {
    for mode in modes() {
        terminated_decision(mode).await;
    }
}

// ---------------------------------------------------------------------------------------------
// 6. Randomized: producers, two relays, operators, crashes; ledger and differential oracle.
// ---------------------------------------------------------------------------------------------

struct World {
    ctx: Ctx,
    l: L,
    texts: Texts,
    short: PostgresOutboxStore,
    long: PostgresOutboxStore,
    locked: PostgresOutboxStore,
    app: String,
    /// Events handed out by lease claims that ended without outcome or release.
    unresolved: HashSet<Uuid>,
    /// Owners of such claims under the long lease.
    abandoned_long: Vec<String>,
    /// An abandoned locked claim may hold its aggregates until then.
    locked_open_until: Option<Instant>,
    next: HashMap<String, i64>,
    open: Vec<Tx>,
    handouts: usize,
    resends: usize,
    diffs: usize,
}

const AGGS: [&str; 5] = ["a", "b", "c", "d", "e"];

impl World {
    fn seen(&mut self, c: &Claim, what: &str) {
        self.handouts += c.b.records.len();
        for r in &c.b.records {
            let id = r.envelope.event_id.as_uuid();
            if r.maybe_sent_before {
                self.resends += 1;
            }
            assert!(
                !self.unresolved.contains(&id) || r.maybe_sent_before,
                "{what}: {} v{} handed out again after a lease that ended without outcome, \
                 not flagged maybe_sent_before",
                r.envelope.aggregate_id,
                r.envelope.aggregate_version
            );
        }
    }

    async fn lease_claim(&mut self, rng: &mut Rng, step: usize, what: &str) {
        let use_short = rng.chance(60);
        let owner = format!("r{step}");
        let run = [1, 1, 3][rng.below(3)];
        let limit = 1 + rng.below(8);
        let c = {
            let store = if use_short { &self.short } else { &self.long };
            claim(&self.l, store, &owner, limit, run).await
        };
        self.seen(&c, what);
        let store = if use_short { &self.short } else { &self.long };
        if c.b.records.is_empty() {
            store.release(&c.b.handle).await.unwrap();
            return;
        }
        match rng.below(10) {
            0..=4 => {
                let outs = outcomes(&c.b, usize::MAX, None);
                complete(&self.l, store, &c, &outs).await;
            }
            5 => {
                let outs = outcomes(&c.b, rng.below(2), Some(retry));
                complete(&self.l, store, &c, &outs).await;
            }
            6 => {
                let outs = outcomes(&c.b, rng.below(2), Some(common::park));
                complete(&self.l, store, &c, &outs).await;
            }
            7 => store.release(&c.b.handle).await.unwrap(),
            _ => {
                // Abandoned: no outcome, no release.
                self.unresolved.extend(c.ids());
                if !use_short {
                    self.abandoned_long.push(owner);
                }
            }
        }
    }

    async fn locked_claim(&mut self, rng: &mut Rng, step: usize, what: &str) {
        let run = [1, 1, 3][rng.below(3)];
        let limit = 1 + rng.below(8);
        let c = claim(&self.l, &self.locked, &format!("k{step}"), limit, run).await;
        self.seen(&c, what);
        if c.b.records.is_empty() {
            self.locked.release(&c.b.handle).await.unwrap();
            return;
        }
        match rng.below(10) {
            0..=4 => {
                let outs = outcomes(&c.b, usize::MAX, None);
                complete(&self.l, &self.locked, &c, &outs).await;
            }
            5 => {
                let outs = outcomes(&c.b, rng.below(2), Some(retry));
                complete(&self.l, &self.locked, &c, &outs).await;
            }
            6 => self.locked.release(&c.b.handle).await.unwrap(),
            7 | 8 => {
                // The server ends the claim's connection.
                terminate(&self.ctx, &self.app, "idle in transaction").await;
                let outs = outcomes(&c.b, usize::MAX, None);
                let r = try_complete(&self.l, &self.locked, &c, &outs).await;
                assert!(
                    r.is_err(),
                    "{what}: a completion on a terminated claim: {r:?}"
                );
                let _ = self.locked.release(&c.b.handle).await;
            }
            _ => {
                // Abandoned: ended by `locked_max_hold` (1 s).
                self.locked_open_until = Some(Instant::now() + Duration::from_millis(1_600));
            }
        }
    }

    /// A lease claim and a locked claim at once; both publish everything.
    async fn both(&mut self, step: usize, what: &str) {
        let (p, q) = (format!("p{step}"), format!("q{step}"));
        let (a, b) = tokio::join!(
            claim(&self.l, &self.short, &p, 5, 3),
            claim(&self.l, &self.locked, &q, 5, 1)
        );
        self.seen(&a, what);
        self.seen(&b, what);
        let oa = outcomes(&a.b, usize::MAX, None);
        let ob = outcomes(&b.b, usize::MAX, None);
        let (ra, rb) = tokio::join!(
            try_complete(&self.l, &self.short, &a, &oa),
            try_complete(&self.l, &self.locked, &b, &ob)
        );
        assert_eq!(ra.unwrap().superseded, 0, "{what}");
        assert_eq!(rb.unwrap().superseded, 0, "{what}");
    }

    async fn append(&mut self, rng: &mut Rng) {
        let agg = AGGS[rng.below(AGGS.len())].to_owned();
        let v0 = *self.next.get(&agg).unwrap_or(&1);
        let mut vs = vec![v0];
        if rng.chance(25) {
            vs.push(v0 + 1);
        }
        // A copy of an earlier version now and then.
        if v0 > 1 && rng.chance(5) {
            vs = vec![v0 - 1];
        } else {
            self.next.insert(agg.clone(), v0 + vs.len() as i64);
        }
        let mut t = open(&self.ctx).await;
        t.put(&self.short, &self.l, &agg, &vs).await;
        if self.open.len() < 3 && rng.chance(50) {
            self.open.push(t);
        } else {
            t.commit(&self.l).await;
        }
    }

    async fn end_open(&mut self, rng: &mut Rng) {
        if self.open.is_empty() {
            return;
        }
        let t = self.open.remove(rng.below(self.open.len()));
        if rng.chance(10) {
            t.rollback(&self.l).await;
        } else {
            t.commit(&self.l).await;
        }
    }

    async fn operator_step(&mut self, rng: &mut Rng) {
        let parked: Vec<Row> = rows(&self.ctx)
            .await
            .into_iter()
            .filter(|r| r.status == "parked")
            .collect();
        match rng.below(4) {
            0 => {
                operator(&self.l, &self.short, &self.ctx).await;
            }
            1 if !parked.is_empty() => {
                let r = &parked[rng.below(parked.len())];
                let s = self.l.tick();
                let new = match self
                    .short
                    .reissue_parked(EventId::from_uuid(r.event_id), "op", "again")
                    .await
                {
                    Ok(new) => new,
                    Err(e) => {
                        assert_eq!(e.kind, outbox_core::StoreErrorKind::Conflict, "{e:?}");
                        return;
                    }
                };
                let mut g = self.l.g();
                g.rows.insert(
                    new.as_uuid(),
                    Info {
                        agg: r.aggregate_id.clone(),
                        v: r.aggregate_version,
                        commit: Some(s),
                        rolled_back: false,
                    },
                );
            }
            2 if !parked.is_empty() => {
                let r = &parked[rng.below(parked.len())];
                let done = self
                    .short
                    .discard_parked(EventId::from_uuid(r.event_id), "op", "gone")
                    .await;
                if let Err(e) = done {
                    assert_eq!(e.kind, outbox_core::StoreErrorKind::Conflict, "{e:?}");
                }
            }
            _ => {
                if !self.abandoned_long.is_empty() {
                    let o = self
                        .abandoned_long
                        .remove(rng.below(self.abandoned_long.len()));
                    self.short.release_claims_of(&o, "op").await.unwrap();
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_relays_producers_and_operators() {
    let seed = common::env_seed("UNK47_SEED").unwrap_or(47);
    let secs = std::env::var("UNK47_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40u64);
    eprintln!("randomized_relays_producers_and_operators: UNK47_SEED={seed} UNK47_SECS={secs}");
    let mut rng = Rng(seed);
    let ctx = ctx!(12);
    let Some(texts) = texts().await else { return };
    let gap = Duration::from_millis(800);
    let short = store_with(&ctx, lease(0.3), true, gap);
    short.migrate().await.unwrap();
    let long = store_with(&ctx, lease(30.0), true, gap);
    let app = format!("unk47-r-{}", &ctx.schema[ctx.schema.len() - 6..]);
    let kpool = own_pool(3, &app).await;
    let locked = PostgresOutboxStore::builder(kpool.clone())
        .schema(&ctx.schema)
        .claim_mode(ClaimMode::LockedTransaction)
        .accept_first_version(true)
        .gap_timeout(gap)
        .locked_max_hold(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut w = World {
        ctx,
        l: L::default(),
        texts,
        short,
        long,
        locked,
        app,
        unresolved: HashSet::new(),
        abandoned_long: Vec::new(),
        locked_open_until: None,
        next: HashMap::new(),
        open: Vec::new(),
        handouts: 0,
        resends: 0,
        diffs: 0,
    };
    let start = Instant::now();
    let mut step = 0;
    while start.elapsed() < Duration::from_secs(secs) && step < 2_000 {
        step += 1;
        let what = format!("seed {seed} step {step}");
        match rng.below(100) {
            0..=29 => w.append(&mut rng).await,
            30..=41 => w.end_open(&mut rng).await,
            42..=61 => w.lease_claim(&mut rng, step, &what).await,
            62..=77 => w.locked_claim(&mut rng, step, &what).await,
            78..=83 => w.both(step, &what).await,
            84..=91 => w.operator_step(&mut rng).await,
            _ => tokio::time::sleep(Duration::from_millis(350)).await,
        }
        check(&w.ctx, &w.l, true, &what).await;
        let quiet = w.locked_open_until.is_none_or(|t| Instant::now() > t);
        if quiet && step % 3 == 0 {
            w.diffs += diff_all(&w.ctx, &w.texts, &mut rng, &what).await;
        }
    }
    while !w.open.is_empty() {
        let t = w.open.remove(0);
        t.commit(&w.l).await;
    }
    for o in std::mem::take(&mut w.abandoned_long) {
        w.short.release_claims_of(&o, "op").await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    let what = format!("seed {seed} settle");
    w.diffs += diff_all(&w.ctx, &w.texts, &mut rng, &what).await;
    settle(&w.ctx, &w.l, &w.short, 1, &what).await;
    eprintln!(
        "seed {seed}: {step} steps, {} handed out ({} possibly sent), {} decisions compared",
        w.handouts, w.resends, w.diffs
    );
    assert!(w.handouts > 0 && w.diffs > 0);
    kpool.close().await;
    w.ctx.drop().await;
}

// ---------------------------------------------------------------------------------------------
// 7. The oracle itself.
// ---------------------------------------------------------------------------------------------

/// The differential oracle sees a difference: the grouped read made to ignore the row an expired lease
/// names decides the lease's window differently from the statement before the change; the
/// unmutated statement does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oracle_sees_a_mutated_grouped_read() {
    let ctx = ctx!(6);
    let Some(texts) = texts().await else { return };
    let x = store_with(&ctx, lease(0.2), true, LONG_GAP);
    x.migrate().await.unwrap();
    put(&ctx, &x, &[ev("order", "e", 5), ev("order", "e", 6)]).await;
    let bx = claim_run(&x, "x", 10, 1).await;
    assert_eq!(bx.records.len(), 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    put(&ctx, &x, &[ev("order", "e", 3)]).await;
    let ids: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT id FROM \"{}\".outbox_events WHERE NOT blocked ORDER BY id",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert!(diff_checked(&ctx, &texts, &ids, "unmutated").await.unwrap() > 0);
    let mutated = Texts(
        texts
            .0
            .iter()
            .map(|st| {
                let m = "SELECT s.lease_row";
                let at = st.new.find(m).unwrap();
                assert!(
                    at > st.new.find("c AS MATERIALIZED (").unwrap()
                        && at < st.new.find("h AS MATERIALIZED (").unwrap(),
                    "in c's grouped read"
                );
                let mut new = st.new.clone();
                new.replace_range(at..at + m.len(), "SELECT NULL::int8");
                Stmt {
                    lease: st.lease,
                    runs: st.runs,
                    new,
                    old: st.old.clone(),
                }
            })
            .collect(),
    );
    let e = diff_checked(&ctx, &mutated, &ids, "mutated").await;
    assert!(
        e.is_err(),
        "the oracle missed a mutant of the grouped read: {e:?}"
    );
    ctx.drop().await;
}

// ---------------------------------------------------------------------------------------------
// Found by this pass (pre-existing, fixed).
// ---------------------------------------------------------------------------------------------

/// x (lease 0.2 s) claims e v5 and v6 in one run and never ends its claim (v6 may have been
/// sent). After the lease expired, e v3 is appended. A Lease claim of heads only takes over v5
/// (possibly sent) and must mark v6 `maybe_delivered` (`mark_run`: v6 <= the lease's
/// `lease_upto`), so that the claim after it hands v6 out as possibly sent. But the same
/// statement parks v3 out of order and `promote` unblocks the next blocked row of e, v6: two
/// data-modifying CTEs update the same row in one statement, and PostgreSQL applies only one
/// of them (`promote` won): v6 went out later with `maybe_sent_before` false.
/// Without v3 (`control`) the mark held. Pre-existing (the statement before the per-aggregate
/// read wrote exactly the same rows); fixed: the decision writes the mark and the promotion
/// of a row in one update (`mark_run`, sql.rs). Locked mode was not affected here (its
/// decision runs again after the parks committed).
async fn mark_lost(with_stale: bool) -> (bool, bool) {
    let ctx = common::Ctx::new(6).await.unwrap();
    let texts = texts().await.unwrap();
    let x = store_with(&ctx, lease(0.2), true, LONG_GAP);
    x.migrate().await.unwrap();
    put(&ctx, &x, &[ev("order", "e", 5), ev("order", "e", 6)]).await;
    let bx = claim_run(&x, "x", 10, 2).await;
    assert_eq!(bx.records.len(), 2);
    tokio::time::sleep(Duration::from_millis(400)).await;
    if with_stale {
        put(&ctx, &x, &[ev("order", "e", 3)]).await;
    }
    let mut rng = Rng(7);
    assert!(diff_all(&ctx, &texts, &mut rng, "mark_lost").await > 0);
    let y = store_with(&ctx, lease(30.0), true, LONG_GAP);
    let b = claim_run(&y, "y", 10, 1).await;
    assert_eq!(got(&b), vec![rec("order", "e", 5, true)]);
    let marked: bool = sqlx::query_scalar(&format!(
        "SELECT maybe_delivered FROM \"{}\".outbox_events WHERE aggregate_version = 6",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    common::publish_all(&y, &b).await;
    let b = claim_run(&y, "y", 10, 1).await;
    assert_eq!(b.records.len(), 1);
    assert_eq!(b.records[0].envelope.aggregate_version, 6);
    let flagged = b.records[0].maybe_sent_before;
    common::publish_all(&y, &b).await;
    ctx.drop().await;
    (marked, flagged)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_the_possibly_sent_mark_holds_without_a_stale_row() {
    assert_eq!(mark_lost(false).await, (true, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_row_keeps_the_possibly_sent_mark_of_the_row_it_promotes() {
    assert_eq!(mark_lost(true).await, (true, true));
}
