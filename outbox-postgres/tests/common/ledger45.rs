// The ledger, claim and check helpers of the adversary passes adv45 and atk45
// (`adversary_claim45.rs`, `adversary_takeover45.rs`), included by both test files (each its
// own test binary) with `include!`: what they assert is described at their definitions.

const LONG_GAP: Duration = Duration::from_secs(30);

fn store_with(
    ctx: &Ctx,
    mode: ClaimMode,
    accept_first: bool,
    gap: Duration,
) -> PostgresOutboxStore {
    PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .accept_first_version(accept_first)
        .gap_timeout(gap)
        .build()
        .expect("build")
}

fn locked_store(ctx: &Ctx, accept_first: bool, hold: Duration) -> PostgresOutboxStore {
    PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(ClaimMode::LockedTransaction)
        .accept_first_version(accept_first)
        .gap_timeout(LONG_GAP)
        .locked_max_hold(hold)
        .build()
        .expect("build")
}

// ---------------------------------------------------------------------------------------------
// The ledger: appends, commits, claims and publications on one sequence.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Info {
    agg: String,
    v: i64,
    /// The sequence number taken right after the commit returned.
    commit: Option<u64>,
    rolled_back: bool,
}

#[derive(Default)]
struct Ledger {
    seq: u64,
    rows: HashMap<Uuid, Info>,
    /// Published event -> the sequence number taken before the claim that handed it out.
    pubs: HashMap<Uuid, u64>,
    /// Event -> the sequence number taken before the first claim that handed it out.
    first_handout: HashMap<Uuid, u64>,
    /// (aggregate, version) -> the copies handed out, in order.
    handed: HashMap<(String, i64), Vec<Uuid>>,
    /// Versions handed out by two different copies (each may have reached the broker).
    two_copies_sent: Vec<String>,
    /// Operator retries: (aggregate, version, sequence number taken before the call).
    retried: Vec<(String, i64, u64)>,
}

#[derive(Clone, Default)]
struct L(Arc<Mutex<Ledger>>);

impl L {
    fn tick(&self) -> u64 {
        let mut g = self.0.lock().unwrap();
        g.seq += 1;
        g.seq
    }

    fn g(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.0.lock().unwrap()
    }
}

/// A business transaction on its own connection.
struct Tx {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    events: Vec<Uuid>,
}

async fn open(ctx: &Ctx) -> Tx {
    Tx {
        tx: ctx.pool.begin().await.unwrap(),
        events: Vec::new(),
    }
}

impl Tx {
    /// Appends `vs` of `agg` in one statement (a batch: versions above the lowest are blocked
    /// at insert).
    async fn put(
        &mut self,
        store: &PostgresOutboxStore,
        l: &L,
        agg: &str,
        vs: &[i64],
    ) -> Vec<Uuid> {
        let evs: Vec<Envelope> = vs.iter().map(|v| event(agg, *v)).collect();
        store.append_many(&mut *self.tx, &evs).await.unwrap();
        let ids: Vec<Uuid> = evs.iter().map(|e| e.event_id.as_uuid()).collect();
        let mut g = l.g();
        for e in &evs {
            g.rows.insert(
                e.event_id.as_uuid(),
                Info {
                    agg: agg.to_owned(),
                    v: e.aggregate_version,
                    commit: None,
                    rolled_back: false,
                },
            );
        }
        self.events.extend(&ids);
        ids
    }

    async fn commit(self, l: &L) {
        self.tx.commit().await.unwrap();
        let s = l.tick();
        let mut g = l.g();
        for id in self.events {
            g.rows.get_mut(&id).unwrap().commit = Some(s);
        }
    }

    async fn rollback(self, l: &L) {
        self.tx.rollback().await.unwrap();
        let mut g = l.g();
        for id in self.events {
            g.rows.get_mut(&id).unwrap().rolled_back = true;
        }
    }
}

/// Appends and commits at once.
async fn append_now(
    ctx: &Ctx,
    store: &PostgresOutboxStore,
    l: &L,
    agg: &str,
    vs: &[i64],
) -> Vec<Uuid> {
    let mut t = open(ctx).await;
    let ids = t.put(store, l, agg, vs).await;
    t.commit(l).await;
    ids
}

struct Claim {
    b: ClaimedBatch,
    seq: u64,
}

impl Claim {
    fn ids(&self) -> Vec<Uuid> {
        self.b
            .records
            .iter()
            .map(|r| r.envelope.event_id.as_uuid())
            .collect()
    }
}

async fn claim(l: &L, store: &PostgresOutboxStore, owner: &str, limit: usize, run: usize) -> Claim {
    let seq = l.tick();
    let b = claim_run(store, owner, limit, run).await;
    handed_out(l, &b, seq);
    Claim { b, seq }
}

fn handed_out(l: &L, b: &ClaimedBatch, seq: u64) {
    let mut g = l.g();
    for r in &b.records {
        let id = r.envelope.event_id.as_uuid();
        g.first_handout.entry(id).or_insert(seq);
        let key = (
            r.envelope.aggregate_id.clone(),
            r.envelope.aggregate_version,
        );
        let copies = g.handed.entry(key.clone()).or_default();
        if !copies.contains(&id) {
            copies.push(id);
            if copies.len() > 1 {
                let msg = format!("{} v{}: copies {:?}", key.0, key.1, copies);
                g.two_copies_sent.push(msg);
            }
        }
    }
}

/// Outcomes for `b`: per run, the first `n` published, then `tail` for the next record.
fn outcomes(b: &ClaimedBatch, n: usize, tail: Option<fn(&Envelope) -> Outcome>) -> Vec<Outcome> {
    let mut outs = Vec::new();
    let mut i = 0;
    while i < b.records.len() {
        let mut j = i + 1;
        while j < b.records.len() && b.records[j].run_position > 0 {
            j += 1;
        }
        for (k, r) in b.records[i..j].iter().enumerate() {
            if k < n {
                outs.push(published(&r.envelope, k as i64));
            } else {
                if let Some(t) = tail {
                    outs.push(t(&r.envelope));
                }
                break;
            }
        }
        i = j;
    }
    outs
}

fn record_pubs(l: &L, c: &Claim, outs: &[Outcome], rep: &CompletionReport) {
    let refused: HashSet<Uuid> = rep.superseded_events.iter().map(|e| e.as_uuid()).collect();
    let mut g = l.g();
    for o in outs {
        if matches!(o, Outcome::Published { .. }) && !refused.contains(&o.event_id().as_uuid()) {
            g.pubs.insert(o.event_id().as_uuid(), c.seq);
        }
    }
}

async fn try_complete(
    l: &L,
    store: &PostgresOutboxStore,
    c: &Claim,
    outs: &[Outcome],
) -> Result<CompletionReport, StoreError> {
    let rep = store.complete(&c.b.handle, outs).await?;
    record_pubs(l, c, outs, &rep);
    Ok(rep)
}

/// Completes `c` with `outs`; a live claim's outcomes must all apply.
async fn complete(l: &L, store: &PostgresOutboxStore, c: &Claim, outs: &[Outcome]) {
    let rep = try_complete(l, store, c, outs).await.unwrap();
    assert_eq!(
        rep.superseded, 0,
        "a live claim's outcomes are refused: {rep:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// The checks.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, sqlx::FromRow)]
struct Row {
    id: i64,
    event_id: Uuid,
    aggregate_id: String,
    aggregate_version: i64,
    status: String,
    blocked: bool,
    park_kind: Option<String>,
    maybe_delivered: bool,
}

async fn rows(ctx: &Ctx) -> Vec<Row> {
    sqlx::query_as(&format!(
        "SELECT id, event_id, aggregate_id, aggregate_version, status, blocked, park_kind, \
                maybe_delivered \
         FROM \"{}\".outbox_events ORDER BY id",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

fn dump(rows: &[Row], l: &Ledger) -> String {
    let mut s = String::new();
    for r in rows {
        let i = l.rows.get(&r.event_id);
        s.push_str(&format!(
            "\n  row {} {} v{} {} blocked={} park={:?} maybe_delivered={} commit_seq={:?} \
             first_handout={:?} pub_seq={:?} event={}",
            r.id,
            r.aggregate_id,
            r.aggregate_version,
            r.status,
            r.blocked,
            r.park_kind,
            r.maybe_delivered,
            i.and_then(|i| i.commit),
            l.first_handout.get(&r.event_id),
            l.pubs.get(&r.event_id),
            &r.event_id.simple().to_string()[24..]
        ));
    }
    s
}

/// The contract over the database and the ledger. `quiet`: nothing runs concurrently (the
/// ledger's publications must equal the database's).
async fn check(ctx: &Ctx, l: &L, quiet: bool, what: &str) {
    common::no_orphans(ctx).await;
    check_published_order(ctx).await;
    // The publications applied before the rows are read: with relays running (not `quiet`),
    // a completion that commits after the read is in the ledger read after it, not in the rows.
    let applied_before: HashSet<Uuid> = l.g().pubs.keys().copied().collect();
    let rows = rows(ctx).await;
    let g = l.g();
    let fail = |msg: String| panic!("{what}: {msg}\nrows:{}", dump(&rows, &g));
    // Nothing rolled back is stored; everything stored was appended by the test.
    for r in &rows {
        match g.rows.get(&r.event_id) {
            None => fail(format!("row {} was never appended", r.id)),
            Some(i) if i.rolled_back => fail(format!("row {} of a rolled-back transaction", r.id)),
            Some(i) if i.agg != r.aggregate_id || i.v != r.aggregate_version => {
                fail(format!("row {} is not the event appended", r.id))
            }
            Some(_) => {}
        }
    }
    // One publication per version.
    let mut per_version: HashMap<(&str, i64), Vec<&Row>> = HashMap::new();
    for r in &rows {
        per_version
            .entry((r.aggregate_id.as_str(), r.aggregate_version))
            .or_default()
            .push(r);
    }
    for ((a, v), copies) in &per_version {
        let n = copies.iter().filter(|r| r.status == "published").count();
        if n > 1 {
            fail(format!("{a} v{v} published {n} times"));
        }
    }
    // The database's publications are the applied publications of the ledger.
    let db: HashSet<Uuid> = rows
        .iter()
        .filter(|r| r.status == "published")
        .map(|r| r.event_id)
        .collect();
    let logged: HashSet<Uuid> = g.pubs.keys().copied().collect();
    if quiet && db != logged {
        fail(format!(
            "published rows {:?} and applied publications {:?} differ",
            db.difference(&logged).collect::<Vec<_>>(),
            logged.difference(&db).collect::<Vec<_>>()
        ));
    }
    if let Some(x) = applied_before.difference(&db).next() {
        fail(format!(
            "an applied publication {x} is not published in the database"
        ));
    }
    // The first appended copy among those committed when the version went out.
    for p in rows.iter().filter(|r| r.status == "published") {
        let Some(&s) = g.pubs.get(&p.event_id) else {
            continue;
        };
        for e in &per_version[&(p.aggregate_id.as_str(), p.aggregate_version)] {
            let committed_before = g.rows[&e.event_id].commit.is_some_and(|c| c < s);
            if e.id < p.id && e.status != "discarded" && committed_before {
                fail(format!(
                    "{} v{}: row {} went out (claim seq {s}) while the earlier row {} ({}) had \
                     committed before that claim",
                    p.aggregate_id, p.aggregate_version, p.id, e.id, e.status
                ));
            }
        }
    }
    // A row parked out of order is explained: a version at or above it went out (was first
    // handed out) before the row committed, or an earlier copy of its version was published,
    // or an operator discarded a version at or above it, or retried one above it after the
    // row committed... otherwise a version was skipped.
    for e in rows
        .iter()
        .filter(|r| r.status == "parked" && r.park_kind.as_deref() == Some("out_of_order"))
    {
        let commit = g.rows[&e.event_id].commit;
        let after = |s: u64| commit.is_none_or(|c| c > s);
        let explained = rows.iter().any(|q| {
            q.id != e.id
                && q.aggregate_id == e.aggregate_id
                && q.aggregate_version >= e.aggregate_version
                && (q.status == "discarded"
                    || q.status == "published"
                        && q.aggregate_version == e.aggregate_version
                        && q.id < e.id
                    || g.first_handout.get(&q.event_id).is_some_and(|s| after(*s)))
        }) || g
            .retried
            .iter()
            .any(|(a, v, s)| *a == e.aggregate_id && *v > e.aggregate_version && after(*s));
        if !explained {
            fail(format!(
                "row {} ({} v{}) was parked out of order, but no version at or above it went out \
                 before it committed: a version was skipped",
                e.id, e.aggregate_id, e.aggregate_version
            ));
        }
    }
}

/// Publication times per aggregate increase with versions.
async fn check_published_order(ctx: &Ctx) {
    let bad: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT format('%s v%s (row %s) at %s after v%s (row %s) at %s', p.aggregate_id, \
                       p.aggregate_version, p.id, p.published_at, q.aggregate_version, q.id, \
                       q.published_at) \
         FROM {t} p JOIN {t} q ON q.aggregate_id = p.aggregate_id \
           AND q.aggregate_version > p.aggregate_version AND q.published_at < p.published_at \
         WHERE p.status = 'published' AND q.status = 'published'",
        t = format!("\"{}\".outbox_events", ctx.schema)
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert!(bad.is_empty(), "published out of order: {bad:?}");
}

/// Pending rows that nothing will hand out: no parked row of their aggregate above `last`
/// precedes them in (version, id).
async fn stalled(ctx: &Ctx) -> Vec<String> {
    sqlx::query_scalar(&format!(
        "SELECT format('%s v%s (row %s, blocked %s, due %s)', r.aggregate_id, \
                       r.aggregate_version, r.id, r.blocked, r.next_attempt_at <= now()) \
         FROM {t} r WHERE r.status = 'pending' AND NOT EXISTS ( \
           SELECT 1 FROM {t} u \
           LEFT JOIN \"{s}\".outbox_events_aggregate a \
             ON a.aggregate_type = u.aggregate_type AND a.aggregate_id = u.aggregate_id \
           WHERE u.aggregate_type = r.aggregate_type AND u.aggregate_id = r.aggregate_id \
             AND (u.aggregate_version, u.id) < (r.aggregate_version, r.id) \
             AND u.status = 'parked' AND u.aggregate_version > COALESCE(a.last_version, 0)) \
         ORDER BY r.id",
        t = format!("\"{}\".outbox_events", ctx.schema),
        s = ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Claims and publishes everything claimable until no pending row is left outside a parked
/// aggregate, checking after each step; panics after `secs` seconds.
async fn drain(ctx: &Ctx, l: &L, store: &PostgresOutboxStore, run: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c = claim(l, store, "drain", 7, run).await;
        if c.b.records.is_empty() {
            store.release(&c.b.handle).await.unwrap();
        } else {
            let outs = outcomes(&c.b, usize::MAX, None);
            complete(l, store, &c, &outs).await;
        }
        check(ctx, l, true, what).await;
        if c.b.records.is_empty() && c.b.parked.is_empty() && c.b.gaps_held == 0 {
            let left = stalled(ctx).await;
            if left.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: pending rows never handed out: {left:?}\nrows:{}",
                dump(&rows(ctx).await, &l.g())
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Operator: retries every parked row that is not out of order (permanent errors, version
/// gaps); a `Conflict` (its version at or below `last`, or lower versions waiting) is allowed,
/// and a row at or below `last` is then discarded. Returns how many actions applied.
async fn operator(l: &L, store: &PostgresOutboxStore, ctx: &Ctx) -> usize {
    let mut n = 0;
    for r in rows(ctx).await {
        if r.status != "parked" || r.park_kind.as_deref() == Some("out_of_order") {
            continue;
        }
        let s = l.tick();
        let id = outbox_core::EventId::from_uuid(r.event_id);
        match store.retry_parked(id, "op").await {
            Ok(()) => {
                l.g()
                    .retried
                    .push((r.aggregate_id.clone(), r.aggregate_version, s));
                n += 1;
            }
            Err(e) => {
                assert_eq!(e.kind, outbox_core::StoreErrorKind::Conflict, "{e:?}");
                let last: Option<i64> = sqlx::query_scalar(&format!(
                    "SELECT last_version FROM \"{}\".outbox_events_aggregate \
                     WHERE aggregate_id = $1",
                    ctx.schema
                ))
                .bind(&r.aggregate_id)
                .fetch_optional(&ctx.pool)
                .await
                .unwrap()
                .flatten();
                if last.is_some_and(|last| r.aggregate_version <= last) {
                    store.discard_parked(id, "op", "below last").await.unwrap();
                    n += 1;
                }
            }
        }
    }
    n
}

/// Drains, with the operator acting on what is parked, until nothing is pending.
async fn settle(ctx: &Ctx, l: &L, store: &PostgresOutboxStore, run: usize, what: &str) {
    for _ in 0..10 {
        drain(ctx, l, store, run, what).await;
        if operator(l, store, ctx).await == 0 {
            break;
        }
        check(ctx, l, true, what).await;
    }
    drain(ctx, l, store, run, what).await;
    let left: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events WHERE status = 'pending'",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(
        left,
        0,
        "{what}: pending rows left\nrows:{}",
        dump(&rows(ctx).await, &l.g())
    );
}

/// The event published at `v` of `agg` (None when no copy was).
async fn published_copy(ctx: &Ctx, agg: &str, v: i64) -> Option<Uuid> {
    sqlx::query_scalar(&format!(
        "SELECT event_id FROM \"{}\".outbox_events WHERE aggregate_id = $1 \
         AND aggregate_version = $2 AND status = 'published'",
        ctx.schema
    ))
    .bind(agg)
    .bind(v)
    .fetch_optional(&ctx.pool)
    .await
    .unwrap()
}

fn short(id: Uuid) -> String {
    id.simple().to_string()[24..].to_owned()
}

// ---------------------------------------------------------------------------------------------
// 1. Appends that commit out of id order.
// ---------------------------------------------------------------------------------------------

fn modes() -> [ClaimMode; 2] {
    [lease(30.0), ClaimMode::LockedTransaction]
}

/// Every configuration: claim mode, `accept_first_version`, run length, a fresh aggregate or
/// one whose version 1 was published.
async fn each_config<F, Fut>(fresh_too: bool, body: F)
where
    F: Fn(Ctx, PostgresOutboxStore, usize, bool, String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for mode in modes() {
        for accept_first in [false, true] {
            for run in [1, 3] {
                for fresh in [false, true] {
                    if fresh && !fresh_too {
                        continue;
                    }
                    let Some(ctx) = Ctx::new(8).await else {
                        return;
                    };
                    let store = store_with(&ctx, mode, accept_first, Duration::from_millis(300));
                    store.migrate().await.unwrap();
                    let what =
                        format!("{mode:?} accept_first={accept_first} run={run} fresh={fresh}");
                    body(ctx, store, run, fresh, what).await;
                }
            }
        }
    }
}

/// Version 1 of `agg` published (unless `fresh`); returns the next version.
async fn prelude(
    ctx: &Ctx,
    l: &L,
    store: &PostgresOutboxStore,
    agg: &str,
    fresh: bool,
    what: &str,
) -> i64 {
    if fresh {
        return 1;
    }
    append_now(ctx, store, l, agg, &[1]).await;
    drain(ctx, l, store, 1, what).await;
    2
}
