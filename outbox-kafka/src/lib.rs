//! Kafka (rdkafka) publisher and consumer source for the outbox.
