//! **Temporary**: the mapping of a RabbitMQ publisher confirm into today's Kafka-shaped
//! [`AckMetadata`] `(topic, partition, offset)`, kept in this one module so that phase 2 of the
//! transport seam (backend-neutral acknowledgement metadata in `outbox-core`, see
//! `docs/transports.md`) replaces it in one place.
//!
//! RabbitMQ stores no addressable position for a message: a confirm says "stored (in every
//! queue it was routed to)", nothing more.
//!
//! | `AckMetadata` field | filled with | what is lost |
//! |---|---|---|
//! | `topic` | the exchange | the routing key (derived from the envelope; phase 2 stores it) |
//! | `partition` | always `0` | nothing |
//! | `offset` | the confirm's delivery tag: the publish sequence number on the publisher's channel (counted from 1 per channel) | it is not a position in any queue, repeats after a reconnect, and cannot be used to read the message back |

use outbox_core::AckMetadata;

/// The acknowledgement metadata of the confirm of publish number `tag` on a channel.
pub(crate) fn from_confirm(exchange: &str, tag: u64) -> AckMetadata {
    AckMetadata {
        topic: exchange.to_owned(),
        partition: 0,
        offset: i64::try_from(tag).unwrap_or(i64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exchange_and_tag() {
        assert_eq!(
            from_confirm("orders", 7),
            AckMetadata {
                topic: "orders".into(),
                partition: 0,
                offset: 7
            }
        );
        assert_eq!(from_confirm("x", u64::MAX).offset, i64::MAX);
    }
}
