//! Aggregate names against their bound (issue 20, item 6, held by every store):
//! `aggregate_type` and `aggregate_id` of up to `MAX_AGGREGATE_NAME_BYTES` (1,024) bytes each
//! flow in both claim modes, through every write of the state row (claim, completion, operator
//! retry); longer ones are refused at append even with raised name limits, and a store is not
//! built with a larger bound; a stored event past the bound (written by other means, or by an
//! earlier version of this crate, which took up to 65,535 bytes) is parked alone by the claim,
//! before any state of its aggregate is written, and never stops the claims of other
//! aggregates. The same rule as outbox-postgres, so a team swapping stores sees the same limit.
//!
//! Each test has its own database on the server at `MYSQL_URL`.

mod common;

use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, Envelope, EnvelopeLimits, ParkKind, StoreErrorKind, MAX_AGGREGATE_NAME_BYTES,
};
use outbox_mysql::MySqlOutboxStore;
use outbox_testkit::store_checks;
use rand::{Rng, SeedableRng};

use common::{claim, lease, park, publish_all};

/// `n` random printable ASCII characters (seeded).
fn name(seed: u64, n: usize) -> String {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| rng.random_range(b'!'..=b'~') as char)
        .collect()
}

fn raised(ctx: &common::Ctx, mode: ClaimMode) -> MySqlOutboxStore {
    ctx.builder(mode)
        .limits(EnvelopeLimits::default().with_max_name_len(8192))
        .build()
        .unwrap()
}

fn ev(agg_type: &str, agg_id: &str, version: i64) -> Envelope {
    Envelope::builder(agg_type, agg_id, version, "order.changed")
        .limits(EnvelopeLimits::unlimited())
        .json(&serde_json::json!({ "v": version }))
        .unwrap()
        .build()
        .unwrap()
}

const MODES: [&str; 2] = ["lease", "locked"];

fn mode(m: &str) -> ClaimMode {
    match m {
        "lease" => lease(30.0),
        _ => ClaimMode::LockedTransaction,
    }
}

/// At the bound: both names of exactly `MAX_AGGREGATE_NAME_BYTES` bytes (ASCII, and two-byte
/// characters), in both modes, through a claim, a publication, a park and an operator retry
/// (each writes the state row). Two ids that differ only in their last byte, far past an index
/// prefix InnoDB could keep, are two aggregates (the state is keyed by a SHA-256 of the names).
#[tokio::test]
async fn aggregate_names_at_the_bound_flow_in_both_modes() {
    let ctx = ctx!(4);
    for (i, m) in MODES.iter().enumerate() {
        let store = raised(&ctx, mode(m));
        store.migrate().await.unwrap();
        let t = name(2 * i as u64, MAX_AGGREGATE_NAME_BYTES);
        let id = if i == 0 {
            name(2 * i as u64 + 1, MAX_AGGREGATE_NAME_BYTES)
        } else {
            "é".repeat(MAX_AGGREGATE_NAME_BYTES / 2)
        };
        assert_eq!((t.len(), id.len()), (1024, 1024));
        let (v1, v2) = (ev(&t, &id, 1), ev(&t, &id, 2));
        store
            .append_many(&ctx.pool, &[v1.clone(), v2.clone()])
            .await
            .unwrap();
        let b = claim(&store, m, 10).await;
        assert_eq!(b.records.len(), 1, "{m}");
        assert_eq!(b.records[0].envelope.event_id, v1.event_id, "{m}");
        assert_eq!(
            b.records[0].envelope.aggregate_id, id,
            "{m}: read back whole"
        );
        publish_all(&store, &b).await;
        let b = claim(&store, m, 10).await;
        assert_eq!(b.records[0].envelope.event_id, v2.event_id, "{m}");
        let rep = store.complete(&b.handle, &[park(&v2)]).await.unwrap();
        assert_eq!(rep.applied, 1, "{m}");
        store.retry_parked(v2.event_id, "ops").await.unwrap();
        let b = claim(&store, m, 10).await;
        assert_eq!(b.records[0].envelope.event_id, v2.event_id, "{m}");
        publish_all(&store, &b).await;
        let last: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT last_version FROM {} WHERE aggregate_type = ? AND aggregate_id = ?",
            ctx.table("outbox_events_aggregate")
        ))
        .bind(&t)
        .bind(&id)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(last, Some(2), "{m}");
        // Two ids of the bound's length that differ in their last byte.
        let stem = name(100 + i as u64, MAX_AGGREGATE_NAME_BYTES - 1);
        let (x, y) = (format!("{stem}x"), format!("{stem}y"));
        store
            .append_many(&ctx.pool, &[ev("order", &x, 1), ev("order", &y, 1)])
            .await
            .unwrap();
        let b = claim(&store, m, 10).await;
        assert_eq!(
            b.records.len(),
            2,
            "{m}: both heads at once, two aggregates"
        );
        publish_all(&store, &b).await;
    }
    ctx.drop().await;
}

// FOUND (aligning outbox-mysql with issue 20, item 6): this store took aggregate names up to
// 65,535 bytes (its TEXT columns) with a raised name limit, and built with any
// `max_aggregate_name_bytes`; outbox-postgres refuses past 1,024 bytes, so an event this store
// took would be refused by the other. Now one byte past the bound is refused at append (and
// nothing of the call is written), and a store is not built with a larger bound.
#[tokio::test]
async fn aggregate_names_past_the_bound_are_refused_at_append_and_in_the_builder() {
    let ctx = ctx!(4);
    let store = raised(&ctx, lease(30.0));
    store.migrate().await.unwrap();
    let ok = ev("order", "fine", 1);
    for (t, id) in [
        (name(1, MAX_AGGREGATE_NAME_BYTES + 1), "a".to_owned()),
        ("order".to_owned(), name(2, MAX_AGGREGATE_NAME_BYTES + 1)),
        (
            "order".to_owned(),
            "é".repeat(MAX_AGGREGATE_NAME_BYTES / 2 + 1),
        ),
        ("order".to_owned(), name(3, 65_535)),
    ] {
        let err = store
            .append_many(&ctx.pool, &[ok.clone(), ev(&t, &id, 1)])
            .await
            .expect_err("an aggregate name past the bound was accepted");
        assert_eq!(err.kind, StoreErrorKind::Validation, "{err}");
    }
    let rows: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {}",
        ctx.table("outbox_events")
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(rows, 0, "nothing of a refused call is written");
    let mut above = EnvelopeLimits::default();
    above.max_aggregate_name_bytes = MAX_AGGREGATE_NAME_BYTES + 1;
    let err = ctx
        .builder(lease(30.0))
        .limits(above)
        .build()
        .expect_err("limits past the bound were accepted");
    assert_eq!(err.kind, StoreErrorKind::Configuration, "{err}");
    let err = ctx
        .builder(lease(30.0))
        .limits(EnvelopeLimits::unlimited())
        .build()
        .expect_err("unlimited limits were accepted for appends");
    assert_eq!(err.kind, StoreErrorKind::Configuration, "{err}");
    ctx.drop().await;
}

// FOUND (aligning outbox-mysql with issue 20, item 6): a stored event whose aggregate id is past
// the bound (inserted by SQL, or by an earlier version of this crate) was claimed and published
// by this store, while outbox-postgres parks it. Now the claim parks it, and its later
// versions, as permanent errors before writing any state of its aggregate; the others flow; it
// can be discarded, not retried or re-issued.
#[tokio::test]
async fn a_stored_event_past_the_bound_is_parked_before_any_state_is_written() {
    let ctx = ctx!(4);
    for (i, m) in MODES.iter().enumerate() {
        let store = ctx.store(mode(m)).await;
        let long_id = name(10 + i as u64, MAX_AGGREGATE_NAME_BYTES + 1 + 2000 * i);
        let (l1, l2) = (ev("order", &long_id, 1), ev("order", &long_id, 2));
        for e in [&l1, &l2] {
            sqlx::query(&format!(
                "INSERT INTO {} (event_id, aggregate_type, aggregate_id, aggregate_version, \
                   event_type, schema_version, content_type, payload, headers, created_at) \
                 VALUES (?, ?, ?, ?, ?, 1, 'application/json', ?, '{{}}', UTC_TIMESTAMP(6))",
                ctx.table("outbox_events")
            ))
            .bind(e.event_id.as_uuid())
            .bind(&e.aggregate_type)
            .bind(&e.aggregate_id)
            .bind(e.aggregate_version)
            .bind(&e.event_type)
            .bind(&e.payload.bytes)
            .execute(&ctx.pool)
            .await
            .unwrap();
        }
        let others: Vec<Envelope> = (0..3)
            .map(|k| common::event(&format!("{m}-ok-{k}"), 1))
            .collect();
        store.append_many(&ctx.pool, &others).await.unwrap();

        let b = claim(&store, m, 10).await;
        let got: Vec<_> = b.records.iter().map(|r| r.envelope.event_id).collect();
        assert_eq!(
            got,
            others.iter().map(|e| e.event_id).collect::<Vec<_>>(),
            "{m}: the other aggregates are claimed"
        );
        let mut reported: Vec<_> = b.parked.clone();
        publish_all(&store, &b).await;
        let b = claim(&store, m, 10).await;
        assert!(b.records.is_empty(), "{m}");
        reported.extend(b.parked.iter().cloned());
        for e in [&l1, &l2] {
            assert!(
                reported
                    .iter()
                    .any(|p| p.event_id == e.event_id && p.kind == ParkKind::PermanentError),
                "{m}: the claims report the events they parked: {reported:?}"
            );
        }
        let states: i64 = sqlx::query_scalar(&format!(
            "SELECT COUNT(*) FROM {} WHERE aggregate_id = ?",
            ctx.table("outbox_events_aggregate")
        ))
        .bind(&long_id)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(states, 0, "{m}: no state of the aggregate was written");
        store_checks::unkeyable_pair_can_only_be_discarded(
            &store,
            [l1.event_id, l2.event_id],
            MAX_AGGREGATE_NAME_BYTES,
            m,
        )
        .await;
        // Fresh tables for the next mode.
        for t in ["outbox_events", "outbox_events_aggregate"] {
            sqlx::query(&format!("DELETE FROM {}", ctx.table(t)))
                .execute(&ctx.pool)
                .await
                .unwrap();
        }
    }
    ctx.drop().await;
}
