//! # outbox-sim: the crash-at-every-step simulation, driving the production code
//!
//! A state-machine property test of the whole pipeline (business transactions → outbox →
//! relays → log → consumer engine → inbox) in which the code under test is the real code:
//!
//! * **Relays** are [`outbox_core::Relay`]s running [`Relay::run_once`](outbox_core::Relay::run_once)
//!   (prefetch on and off, lease and locked-transaction claims) as tokio tasks. They publish
//!   through a scripted double ([`publisher::pair`], in the manner of tower-test's mock/handle
//!   pair): the double holds each batch between send and acknowledgement, and the simulation
//!   decides when it is answered and how, record by record (acknowledged with metadata,
//!   transient, transport or permanent failure, stored with the acknowledgement lost), or
//!   lets the relay's process die with the batch held (the task is aborted; a locked
//!   claim's connection drops).
//! * **The consumer** is [`outbox_inbox::ConsumerEngine`] over the in-memory log, with its
//!   batching, its handler fallback, its watermark and consumer-side parking; it crashes
//!   between any two steps (the engine and its running transactions are dropped, a new one
//!   resumes from the committed offsets) and hands partitions over on rebalances.
//! * **The transport** is a mode of the case ([`Transport`], see `docs/simulation.md`):
//!   Kafka's partitioned log with offset commits (half the cases); NATS JetStream's stream
//!   (a re-send inside the duplicate window is not stored again and its acknowledgement names
//!   the copy stored before; per-message acks by delivery sequence; a message not acknowledged
//!   within the ack wait, virtual time moved by [`Step::Advance`], is redelivered after later
//!   ones at a new delivery sequence, a crashed member's too; a member leaving on
//!   [`Step::Rebalance`] gives back what it holds); RabbitMQ's queue (every re-send stored;
//!   `ack multiple` by delivery tag; a channel that closes, on a crash or lost under the
//!   running engine on [`Step::Rebalance`], requeues every unacked delivery flagged
//!   redelivered, and tags start again on the new channel). [`SimConfig::transport`] forces
//!   one.
//! * **The stores** are generic ([`Backend`]): [`MemoryBackend`] runs on the testkit's
//!   in-memory backends; `PostgresBackend` (feature `postgres`) on a real server, one schema
//!   per case; `MySqlBackend` (feature `mysql`) on MySQL 8 / MariaDB, one database per case.
//! * **The producer** runs business transactions of the user's [`Command`]s, and also leaves
//!   its aggregates' versions out of order ([`Skew`]): a version past the next (a gap, filled
//!   late or never), the lowest missing one (a late fill, committed after a higher version), a
//!   version the aggregate already has (a re-append).
//! * **What runs concurrently in production runs concurrently** ([`Step::Race`]): claims of
//!   several relays, completions and operator actions start together, in the order and at the
//!   stagger the case chose, and their statements interleave on the server.
//! * **Interleavings too rare to meet by chance are forced** ([`Step::Overtake`]): a lease
//!   expires between a relay's send and its answer, another relay claims the aggregate, and
//!   the late completion runs after that claim committed, or, on PostgreSQL, while that claim
//!   stands mid-transaction after its decision's snapshot, holding the aggregate's lock (a
//!   row lock of the simulation's own stops it there, and the lock waits are read from
//!   `pg_blocking_pids`: the completion must queue behind the claim). The seed chooses the
//!   relays, the answers and the variant, so a failing seed replays the same interleaving.
//! * **Every consumer version policy** ([`Policy`]: `Reject`, `Hold`, `Unchecked`) is a mode of
//!   the case; `Unchecked` in half the cases (only a handler's failure parks a message there,
//!   so its cases must be many for a parked message to meet a later version).
//! * **Operators act** on the outbox's parked events (retry, discard, re-issue:
//!   [`Step::Operator`], and inside races) and release the claims of a relay that died
//!   ([`Step::ReleaseClaims`]: `release_claims_of` its owner, which ends its leases at once).
//!
//! Every step ([`Step`]) is followed by the invariants, checked against the real state:
//!
//! * nothing from a rolled-back transaction is stored or published; no committed event is lost;
//! * the acknowledgement metadata stored for a published record points at that record in the
//!   log, in the transport's coordinates (same event id at that topic, partition and offset,
//!   or at that stream sequence; a RabbitMQ confirm names the exchange and the event's routing
//!   key, and the queue holds the event), so a batch with mixed per-record outcomes cannot be
//!   recorded crosswise;
//! * a parked event is never published without an operator action; a record is sent only
//!   under a live claim of its sender, and only as its aggregate's next version (the one after
//!   the last published, discarded or accepted by an operator): nothing goes out past a gap,
//!   nothing at or below a version already done;
//! * **runs** (relays claim runs of up to 3 events in half the cases, [`Modes::run`], the
//!   batch 2 larger; the double holds each wave, so a crash, a lost acknowledgement or a
//!   lease expiry falls between any two events of a run): *send order*, a version past the
//!   next goes out only after the acknowledgement of every version before it came back to its
//!   sender under the claim that holds it (so never before it, nor after its failure);
//!   *prefix*, a published event that its claim handed out inside a run has the event before
//!   it published too (the store's `last` never passes an unpublished version); and first
//!   deliveries in version order, below, over runs;
//! * a version-gap park is a real gap, made no earlier than the store's gap timeout after the
//!   commit; an out-of-order park is at or below the last version done;
//! * **an operator action changes only its aggregate**: around every operator step (and every
//!   retry and discard of the drain) the store's whole delivery state is read
//!   ([`Backend::delivery_snapshot`]: every column of every outbox row and of the aggregates'
//!   own state, their last version and lease) once the relays' store calls under way have
//!   ended, and compared: every other aggregate is exactly as it was; a retry makes its event
//!   pending with no attempts, a discard or re-issue marks it discarded (a re-issue adds one
//!   fresh pending copy of the same version), the aggregate's last version becomes exactly
//!   the greater of what it was and what the action accepts, and its lease and other rows'
//!   delivery stay; a release of a dead relay's claims ends that owner's leases and nothing
//!   else; a refused action changes nothing at all (actions inside a [`Step::Race`], and
//!   one that had to wait for the relays to finish their batches, are not compared: other
//!   writers ran meanwhile);
//! * attempts are spent only by record-scoped failures: a row shows at most as many as its own
//!   transient or permanent failures since its last retry (a broker that is down, a lost
//!   acknowledgement, defer without spending one);
//! * a completion under a claim that another claim superseded applies nothing (fencing);
//! * no two relays hold one aggregate at once (a lease counts until it expires);
//! * a claim that returns fewer events than its limit left no due, unblocked aggregate head
//!   behind (parking blocks its own aggregate only; on the in-memory store, which promises it);
//! * per aggregate, first deliveries in the log strictly increase in version (the rule of
//!   `outbox_testkit::rules`, which the randomized runs judge by too);
//! * each effect committed at most once, in version order per aggregate; while a message is
//!   parked on the consumer side, nothing of a higher version of its aggregate is applied,
//!   under every version policy (on JetStream, where a redelivery comes after later messages,
//!   the order is the inbox's: promised by `Reject` and `Hold`, with the first version
//!   required, not by `Unchecked`, whose cases are held to "once" only);
//! * on PostgreSQL, where the store runs its wake-up gate and listener: an event appended while
//!   the gate was armed (a relay idle and waiting) wakes the listener within 2 s of its commit
//!   (the gate's promise: no lost wake-up);
//! * the positions a source hands the engine grow within an assignment (the engine sees no
//!   rewind: nothing here rewinds a log), so no watermark forgets messages in flight;
//! * the committed offset never passes a message whose outcome is not final; on JetStream and
//!   RabbitMQ, every message the broker holds acknowledged is final (registered or parked);
//! * the engine handles handler failures as documented: it never hands an event to the
//!   handler again after a permanent failure, or after `max_attempts` transient ones, in one
//!   engine generation (it parks it), nor before the retry policy's `min_delay` after a
//!   transient one; a message parked because its handler failed had one of those
//!   ([`HandlerFault::Stuck`] keeps failing one event until an operator retries it). A
//!   failure is what the engine sees: a scripted fault or the handler's own error (the
//!   user's handler refusing an event counts as its permanent failure). A RabbitMQ channel
//!   lost under the engine starts a generation, in which an event the channel held may fail
//!   transiently once more (a running batch's last call for its old delivery);
//! * a version gap parked on the consumer side is a real one: a lower version of the aggregate
//!   was never committed, or was discarded (or, on JetStream, was redelivered after it).
//!
//! At quiescence (faults stop, open transactions commit; JetStream's ack waits run out):
//! every committed event ends published or parked without an operator; consumer-side
//! parking holds only its aggregate (every other aggregate's events are applied, the offsets
//! reach the end, every stored message is acknowledged); after operator
//! retries on both sides, every committed event that was not discarded is published and
//! applied exactly once.
//!
//! The simulation proves it catches bugs: [`SeededBug`] lists deliberate bugs (wrappers and
//! doubles around the production code, nothing in the production code changes), and the
//! crate's tests show each one caught. Bugs planted *in* the PostgreSQL and MariaDB stores and
//! the inbox engine (the claim's gap rule, the completion's locks, attempts spent on deferral,
//! fencing, a lost wake-up, `Unchecked` applying past a parked message, an operator retry
//! that retries every parked event of the aggregate type, an operator action that raises
//! every aggregate's last version) are patches in `scripts/seeded-bugs`, applied one at a
//! time by `scripts/seeded-bugs/run`, which runs the PostgreSQL (or, for a `mysql-` patch,
//! the MariaDB) simulation against each and reports the case that caught it
//! (`docs/simulation.md` has the figures). Bugs *in* the production code are the other half:
//! cargo-mutants mutates the engine's batch and fallback, the processor's batch, the relay's
//! result mapping and the offset watermark, and runs this crate's property test alone against
//! each mutant (`docs/mutants.md`, "Caught by the simulation alone"); the last two invariants
//! above were added for mutants it missed.
//!
//! # Replaying a failure
//!
//! A failure prints the seed and the shrunk case (modes and steps); `OUTBOX_SIM_SEED` replays
//! the generator, and [`Simulation::run`] replays a case by hand. The relays, the store and the
//! log run on virtual time, so their side replays exactly; the consumer engine's retry backoff
//! and poll timeouts are real milliseconds (the engine reads tokio's and the system's clock),
//! so its interleaving with the other steps can differ slightly between runs of one case. On
//! PostgreSQL everything runs on real time (see `PostgresBackend`, feature `postgres`).
//!
//! # Running it
//!
//! ```
//! use outbox_sim::{check_memory, SimConfig};
//! // `OUTBOX_SIM_CASES` overrides the number of cases, `OUTBOX_SIM_SEED` replays a seed.
//! check_memory(&SimConfig::default().fixed_cases(2).max_steps(20));
//! ```
//!
//! # Your own effect and your own commands
//!
//! A consumer [`Handler`](outbox_inbox::Handler) written for the real inbox transaction runs
//! unchanged: the engine runs it through [`SimHandler`], which records the simulation's own
//! effect in the same transaction first. Producer commands are [`Command`]s: a transition of
//! an aggregate's state with its guard; a business transaction runs them and appends their
//! events. See `tests/user_handler.rs` for a complete example.
//!
//! ```
//! use outbox_core::{async_trait, Envelope};
//! use outbox_inbox::{Handler, HandlerError};
//! use outbox_sim::{run_property, Command, MemoryBackend, SimConfig, Simulation, Transition};
//! use outbox_testkit::MemoryTx;
//! use serde_json::{json, Value};
//!
//! /// The consumer's projection: the latest status of each order.
//! struct OrderStatus;
//!
//! #[async_trait]
//! impl Handler<MemoryTx> for OrderStatus {
//!     async fn handle(&self, tx: &mut MemoryTx, e: &Envelope) -> Result<(), HandlerError> {
//!         tx.put("order_status", &e.aggregate_id, json!(e.event_type));
//!         Ok(())
//!     }
//! }
//!
//! /// A producer command: pay an order that is open.
//! struct Pay;
//!
//! impl Command for Pay {
//!     fn name(&self) -> &str { "pay" }
//!     fn guard(&self, state: &Value) -> bool { state.is_null() }
//!     fn apply(&self, _state: &Value) -> Transition {
//!         Transition::new(json!("paid"), "order.paid", json!({}))
//!     }
//! }
//!
//! let config = SimConfig::default().fixed_cases(2).max_steps(20);
//! let result = run_property(&config, None, |modes| {
//!     Simulation::new(
//!         config.clone(),
//!         modes,
//!         |_, mode| MemoryBackend::new(mode),
//!         OrderStatus,
//!         vec![Box::new(Pay)],
//!     )
//! });
//! assert!(result.is_ok(), "{result:?}");
//! ```

mod backend;
mod config;
mod consumer;
mod invariants;
#[cfg(feature = "mysql")]
mod mysql;
mod operator_scope;
#[cfg(feature = "postgres")]
mod pg_hold;
#[cfg(feature = "postgres")]
mod postgres;
mod producer;
pub mod publisher;
mod relay;
mod runner;
mod steps;
mod transport;

pub use backend::{
    Backend, DeliverySnapshot, EffectsView, Hold, MemoryBackend, RowView, ShortClaimCheck,
    StoredAggregate, StoredRow,
};
pub use config::{cases_from_env, SeededBug, SimConfig, CASES_ENV, SEED_ENV};
pub use consumer::{InboxTx, NoEffect, SimHandler, SimSource};
pub use invariants::Violations;
#[cfg(feature = "mysql")]
pub use mysql::MySqlBackend;
#[cfg(feature = "postgres")]
pub use postgres::PostgresBackend;
pub use producer::{Command, Touch, Transition};
pub use relay::SimStore;
pub use runner::{
    check_memory, run_property, runtime, sample_cases, SimReport, Simulation, Violation, GROUP,
};
pub use steps::{
    cases, describe, steps, Case, HandlerFault, Modes, OperatorStep, Policy, RaceOp, RecordAnswer,
    Skew, Step, StoreFault,
};
pub use transport::{
    JetStreamMember, RabbitMember, Transport, TransportSource, ACK_WAIT, DUPLICATE_WINDOW, EXCHANGE,
};
