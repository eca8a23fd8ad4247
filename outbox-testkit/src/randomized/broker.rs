//! The fake broker of a run: decides, per hand-over of each record and from the seed, whether
//! it is acknowledged, acknowledged with the report lost, or fails (record-scoped, permanent,
//! transport, timeout); stalls now and then past the claim's life; stores a record only while
//! the handing relay's claim is certainly live, and records every delivery in the history.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::{
    async_trait, AckMetadata, Envelope, EventId, PublishError, PublishErrorKind, PublishResult,
    Publisher,
};
use rand::rngs::StdRng;
use rand::Rng;

use super::history::{Ack, World};
use super::{
    label_of, mix, roll, RandomizedBackend, DELIVERY_TIMEOUT, PARTITIONS, SALT_VERDICT, TOPIC,
};

pub(crate) struct FakePublisher<B> {
    pub(crate) relay: String,
    pub(crate) world: Arc<World>,
    /// Reads the rows' statuses (on connections apart from the relays').
    pub(crate) backend: Arc<B>,
    pub(crate) rng: Mutex<StdRng>,
}

pub(crate) enum Verdict {
    Ack,
    AckLost,
    Other,
    Invalid,
    Unavailable,
    Timeout,
}

impl<B> FakePublisher<B> {
    fn verdict(&self, label: &str, n: u32) -> Verdict {
        let r = roll(self.world.seed, SALT_VERDICT, label, n);
        match r {
            r if r < 0.76 => Verdict::Ack,
            r if r < 0.79 => Verdict::AckLost,
            r if r < 0.88 => Verdict::Other,
            r if r < 0.91 => Verdict::Invalid,
            r if r < 0.97 => Verdict::Unavailable,
            _ => Verdict::Timeout,
        }
    }
}

#[async_trait]
impl<B: RandomizedBackend> Publisher for FakePublisher<B> {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let world = &self.world;
        // Call-level decisions: the transport down for the whole call; the delivery delay
        // (beyond the delivery timeout now and then: nothing is delivered then); and a stall
        // after the delivery reports, past the claim's life now and then, so leases expire
        // mid-publish and another relay takes the aggregates over.
        let (down, deliver_after, linger) = {
            let mut rng = self.rng.lock().unwrap();
            let down = rng.random_bool(0.02);
            let deliver_after = match rng.random_range(0..100u32) {
                0..=69 => Duration::ZERO,
                70..=97 => Duration::from_millis(rng.random_range(1..80)),
                _ => DELIVERY_TIMEOUT + Duration::from_millis(rng.random_range(20..200)),
            };
            let linger = if rng.random_bool(0.012) {
                world.claim_life + Duration::from_millis(rng.random_range(200..1200))
            } else if rng.random_bool(0.2) {
                Duration::from_millis(rng.random_range(1..40))
            } else {
                Duration::ZERO
            };
            (down, deliver_after, linger)
        };

        // Check 1, at hand-over: every record is pending in the database while its claim is
        // live (status read on a separate connection; the claim must still be live when the
        // answer is in, else the record counts as stalled and is not delivered).
        let ids: Vec<EventId> = batch.iter().map(|e| e.event_id).collect();
        let statuses = self.backend.statuses(&ids).await;
        let checked_at = Instant::now();
        let mut deadlines: Vec<Option<Instant>> = Vec::with_capacity(batch.len());
        let (mut checked, mut stalled, mut unchecked) = (0usize, 0usize, 0usize);
        for e in batch {
            let deadline = world.deadline_of(&self.relay, e.event_id);
            match (deadline, &statuses) {
                (None, _) => {
                    world.violation(format!(
                        "check 1 (unclaimed hand-over): {} ({}) was handed to {} without a \
                         claim of that relay",
                        label_of(e),
                        e.event_id,
                        self.relay
                    ));
                    deadlines.push(None);
                }
                (Some(d), Some(statuses)) if checked_at < d => {
                    checked += 1;
                    let status = statuses.get(&e.event_id).map_or("<no row>", |s| s.as_str());
                    if status != "pending" {
                        world.violation(format!(
                            "check 1 (at hand-over): {} ({}) was handed to {} at {} while its \
                             row was '{status}' (its claim is live until at least {})",
                            label_of(e),
                            e.event_id,
                            self.relay,
                            world.ms(checked_at),
                            world.ms(d)
                        ));
                    }
                    deadlines.push(Some(d));
                }
                (Some(_), None) => {
                    // The status query failed (a loaded machine): not delivered, unchecked.
                    unchecked += 1;
                    deadlines.push(None);
                }
                (Some(_), _) => {
                    stalled += 1;
                    deadlines.push(None);
                }
            }
        }
        if !deliver_after.is_zero() {
            tokio::time::sleep(deliver_after).await;
        }
        let results: Vec<PublishResult> = {
            let mut broker = world.broker.lock().unwrap();
            let now = Instant::now();
            broker.calls += 1;
            broker.checked += checked;
            broker.stalled += stalled;
            broker.status_query_failures += usize::from(statuses.is_none());
            broker.unchecked += unchecked;
            broker.long_stalls += usize::from(linger > world.claim_life);
            let mut out = Vec::with_capacity(batch.len());
            for (e, deadline) in batch.iter().zip(&deadlines) {
                let label = label_of(e);
                let n = {
                    let c = broker.handovers.entry(label.clone()).or_default();
                    *c += 1;
                    *c
                };
                let in_time = deadline.is_some_and(|d| now < d) && deliver_after < DELIVERY_TIMEOUT;
                let (name, deliver, error) = if down {
                    (
                        "transport_down",
                        false,
                        Some(PublishError::new(
                            PublishErrorKind::BrokerUnavailable,
                            "all brokers down",
                        )),
                    )
                } else if !in_time {
                    (
                        "no_report_in_time",
                        false,
                        Some(PublishError::new(
                            PublishErrorKind::Timeout,
                            "no delivery report within the delivery timeout",
                        )),
                    )
                } else {
                    match self.verdict(&label, n) {
                        Verdict::Ack => ("ack", true, None),
                        Verdict::AckLost => (
                            "ack_lost",
                            true,
                            Some(PublishError::new(
                                PublishErrorKind::Timeout,
                                "stored, but the delivery report was lost",
                            )),
                        ),
                        Verdict::Other => (
                            "other",
                            false,
                            Some(PublishError::new(
                                PublishErrorKind::Other,
                                "record-scoped transient failure",
                            )),
                        ),
                        Verdict::Invalid => (
                            "invalid_record",
                            false,
                            Some(PublishError::new(
                                PublishErrorKind::InvalidRecord,
                                "the broker rejected the record",
                            )),
                        ),
                        Verdict::Unavailable => (
                            "broker_unavailable",
                            false,
                            Some(PublishError::new(
                                PublishErrorKind::BrokerUnavailable,
                                "connection to the partition leader lost",
                            )),
                        ),
                        Verdict::Timeout => (
                            "timeout",
                            false,
                            Some(PublishError::new(
                                PublishErrorKind::Timeout,
                                "message timed out",
                            )),
                        ),
                    }
                };
                *broker.verdicts.entry(name).or_default() += 1;
                if !deliver {
                    out.push(Err(error.unwrap_or_else(|| {
                        PublishError::new(PublishErrorKind::Other, "not delivered")
                    })));
                    continue;
                }
                let partition = (mix(e
                    .aggregate_id
                    .bytes()
                    .fold(0u64, |h, b| h.wrapping_mul(31) ^ u64::from(b)))
                    % PARTITIONS as u64) as usize;
                let offset = broker.offsets[partition];
                broker.offsets[partition] += 1;
                let reported = error.is_none();
                broker.acks.push(Ack {
                    at: now,
                    event: e.event_id,
                    dedup: e.dedup_id(),
                    label,
                    agg: e.aggregate_id.clone(),
                    version: e.aggregate_version,
                    relay: self.relay.clone(),
                    partition: partition as i32,
                    offset,
                    reported,
                });
                out.push(match error {
                    None => Ok(AckMetadata::kafka(TOPIC, partition as i32, offset)),
                    Some(e) => Err(e),
                });
            }
            out
        };
        if !linger.is_zero() {
            tokio::time::sleep(linger).await;
        }
        results
    }

    fn delivery_timeout(&self) -> Duration {
        DELIVERY_TIMEOUT
    }
}
