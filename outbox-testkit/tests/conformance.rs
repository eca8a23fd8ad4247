//! The conformance suite against the in-memory backends.

mod outbox {
    outbox_testkit::outbox_conformance_tests!(async {
        outbox_testkit::conformance::MemoryOutboxHarness::new()
    });
}

mod inbox {
    outbox_testkit::inbox_conformance_tests!(async {
        outbox_testkit::conformance::MemoryInboxHarness::new()
    });
}

mod publisher {
    outbox_testkit::publisher_conformance_tests!(async {
        outbox_testkit::conformance::MemoryPublisherHarness::new()
    });
}

#[test]
fn the_macros_emit_every_listed_check() {
    // Keeps the name lists (documentation for backend authors) in sync with the macros.
    let source = include_str!("../src/conformance/mod.rs");
    for name in outbox_testkit::conformance::OUTBOX_CHECKS
        .iter()
        .chain(outbox_testkit::conformance::INBOX_CHECKS)
        .chain(outbox_testkit::conformance::PUBLISHER_CHECKS)
    {
        assert!(
            source.matches(&format!("            {name},")).count() == 1,
            "{name} is not emitted by a macro exactly once"
        );
    }
}
