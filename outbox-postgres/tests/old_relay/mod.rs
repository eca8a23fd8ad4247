//! Relays of older versions, for the rolling-upgrade tests (`adversary_upgrade_block.rs`).
//!
//! Their SQL is not written by hand: `sql_v10.rs` and `sql_v5.rs` are verbatim copies of
//! `src/sql.rs` at two commits (see their headers), built for the test's schema by their own
//! `OutboxSql::new`:
//!
//! * [`Version::V10`]: `1522a56^`, the last version before runs (migration 10; parent of the
//!   commit adding migration 11). Its claim blocks every follower of an aggregate (`blk`), its
//!   completions and discards promote the aggregate's first blocked row (`promote_after`), a
//!   claim that parks a stale or `bad_key` head promotes (`promote`). It runs on the current
//!   schema (migration 11 only adds `lease_upto`, which it neither reads nor writes).
//! * [`Version::V5`]: `96643ee^`, the version before migration 6. Its claim blocks only the
//!   window's followers, a stale park promotes. It writes `ack_topic` (renamed by migration
//!   8), so it runs on a schema of migrations 5 to 7 only.
//!
//! What the Rust side of those versions did around the statements is reproduced here from
//! their `outbox/claim.rs`, `outbox/complete.rs` and `outbox/operator.rs`: the claim's
//! transaction settings (V10 also takes the migration key shared first), step 1 then step 2 in
//! one transaction, committed (lease) or held until the completion (locked); a lease
//! completion takes the aggregates' advisory locks in key order and runs `complete_lease` with
//! the token; an operator discard or retry reads the event's state, locks its aggregate, reads
//! it again, refuses what those versions refused (not parked, versions waiting below, a retry
//! at or below `last`) and runs the statement with the same bindings. Left out: the audit row
//! and the notification of operator actions, the undecodable-row path.
#![allow(dead_code, unreachable_pub)]

mod sql_v10;
mod sql_v5;

use sqlx::{PgPool, Postgres, Row, Transaction};
use uuid::Uuid;

/// `crate::schema::qualified` of the current crate (identifiers are validated test names).
fn qualified(schema: &str, name: &str) -> String {
    format!("\"{schema}\".\"{name}\"")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    V5,
    V10,
}

struct Stmts {
    claim_candidates: String,
    claim_decide_lease: String,
    claim_decide_locked: String,
    complete_lease: String,
    complete_locked: String,
    lock_keys: String,
    event_state: String,
    retry_parked: String,
    discard_parked: String,
}

/// One claimed row (what the old `ClaimedRow` carried).
#[derive(Clone, Debug)]
pub struct OldRow {
    pub id: i64,
    pub event: Uuid,
    pub key: i64,
    pub agg_type: String,
    pub agg_id: String,
    pub version: i64,
}

/// An old relay's claim: its claimed rows, every step-2 decision (aggregate id, version,
/// action), and in locked mode the transaction that holds the aggregate locks.
pub struct OldClaim {
    pub token: Uuid,
    pub rows: Vec<OldRow>,
    pub actions: Vec<(String, i64, String)>,
    tx: Option<Transaction<'static, Postgres>>,
}

/// An outcome the old completion writes for a claimed row (rows without one are released).
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Published,
    Retry,
    Park,
}

pub struct OldRelay {
    pub version: Version,
    pub locked: bool,
    /// The lease of a lease claim (30 s unless set).
    pub lease: std::time::Duration,
    pool: PgPool,
    seed: i64,
    s: Stmts,
}

impl OldRelay {
    /// An old relay over `outbox_events` of `schema` (`locked`: `ClaimMode::LockedTransaction`,
    /// else a 30 s lease).
    pub fn new(version: Version, pool: PgPool, schema: &str, locked: bool) -> Self {
        Self::with_first_version(version, pool, schema, locked, false)
    }

    /// [`Self::new`] with that version's `accept_first_version` option.
    pub fn with_first_version(
        version: Version,
        pool: PgPool,
        schema: &str,
        locked: bool,
        accept_first_version: bool,
    ) -> Self {
        let table = "outbox_events";
        // The statements this model runs, taken by name from a released version's `OutboxSql`
        // (each version its own type, the same field names).
        macro_rules! stmts {
            ($sql:expr) => {{
                let q = $sql;
                Stmts {
                    claim_candidates: q.claim_candidates,
                    claim_decide_lease: q.claim_decide_lease,
                    claim_decide_locked: q.claim_decide_locked,
                    complete_lease: q.complete_lease,
                    complete_locked: q.complete_locked,
                    lock_keys: q.lock_keys,
                    event_state: q.event_state,
                    retry_parked: q.retry_parked,
                    discard_parked: q.discard_parked,
                }
            }};
        }
        let (s, seed) = match version {
            Version::V10 => (
                stmts!(sql_v10::OutboxSql::new(schema, table, accept_first_version)),
                sql_v10::seed(schema, table),
            ),
            Version::V5 => (
                stmts!(sql_v5::OutboxSql::new(schema, table, accept_first_version)),
                sql_v5::seed(schema, table),
            ),
        };
        Self {
            version,
            locked,
            lease: std::time::Duration::from_secs(30),
            pool,
            seed,
            s,
        }
    }

    /// `schema::migration_lock_key` at `1522a56^` (V10's claims take it shared first).
    fn migration_lock_key(&self) -> i64 {
        self.seed.rotate_left(29) ^ 0x6d69_6772_6174_696f
    }

    /// The claim: `claim_inner` of the old `outbox/claim.rs` (`begin_claim`, step 1, step 2).
    pub async fn claim(&self, owner: &str, limit: i64) -> OldClaim {
        let begin = "BEGIN ISOLATION LEVEL READ COMMITTED; \
             SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL jit = off; \
             SET LOCAL enable_sort = off; SET LOCAL enable_bitmapscan = off";
        let commit_mode = if self.locked {
            "SET LOCAL idle_in_transaction_session_timeout = 60000; \
             SET LOCAL synchronous_commit = off"
        } else {
            "SET LOCAL synchronous_commit = on"
        };
        let after_migrations = match self.version {
            Version::V10 => format!(
                "; SELECT pg_advisory_xact_lock_shared({})",
                self.migration_lock_key()
            ),
            Version::V5 => String::new(),
        };
        let begin_claim = format!("{begin}; {commit_mode}{after_migrations}");
        let mut tx = self
            .pool
            .begin_with(begin_claim.clone())
            .await
            .expect("old claim: begin");
        let token = Uuid::now_v7();
        let ids: Vec<i64> = sqlx::query_scalar(&self.s.claim_candidates)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await
            .expect("old claim: step 1");
        let mut claim = OldClaim {
            token,
            rows: Vec::new(),
            actions: Vec::new(),
            tx: None,
        };
        if ids.is_empty() {
            tx.commit().await.unwrap();
            return claim;
        }
        let (mut rows, actions) = self.decide(&mut tx, &ids, owner, token).await;
        let parks = |a: &[(String, i64, String)]| {
            a.iter()
                .any(|a| matches!(a.2.as_str(), "stale" | "gap_park" | "bad_key"))
        };
        let mut parked = parks(&actions);
        claim.actions = actions;
        // Locked mode (`claim_inner` at 1522a56^ / 96643ee^): parks commit on their own, then
        // the claimed aggregates are try-locked again and decided again (at most 3 rounds).
        let mut rounds = 0;
        while self.locked && !rows.is_empty() && parked && rounds < 3 {
            rounds += 1;
            tx.commit().await.unwrap();
            tx = self.pool.begin_with(begin_claim.clone()).await.unwrap();
            let keys: Vec<i64> = rows.iter().map(|r| r.key ^ self.seed).collect();
            let locked: Vec<bool> = sqlx::query_scalar(
                "SELECT pg_try_advisory_xact_lock(u.k) FROM UNNEST($1::int8[]) WITH ORDINALITY \
                 AS u(k, n) ORDER BY u.n",
            )
            .bind(&keys)
            .fetch_all(&mut *tx)
            .await
            .unwrap();
            let ids: Vec<i64> = rows
                .iter()
                .zip(&locked)
                .filter(|(_, ok)| **ok)
                .map(|(r, _)| r.id)
                .collect();
            if ids.is_empty() {
                rows = Vec::new();
                break;
            }
            let (again, actions) = self.decide(&mut tx, &ids, owner, token).await;
            parked = parks(&actions);
            claim.actions.extend(actions);
            rows = again;
        }
        claim.rows = rows;
        if self.locked && !claim.rows.is_empty() {
            claim.tx = Some(tx);
        } else {
            tx.commit().await.unwrap();
        }
        claim
    }

    /// Claim step 2 on `ids`: the claimed rows (id order) and every decision.
    async fn decide(
        &self,
        tx: &mut sqlx::PgConnection,
        ids: &[i64],
        owner: &str,
        token: Uuid,
    ) -> (Vec<OldRow>, Vec<(String, i64, String)>) {
        // Gap timeout 60 s, re-check 1 s (the defaults).
        let (gap_us, recheck_us) = (60_000_000_i64, 1_000_000_i64);
        let rows = if self.locked {
            sqlx::query(&self.s.claim_decide_locked)
                .bind(ids)
                .bind(gap_us)
                .bind(recheck_us)
        } else {
            sqlx::query(&self.s.claim_decide_lease)
                .bind(ids)
                .bind(owner)
                .bind(token)
                .bind(self.lease.as_micros() as i64)
                .bind(gap_us)
                .bind(recheck_us)
        }
        .fetch_all(&mut *tx)
        .await
        .expect("old claim: step 2");
        let (mut claimed, mut actions) = (Vec::new(), Vec::new());
        for r in &rows {
            let action: String = r.get("action");
            let agg_id: String = r.get("aggregate_id");
            let version: i64 = r.get("aggregate_version");
            actions.push((agg_id.clone(), version, action.clone()));
            if action == "claim" && r.get::<bool, _>("claimed") {
                claimed.push(OldRow {
                    id: r.get("id"),
                    event: r.get("event_id"),
                    key: r.get("k"),
                    agg_type: r.get("aggregate_type"),
                    agg_id,
                    version,
                });
            }
        }
        claimed.sort_by_key(|r| r.id);
        (claimed, actions)
    }

    /// The completion (old `outbox/complete.rs`): outcomes by index into `claim.rows`; rows
    /// without one are released. Returns the applied row ids.
    pub async fn complete(&self, claim: OldClaim, outcomes: &[(usize, Kind)]) -> Vec<i64> {
        let version = self.version;
        self.try_complete(claim, outcomes)
            .await
            .unwrap_or_else(|e| panic!("old completion ({version:?}): {e}"))
    }

    /// [`Self::complete`], its statement's error returned (the transaction rolled back).
    pub async fn try_complete(
        &self,
        claim: OldClaim,
        outcomes: &[(usize, Kind)],
    ) -> Result<Vec<i64>, sqlx::Error> {
        let n = claim.rows.len();
        if n == 0 {
            // A relay completes no empty claim (a locked claim without rows committed).
            assert!(claim.tx.is_none());
            return Ok(Vec::new());
        }
        let kind_of = |i: usize| outcomes.iter().find(|o| o.0 == i).map(|o| o.1);
        let ids: Vec<i64> = claim.rows.iter().map(|r| r.id).collect();
        let keys: Vec<i64> = claim.rows.iter().map(|r| r.key).collect();
        let types: Vec<String> = claim.rows.iter().map(|r| r.agg_type.clone()).collect();
        let aggs: Vec<String> = claim.rows.iter().map(|r| r.agg_id.clone()).collect();
        let versions: Vec<i64> = claim.rows.iter().map(|r| r.version).collect();
        let mut kinds = Vec::with_capacity(n);
        let (mut dest, mut part, mut pos, mut delay) = (vec![], vec![], vec![], vec![]);
        let (mut eclass, mut ekind, mut emsg, mut pkind, mut uncertain) =
            (vec![], vec![], vec![], vec![], vec![]);
        let (mut transport, mut route, mut dup) = (vec![], vec![], vec![]);
        for (i, r) in claim.rows.iter().enumerate() {
            let k = kind_of(i);
            kinds.push(match k {
                None => "release",
                Some(Kind::Published) => "published",
                Some(Kind::Retry) => "retry",
                Some(Kind::Park) => "park",
            });
            let published = matches!(k, Some(Kind::Published));
            dest.push(published.then(|| "orders".to_owned()));
            part.push(published.then_some(0_i32));
            pos.push(published.then_some(r.version));
            transport.push(published.then(|| "kafka".to_owned()));
            route.push(None::<String>);
            dup.push(None::<bool>);
            delay.push(matches!(k, Some(Kind::Retry)).then_some(0_i64));
            let err = matches!(k, Some(Kind::Retry | Kind::Park));
            let permanent = matches!(k, Some(Kind::Park));
            eclass.push(err.then(|| if permanent { "permanent" } else { "transient" }.to_owned()));
            ekind.push(err.then(|| {
                if permanent {
                    "record_too_large"
                } else {
                    "timeout"
                }
                .to_owned()
            }));
            emsg.push(err.then(|| "old relay".to_owned()));
            pkind.push(permanent.then(|| "permanent_error".to_owned()));
            uncertain.push(false);
        }
        let sql = if self.locked {
            &self.s.complete_locked
        } else {
            &self.s.complete_lease
        };
        let mut q = sqlx::query(sql)
            .bind(&ids)
            .bind(&keys)
            .bind(&types)
            .bind(&aggs)
            .bind(&versions)
            .bind(&kinds);
        q = match self.version {
            // OutcomeArrays of 1522a56^: destination, partition, position, delay, error,
            // park kind, uncertain, transport, route, duplicate.
            Version::V10 => q
                .bind(&dest)
                .bind(&part)
                .bind(&pos)
                .bind(&delay)
                .bind(&eclass)
                .bind(&ekind)
                .bind(&emsg)
                .bind(&pkind)
                .bind(&uncertain)
                .bind(&transport)
                .bind(&route)
                .bind(&dup),
            // OutcomeArrays of 96643ee^: topic, partition, offset, delay, error, park kind,
            // uncertain.
            Version::V5 => q
                .bind(&dest)
                .bind(&part)
                .bind(&pos)
                .bind(&delay)
                .bind(&eclass)
                .bind(&ekind)
                .bind(&emsg)
                .bind(&pkind)
                .bind(&uncertain),
        };
        let row = if let Some(mut tx) = claim.tx {
            match q.fetch_one(&mut *tx).await {
                Ok(row) => {
                    tx.commit().await.unwrap();
                    row
                }
                Err(e) => {
                    tx.rollback().await.unwrap();
                    return Err(e);
                }
            }
        } else {
            let mut tx = self
                .pool
                .begin_with(
                    "BEGIN ISOLATION LEVEL READ COMMITTED; \
                     SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL jit = off; \
                     SET LOCAL synchronous_commit = off",
                )
                .await
                .unwrap();
            let lock: Vec<i64> = keys.iter().map(|k| k ^ self.seed).collect();
            sqlx::query(&self.s.lock_keys)
                .bind(&lock)
                .execute(&mut *tx)
                .await
                .unwrap();
            match q.bind(claim.token).fetch_one(&mut *tx).await {
                Ok(row) => {
                    tx.commit().await.unwrap();
                    row
                }
                Err(e) => {
                    tx.rollback().await.unwrap();
                    return Err(e);
                }
            }
        };
        Ok(row.get("applied"))
    }

    /// Releases a locked claim (rollback) or drops a lease claim's memory (its lease runs out).
    pub async fn abandon(&self, claim: OldClaim) {
        if let Some(tx) = claim.tx {
            tx.rollback().await.unwrap();
        }
    }

    /// Operator discard (`discard_parked_inner` of the old `outbox/operator.rs`).
    pub async fn discard(&self, event: Uuid) -> Result<(), String> {
        self.operator(event, true).await
    }

    /// Operator retry (`retry_parked_inner` of the old `outbox/operator.rs`).
    pub async fn retry(&self, event: Uuid) -> Result<(), String> {
        self.operator(event, false).await
    }

    async fn operator(&self, event: Uuid, discard: bool) -> Result<(), String> {
        let mut tx = self
            .pool
            .begin_with(
                "BEGIN ISOLATION LEVEL READ COMMITTED; \
                 SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL jit = off; \
                 SET LOCAL synchronous_commit = on",
            )
            .await
            .unwrap();
        let before = sqlx::query(&self.s.event_state)
            .bind(event)
            .fetch_optional(&mut *tx)
            .await
            .unwrap()
            .ok_or("not found")?;
        let key: i64 = before.get("k");
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(key ^ self.seed)
            .execute(&mut *tx)
            .await
            .unwrap();
        let s = sqlx::query(&self.s.event_state)
            .bind(event)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        let status: String = s.get("status");
        let (version, last, waiting): (i64, i64, i64) = (
            s.get("aggregate_version"),
            s.get("last"),
            s.get("waiting_below"),
        );
        if status != "parked" {
            return Err(format!("not parked ({status})"));
        }
        if waiting > 0 {
            return Err(format!("{waiting} versions waiting below"));
        }
        let (at, ai): (String, String) = (s.get("aggregate_type"), s.get("aggregate_id"));
        if discard {
            // V10 raises the last version to max(version, last), V5 to the version.
            let raise = match self.version {
                Version::V10 => version.max(last),
                Version::V5 => version,
            };
            sqlx::query(&self.s.discard_parked)
                .bind(event)
                .bind(key)
                .bind(&at)
                .bind(&ai)
                .bind(raise)
                .bind("operator of an old version")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        } else {
            if version <= last {
                return Err(format!("out of order: {version} <= {last}"));
            }
            sqlx::query(&self.s.retry_parked)
                .bind(event)
                .bind(key)
                .bind(&at)
                .bind(&ai)
                .bind(version - 1)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
        Ok(())
    }
}
