//! The actors of a run: relays (spawned, killed and replaced), producers and the operator.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, Envelope, EventId, Relay, RelayConfig, RetryPolicy, ShutdownSignal, StoreErrorKind,
    SystemClock,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::broker::FakePublisher;
use super::history::{Committed, OpRecord, Window, World};
use super::recorded::Recorded;
use super::{
    label_of, mix, roll, RandomizedBackend, Spec, StoreParams, DELIVERY_TIMEOUT, DRAIN_RETRIES,
    GAP_TIMEOUT, LABEL, LOCKED_HOLD, OPEN_AGGREGATES, SALT_OPERATOR, SALT_OP_SKIP, SALT_PRODUCER,
    SALT_RELAY,
};

pub(crate) struct RelaySlot {
    pub(crate) index: usize,
    pub(crate) generation: u32,
    pub(crate) owner: String,
    pub(crate) batch: usize,
    pub(crate) prefetch: bool,
    pub(crate) shutdown: ShutdownSignal,
    pub(crate) handle: tokio::task::JoinHandle<()>,
}

pub(crate) struct Env<B: RandomizedBackend> {
    pub(crate) world: Arc<World>,
    pub(crate) backend: Arc<B>,
    pub(crate) spec: Spec,
}

impl<B: RandomizedBackend> Env<B> {
    /// A new store instance, as a separate relay process would have.
    pub(crate) fn store(&self) -> B::Store {
        self.backend.store(&StoreParams {
            mode: self.spec.mode,
            locked_hold: LOCKED_HOLD,
            gap_timeout: GAP_TIMEOUT,
            delivery_timeout: DELIVERY_TIMEOUT,
        })
    }

    pub(crate) fn spawn_relay(
        &self,
        index: usize,
        generation: u32,
        batch: usize,
        prefetch: bool,
    ) -> RelaySlot {
        let world = self.world.clone();
        let owner = format!("relay{index}-gen{generation}");
        let relay_seed =
            mix(world.seed ^ SALT_RELAY ^ ((index as u64) << 8) ^ u64::from(generation));
        let publisher = FakePublisher {
            relay: owner.clone(),
            world: world.clone(),
            backend: self.backend.clone(),
            rng: Mutex::new(StdRng::seed_from_u64(mix(relay_seed))),
        };
        // Each relay has its own store instance, as separate processes would.
        let store = Recorded {
            inner: self.store(),
            world: world.clone(),
        };
        // The run length: drawn per relay from the spec's lengths (seeded).
        let lengths = self.spec.runs;
        let run = lengths[(mix(relay_seed ^ 0x52_554e) % lengths.len() as u64) as usize];
        let config = RelayConfig::builder()
            .owner(&owner)
            .batch_size(batch)
            .run(run)
            .prefetch(prefetch)
            .idle(Duration::from_millis(5), Duration::from_millis(80))
            .lease_margin(outbox_core::MIN_LEASE_MARGIN)
            .circuit_breaker(Duration::from_millis(50), Duration::from_millis(400))
            .retry(
                RetryPolicy::builder()
                    .base(Duration::from_millis(20))
                    .max_delay(Duration::from_millis(300))
                    .max_attempts(4)
                    .build()
                    .unwrap(),
            )
            .build()
            .unwrap();
        let mut relay = Relay::new(
            store,
            publisher,
            config,
            Arc::new(SystemClock),
            Box::new(StdRng::seed_from_u64(relay_seed)),
        )
        .expect("relay configuration");
        let shutdown = relay.shutdown_signal();
        let task_owner = owner.clone();
        let handle = tokio::spawn(async move {
            let mut failures = 0u32;
            while !relay.shutdown_signal().is_triggered() {
                match relay.run_once().await {
                    Ok(rep) => {
                        failures = 0;
                        world.note_cycle(&rep);
                        if let Some(pause) = rep.pause {
                            tokio::time::sleep(pause).await;
                        } else if rep.is_idle() {
                            let d = relay.idle_delay();
                            tokio::time::sleep(d).await;
                        } else {
                            relay.reset_idle();
                        }
                    }
                    Err(e) => {
                        failures += 1;
                        world.note_relay_error(&task_owner, &e);
                        let d = relay.error_delay(failures);
                        tokio::time::sleep(d).await;
                    }
                }
            }
            if let Err(e) = relay.release_prefetched().await {
                world.note_relay_error(&task_owner, &e);
            }
        });
        RelaySlot {
            index,
            generation,
            owner,
            batch,
            prefetch,
            shutdown,
            handle,
        }
    }
}

struct Agg {
    id: String,
    next: i64,
    target: i64,
    /// A skipped version to append late, not before the instant.
    fill: Option<(i64, Instant)>,
}

#[derive(Default)]
pub(crate) struct Injected {
    pub(crate) dup: usize,
    pub(crate) gap: usize,
    pub(crate) fill: usize,
    pub(crate) transactions: usize,
    pub(crate) held_open: usize,
}

pub(crate) async fn produce<B: RandomizedBackend>(
    world: Arc<World>,
    backend: Arc<B>,
    store: B::Store,
    idx: usize,
    until: Instant,
) -> Injected {
    let mut rng = StdRng::seed_from_u64(mix(world.seed ^ SALT_PRODUCER ^ idx as u64));
    let mut made = 0u64;
    let mut counter = 0u64;
    let mut new_agg = |rng: &mut StdRng| {
        made += 1;
        Agg {
            id: format!("p{idx}-a{made}"),
            next: 1,
            target: if rng.random_bool(0.2) {
                rng.random_range(20..=40)
            } else {
                rng.random_range(2..=8)
            },
            fill: None,
        }
    };
    let mut aggs: Vec<Agg> = (0..OPEN_AGGREGATES).map(|_| new_agg(&mut rng)).collect();
    let mut inj = Injected::default();
    while Instant::now() < until {
        // The transaction first: a pool timeout on a loaded machine costs a turn, nothing else.
        let Ok(mut tx) = backend.begin().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let rollback = rng.random_bool(0.03);
        let steps = rng.random_range(1..=3);
        let mut events = Vec::with_capacity(steps);
        for _ in 0..steps {
            let i = rng.random_range(0..aggs.len());
            let a = &mut aggs[i];
            counter += 1;
            let (version, kind) = if rollback {
                // Not committed: the aggregate's state does not move.
                (a.next, "rolledback")
            } else {
                let r: f64 = rng.random();
                match a.fill {
                    Some((v, at)) if r < 0.5 && Instant::now() >= at => {
                        a.fill = None;
                        inj.fill += 1;
                        (v, "fill")
                    }
                    _ if r < 0.02 && a.next > 1 => {
                        // A duplicate of a recent version, or an older one: out of order.
                        inj.dup += 1;
                        (rng.random_range((a.next - 3).max(1)..a.next), "dup")
                    }
                    _ if r < 0.04 => {
                        // Skip a version; now and then it arrives late.
                        inj.gap += 1;
                        if a.fill.is_none() && rng.random_bool(0.5) {
                            let delay = Duration::from_millis(rng.random_range(0..3000));
                            a.fill = Some((a.next, Instant::now() + delay));
                        }
                        a.next += 2;
                        (a.next - 1, "gap")
                    }
                    _ => {
                        a.next += 1;
                        (a.next - 1, "next")
                    }
                }
            };
            let label = format!("{}/v{version}/{kind}{counter}", a.id);
            let e = Envelope::builder("order", a.id.clone(), version, "order.changed")
                .json(&serde_json::json!({ "v": version, "label": label }))
                .unwrap()
                .header(LABEL, label.clone())
                .build()
                .unwrap();
            events.push((e, label));
        }
        let envelopes: Vec<Envelope> = events.iter().map(|(e, _)| e.clone()).collect();
        if let Err(e) = backend.append(&store, &mut tx, &envelopes).await {
            panic!(
                "seed {}: producer {idx}: appending {} valid events failed: {e}",
                world.seed,
                envelopes.len()
            );
        }
        if rng.random_bool(0.1) {
            // Held open: later transactions (higher ids) commit first.
            inj.held_open += 1;
            tokio::time::sleep(Duration::from_millis(rng.random_range(20..200))).await;
        }
        inj.transactions += 1;
        if rollback {
            // A failed rollback leaves nothing committed either.
            backend.rollback(tx).await;
            let mut rb = world.rolled_back.lock().unwrap();
            rb.extend(events.into_iter().map(|(e, l)| (e.event_id, l)));
        } else {
            if let Err(e) = backend.commit(tx).await {
                panic!(
                    "seed {}: producer {idx}: a commit failed, its outcome is unknown and the \
                     run cannot judge what follows: {e}",
                    world.seed
                );
            }
            let at = Instant::now();
            let mut c = world.committed.lock().unwrap();
            c.extend(events.into_iter().map(|(e, label)| Committed {
                id: e.event_id,
                label,
                at,
            }));
        }
        for a in &mut aggs {
            if a.next > a.target && a.fill.is_none() {
                *a = new_agg(&mut rng);
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(2..12))).await;
    }
    inj
}

// ---------------------------------------------------------------------------------------------
// The operator

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Running,
    Draining,
}

#[derive(Default)]
pub(crate) struct OperatorState {
    pub(crate) drain_retries: HashMap<EventId, u32>,
    pub(crate) parked_event_checks: usize,
    pub(crate) kills: usize,
    pub(crate) released_claims: u64,
    /// `release_claims_of` calls that lost their connection (may or may not have released).
    pub(crate) uncertain_releases: usize,
    pub(crate) connection_errors: usize,
}

pub(crate) async fn operate<S: OutboxStore>(
    world: &World,
    store: &S,
    phase: Phase,
    st: &mut OperatorState,
) {
    let parked = match store.list_parked(500).await {
        Ok(p) => p,
        Err(e) if e.kind == StoreErrorKind::Connection => {
            st.connection_errors += 1;
            return;
        }
        Err(e) => {
            world.violation(format!("operator: list_parked failed: {e}"));
            return;
        }
    };
    for p in parked {
        let id = p.envelope.event_id;
        let label = label_of(&p.envelope);
        let n = {
            let mut counts = world.op_counts.lock().unwrap();
            let c = counts.entry(label.clone()).or_default();
            *c += 1;
            *c
        };
        if phase == Phase::Running && roll(world.seed, SALT_OP_SKIP, &label, n) < 0.3 {
            continue; // left parked for now
        }
        let r = roll(world.seed, SALT_OPERATOR, &label, n);
        if r < 0.15 {
            // What an operator looks at first.
            st.parked_event_checks += 1;
            match store.parked_event(id).await {
                Ok(seen) if seen.envelope.event_id == id => {}
                Ok(seen) => world.violation(format!(
                    "operator: parked_event({id}) returned event {}",
                    seen.envelope.event_id
                )),
                Err(e) if e.kind == StoreErrorKind::NotFound => continue,
                Err(e) if e.kind == StoreErrorKind::Connection => {
                    st.connection_errors += 1;
                    continue;
                }
                Err(e) => world.violation(format!("operator: parked_event({id}) failed: {e}")),
            }
        }
        let action = match phase {
            Phase::Draining => {
                let tries = st.drain_retries.entry(id).or_default();
                *tries += 1;
                if *tries <= DRAIN_RETRIES {
                    "retry"
                } else {
                    "discard"
                }
            }
            Phase::Running if r < 0.5 => "retry",
            Phase::Running if r < 0.75 => "discard",
            Phase::Running => "reissue",
        };
        if act(world, store, id, &label, action).await == "conflict" && action != "discard" {
            // Out of order (at or below the last version sent): the documented answer. (While
            // lower versions are waiting below a gap, the discard is refused too.)
            act(world, store, id, &label, "discard").await;
        }
    }
}

/// One operator action, recorded: "ok", "conflict", "not_found" or "uncertain".
async fn act<S: OutboxStore>(
    world: &World,
    store: &S,
    id: EventId,
    label: &str,
    action: &'static str,
) -> &'static str {
    let call = Instant::now();
    let res = match action {
        "retry" => store.retry_parked(id, "operator").await.map(|()| None),
        "discard" => store
            .discard_parked(id, "operator", "randomized test: discarded by the operator")
            .await
            .map(|()| None),
        _ => store
            .reissue_parked(id, "operator", "randomized test: re-issued by the operator")
            .await
            .map(Some),
    };
    let window = Window {
        call,
        ret: Instant::now(),
    };
    let (result, new_id) = match res {
        Ok(new_id) => ("ok", new_id),
        // Out of order (retry, re-issue), or lower versions waiting below a gap (every action:
        // they go out first and the action is tried again later).
        Err(e) if e.kind == StoreErrorKind::Conflict => ("conflict", None),
        Err(e) if e.kind == StoreErrorKind::NotFound => ("not_found", None),
        // A lost connection (a pool timeout on a loaded machine): the action may or may not
        // have committed. The checks take both possibilities into account.
        Err(e) if e.kind == StoreErrorKind::Connection => ("uncertain", None),
        Err(e) => {
            world.violation(format!(
                "operator: {action} of {label} ({id}) failed unexpectedly: {e}"
            ));
            ("error", None)
        }
    };
    world.ops.lock().unwrap().push(OpRecord {
        event: id,
        label: label.to_owned(),
        action,
        window,
        result,
        new_id,
    });
    result
}

/// Kills a relay mid-cycle (its task is dropped wherever it is), ends its claims as an operator
/// would (lease mode: `release_claims_of`, or leaves them to expire), and starts a new one.
pub(crate) async fn kill_and_replace<B: RandomizedBackend>(
    env: &Env<B>,
    slot: &mut RelaySlot,
    release: bool,
    st: &mut OperatorState,
) {
    let world = &env.world;
    let aborted = Instant::now();
    slot.handle.abort();
    let _ = (&mut slot.handle).await;
    st.kills += 1;
    if env.spec.mode == ClaimMode::LockedTransaction {
        // Dropping the task dropped its store instance and the claim transactions with it.
        let mut log = world.claims.lock().unwrap();
        log.owner_end.insert(slot.owner.clone(), aborted);
        let mut dropped = 0;
        for c in log.claims.iter_mut().filter(|c| c.owner == slot.owner) {
            dropped += std::mem::take(&mut c.provisional_parks).len();
        }
        log.claim_parks_rolled_back += dropped;
    }
    if release {
        let call = Instant::now();
        if env.spec.mode != ClaimMode::LockedTransaction {
            world
                .claims
                .lock()
                .unwrap()
                .owner_end
                .insert(slot.owner.clone(), call);
        }
        match env.store().release_claims_of(&slot.owner, "operator").await {
            Ok(n) => st.released_claims += n,
            Err(e) if e.kind == StoreErrorKind::Connection => st.uncertain_releases += 1,
            Err(e) => world.violation(format!(
                "operator: release_claims_of({}) failed: {e}",
                slot.owner
            )),
        }
    }
    *slot = env.spawn_relay(slot.index, slot.generation + 1, slot.batch, slot.prefetch);
}

// ---------------------------------------------------------------------------------------------
// The run
