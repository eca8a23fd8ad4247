use async_trait::async_trait;
use outbox_core::{Classify, Envelope, ErrorClass, EventId};

/// Applies one event's effect inside the inbox transaction.
///
/// # Contract
///
/// * The handler MUST write its effect through `tx` only, so the effect commits or rolls back
///   with the registration.
/// * It SHOULD check the number of rows it expected to change (optimistic version checks) and
///   return an error when they differ: the engine then rolls back the whole transaction.
/// * It MUST NOT commit or roll back `tx` itself.
#[async_trait]
pub trait Handler<Tx: Send>: Send + Sync {
    /// Applies `event` in `tx`.
    async fn handle(&self, tx: &mut Tx, event: &Envelope) -> Result<(), HandlerError>;

    /// Applies `events` in `tx`, in order: the fresh events of one engine batch. The default
    /// calls [`handle`](Self::handle) for each. Override it to apply a batch in a few
    /// set-based statements (one `UPDATE .. FROM unnest(..)` instead of one statement per
    /// event), which is where most of a consumer's time goes.
    ///
    /// # Contract
    ///
    /// * Events of one aggregate MUST be applied in the order given (a batch can hold several
    ///   versions of an aggregate; one set-based statement must not update a row twice).
    /// * On failure it MUST return the index of an event whose own application failed; the
    ///   engine rolls the transaction back, retries or parks that event, and applies the others
    ///   again. An implementation that cannot tell which event failed SHOULD fall back to
    ///   [`handle`](Self::handle) one by one for the batch.
    async fn handle_batch(
        &self,
        tx: &mut Tx,
        events: &[&Envelope],
    ) -> Result<(), BatchHandlerError> {
        for (index, event) in events.iter().enumerate() {
            self.handle(tx, event)
                .await
                .map_err(|error| BatchHandlerError { index, error })?;
        }
        Ok(())
    }
}

/// A failure of [`Handler::handle_batch`]: which event failed, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("event #{index} of the batch: {error}")]
pub struct BatchHandlerError {
    /// Index into the `events` slice.
    pub index: usize,
    /// The failure.
    pub error: HandlerError,
}

impl BatchHandlerError {
    /// A failure of the event at `index`.
    pub fn new(index: usize, error: HandlerError) -> Self {
        Self { index, error }
    }
}

/// A handler failure, classified.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("handler failed ({class}): {message}")]
pub struct HandlerError {
    /// Transient: roll back and try again later. Permanent: the event cannot be applied.
    pub class: ErrorClass,
    /// Detail (never the payload).
    pub message: String,
}

impl HandlerError {
    /// A transient failure (e.g. a lock timeout, a version not there yet).
    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::Transient,
            message: message.into(),
        }
    }
    /// A permanent failure (e.g. a payload that violates the schema).
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::Permanent,
            message: message.into(),
        }
    }
}

impl Classify for HandlerError {
    fn class(&self) -> ErrorClass {
        self.class
    }
}

impl From<outbox_core::StoreError> for HandlerError {
    fn from(e: outbox_core::StoreError) -> Self {
        Self {
            class: e.class,
            message: e.to_string(),
        }
    }
}

/// Namespace of idempotency keys (a fixed, random UUID).
const KEY_NAMESPACE: uuid::Uuid = uuid::Uuid::from_u128(0x6f1c_2b4e_93a7_4d0c_8b55_1e7f_0a3d_c219);

/// A stable idempotency key for an effect of `consumer` on `event_id` (UUID v5).
///
/// The same pair always yields the same key, so a retried call to an external API (payment,
/// e-mail) can be deduplicated by that API.
///
/// ```
/// use outbox_core::EventId;
/// let id = EventId::now_v7();
/// assert_eq!(outbox_inbox::idempotency_key("billing", id), outbox_inbox::idempotency_key("billing", id));
/// assert_ne!(outbox_inbox::idempotency_key("billing", id), outbox_inbox::idempotency_key("mailer", id));
/// ```
pub fn idempotency_key(consumer: &str, event_id: EventId) -> uuid::Uuid {
    let mut name = Vec::with_capacity(consumer.len() + 17);
    name.extend_from_slice(consumer.as_bytes());
    name.push(0);
    name.extend_from_slice(event_id.as_uuid().as_bytes());
    uuid::Uuid::new_v5(&KEY_NAMESPACE, &name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key is a UUID v5 of `(consumer, event)`: stable, and different when either differs
    /// (the doc test says so too, but the mutation run's test tool, nextest, skips doc tests).
    #[test]
    fn idempotency_keys_are_stable_per_consumer_and_event() {
        let (a, b) = (EventId::now_v7(), EventId::now_v7());
        let key = idempotency_key("billing", a);
        assert_eq!(key, idempotency_key("billing", a));
        assert_eq!(key.get_version_num(), 5);
        assert_ne!(key, idempotency_key("mailer", a));
        assert_ne!(key, idempotency_key("billing", b));
        // The separator keeps ("ab", ..) and ("a", "b"..) apart; so does the namespace.
        assert_eq!(
            key,
            uuid::Uuid::new_v5(
                &KEY_NAMESPACE,
                &[b"billing".as_slice(), &[0], a.as_uuid().as_bytes()].concat()
            )
        );
    }

    #[test]
    fn handler_errors_keep_their_class() {
        assert_eq!(HandlerError::transient("t").class(), ErrorClass::Transient);
        assert_eq!(HandlerError::permanent("p").class(), ErrorClass::Permanent);
        for (kind, class) in [
            (
                outbox_core::StoreErrorKind::Connection,
                ErrorClass::Transient,
            ),
            (
                outbox_core::StoreErrorKind::Constraint,
                ErrorClass::Permanent,
            ),
        ] {
            let store = outbox_core::StoreError::new(kind, "from the store");
            let text = store.to_string();
            let e = HandlerError::from(store);
            assert_eq!((e.class(), e.message), (class, text));
        }
        let b = BatchHandlerError::new(3, HandlerError::permanent("bad"));
        assert_eq!((b.index, b.error.class), (3, ErrorClass::Permanent));
    }
}
