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
