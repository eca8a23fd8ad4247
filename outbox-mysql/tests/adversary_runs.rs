//! Adversary pass on run claims (issue 25) in both claim modes:
//! `outbox_testkit::run_adversary_tests!` over `outbox_testkit::scenarios::run_adversary`; each
//! test gets its own database. MariaDB ignores `run` (heads only, which the contract allows):
//! the scenarios hold it to the same guarantees (no loss, order, once each) and to heads only.

mod common;

outbox_testkit::run_adversary_tests!(common::backend::MyBackend, runs = false);
