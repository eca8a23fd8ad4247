//! The scripted publisher double, in the manner of tower-test's mock/handle pair: [`pair`]
//! returns a [`ScriptedPublisher`] (given to the real `Relay`) and a [`PublisherHandle`] (kept
//! by the simulation). A `publish` call hands its batch to the handle and waits; the
//! simulation decides when, and how, each record is answered, or lets the relay's process die
//! while the batch is held.

use std::time::Duration;

use outbox_core::{async_trait, Envelope, PublishError, PublishResult, Publisher};
use tokio::sync::{mpsc, oneshot};

/// A batch held between send and acknowledgement.
#[derive(Debug)]
pub struct HeldBatch {
    /// The records as the relay sent them.
    pub records: Vec<Envelope>,
    reply: oneshot::Sender<Vec<PublishResult>>,
}

impl HeldBatch {
    /// Answers the batch; the relay's `publish` returns `results`.
    pub fn answer(self, results: Vec<PublishResult>) {
        // The relay may have died meanwhile; then nobody listens.
        let _ = self.reply.send(results);
    }
}

/// The publisher given to the relay.
#[derive(Clone, Debug)]
pub struct ScriptedPublisher {
    requests: mpsc::UnboundedSender<HeldBatch>,
    delivery_timeout: Duration,
}

/// The simulation's side of the double.
#[derive(Debug)]
pub struct PublisherHandle {
    requests: mpsc::UnboundedReceiver<HeldBatch>,
}

/// A publisher double and its handle.
pub fn pair(delivery_timeout: Duration) -> (ScriptedPublisher, PublisherHandle) {
    let (tx, rx) = mpsc::unbounded_channel();
    (
        ScriptedPublisher {
            requests: tx,
            delivery_timeout,
        },
        PublisherHandle { requests: rx },
    )
}

impl PublisherHandle {
    /// The next batch sent, waiting for it.
    pub async fn next_batch(&mut self) -> Option<HeldBatch> {
        self.requests.recv().await
    }

    /// A batch already sent, without waiting.
    pub fn try_next_batch(&mut self) -> Option<HeldBatch> {
        self.requests.try_recv().ok()
    }
}

#[async_trait]
impl Publisher for ScriptedPublisher {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let records: Vec<Envelope> = batch.iter().map(|e| (*e).clone()).collect();
        let (reply, answer) = oneshot::channel();
        let failed = || {
            batch
                .iter()
                .map(|_| {
                    Err(PublishError::new(
                        outbox_core::PublishErrorKind::Timeout,
                        "the scripted broker went away",
                    ))
                })
                .collect()
        };
        if self.requests.send(HeldBatch { records, reply }).is_err() {
            return failed();
        }
        answer.await.unwrap_or_else(|_| failed())
    }

    fn delivery_timeout(&self) -> Duration {
        self.delivery_timeout
    }
}
