//! Adversary pass on run claims (issue 25) in both claim modes:
//! `outbox_testkit::run_adversary_tests!` over `outbox_testkit::scenarios::run_adversary`; each
//! test gets its own schema. PostgreSQL hands out runs.

mod common;

outbox_testkit::run_adversary_tests!(common::backend::PgBackend, runs = true);
