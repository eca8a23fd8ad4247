//! **Temporary**: the mapping of a JetStream `PubAck` into today's Kafka-shaped
//! [`AckMetadata`] `(topic, partition, offset)`, kept in this one module so that phase 2 of the
//! transport seam (backend-neutral acknowledgement metadata in `outbox-core`, see
//! `docs/transports.md`) replaces it in one place.
//!
//! | `AckMetadata` field | filled with | what is lost |
//! |---|---|---|
//! | `topic` | the stream name of the `PubAck` | the subject (it is derived from the envelope) |
//! | `partition` | always `0`: a stream is one ordered log | nothing |
//! | `offset` | the stream sequence of the `PubAck` (`u64`, saturated to `i64::MAX`) | whether the `PubAck` was a duplicate (the stream already held this `Nats-Msg-Id`; the sequence is then the stored copy's) |

use async_nats::jetstream::publish::PublishAck;
use outbox_core::AckMetadata;

/// The acknowledgement metadata of a `PubAck`.
pub(crate) fn from_pub_ack(ack: &PublishAck) -> AckMetadata {
    AckMetadata {
        topic: ack.stream.clone(),
        partition: 0,
        offset: i64::try_from(ack.sequence).unwrap_or(i64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_and_sequence_become_topic_and_offset() {
        let ack = PublishAck {
            stream: "ORDERS".into(),
            sequence: 42,
            duplicate: true,
            ..Default::default()
        };
        assert_eq!(
            from_pub_ack(&ack),
            AckMetadata {
                topic: "ORDERS".into(),
                partition: 0,
                offset: 42
            }
        );
        let huge = PublishAck {
            sequence: u64::MAX,
            ..ack
        };
        assert_eq!(from_pub_ack(&huge).offset, i64::MAX);
    }
}
