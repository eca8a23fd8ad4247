//! One hot aggregate beside the others (issue 25) against PostgreSQL, in both claim modes:
//! 10,000 versions of one aggregate must not keep another aggregate's event out of the claims.
//! The tests are `outbox_testkit::hot_aggregate_tests!` over
//! `outbox_testkit::scenarios::hot_aggregate`, the same as MySQL's and the in-memory store's;
//! each gets a schema of its own.

mod common;

outbox_testkit::hot_aggregate_tests!(common::backend::PgBackend);
