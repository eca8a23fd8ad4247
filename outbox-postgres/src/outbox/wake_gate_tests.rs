//! The gate's session checks after the lock was taken, through a real PgBouncer in transaction
//! mode (each test starts its own, two server sessions, in front of `DATABASE_URL`).
//!
//! PgBouncer hands a client's next transaction the most recently released server session, so a
//! test steers the gate's next statement onto the other session by holding the gate's session
//! in an open transaction of another client. The gate's connection is put in place directly
//! (its opening check would find the pooler before any lock is taken, which
//! `tests/pgbouncer.rs` tests through the public API); the store's claims are not used, since
//! sqlx's prepared statements do not survive a change of session behind PgBouncer 1.18.

use std::time::{Duration, Instant};

use outbox_test_support::PgBouncer;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, Executor, PgConnection};

use super::{backend_pid, gate_keys, GateSession};
use crate::PostgresOutboxStore;

struct Setup {
    bouncer: PgBouncer,
    direct: String,
    store: PostgresOutboxStore,
}

async fn setup(test: &str) -> Option<Setup> {
    let direct = outbox_test_support::database_url(test)?;
    let bin = outbox_test_support::pgbouncer_bin(test)?;
    let bouncer = PgBouncer::start(&bin, &direct, "transaction", 2);
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&bouncer.url())
        .await
        .unwrap_or_else(|e| panic!("PgBouncer: {e}\n{}", bouncer.log()));
    let store = PostgresOutboxStore::builder(pool)
        .schema(outbox_test_support::unique("gate"))
        .wake_gate_wait(Duration::from_millis(300))
        .build()
        .unwrap();
    Some(Setup {
        bouncer,
        direct,
        store,
    })
}

impl Setup {
    /// Gives the gate a connection through the pooler; returns the server session it was
    /// opened on.
    async fn gate_session(&self) -> i32 {
        let mut conn = PgConnection::connect(&self.bouncer.url()).await.unwrap();
        let pid = backend_pid(&mut conn).await.unwrap();
        *self.store.inner.gate.session.lock().await = Some(GateSession { conn, pid });
        pid
    }

    /// Another client of the pooler in an open transaction on server session `pid`, so that
    /// the gate's next transaction runs on another one.
    async fn occupy(&self, pid: i32) -> PgConnection {
        let mut elsewhere: Vec<PgConnection> = Vec::new();
        for _ in 0..4 {
            let mut c = PgConnection::connect(&self.bouncer.url()).await.unwrap();
            c.execute("BEGIN").await.unwrap();
            if backend_pid(&mut c).await.unwrap() == pid {
                for mut other in elsewhere {
                    other.execute("COMMIT").await.unwrap();
                }
                return c;
            }
            elsewhere.push(c);
        }
        panic!("no client of the pooler got server session {pid}");
    }

    /// The server sessions holding the gate's lock (granted, exclusive).
    async fn holders(&self) -> Vec<i32> {
        let (k1, k2) = gate_keys(self.store.inner.seed);
        let mut c = PgConnection::connect(&self.direct).await.unwrap();
        sqlx::query_scalar(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 \
             AND classid::int8 = $1 AND objid::int8 = $2 AND granted AND mode = 'ExclusiveLock'",
        )
        .bind(i64::from(k1 as u32))
        .bind(i64::from(k2 as u32))
        .fetch_all(&mut c)
        .await
        .unwrap()
    }
}

/// The arm's transaction runs on another session than the gate's: the lock it was granted
/// there is released in the same transaction (nothing leaks), and the gate is off for good.
#[tokio::test]
async fn an_arm_served_by_another_session_releases_the_lock_there_and_turns_the_gate_off() {
    let Some(s) = setup("gate_arm_on_another_session").await else {
        return;
    };
    let pid = s.gate_session().await;
    let mut busy = s.occupy(pid).await;
    assert!(!s.store.arm().await);
    assert!(!s.store.wake_gate_armed());
    assert_eq!(s.holders().await, Vec::<i32>::new(), "the lock leaked");
    let why = s.store.wake_gate_disabled().expect("the gate is off");
    assert!(why.contains("ran its arm on server session"), "{why}");
    busy.execute("COMMIT").await.unwrap();
    // Off for good: a later arm neither locks nor waits.
    assert!(!s.store.arm().await);
    assert!(s.holders().await.is_empty());
}

/// Armed on the gate's session, the unlock runs on another: `pg_advisory_unlock` says `false`,
/// the gate turns off, and the lock is left with the session that took it (the documented
/// cost, until the pooler closes it). The next idle claim's arm, while that session is busy,
/// returns at once instead of waiting behind the leaked lock. (Before the fix the unlock's
/// result was ignored, and that arm, run on a session where no `lock_timeout` was set, waited
/// for ever.)
#[tokio::test]
async fn an_unlock_served_by_another_session_turns_the_gate_off() {
    let Some(s) = setup("gate_unlock_on_another_session").await else {
        return;
    };
    let pid = s.gate_session().await;
    assert!(s.store.arm().await);
    assert_eq!(s.holders().await, vec![pid]);
    let mut busy = s.occupy(pid).await;
    s.store.disarm().await;
    assert!(!s.store.wake_gate_armed());
    let why = s.store.wake_gate_disabled().expect("the gate is off");
    assert!(why.contains("pg_advisory_unlock returned false"), "{why}");
    assert_eq!(s.holders().await, vec![pid]);
    let started = Instant::now();
    let armed = tokio::time::timeout(Duration::from_secs(10), s.store.arm())
        .await
        .expect("the arm waited behind the leaked lock");
    assert!(!armed);
    assert!(started.elapsed() < Duration::from_secs(2));
    busy.execute("COMMIT").await.unwrap();
}

/// The idle check of an armed gate is answered by another session: off, with the reason.
#[tokio::test]
async fn an_armed_gate_answered_by_another_session_turns_itself_off() {
    let Some(s) = setup("gate_alive_on_another_session").await else {
        return;
    };
    let pid = s.gate_session().await;
    assert!(s.store.arm().await);
    let mut busy = s.occupy(pid).await;
    assert!(!s.store.gate_alive().await);
    assert!(!s.store.wake_gate_armed());
    let why = s.store.wake_gate_disabled().expect("the gate is off");
    assert!(why.contains("answered from server session"), "{why}");
    busy.execute("COMMIT").await.unwrap();
}

/// Another session holds the gate's lock (another relay, or a lock leaked on a pooled
/// session) and the arm runs on a session where no `SET lock_timeout` was ever made: the arm
/// still gives up within `wake_gate_wait`, since its timeout is set in its own transaction.
/// (Set once per connection, a timeout on one pooled session does not bound a lock request
/// made on another: the relay's claim waited for ever.)
#[tokio::test]
async fn an_arm_never_waits_past_wake_gate_wait_whatever_session_serves_it() {
    let Some(s) = setup("gate_arm_bounded").await else {
        return;
    };
    let (k1, k2) = gate_keys(s.store.inner.seed);
    let mut other_relay = PgConnection::connect(&s.direct).await.unwrap();
    other_relay
        .execute(&*format!("SELECT pg_advisory_lock({k1}, {k2})"))
        .await
        .unwrap();
    let pid = s.gate_session().await;
    let mut busy = s.occupy(pid).await;
    let started = Instant::now();
    let armed = tokio::time::timeout(Duration::from_secs(10), s.store.arm())
        .await
        .expect("the arm waited past wake_gate_wait");
    assert!(!armed);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // A lock held elsewhere is no sign of a pooler: the gate stays available.
    assert_eq!(s.store.wake_gate_disabled(), None);
    busy.execute("COMMIT").await.unwrap();
    other_relay.close().await.unwrap();
}
