//! The acknowledgement metadata of a JetStream `PubAck`: [`AckMetadata::JetStream`].
//!
//! | field | filled with |
//! |---|---|
//! | `stream` | the stream that stored the message (named by the `PubAck`) |
//! | `sequence` | its stream sequence (for a duplicate: the sequence of the copy stored before) |
//! | `subject` | the subject the message was published to (the `PubAck` does not repeat it) |
//! | `duplicate` | the stream already held this `Nats-Msg-Id` within its duplicate window and stored nothing new |

use async_nats::jetstream::publish::PublishAck;
use outbox_core::AckMetadata;

/// The acknowledgement metadata of the `PubAck` of a message published to `subject`.
pub(crate) fn from_pub_ack(ack: &PublishAck, subject: &str) -> AckMetadata {
    AckMetadata::JetStream {
        stream: ack.stream.clone(),
        sequence: ack.sequence,
        subject: subject.to_owned(),
        duplicate: ack.duplicate,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_sequence_subject_and_the_duplicate_flag_are_kept() {
        for duplicate in [false, true] {
            let ack = PublishAck {
                stream: "ORDERS".into(),
                sequence: 42,
                duplicate,
                ..Default::default()
            };
            assert_eq!(
                from_pub_ack(&ack, "outbox.order"),
                AckMetadata::JetStream {
                    stream: "ORDERS".into(),
                    sequence: 42,
                    subject: "outbox.order".into(),
                    duplicate,
                }
            );
        }
        let huge = PublishAck {
            stream: "S".into(),
            sequence: u64::MAX,
            ..Default::default()
        };
        assert!(matches!(
            from_pub_ack(&huge, "s"),
            AckMetadata::JetStream {
                sequence: u64::MAX,
                ..
            }
        ));
    }
}
