//! **Test only** (feature `sql-mutation`): the statements `scripts/mutants-sql` mutates.
//!
//! ```text
//! cargo run -p outbox-postgres --features sql-mutation --example sql_mutants -- list
//! cargo run -p outbox-postgres --features sql-mutation --example sql_mutants -- check < mutants.jsonl
//! ```
//!
//! `list` prints the canonical text of every statement of both variants as JSON
//! (`{"plain": {name: text}, "first_version": {..}}`). `check` reads one mutant a line (the
//! JSON of `OUTBOX_SQL_MUTANT`) and prints one JSON line per mutant: where it applies in each
//! variant (`null`: that code is not in the variant), or `error` when it applies nowhere, and,
//! with `DATABASE_URL` set, `invalid`: PostgreSQL's refusal to prepare the mutated statement
//! (its parse and analysis), per variant, on tables migrated in the canonical schema; a
//! parameter whose type only a removed predicate gave is not counted (the store binds typed
//! values).
use std::io::BufRead;

use outbox_postgres::sql_mutation::{self, Mutant, Variant};
use serde_json::{json, Map, Value};
use sqlx::Executor;

const VARIANTS: [(Variant, &str); 2] = [
    (Variant::Plain, "plain"),
    (Variant::FirstVersion, "first_version"),
];

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    match std::env::args().nth(1).as_deref() {
        Some("list") => {
            let mut out = Map::new();
            for (v, name) in VARIANTS {
                let texts: Map<String, Value> = sql_mutation::statements(v)
                    .into_iter()
                    .map(|(n, t)| (n.to_owned(), Value::String(t)))
                    .collect();
                out.insert(name.to_owned(), Value::Object(texts));
            }
            println!("{}", Value::Object(out));
        }
        Some("check") => check().await?,
        _ => return Err("usage: sql_mutants list | check < mutants.jsonl".into()),
    }
    Ok(())
}

async fn check() -> Result<(), Box<dyn std::error::Error>> {
    let mut conn = match std::env::var("DATABASE_URL") {
        Ok(url) => {
            let pool = sqlx::PgPool::connect(&url).await?;
            // The canonical tables, so that statements are analysed as the stores run them.
            for first in [false, true] {
                outbox_postgres::PostgresOutboxStore::builder(pool.clone())
                    .schema(sql_mutation::SCHEMA)
                    .table(sql_mutation::TABLE)
                    .accept_first_version(first)
                    .build()?
                    .migrate()
                    .await?;
            }
            Some(pool.acquire().await?)
        }
        Err(_) => None,
    };
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let mut out = Map::new();
        let m = match Mutant::parse(&line) {
            Ok(m) => m,
            Err(e) => {
                out.insert("error".into(), Value::String(e));
                println!("{}", Value::Object(out));
                continue;
            }
        };
        let mut invalid = Map::new();
        let mut applies = false;
        for (v, name) in VARIANTS {
            match sql_mutation::locate(&m, v) {
                Ok(at) => {
                    applies |= at.is_some();
                    out.insert(name.to_owned(), json!(at));
                    if let (Some(_), Some(conn)) = (at, conn.as_mut()) {
                        let texts = sql_mutation::mutated_statements(
                            &m,
                            sql_mutation::SCHEMA,
                            sql_mutation::TABLE,
                            v == Variant::FirstVersion,
                        )?;
                        let text = &texts.iter().find(|(n, _)| *n == m.statement).unwrap().1;
                        // A parameter that only a removed predicate typed (42P18) is typed by
                        // the store's binds when it runs: not a refusal.
                        let refused =
                            (&mut **conn)
                                .prepare(text.as_str())
                                .await
                                .err()
                                .filter(|e| {
                                    e.as_database_error().and_then(|d| d.code()).as_deref()
                                        != Some("42P18")
                                });
                        invalid.insert(name.to_owned(), json!(refused.map(|e| e.to_string())));
                    }
                }
                Err(e) => {
                    out.insert("error".into(), Value::String(e));
                }
            }
        }
        if !applies && !out.contains_key("error") {
            out.insert("error".into(), "applies to no variant".into());
        }
        out.insert("invalid".into(), Value::Object(invalid));
        println!("{}", Value::Object(out));
    }
    Ok(())
}
