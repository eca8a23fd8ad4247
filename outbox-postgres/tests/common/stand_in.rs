//! Stores whose sessions see a stand-in for a built-in function the statements call
//! unqualified (a key collision, a clock at a chosen instant), on the test's schema.

use outbox_core::ClaimMode;
use outbox_postgres::PostgresOutboxStore;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

/// A pool whose sessions search the test's schema before `pg_catalog`, where `function` (the
/// body of a `CREATE OR REPLACE FUNCTION` in that schema) stands in for a built-in function
/// the statements call unqualified. The tables are migrated first (by a store of `mode`), on
/// the ordinary pool (their defaults and indexes keep the real functions).
pub async fn stand_in_pool(ctx: &super::Ctx, mode: ClaimMode, function: &str) -> PgPool {
    let s = &ctx.schema;
    ctx.store(mode).await;
    sqlx::query(&format!("CREATE OR REPLACE FUNCTION \"{s}\".{function}"))
        .execute(&ctx.pool)
        .await
        .unwrap();
    search_path_pool(ctx, 3).await
}

/// A pool of at most `max` connections whose sessions search the test's schema before
/// `pg_catalog`: a function created there stands in for the built-in function of the same name
/// that the statements call unqualified.
pub async fn search_path_pool(ctx: &super::Ctx, max: u32) -> PgPool {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| super::DEFAULT_URL.to_owned());
    let opts: PgConnectOptions = url.parse().unwrap();
    let set = format!("SET search_path = \"{}\", pg_catalog", ctx.schema);
    PgPoolOptions::new()
        .max_connections(max)
        .after_connect(move |conn, _| {
            let set = set.clone();
            Box::pin(async move {
                sqlx::query(&set).execute(&mut *conn).await?;
                Ok(())
            })
        })
        .connect_with(opts)
        .await
        .unwrap()
}

/// A store of `mode` over [`stand_in_pool`].
pub async fn stand_in_store(
    ctx: &super::Ctx,
    mode: ClaimMode,
    accept_first_version: bool,
    function: &str,
) -> (PgPool, PostgresOutboxStore) {
    let pool = stand_in_pool(ctx, mode, function).await;
    let store = PostgresOutboxStore::builder(pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .accept_first_version(accept_first_version)
        .build()
        .unwrap();
    (pool, store)
}

/// The stand-in for `hashtextextended(text, bigint)` that gives every name containing
/// `collide` the same key: the 64-bit key collision that the statements guard against by
/// comparing the aggregate's type and id next to its key, which no real pair of names is known
/// to produce (the stand-in only costs index use).
pub const COLLIDING_KEYS: &str = "hashtextextended(t text, seed int8) RETURNS int8 \
     LANGUAGE sql IMMUTABLE AS $$ \
       SELECT CASE WHEN t LIKE '%collide%' THEN 4242::int8 \
                   ELSE pg_catalog.hashtextextended(t, seed) END $$";

/// A store whose sessions compute every aggregate key with [`COLLIDING_KEYS`].
pub async fn colliding_store(
    ctx: &super::Ctx,
    mode: ClaimMode,
    accept_first_version: bool,
) -> (PgPool, PostgresOutboxStore) {
    stand_in_store(ctx, mode, accept_first_version, COLLIDING_KEYS).await
}
