//! What `/healthz` and `/readyz` answer, and the HTTP server that serves them with `/metrics`.

use std::sync::{Arc, RwLock};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;

use crate::error::CliError;

/// One dependency's state.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Check {
    /// Reachable and usable.
    pub ok: bool,
    /// Why not (with the fix), or what was seen.
    pub detail: String,
}

impl Check {
    fn unknown() -> Self {
        Self {
            ok: false,
            detail: "not checked yet".into(),
        }
    }
}

/// Readiness of the daemon: database, broker, relay registry, and a fatal error that ends the
/// process.
#[derive(Clone, Debug, Serialize)]
pub struct Readiness {
    /// The database (reachable, schema and privileges in place).
    pub database: Check,
    /// The broker (reachable, topics present).
    pub broker: Check,
    /// The relay registry: the workers are registered and their latest heartbeat was
    /// written. Not ready without it: an operator who does not see the relay in `outbox
    /// status` may release its claims as a dead relay's.
    pub registry: Check,
    /// Workers are running (false while starting and after a shutdown began).
    pub relaying: bool,
    /// A permanent error that stops the relay, with the fix.
    pub fatal: Option<String>,
}

impl Readiness {
    /// Database and broker fine, workers running, nothing fatal.
    pub fn is_ready(&self) -> bool {
        self.database.ok
            && self.broker.ok
            && self.registry.ok
            && self.relaying
            && self.fatal.is_none()
    }
}

/// Shared, updated by the daemon's tasks.
#[derive(Clone, Debug)]
pub struct Health(Arc<RwLock<Readiness>>);

impl Default for Health {
    fn default() -> Self {
        Self(Arc::new(RwLock::new(Readiness {
            database: Check::unknown(),
            broker: Check::unknown(),
            registry: Check::unknown(),
            relaying: false,
            fatal: None,
        })))
    }
}

impl Health {
    /// Updates with `f`, and `outbox_relay_ready` (what `/readyz` answers, as a series
    /// that alert rules can use) with it.
    pub fn update(&self, f: impl FnOnce(&mut Readiness)) {
        let mut r = self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut r);
        metrics::gauge!("outbox_relay_ready").set(if r.is_ready() { 1.0 } else { 0.0 });
    }
    /// A copy of the state.
    pub fn get(&self) -> Readiness {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
    /// Ready: database, broker and registry fine, workers running, nothing fatal.
    pub fn is_ready(&self) -> bool {
        self.get().is_ready()
    }
    /// Sets a database check.
    pub fn database(&self, ok: bool, detail: impl Into<String>) {
        let detail = detail.into();
        self.update(|r| r.database = Check { ok, detail });
    }
    /// Sets the registry check.
    pub fn registry(&self, ok: bool, detail: impl Into<String>) {
        let detail = detail.into();
        self.update(|r| r.registry = Check { ok, detail });
    }
    /// Sets a broker check.
    pub fn broker(&self, ok: bool, detail: impl Into<String>) {
        let detail = detail.into();
        self.update(|r| r.broker = Check { ok, detail });
    }
}

#[derive(Clone)]
struct AppState {
    metrics: PrometheusHandle,
    health: Health,
}

async fn metrics_handler(State(s): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
}

async fn healthz() -> impl IntoResponse {
    (StatusCode::OK, "ok\n")
}

async fn readyz(State(s): State<AppState>) -> impl IntoResponse {
    let r = s.health.get();
    let ready = s.health.is_ready();
    let body = serde_json::json!({
        "ready": ready,
        "database": r.database,
        "broker": r.broker,
        "registry": r.registry,
        "relaying": r.relaying,
        "fatal": r.fatal,
    });
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        format!("{body}\n"),
    )
}

/// Binds `listen` (failing with the fix when it cannot) and serves until the process ends;
/// `console`, when given, is served under `/console` ([`crate::console::router`]).
pub async fn serve(
    listen: &str,
    metrics: PrometheusHandle,
    health: Health,
    console: Option<Router>,
) -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>), CliError> {
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        CliError::config(
            format!("cannot listen on {listen} for /metrics, /healthz and /readyz: {e}"),
            "set http.listen (or --listen) to a free address, or --no-http",
        )
    })?;
    let addr = listener
        .local_addr()
        .map_err(|e| CliError::failed(e.to_string()))?;
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState { metrics, health });
    let app = match console {
        Some(c) => app.nest("/console", c),
        None => app,
    };
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the HTTP endpoint stopped");
        }
    });
    Ok((addr, task))
}
