//! The acknowledgement metadata of a RabbitMQ publisher confirm: [`AckMetadata::RabbitMq`].
//!
//! RabbitMQ stores no addressable position for a message: a confirm says "stored (in every
//! queue it was routed to)", nothing more. What is kept is where the message was sent: the
//! exchange and the routing key. The confirm's delivery tag (the publish sequence number on
//! the publisher's channel) is not kept: it is no position in any queue and repeats after a
//! reconnect.

use outbox_core::AckMetadata;

/// The acknowledgement metadata of the confirm of a message published to `exchange` with
/// `routing_key`.
pub(crate) fn from_confirm(exchange: &str, routing_key: &str) -> AckMetadata {
    AckMetadata::RabbitMq {
        exchange: exchange.to_owned(),
        routing_key: routing_key.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exchange_and_routing_key() {
        let ack = from_confirm("orders", "order.created");
        assert_eq!(
            ack,
            AckMetadata::RabbitMq {
                exchange: "orders".into(),
                routing_key: "order.created".into(),
            }
        );
        assert_eq!(ack.position(), None, "a confirm names no stored position");
    }
}
