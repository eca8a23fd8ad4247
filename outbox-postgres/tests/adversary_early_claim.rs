//! Adversary pass on the relay's early claim (`RelayConfig::early_claim`) against PostgreSQL,
//! in both claim modes: the early claim racing the completion of the batch in flight, the
//! completion failing after it (before reaching the server, or after committing), the relay
//! dropped between the two, the driver stopped with an early claim outstanding, and (lease
//! mode) an early claim whose lease runs out while the completion is written. The tests are
//! `outbox_testkit::early_claim_tests!` over `outbox_testkit::scenarios::early_claim`, the
//! same as MySQL's (`outbox-mysql/tests/adversary_early_claim.rs`); each gets a schema of its own.
//! `outbox_testkit::early_claim_run_tests!` adds the same attacks with runs (`RelayConfig::run`
//! 3 and 100, `run_yields` off and on): runs cut or failed mid-way, and failed completions of a
//! batch holding a run, beside the early claim.

mod common;

outbox_testkit::early_claim_tests!(common::backend::PgBackend);
outbox_testkit::early_claim_run_tests!(common::backend::PgBackend, runs = true);
