//! A lease claim's transaction runs generic plans (stop 46, `BEGIN_LEASE_CLAIM` in
//! `src/outbox/claim.rs`): planned once per session and statement, while a table may hold
//! nothing, and kept while it grows to millions of rows. They are safe only if every scan of
//! a table is keyed: these tests take the generic plans the store's own transaction settings
//! make (`explain_claim_generic`) on an empty table, and on a table of a few thousand rows
//! after `ANALYZE`, and refuse any sequential scan of the outbox or state table and any index
//! scan of them without an index condition (the candidates' ordered walk of the claim index,
//! stopped at the claim's limit, is the one exception).
//!
//! Before the statements were written for it (stop 46), generic plans on an empty table read
//! the outbox table in full four times per decision: the park (`prk`) and the promotion
//! (`promote`) as hash joins over a sequential scan, and the park of undecodable rows walked
//! the whole unfinished index; each now names its rows by key (`= ANY (ARRAY(..))`).

mod common;

use outbox_postgres::PostgresOutboxStore;

use common::{event, lease, Ctx};

/// The node depth of a plan line (the column of its `->`, or of its first character).
fn depth(line: &str) -> usize {
    line.find("->")
        .unwrap_or_else(|| line.len() - line.trim_start().len())
}

/// Every unkeyed read of the store's tables in `plan`; counts the keyed index scans seen.
fn unkeyed(plan: &str, table: &str, keyed: &mut usize) -> Vec<String> {
    let lines: Vec<&str> = plan.lines().collect();
    let mut bad = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let on_ours = line.contains(&format!(" on {table} "))
            || line.contains(&format!(" on {table}_aggregate "));
        if !on_ours {
            continue;
        }
        if line.contains("Seq Scan") || line.contains("Bitmap") {
            bad.push(line.trim().to_owned());
            continue;
        }
        if !line.contains("Index Scan") && !line.contains("Index Only Scan") {
            continue;
        }
        let d = depth(line);
        let detail = lines[i + 1..]
            .iter()
            .take_while(|l| !l.contains("->") && depth(l) > d);
        let mut cond = false;
        for l in detail {
            cond |= l.trim_start().starts_with("Index Cond:");
        }
        if cond {
            *keyed += 1;
        } else if !line.contains(&format!("using {table}_claim_idx ")) {
            bad.push(line.trim().to_owned());
        }
    }
    bad
}

async fn check_plans(store: &PostgresOutboxStore, what: &str) {
    let plans = store.explain_claim_generic().await.expect("explain");
    let names: Vec<&str> = plans.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        [
            "claim_candidates_lease",
            "claim_decide_lease",
            "claim_decide_lease_runs",
            "park_undecodable"
        ],
        "{what}"
    );
    for (name, plan) in &plans {
        let mut keyed = 0;
        let bad = unkeyed(plan, "outbox_events", &mut keyed);
        assert!(
            bad.is_empty(),
            "{what}: {name}: unkeyed reads of the tables in its generic plan: {bad:#?}\n{plan}"
        );
        // Not vacuous: each statement reads the tables, by key.
        assert!(keyed > 0, "{what}: {name}: no keyed scan found\n{plan}");
        assert!(
            plan.contains("outbox_events"),
            "{what}: {name}: the plan names no table of the store\n{plan}"
        );
    }
}

fn store(ctx: &Ctx, accept_first_version: bool) -> PostgresOutboxStore {
    PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(lease(30.0))
        .accept_first_version(accept_first_version)
        .build()
        .unwrap()
}

#[tokio::test]
async fn generic_claim_plans_made_on_an_empty_table_read_by_key() {
    for accept_first_version in [false, true] {
        let ctx = Ctx::new(4).await.expect("database");
        let s = store(&ctx, accept_first_version);
        s.migrate().await.unwrap();
        check_plans(
            &s,
            &format!("empty, accept_first_version {accept_first_version}"),
        )
        .await;
        ctx.drop().await;
    }
}

#[tokio::test]
async fn generic_claim_plans_made_on_a_filled_table_read_by_key() {
    for accept_first_version in [false, true] {
        let ctx = Ctx::new(4).await.expect("database");
        let s = store(&ctx, accept_first_version);
        s.migrate().await.unwrap();
        // 3,000 events over 300 aggregates, some claimed and published, the rest pending.
        for chunk in 0..30 {
            let events: Vec<_> = (0..100)
                .map(|i| {
                    event(
                        &format!("a{}", (chunk * 100 + i) % 300),
                        1 + (chunk / 3) as i64,
                    )
                })
                .collect();
            s.append_many(&ctx.pool, &events).await.unwrap();
        }
        let b = common::claim(&s, "p", 500).await;
        assert_eq!(b.records.len(), 300, "the heads");
        common::publish_all(&s, &b).await;
        sqlx::query(&format!("ANALYZE \"{}\".outbox_events", ctx.schema))
            .execute(&ctx.pool)
            .await
            .unwrap();
        check_plans(
            &s,
            &format!("filled, accept_first_version {accept_first_version}"),
        )
        .await;
        ctx.drop().await;
    }
}

/// A lease claim of more candidates than the generic bound decides with a custom plan, and one
/// of fewer with the generic plan: both hand out the same heads (ordinary claims of every other
/// test cover the rest).
#[tokio::test]
async fn small_and_large_lease_claims_hand_out_every_head_once() {
    let ctx = Ctx::new(4).await.expect("database");
    let s = ctx.store(lease(30.0)).await;
    let events: Vec<_> = (0..100).map(|i| event(&format!("k{i}"), 1)).collect();
    s.append_many(&ctx.pool, &events).await.unwrap();
    let mut seen = std::collections::HashSet::new();
    for limit in [5usize, 32, 33, 30] {
        let b = common::claim(&s, "p", limit).await;
        assert_eq!(b.records.len(), limit, "limit {limit}");
        for r in &b.records {
            assert!(seen.insert(r.envelope.event_id), "handed out twice");
        }
        common::publish_all(&s, &b).await;
    }
    assert_eq!(seen.len(), 100, "every claim full");
    ctx.drop().await;
}
