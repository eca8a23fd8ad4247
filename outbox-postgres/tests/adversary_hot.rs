//! Adversary pass on issue 25 (claims block an aggregate's every follower) in both claim
//! modes: `outbox_testkit::hot_adversary_tests!` over `outbox_testkit::scenarios::hot_adversary`;
//! each test gets its own database/schema.

mod common;

outbox_testkit::hot_adversary_tests!(common::backend::PgBackend);
