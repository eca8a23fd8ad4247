//! The run-claim adversary scenarios (`outbox_testkit::scenarios::run_adversary`) on the
//! in-memory store, lease mode (its locked mode cannot end a crashed relay's claim).

outbox_testkit::run_adversary_tests!(
    outbox_testkit::randomized::MemoryBackend,
    runs = true,
    lease_only
);
