//! The conformance suite against the in-memory backends, and against the fault wrappers of
//! `outbox_testkit::fault` around them with no fault scheduled (a wrapper that passes nothing
//! through unchanged would fail here before it misleads a simulation).

mod outbox {
    outbox_testkit::outbox_conformance_tests!(async {
        outbox_testkit::conformance::MemoryOutboxHarness::new()
    });
}

/// The in-memory store with runs turned off: a store that ignores `ClaimRequest::run` passes
/// the suite (heads only).
mod outbox_heads_only {
    outbox_testkit::outbox_conformance_tests!(async {
        outbox_testkit::conformance::MemoryOutboxHarness::heads_only()
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

mod source {
    outbox_testkit::source_conformance_tests!(async {
        outbox_testkit::conformance::MemorySourceHarness::new()
    });
}

/// Harnesses that put a fault wrapper with an empty fault script around the in-memory ones.
mod faultless {
    use std::time::Duration;

    use outbox_core::{async_trait, AckMetadata, ClaimHandle, ClaimMode, Envelope, StoreError};
    use outbox_testkit::conformance::{
        Capabilities, InboxHarness, MemoryInboxHarness, MemoryOutboxHarness,
        MemoryPublisherHarness, MemorySourceHarness, OutboxHarness, PublisherHarness, RawRecord,
        ReadBack, SourceCapabilities, SourceHarness,
    };
    use outbox_testkit::fault::{
        FaultInjector, FaultSource, FaultyInbox, FaultyPublisher, FaultySource, FaultyStore,
    };
    use outbox_testkit::{
        MemoryConsumer, MemoryInboxStore, MemoryLog, MemoryOutboxStore, MemoryTx,
    };

    fn no_faults() -> FaultInjector {
        FaultInjector::new(FaultSource::script([]))
    }

    pub(crate) struct Outbox(MemoryOutboxHarness);

    impl Outbox {
        pub(crate) fn new() -> Self {
            Self(MemoryOutboxHarness::new())
        }
    }

    #[async_trait]
    impl OutboxHarness for Outbox {
        type Store = FaultyStore<MemoryOutboxStore>;

        fn capabilities(&self) -> Capabilities {
            self.0.capabilities()
        }

        async fn store(&self, mode: ClaimMode) -> Self::Store {
            FaultyStore::memory(self.0.store(mode).await, no_faults())
        }

        async fn store_accepting_first_version(&self, mode: ClaimMode) -> Self::Store {
            FaultyStore::memory(
                self.0.store_accepting_first_version(mode).await,
                no_faults(),
            )
        }

        async fn begin(&self) -> MemoryTx {
            self.0.begin().await
        }

        async fn commit(&self, tx: MemoryTx) -> Result<(), StoreError> {
            self.0.commit(tx).await
        }

        async fn rollback(&self, tx: MemoryTx) {
            self.0.rollback(tx).await;
        }

        async fn advance(&self, by: Duration) {
            self.0.advance(by).await;
        }

        async fn abandon(&self, store: &Self::Store, claim: &ClaimHandle) -> bool {
            self.0.abandon(store.inner(), claim).await
        }
    }

    pub(crate) struct Inbox {
        harness: MemoryInboxHarness,
        store: FaultyInbox<MemoryInboxStore>,
    }

    impl Inbox {
        pub(crate) fn new() -> Self {
            let harness = MemoryInboxHarness::new();
            let store = FaultyInbox::new(harness.inbox.clone(), no_faults());
            Self { harness, store }
        }
    }

    #[async_trait]
    impl InboxHarness for Inbox {
        type Store = FaultyInbox<MemoryInboxStore>;

        fn capabilities(&self) -> Capabilities {
            self.harness.capabilities()
        }

        fn store(&self) -> &Self::Store {
            &self.store
        }

        async fn advance(&self, by: Duration) {
            self.harness.advance(by).await;
        }
    }

    pub(crate) struct Publisher {
        harness: MemoryPublisherHarness,
        publisher: FaultyPublisher<MemoryLog>,
    }

    impl Publisher {
        pub(crate) fn new() -> Self {
            let harness = MemoryPublisherHarness::new();
            let publisher = FaultyPublisher::new(harness.log.clone(), no_faults());
            Self { harness, publisher }
        }
    }

    #[async_trait]
    impl PublisherHarness for Publisher {
        type Publisher = FaultyPublisher<MemoryLog>;

        fn publisher(&self) -> &Self::Publisher {
            &self.publisher
        }

        fn max_record_bytes(&self) -> Option<usize> {
            self.harness.max_record_bytes()
        }

        fn unroutable_event(&self) -> Option<Envelope> {
            self.harness.unroutable_event()
        }

        async fn read_back(&self, ack: &AckMetadata) -> Option<ReadBack> {
            self.harness.read_back(ack).await
        }
    }

    /// Every member it hands out is a [`FaultySource`] around the in-memory member; checks
    /// that reach the log itself (producing, reading the group's offsets, deleting records,
    /// fencing) go to the in-memory harness.
    pub(crate) struct Source(MemorySourceHarness);

    impl Source {
        pub(crate) fn new() -> Self {
            Self(MemorySourceHarness::new())
        }
    }

    #[async_trait]
    impl SourceHarness for Source {
        type Source = FaultySource<MemoryConsumer>;

        fn capabilities(&self) -> SourceCapabilities {
            self.0.capabilities()
        }

        fn topic(&self) -> String {
            self.0.topic()
        }

        async fn produce(&self, partition: i32, record: RawRecord) -> i64 {
            self.0.produce(partition, record).await
        }

        async fn join(&self) -> Self::Source {
            FaultySource::new(self.0.join().await, no_faults())
        }

        async fn join_from_latest(&self) -> Option<Self::Source> {
            self.0
                .join_from_latest()
                .await
                .map(|member| FaultySource::new(member, no_faults()))
        }

        async fn leave(&self, member: Self::Source) {
            self.0.leave(member.into_inner()).await;
        }

        async fn take_over(&self, member: &Self::Source) -> Self::Source {
            FaultySource::new(self.0.take_over(member.inner()).await, no_faults())
        }

        async fn committed(&self, partition: i32) -> Option<i64> {
            self.0.committed(partition).await
        }

        async fn delete_records_before(&self, partition: i32, offset: i64) {
            self.0.delete_records_before(partition, offset).await;
        }
    }

    mod outbox {
        outbox_testkit::outbox_conformance_tests!(async { super::Outbox::new() });
    }

    mod inbox {
        outbox_testkit::inbox_conformance_tests!(async { super::Inbox::new() });
    }

    mod publisher {
        outbox_testkit::publisher_conformance_tests!(async { super::Publisher::new() });
    }

    mod source {
        outbox_testkit::source_conformance_tests!(async { super::Source::new() });
    }
}

#[test]
fn the_macros_emit_every_listed_check() {
    // Keeps the name lists (documentation for backend authors) in sync with the macros.
    let source = include_str!("../src/conformance/mod.rs");
    for name in outbox_testkit::conformance::OUTBOX_CHECKS
        .iter()
        .chain(outbox_testkit::conformance::INBOX_CHECKS)
        .chain(outbox_testkit::conformance::PUBLISHER_CHECKS)
        .chain(outbox_testkit::conformance::SOURCE_CHECKS)
        .chain(outbox_testkit::conformance::REGISTRY_CHECKS)
    {
        assert!(
            source.matches(&format!("            {name},")).count() == 1,
            "{name} is not emitted by a macro exactly once"
        );
    }
}

mod reporting {
    outbox_testkit::reporting_conformance_tests!(async {
        outbox_testkit::conformance::MemoryOutboxHarness::new()
    });
}

mod registry {
    outbox_testkit::registry_conformance_tests!(async {
        outbox_testkit::conformance::MemoryOutboxHarness::new()
    });
}
