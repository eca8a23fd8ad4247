//! The simulation on a real server, one scratch namespace (a database or a schema) per case,
//! real time (short leases), fewer cases; the scripted scenarios every server runs.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::ClaimMode;
use outbox_sim::{
    describe, run_property, Backend, Modes, NoEffect, RecordAnswer, SimConfig, SimReport,
    Simulation, Step, Touch,
};
use proptest::test_runner::TestError;
use tokio::runtime::Runtime;

use super::{answer, begin, expect_property, operator_steps};

/// A server the simulation runs on.
pub trait Server {
    /// The simulation's backend on it.
    type Backend: Backend;
    /// Scratch namespaces are named `{PREFIX}_{unix seconds}_{12 hex digits}`.
    const PREFIX: &'static str;
    /// The server's name in messages.
    const NAME: &'static str;

    /// The backend over the new namespace `name` of the server at `url`, in `mode`.
    fn backend(rt: &Runtime, url: &str, name: &str, mode: ClaimMode) -> Self::Backend;

    /// A connection to drop namespaces with.
    type Admin;

    /// An admin connection to the server at `url` (`None` when it cannot be reached).
    async fn admin(url: &str) -> Option<Self::Admin>;

    /// The names of the namespaces named `{PREFIX}_...`.
    async fn namespaces(admin: &Self::Admin) -> Vec<String>;

    /// Drops the namespace `name` (errors ignored).
    async fn drop_namespace(admin: &Self::Admin, name: &str);
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("time after 1970")
        .as_secs()
}

/// The namespaces a test created, dropped when it ends (also when it panics), with those that
/// interrupted runs left (older than an hour).
pub struct Scratch<S: Server> {
    url: String,
    names: Mutex<Vec<String>>,
    server: PhantomData<fn() -> S>,
}

impl<S: Server> Scratch<S> {
    pub fn new(url: &str) -> Arc<Self> {
        Arc::new(Self {
            url: url.to_owned(),
            names: Mutex::new(Vec::new()),
            server: PhantomData,
        })
    }

    /// A simulation on a fresh namespace (recorded for the drop at the end).
    pub fn simulation(&self, config: &SimConfig, modes: Modes) -> Simulation<S::Backend, NoEffect> {
        let name = format!(
            "{}_{}_{}",
            S::PREFIX,
            now_secs(),
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        self.names.lock().expect("not poisoned").push(name.clone());
        let url = self.url.clone();
        Simulation::new(
            config.clone(),
            modes,
            move |rt, mode| S::backend(rt, &url, &name, mode),
            NoEffect,
            vec![Box::new(Touch)],
        )
    }
}

impl<S: Server> Drop for Scratch<S> {
    fn drop(&mut self) {
        let ours = std::mem::take(&mut *self.names.lock().unwrap_or_else(|e| e.into_inner()));
        outbox_sim::runtime().block_on(async {
            let Some(admin) = S::admin(&self.url).await else {
                return;
            };
            let now = now_secs();
            for name in S::namespaces(&admin).await {
                let stale = name
                    .split('_')
                    .nth(1)
                    .and_then(|s| s.parse::<u64>().ok())
                    .is_some_and(|t| now.saturating_sub(t) > 3600);
                if stale || ours.contains(&name) {
                    S::drop_namespace(&admin, &name).await;
                }
            }
        });
    }
}

/// The servers' timing (a 4 s lease), `cases` fixed cases of up to 50 steps.
pub fn config(cases: u32) -> SimConfig {
    SimConfig::default()
        .timing(
            Duration::from_secs(4),
            Duration::from_millis(500),
            (Duration::from_millis(10), Duration::from_millis(40)),
        )
        .fixed_cases(cases)
        .max_steps(50)
        .max_shrink_iters(20)
}

/// The property over `cases` cases (or those `cases_env` names).
pub fn simulation_holds_every_invariant<S: Server>(url: &str, cases_env: &str, cases: u32) {
    let cases = std::env::var(cases_env)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(cases);
    let config = config(cases);
    let scratch = Scratch::<S>::new(url);
    let result = run_property(&config, None, |modes| scratch.simulation(&config, modes));
    drop(scratch);
    expect_property(result);
}

/// Relay crashes holding work, a batch mixing acknowledgements and a lost one, handler faults
/// and a consumer crash, in both claim modes with and without prefetch: each event applied
/// once.
pub fn crashes_mixed_batches_and_handler_faults<S: Server>(url: &str) {
    let scratch = Scratch::<S>::new(url);
    let mut reports: Vec<(Modes, Result<SimReport, String>)> = Vec::new();
    for lease in [false, true] {
        for prefetch in [false, true] {
            let modes = Modes {
                lease,
                prefetch,
                ..Modes::default()
            };
            let mut sim = scratch.simulation(&config(1), modes);
            let steps = vec![
                begin(0, 2),
                begin(1, 2),
                begin(2, 1),
                Step::Commit(0),
                Step::Commit(0),
                Step::Commit(0),
                Step::Relay(0), // the first batch (how many heads depends on the claim's scan)
                answer(0, &[RecordAnswer::Ack, RecordAnswer::AckLost]),
                Step::Relay(0),
                Step::RelayCrash(0), // dies holding the next batch; a locked claim's connection drops
                Step::HandlerFault(outbox_sim::HandlerFault::Permanent),
                Step::Consumer(8),
                Step::ConsumerCrash,
                Step::Relay(1),
                answer(1, &[RecordAnswer::Permanent, RecordAnswer::Ack]),
                Step::Consumer(8),
                Step::Rebalance,
            ];
            reports.push((modes, sim.run(&steps).map_err(|v| v.to_string())));
        }
    }
    drop(scratch);
    for (modes, r) in reports {
        let r = r.unwrap_or_else(|v| panic!("{modes:?}: {v}"));
        assert_eq!(r.committed_events, 5, "{modes:?}: {r:?}");
        assert_eq!(r.applied, 5, "{modes:?}: each event applied once: {r:?}");
        assert!(r.relay_crashes_holding_work >= 1, "{modes:?}: {r:?}");
    }
}

/// The invariants read the server's real state: outcomes recorded one record off are found
/// there as they are in memory.
pub fn a_seeded_bug_is_caught<S: Server>(url: &str) {
    let config = config(20)
        .bug(outbox_sim::SeededBug::ShiftedOutcomes)
        .max_shrink_iters(0);
    let scratch = Scratch::<S>::new(url);
    let result = run_property(&config, None, |modes| scratch.simulation(&config, modes));
    drop(scratch);
    match result {
        Err(TestError::Fail(reason, case)) => {
            let why = reason.message().to_owned();
            eprintln!("caught on {}: {why}\n{}", S::NAME, describe(&case));
            assert!(
                why.contains("but the log holds")
                    || why.contains("was published without an operator action"),
                "{why}"
            );
        }
        other => panic!(
            "the shifted outcomes were not caught on {}: {other:?}",
            S::NAME
        ),
    }
}

/// [`operator_steps`] on the server, in both claim modes: each action and the release checked
/// for its scope (the store's whole delivery state, every column of the events and of the
/// aggregates' state, before and after).
pub fn operator_actions_change_only_their_target<S: Server>(url: &str) {
    let scratch = Scratch::<S>::new(url);
    let mut reports = Vec::new();
    for lease in [false, true] {
        let modes = Modes {
            lease,
            ..Modes::default()
        };
        let mut sim = scratch.simulation(&config(1), modes);
        reports.push((lease, sim.run(&operator_steps()).map_err(|v| v.to_string())));
    }
    drop(scratch);
    for (lease, r) in reports {
        let r = r.unwrap_or_else(|v| panic!("lease {lease}: {v}"));
        // The actions on parked events (how many events park depends on the claim's
        // scan) and the release, each checked.
        assert!(r.operator_actions >= 2, "lease {lease}: {r:?}");
        assert!(
            r.operator_scope_checked > r.operator_actions,
            "lease {lease}: {r:?}"
        );
        assert_eq!(r.claim_releases, 1, "lease {lease}: {r:?}");
        assert_eq!(
            r.claims_released > 0,
            lease,
            "a lease is released on {}, a locked claim ends with its connection: {r:?}",
            S::NAME
        );
    }
}
