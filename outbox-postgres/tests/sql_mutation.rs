//! The test-only SQL mutation hook (feature `sql-mutation`): a store built while
//! `OUTBOX_SQL_MUTANT` is set applies that mutant or refuses to build, so `scripts/mutants-sql`
//! can never test unmutated code by mistake. One test: it sets the process environment.
use outbox_postgres::sql_mutation::{statements, Variant, ENV};
use outbox_postgres::PostgresOutboxStore;

fn build() -> Result<PostgresOutboxStore, outbox_core::StoreError> {
    let pool = sqlx::PgPool::connect_lazy("postgres://nobody@127.0.0.1:1/none").unwrap();
    PostgresOutboxStore::builder(pool).schema("shop").build()
}

fn mutant(statement: &str, offset: usize, original: &str) -> String {
    serde_json::json!({"statement": statement, "variant": "plain", "offset": offset,
                       "original": original, "replacement": "<"})
    .to_string()
}

#[tokio::test]
async fn the_store_applies_the_named_mutant_or_refuses_to_build() {
    std::env::remove_var(ENV);
    assert!(build().is_ok(), "no mutant: builds as usual");

    let (_, text) = statements(Variant::Plain)
        .into_iter()
        .find(|(n, _)| *n == "claim_decide_lease")
        .unwrap();
    let at = text.find("<=").unwrap();
    std::env::set_var(ENV, mutant("claim_decide_lease", at, "<="));
    assert!(build().is_ok(), "a mutant that applies");

    for (bad, why) in [
        (mutant("no_such_statement", at, "<="), "unknown statement"),
        (mutant("claim_decide_lease", at + 1, "<="), "is not at byte"),
        (
            mutant("claim_decide_lease", at, "SKIP LOCKED"),
            "is not at byte",
        ),
        ("{".to_owned(), "is not JSON"),
    ] {
        std::env::set_var(ENV, &bad);
        let e = build().expect_err(&bad);
        assert!(e.to_string().contains(why), "{bad}: {e}");
    }
    std::env::remove_var(ENV);
}
