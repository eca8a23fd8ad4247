//! The membership lease of a durable consumer: one active [`NatsSource`](crate::NatsSource)
//! member at a time (see the module docs of [`crate::source`], "One active member").
//!
//! A key in a JetStream key-value bucket whose `max_age` is the lease TTL: a member acquires it
//! with `create` (only if absent), renews it with `update` against its last revision every
//! TTL / 3, and deletes it at close when the key is still its own revision. A key not renewed
//! ages out of the bucket after the TTL, and a standby's next `create` takes it over.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::kv::{CreateErrorKind, Store, UpdateErrorKind};
use async_nats::jetstream::stream::{Config as StreamConfig, DiscardPolicy};
use async_nats::jetstream::Context;
use bytes::Bytes;
use outbox_core::{ErrorClass, SourceError};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The bucket of the leases with TTL `ttl` (the bucket's `max_age`, so one bucket per TTL).
pub(crate) fn bucket_name(ttl: Duration) -> String {
    format!("outbox_leases_{}ms", ttl.as_millis())
}

/// The key of the lease of `durable` on `stream`: each character outside the key alphabet
/// (`[-_/=a-zA-Z0-9]`, the dot reserved as the separator) and `=` itself written as `=XX`
/// (hex of its UTF-8 bytes), so that two different pairs never share a key.
pub(crate) fn lease_key(stream: &str, durable: &str) -> String {
    fn escape(out: &mut String, s: &str) {
        for c in s.chars() {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '/') {
                out.push(c);
            } else {
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.push_str(&format!("={b:02X}"));
                }
            }
        }
    }
    let mut key = String::new();
    escape(&mut key, stream);
    key.push('.');
    escape(&mut key, durable);
    key
}

/// What the member knows of its lease.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Held {
    /// The revision of the key this member wrote last.
    pub(crate) revision: u64,
    /// When the request that wrote it was sent (the key lives at least the TTL after it).
    pub(crate) confirmed_at: Option<Instant>,
    /// Grows with every acquisition: a member reading under an older term lost the lease
    /// in between.
    pub(crate) term: u64,
    /// The TTL of another member's live lease on the same durable consumer, found in the
    /// bucket of another TTL at an acquisition: this member never reads (module docs).
    pub(crate) conflict: Option<Duration>,
}

/// What a member reads of its lease: shared by the renewal task, the source's checks and the
/// task that stops reading the moment the lease runs out (see `NatsSource`'s lease watch).
#[derive(Clone, Debug)]
pub(crate) struct LeaseView {
    ttl: Duration,
    state: Arc<Mutex<Held>>,
    /// Signalled at every change of `state` (a permit is kept when nobody waits).
    changed: Arc<Notify>,
}

impl LeaseView {
    fn held(&self) -> Held {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The term of the lease when this member holds it and it is fresh enough to hand out
    /// messages: confirmed less than the TTL minus a margin ago.
    pub(crate) fn valid_term(&self) -> Option<u64> {
        let held = self.held();
        let at = held.confirmed_at?;
        (at.elapsed() < valid_for(self.ttl)).then_some(held.term)
    }

    /// The lease TTL of another member of the durable consumer, when this member found one
    /// active with a TTL other than its own (it then never reads).
    pub(crate) fn conflict(&self) -> Option<Duration> {
        self.held().conflict
    }

    /// When the lease held now stops being valid unless it is renewed before (none: not
    /// held).
    pub(crate) fn valid_until(&self) -> Option<Instant> {
        self.held().confirmed_at.map(|at| at + valid_for(self.ttl))
    }

    /// Completes at the next change of the lease's state (at once when one happened since
    /// the last call).
    pub(crate) async fn changed(&self) {
        self.changed.notified().await;
    }
}

#[derive(Debug)]
pub(crate) struct Lease {
    store: Store,
    key: String,
    view: LeaseView,
    task: JoinHandle<()>,
}

impl Lease {
    /// Opens (creates when missing) the bucket and starts the task that acquires and renews
    /// the lease.
    pub(crate) async fn start(
        js: &Context,
        stream: &str,
        durable: &str,
        ttl: Duration,
        timeout: Duration,
        member: String,
    ) -> Result<Self, SourceError> {
        let bucket = bucket_name(ttl);
        // The bucket's stream, made here as a key-value bucket is (`create_key_value` asks
        // for the account's info first, which the client cannot read from a 2.9 server).
        let config = StreamConfig {
            name: format!("KV_{bucket}"),
            description: Some("outbox-nats: one active member per durable consumer".into()),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: 1,
            max_age: ttl,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: DiscardPolicy::New,
            num_replicas: 1,
            ..Default::default()
        };
        let failed = |what: &str, e: &dyn std::fmt::Display| {
            SourceError::new(
                ErrorClass::Transient,
                format!("lease bucket {bucket:?}: {what}: {e}"),
            )
        };
        let timed_out = || failed("timed out", &format!("{timeout:?}"));
        tokio::time::timeout(timeout, js.get_or_create_stream(config))
            .await
            .map_err(|_| timed_out())?
            .map_err(|e| failed("creating its stream", &e))?;
        let store = tokio::time::timeout(timeout, js.get_key_value(&bucket))
            .await
            .map_err(|_| timed_out())?
            .map_err(|e| failed("opening it", &e))?;
        let key = lease_key(stream, durable);
        let view = LeaseView {
            ttl,
            state: Arc::new(Mutex::new(Held::default())),
            changed: Arc::new(Notify::new()),
        };
        let task = tokio::spawn(run(
            js.clone(),
            store.clone(),
            key.clone(),
            timeout,
            Bytes::from(member),
            view.clone(),
        ));
        Ok(Self {
            store,
            key,
            view,
            task,
        })
    }

    /// What this member reads of its lease.
    pub(crate) fn view(&self) -> &LeaseView {
        &self.view
    }

    /// Stops renewing and deletes the key when it is still this member's revision (a member
    /// that lost the lease, and does not know it yet, names a revision the key no longer
    /// has: the server refuses the delete, and the new holder keeps its lease).
    pub(crate) async fn release(&self, timeout: Duration) {
        self.task.abort();
        let held = self.view.held();
        if held.confirmed_at.is_some() {
            let _ = tokio::time::timeout(
                timeout,
                self.store
                    .delete_expect_revision(&self.key, Some(held.revision)),
            )
            .await;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How long after its last confirmed write a lease is used: the TTL minus a quarter of it
/// (the margin covers the request's own time and the clock of the task waking late).
pub(crate) fn valid_for(ttl: Duration) -> Duration {
    ttl - ttl / 4
}

/// The TTL of a live lease on `key` in a lease bucket other than `own` (a member of the same
/// durable consumer configured with another `lease_ttl`), if any.
async fn other_ttl_holder(
    js: &Context,
    own: &str,
    key: &str,
) -> Result<Option<Duration>, async_nats::Error> {
    use futures::TryStreamExt;
    let mut names = js.stream_names();
    while let Some(name) = names.try_next().await? {
        let Some(bucket) = name.strip_prefix("KV_") else {
            continue;
        };
        let Some(ms) = bucket
            .strip_prefix("outbox_leases_")
            .and_then(|b| b.strip_suffix("ms"))
            .and_then(|ms| ms.parse::<u64>().ok())
        else {
            continue;
        };
        if bucket == own {
            continue;
        }
        if js.get_key_value(bucket).await?.get(key).await?.is_some() {
            return Ok(Some(Duration::from_millis(ms)));
        }
    }
    Ok(None)
}

async fn run(
    js: Context,
    store: Store,
    key: String,
    timeout: Duration,
    member: Bytes,
    view: LeaseView,
) {
    let ttl = view.ttl;
    let state = &view.state;
    let renew_every = ttl / 3;
    let retry = (ttl / 10).min(Duration::from_secs(1));
    let set = |f: &dyn Fn(&mut Held)| {
        f(&mut state.lock().unwrap_or_else(PoisonError::into_inner));
        view.changed.notify_one();
    };
    // After a renewal that failed without an answer: when to try again.
    let mut retry_at: Option<Instant> = None;
    loop {
        let held = *state.lock().unwrap_or_else(PoisonError::into_inner);
        let sent = Instant::now();
        match held.confirmed_at {
            None => {
                match tokio::time::timeout(timeout, store.create(&key, member.clone())).await {
                    Ok(Ok(revision)) => {
                        // Members with another TTL use another bucket: one of them active
                        // there makes this one refuse to read. Checked after the create, so
                        // that of two such members starting together at most one passes (each
                        // writes its key before it looks for the other's).
                        let own = bucket_name(ttl);
                        let check =
                            tokio::time::timeout(timeout, other_ttl_holder(&js, &own, &key)).await;
                        if !matches!(check, Ok(Ok(None))) {
                            let _ = tokio::time::timeout(
                                timeout,
                                store.delete_expect_revision(&key, Some(revision)),
                            )
                            .await;
                        }
                        match check {
                            Ok(Ok(None)) => {}
                            Ok(Ok(Some(other))) => {
                                tracing::error!(key = %key, ttl = ?ttl, other = ?other, "another member of this durable consumer holds its lease with another lease TTL: this member does not read (members of one durable consumer must use the same lease_ttl)");
                                set(&|h| h.conflict = Some(other));
                                return;
                            }
                            Ok(Err(e)) => {
                                tracing::warn!(key = %key, error = %e, "lease acquired, but the leases of other TTLs could not be read: given back, retried");
                                tokio::time::sleep(retry).await;
                                continue;
                            }
                            Err(_) => {
                                tracing::warn!(key = %key, "lease acquired, but reading the leases of other TTLs timed out: given back, retried");
                                tokio::time::sleep(retry).await;
                                continue;
                            }
                        }
                        tracing::info!(key = %key, revision, "lease acquired: this member is the active one");
                        set(&|h| {
                            h.revision = revision;
                            h.confirmed_at = Some(sent);
                            h.term += 1;
                        });
                        continue;
                    }
                    Ok(Err(e)) if e.kind() == CreateErrorKind::AlreadyExists => {}
                    Ok(Err(e)) => {
                        tracing::debug!(key = %key, error = %e, "lease acquisition failed")
                    }
                    Err(_) => tracing::debug!(key = %key, "lease acquisition timed out"),
                }
                tokio::time::sleep(retry).await;
            }
            Some(at) => {
                tokio::time::sleep_until(retry_at.take().unwrap_or(at + renew_every)).await;
                let sent = Instant::now();
                let result = tokio::time::timeout(
                    timeout.min(renew_every),
                    store.update(&key, member.clone(), held.revision),
                )
                .await;
                match result {
                    Ok(Ok(revision)) => set(&|h| {
                        h.revision = revision;
                        h.confirmed_at = Some(sent);
                    }),
                    Ok(Err(e)) if e.kind() == UpdateErrorKind::WrongLastRevision => {
                        tracing::warn!(key = %key, "lease lost (another member holds it, or it expired): this member becomes a standby");
                        set(&|h| h.confirmed_at = None);
                    }
                    other => {
                        let why = match other {
                            Ok(Err(e)) => e.to_string(),
                            _ => "timed out".to_owned(),
                        };
                        if at.elapsed() >= valid_for(ttl) {
                            tracing::warn!(key = %key, error = %why, "lease not renewed in time: this member becomes a standby");
                            set(&|h| h.confirmed_at = None);
                        } else {
                            tracing::debug!(key = %key, error = %why, "lease renewal failed; retried");
                            retry_at = Some(Instant::now() + retry);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_valid_and_distinct() {
        assert_eq!(lease_key("ORDERS", "billing"), "ORDERS.billing");
        assert_eq!(lease_key("a=b", "c"), "a=3Db.c");
        assert_ne!(lease_key("a=3D", "b"), lease_key("a=", "b"));
        assert_eq!(lease_key("s", "é"), "s.=C3=A9");
        assert_eq!(
            bucket_name(Duration::from_secs(10)),
            "outbox_leases_10000ms"
        );
    }
}
