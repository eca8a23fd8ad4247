//! The demo through Kafka: a fresh topic and consumer group per run.

use std::time::Duration;

use outbox_kafka::{KafkaPublisher, KafkaSource};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::ClientConfig;

use crate::{CONSUMER, MAX_RECORD_BYTES};

/// Kafka backends of one demo run.
pub struct KafkaBackend {
    /// The topic of this run.
    pub topic: String,
    /// The publisher.
    pub publisher: KafkaPublisher,
    /// The projection's source (the engine hands it its offset tracker).
    pub source: KafkaSource,
}

impl std::fmt::Debug for KafkaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaBackend")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

/// Prints the run's topic and deletes it unless `keep` (the demo cleans up after itself).
pub async fn finish(brokers: &str, topic: &str, keep: bool) {
    if keep {
        eprintln!("kept Kafka topic {topic}");
        return;
    }
    let deleted = async {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()?;
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        for r in admin.delete_topics(&[topic], &opts).await? {
            r.map_err(|(t, code)| anyhow::anyhow!("cannot delete topic {t}: {code}"))?;
        }
        anyhow::Ok(())
    };
    match deleted.await {
        Ok(()) => eprintln!("used Kafka topic {topic} (deleted; --keep keeps it)"),
        Err(e) => eprintln!("used Kafka topic {topic}; deleting it failed: {e}"),
    }
}

impl KafkaBackend {
    /// Creates a topic `outbox-demo-<random>` with 3 partitions and starts the publisher and the
    /// source.
    pub async fn start(brokers: &str) -> anyhow::Result<Self> {
        let topic = format!(
            "outbox-demo-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()?;
        let results = admin
            .create_topics(
                [&NewTopic::new(&topic, 3, TopicReplication::Fixed(1))],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await?;
        for r in results {
            r.map_err(|(t, code)| anyhow::anyhow!("cannot create topic {t}: {code}"))?;
        }
        let publisher = KafkaPublisher::builder(brokers, &topic)
            .delivery_timeout(Duration::from_secs(10))
            // The producer refuses records above this size: the poison order is permanent.
            .set("message.max.bytes", MAX_RECORD_BYTES.to_string())
            .start()
            .await
            .map_err(|e| anyhow::anyhow!("Kafka publisher: {e}"))?;
        let source = KafkaSource::builder(brokers, format!("{CONSUMER}-{topic}"))
            .topic(&topic)
            .session_timeout(Duration::from_secs(6))
            .build()?;
        Ok(Self {
            topic,
            publisher,
            source,
        })
    }
}
