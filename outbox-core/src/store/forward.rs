//! [`forward_store_roles!`](crate::forward_store_roles): a wrapper's unchanged roles, forwarded.

/// Implements the named store roles for a wrapper by forwarding every method to its inner
/// store, so a wrapper writes only the roles it changes.
///
/// The wrapper must be a type with one type parameter, the store it wraps (directly or inside
/// other wrappers that forward the role), reached through a field (a name or a tuple index).
/// Roles: `append`, `relay`, `operator`, `maintenance`, `reporting`.
///
/// ```
/// use outbox_core::{async_trait, AppendStore, Envelope, StoreError};
///
/// /// Counts appended events; every other role goes straight to the inner store.
/// struct Counting<S> {
///     inner: S,
///     appended: std::sync::atomic::AtomicU64,
/// }
///
/// #[async_trait]
/// impl<S: AppendStore> AppendStore for Counting<S> {
///     type Tx = S::Tx;
///     async fn append(&self, tx: &mut S::Tx, events: &[Envelope]) -> Result<(), StoreError> {
///         self.inner.append(tx, events).await?;
///         self.appended
///             .fetch_add(events.len() as u64, std::sync::atomic::Ordering::Relaxed);
///         Ok(())
///     }
/// }
///
/// outbox_core::forward_store_roles!(Counting<S>.inner => relay, operator, maintenance, reporting);
///
/// fn whole<T: outbox_core::OutboxStore>() {}
/// fn check<S: outbox_core::OutboxStore>() {
///     whole::<Counting<S>>();
/// }
/// ```
#[macro_export]
macro_rules! forward_store_roles {
    ($wrapper:ident < $s:ident > . $field:tt => $($role:ident),+ $(,)?) => {
        $( $crate::forward_store_roles!(@$role $wrapper, $s, $field); )+
    };
    (@append $wrapper:ident, $s:ident, $field:tt) => {
        #[$crate::async_trait]
        impl<$s: $crate::AppendStore> $crate::AppendStore for $wrapper<$s> {
            type Tx = <$s as $crate::AppendStore>::Tx;
            async fn append(
                &self,
                tx: &mut Self::Tx,
                events: &[$crate::Envelope],
            ) -> ::core::result::Result<(), $crate::StoreError> {
                $crate::AppendStore::append(&self.$field, tx, events).await
            }
        }
    };
    (@relay $wrapper:ident, $s:ident, $field:tt) => {
        #[$crate::async_trait]
        impl<$s: $crate::RelayStore> $crate::RelayStore for $wrapper<$s> {
            async fn claim(
                &self,
                request: &$crate::ClaimRequest,
            ) -> ::core::result::Result<$crate::ClaimedBatch, $crate::StoreError> {
                $crate::RelayStore::claim(&self.$field, request).await
            }
            async fn complete(
                &self,
                claim: &$crate::ClaimHandle,
                outcomes: &[$crate::Outcome],
            ) -> ::core::result::Result<$crate::CompletionReport, $crate::StoreError> {
                $crate::RelayStore::complete(&self.$field, claim, outcomes).await
            }
            async fn release(
                &self,
                claim: &$crate::ClaimHandle,
            ) -> ::core::result::Result<(), $crate::StoreError> {
                $crate::RelayStore::release(&self.$field, claim).await
            }
            fn claim_mode(&self) -> $crate::ClaimMode {
                $crate::RelayStore::claim_mode(&self.$field)
            }
            fn locked_claim_timeout(&self) -> ::core::option::Option<::core::time::Duration> {
                $crate::RelayStore::locked_claim_timeout(&self.$field)
            }
        }
    };
    (@operator $wrapper:ident, $s:ident, $field:tt) => {
        #[$crate::async_trait]
        impl<$s: $crate::OperatorStore> $crate::OperatorStore for $wrapper<$s> {
            async fn list_parked(
                &self,
                limit: usize,
            ) -> ::core::result::Result<::std::vec::Vec<$crate::ParkedEvent>, $crate::StoreError>
            {
                $crate::OperatorStore::list_parked(&self.$field, limit).await
            }
            async fn parked_event(
                &self,
                event_id: $crate::EventId,
            ) -> ::core::result::Result<$crate::ParkedEvent, $crate::StoreError> {
                $crate::OperatorStore::parked_event(&self.$field, event_id).await
            }
            async fn retry_parked(
                &self,
                event_id: $crate::EventId,
                actor: &str,
            ) -> ::core::result::Result<(), $crate::StoreError> {
                $crate::OperatorStore::retry_parked(&self.$field, event_id, actor).await
            }
            async fn retry_parked_with_reason(
                &self,
                event_id: $crate::EventId,
                actor: &str,
                reason: &str,
            ) -> ::core::result::Result<(), $crate::StoreError> {
                $crate::OperatorStore::retry_parked_with_reason(&self.$field, event_id, actor, reason)
                    .await
            }
            async fn discard_parked(
                &self,
                event_id: $crate::EventId,
                actor: &str,
                reason: &str,
            ) -> ::core::result::Result<(), $crate::StoreError> {
                $crate::OperatorStore::discard_parked(&self.$field, event_id, actor, reason).await
            }
            async fn reissue_parked(
                &self,
                event_id: $crate::EventId,
                actor: &str,
                reason: &str,
            ) -> ::core::result::Result<$crate::EventId, $crate::StoreError> {
                $crate::OperatorStore::reissue_parked(&self.$field, event_id, actor, reason).await
            }
            async fn audit_trail(
                &self,
                event_id: ::core::option::Option<$crate::EventId>,
            ) -> ::core::result::Result<::std::vec::Vec<$crate::AuditEntry>, $crate::StoreError>
            {
                $crate::OperatorStore::audit_trail(&self.$field, event_id).await
            }
            async fn release_claims_of(
                &self,
                owner: &str,
                actor: &str,
            ) -> ::core::result::Result<u64, $crate::StoreError> {
                $crate::OperatorStore::release_claims_of(&self.$field, owner, actor).await
            }
        }
    };
    (@maintenance $wrapper:ident, $s:ident, $field:tt) => {
        #[$crate::async_trait]
        impl<$s: $crate::MaintenanceStore> $crate::MaintenanceStore for $wrapper<$s> {
            async fn cleanup(
                &self,
                retention: ::core::time::Duration,
                batch_size: usize,
            ) -> ::core::result::Result<$crate::CleanupReport, $crate::StoreError> {
                $crate::MaintenanceStore::cleanup(&self.$field, retention, batch_size).await
            }
            async fn stats(
                &self,
            ) -> ::core::result::Result<$crate::OutboxStats, $crate::StoreError> {
                $crate::MaintenanceStore::stats(&self.$field).await
            }
        }
    };
    (@reporting $wrapper:ident, $s:ident, $field:tt) => {
        #[$crate::async_trait]
        impl<$s: $crate::ReportingStore> $crate::ReportingStore for $wrapper<$s> {
            async fn backlog(
                &self,
            ) -> ::core::result::Result<$crate::OutboxStats, $crate::StoreError> {
                $crate::ReportingStore::backlog(&self.$field).await
            }
            async fn publish_latency(
                &self,
                window: ::core::time::Duration,
            ) -> ::core::result::Result<$crate::LatencySummary, $crate::StoreError> {
                $crate::ReportingStore::publish_latency(&self.$field, window).await
            }
            async fn flow(
                &self,
                window: ::core::time::Duration,
            ) -> ::core::result::Result<$crate::WindowFlow, $crate::StoreError> {
                $crate::ReportingStore::flow(&self.$field, window).await
            }
            async fn flows(
                &self,
                windows: &[::core::time::Duration],
            ) -> ::core::result::Result<
                ::std::vec::Vec<$crate::WindowFlow>,
                $crate::StoreError,
            > {
                $crate::ReportingStore::flows(&self.$field, windows).await
            }
            async fn cleanup_candidates(
                &self,
                retention: ::core::time::Duration,
            ) -> ::core::result::Result<u64, $crate::StoreError> {
                $crate::ReportingStore::cleanup_candidates(&self.$field, retention).await
            }
            async fn count_published(
                &self,
                filter: &$crate::PublishedFilter,
            ) -> ::core::result::Result<u64, $crate::StoreError> {
                $crate::ReportingStore::count_published(&self.$field, filter).await
            }
            async fn published_events(
                &self,
                filter: &$crate::PublishedFilter,
                after: ::core::option::Option<$crate::PublishedPosition>,
                limit: usize,
            ) -> ::core::result::Result<::std::vec::Vec<$crate::PublishedRow>, $crate::StoreError>
            {
                $crate::ReportingStore::published_events(&self.$field, filter, after, limit).await
            }
            async fn interval_counts(
                &self,
                since: $crate::store::reporting::UtcTime,
                interval: ::core::time::Duration,
                grace: ::core::time::Duration,
            ) -> ::core::result::Result<::std::vec::Vec<$crate::IntervalCount>, $crate::StoreError>
            {
                $crate::ReportingStore::interval_counts(&self.$field, since, interval, grace).await
            }
            async fn published_ids(
                &self,
                event_type: &str,
                start: $crate::store::reporting::UtcTime,
                end: $crate::store::reporting::UtcTime,
                topics: &[::std::string::String],
                grace: ::core::time::Duration,
            ) -> ::core::result::Result<::std::vec::Vec<$crate::PublishedId>, $crate::StoreError>
            {
                $crate::ReportingStore::published_ids(
                    &self.$field,
                    event_type,
                    start,
                    end,
                    topics,
                    grace,
                )
                .await
            }
        }
    };
}
