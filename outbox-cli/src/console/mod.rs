//! The web console: the backlog and the age of its oldest event over time, the relays of the
//! registry (live or stale) beside the claims each holds, parked events with show / retry / discard / re-issue, and the consumers with their
//! lag, parked and waiting messages. Served by `outbox console` (its own address,
//! `console.listen`) and by `outbox relay` under `/console` on `http.listen`, on PostgreSQL and
//! MySQL / MariaDB alike (through the reporting and operator roles, [`ConsoleStore`]).
//!
//! Server-rendered HTML (maud: every value escaped), charts as inline SVG drawn on the server,
//! no script and nothing loaded from elsewhere; a JSON document behind each page under
//! `/console/api/`. Security model (see `docs/console.md`): loopback by default; read-only
//! unless `console.operator_token` is set; an action is a POST that must carry a valid CSRF
//! token in its cookie and its form ([`security`]) and the operator token, with a reason, the
//! operator's name (the actor in the store's audit trail) and a ticked confirmation, after a
//! confirmation page.

mod history;
pub mod security;
mod store;
mod views;

use std::sync::Arc;

use axum::extract::{Form, Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;
use chrono::Utc;
use maud::Markup;
use outbox_core::{EventId, StoreError, StoreErrorKind};
use serde::Deserialize;
use serde_json::{json, Value};

pub use history::{History, Sample, MAX_SAMPLES};
pub use store::{relay_rows, Action, ClaimHolder, ConsoleStore, RelayRow, RowState};

use crate::config::Config;
use crate::error::CliError;
use crate::health::Health;

/// Most parked events a page lists.
const LIST_LIMIT: usize = 500;

/// What the handlers share.
#[derive(Clone)]
pub struct ConsoleState(Arc<Inner>);

struct Inner {
    config: Config,
    store: ConsoleStore,
    history: History,
    csrf: security::Csrf,
    relay: Option<(String, Health)>,
}

impl ConsoleState {
    /// The console over `store`, drawing `history`; `relay` is the owner and readiness of the
    /// relay that serves it, if one does.
    pub fn new(
        config: &Config,
        store: ConsoleStore,
        history: History,
        relay: Option<(String, Health)>,
    ) -> Self {
        Self(Arc::new(Inner {
            config: config.clone(),
            store,
            history,
            csrf: security::Csrf::default(),
            relay,
        }))
    }

    /// Whether actions are enabled (an operator token is configured).
    pub fn operator(&self) -> bool {
        !self.0.config.console.operator_token.is_empty()
    }

    fn html(&self, title: &str, refresh: Option<u32>, body: Markup) -> Response {
        let frame = views::Frame {
            title,
            operator: self.operator(),
            table: self.0.store.table(),
            refresh,
        };
        views::page(&frame, body).into_response()
    }

    fn problem_page(&self, p: Problem) -> Response {
        let body = views::failure(&p.message, p.hint.as_deref());
        let mut r = self.html(p.title(), None, body);
        *r.status_mut() = p.status;
        r
    }

    fn store_problem(&self, e: &StoreError) -> Problem {
        let c = CliError::from_store(e, self.0.store.table());
        Problem {
            status: match e.kind {
                StoreErrorKind::NotFound => StatusCode::NOT_FOUND,
                StoreErrorKind::Conflict => StatusCode::CONFLICT,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
            message: c.message,
            hint: c.hint,
        }
    }
}

/// Why a request failed.
#[derive(Debug)]
struct Problem {
    status: StatusCode,
    message: String,
    hint: Option<String>,
}

impl Problem {
    fn new(status: StatusCode, message: impl Into<String>, hint: Option<&str>) -> Self {
        Self {
            status,
            message: message.into(),
            hint: hint.map(str::to_owned),
        }
    }
    fn title(&self) -> &'static str {
        match self.status {
            StatusCode::FORBIDDEN => "Refused",
            StatusCode::NOT_FOUND => "Not found",
            StatusCode::BAD_REQUEST => "Incomplete request",
            StatusCode::CONFLICT => "Refused by the store",
            _ => "Error",
        }
    }
    fn json(&self) -> Response {
        json_response(
            self.status,
            &json!({"error": {"message": self.message, "hint": self.hint}}),
        )
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        format!("{v}\n"),
    )
        .into_response()
}

/// The console's routes, to be nested under `/console`.
pub fn router(state: ConsoleState) -> Router {
    Router::new()
        .route("/", get(overview))
        .route("/parked", get(parked_list))
        .route("/parked/{id}", get(parked_show))
        .route("/parked/{id}/{action}", get(confirm).post(act))
        .route("/consumers", get(consumers))
        .route("/consumers/{name}", get(consumer))
        .route("/api/overview", get(api_overview))
        .route("/api/parked", get(api_parked))
        .route("/api/parked/{id}", get(api_parked_show))
        .route("/api/consumers", get(api_consumers))
        .layer(axum::middleware::map_response(secure_headers))
        .with_state(state)
}

/// The console under `/console`, and `/` sending there: what `outbox console` serves.
pub fn app(state: ConsoleState) -> Router {
    Router::new()
        .route("/", get(|| async { Redirect::to("/console") }))
        .nest("/console", router(state))
}

/// No framing, no sniffing, no referrer to other sites, no caching, and a policy that allows nothing but the
/// page's own inline style and forms posting back to it.
async fn secure_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; \
             form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        h.insert(name, HeaderValue::from_static(value));
    }
    r
}

/// The overview's figures.
struct OverviewData {
    stats: outbox_core::OutboxStats,
    latency: outbox_core::LatencySummary,
    relays: crate::relays::Relays,
    claims: Result<Vec<ClaimHolder>, String>,
}

async fn load_overview(s: &ConsoleState) -> Result<OverviewData, Problem> {
    let store = &s.0.store;
    let stats = store.backlog().await.map_err(|e| s.store_problem(&e))?;
    s.0.history.observe(Utc::now(), &stats);
    let latency = store
        .latency(s.0.config.status.window.0)
        .await
        .map_err(|e| s.store_problem(&e))?;
    let claims = store
        .claim_holders()
        .await
        .map_err(|e| CliError::from_store(&e, store.table()).to_string());
    Ok(OverviewData {
        stats,
        latency,
        relays: store.relays().await,
        claims,
    })
}

fn this_relay(s: &ConsoleState) -> Option<(String, Value)> {
    s.0.relay.as_ref().map(|(owner, health)| {
        let r = health.get();
        (
            owner.clone(),
            json!({"ready": r.is_ready(), "database": r.database, "broker": r.broker,
                   "relaying": r.relaying, "fatal": r.fatal}),
        )
    })
}

async fn overview(State(s): State<ConsoleState>) -> Response {
    let d = match load_overview(&s).await {
        Ok(d) => d,
        Err(p) => return s.problem_page(p),
    };
    let samples = s.0.history.samples();
    let body = views::overview(&views::Overview {
        stats: &d.stats,
        latency: &d.latency,
        window: s.0.config.status.window.0,
        samples: &samples,
        history: s.0.history.window(),
        relays: &d.relays,
        claims: &d.claims,
        this_relay: this_relay(&s),
        consumers: s.0.config.consumers.len(),
    });
    s.html("Overview", Some(15), body)
}

async fn api_overview(State(s): State<ConsoleState>) -> Response {
    let d = match load_overview(&s).await {
        Ok(d) => d,
        Err(p) => return p.json(),
    };
    let st = &d.stats;
    let secs = crate::output::secs;
    json_response(
        StatusCode::OK,
        &json!({
            "outbox": s.0.store.table(),
            "operator_actions": s.operator(),
            "backlog": {
                "unpublished": st.unpublished,
                "in_flight": st.in_flight,
                "parked": st.parked,
                "blocked": st.blocked,
                "gap_held": st.gap_held,
                "oldest_claimable_age_seconds": secs(st.oldest_claimable_age),
                "oldest_blocked_age_seconds": secs(st.oldest_blocked_age),
                "oldest_parked_age_seconds": secs(st.oldest_parked_age),
            },
            "latency": {
                "window_seconds": s.0.config.status.window.0.as_secs_f64(),
                "published": d.latency.count,
                "created": d.latency.created,
                "created_estimated": d.latency.created_estimated,
                "p50_seconds": d.latency.p50,
                "p90_seconds": d.latency.p90,
                "p99_seconds": d.latency.p99,
                "max_seconds": d.latency.max,
                "estimated": d.latency.sample.is_some(),
                "sample_size": d.latency.sample,
            },
            "history": s.0.history.samples(),
            "relays": relays_json(&d),
            "claims": match &d.claims { Ok(c) => json!(c), Err(_) => Value::Null },
            "claims_error": d.claims.as_ref().err(),
            "this_relay": this_relay(&s).map(|(owner, ready)| json!({"owner": owner, "readiness": ready})),
        }),
    )
}

/// The overview's relays: `outbox status --json`'s `relays` object, each entry with the claims
/// its owner holds now, and the holders the registry does not know.
fn relays_json(d: &OverviewData) -> Value {
    let held: &[ClaimHolder] = d.claims.as_deref().unwrap_or(&[]);
    let entries: Vec<Value> = relay_rows(&d.relays, held)
        .iter()
        .map(|r| {
            let mut v = match r.entry {
                Some((e, now)) => crate::relays::entry_json(e, now),
                None => json!({"owner": r.owner}),
            };
            v["state"] = json!(r.state().as_str());
            v["registered"] = json!(r.entry.is_some());
            v["aggregates_claimed"] = match (r.claims, &d.claims) {
                (Some(c), _) => json!(c.aggregates),
                (None, Ok(_)) => json!(0),
                (None, Err(_)) => Value::Null,
            };
            v["lease_until"] = json!(r.claims.and_then(|c| c.lease_until));
            v["release_command"] = json!(r.release_command());
            v
        })
        .collect();
    let mut doc = d.relays.json();
    doc["entries"] = json!(entries);
    doc
}

async fn parked_list(State(s): State<ConsoleState>) -> Response {
    match s.0.store.list_parked(LIST_LIMIT).await {
        Ok(parked) => s.html("Parked events", None, views::parked_list(&parked)),
        Err(e) => s.problem_page(s.store_problem(&e)),
    }
}

async fn api_parked(State(s): State<ConsoleState>) -> Response {
    match s.0.store.list_parked(LIST_LIMIT).await {
        Ok(parked) => json_response(
            StatusCode::OK,
            &json!({"parked": parked.iter().map(crate::commands::parked::parked_json).collect::<Vec<_>>()}),
        ),
        Err(e) => s.store_problem(&e).json(),
    }
}

fn event_id(s: &str) -> Result<EventId, Problem> {
    s.trim().parse().map_err(|_| {
        Problem::new(
            StatusCode::NOT_FOUND,
            format!("{s:?} is not an event id"),
            Some("open an event from the list of parked events"),
        )
    })
}

async fn parked_show(State(s): State<ConsoleState>, Path(id): Path<String>) -> Response {
    let id = match event_id(&id) {
        Ok(i) => i,
        Err(p) => return s.problem_page(p),
    };
    match s.0.store.parked(id).await {
        Ok((None, trail)) if trail.is_empty() => s.problem_page(Problem::new(
            StatusCode::NOT_FOUND,
            format!("event {id} is not parked and has no audit trail"),
            None,
        )),
        Ok((parked, trail)) => {
            let note = parked.as_ref().map(crate::commands::parked::attempts_note);
            let body = views::parked_event(
                &id.to_string(),
                parked.as_ref(),
                &trail,
                note.as_deref(),
                s.operator(),
            );
            s.html("Parked event", None, body)
        }
        Err(e) => s.problem_page(s.store_problem(&e)),
    }
}

async fn api_parked_show(State(s): State<ConsoleState>, Path(id): Path<String>) -> Response {
    let id = match event_id(&id) {
        Ok(i) => i,
        Err(p) => return p.json(),
    };
    match s.0.store.parked(id).await {
        Ok((parked, trail)) => json_response(
            StatusCode::OK,
            &json!({
                "parked": parked.as_ref().map(crate::commands::parked::parked_json),
                "earlier_attempts": parked.as_ref().map(crate::commands::parked::attempts_note),
                "audit": trail.iter().map(crate::commands::parked::audit_json).collect::<Vec<_>>(),
            }),
        ),
        Err(e) => s.store_problem(&e).json(),
    }
}

fn read_only() -> Problem {
    Problem::new(
        StatusCode::FORBIDDEN,
        "this console is read-only: no operator token is configured",
        Some(
            "set console.operator_token (OUTBOX_CONSOLE__OPERATOR_TOKEN) and restart to act \
             from the console, or use `outbox parked retry|discard|reissue`",
        ),
    )
}

fn action(s: &str) -> Result<Action, Problem> {
    Action::parse(s).ok_or_else(|| {
        Problem::new(
            StatusCode::NOT_FOUND,
            format!("{s:?} is not an action (retry, discard, reissue)"),
            None,
        )
    })
}

/// The confirmation step: what the action does, and the form that does it.
async fn confirm(
    State(s): State<ConsoleState>,
    Path((id, what)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    if !s.operator() {
        return s.problem_page(read_only());
    }
    let (id, what) = match (event_id(&id), action(&what)) {
        (Ok(i), Ok(a)) => (i, a),
        (Err(p), _) | (_, Err(p)) => return s.problem_page(p),
    };
    let parked = match s.0.store.parked(id).await {
        Ok((Some(p), _)) => p,
        Ok((None, _)) => {
            return s.problem_page(Problem::new(
                StatusCode::NOT_FOUND,
                format!("event {id} is not parked (any more)"),
                None,
            ))
        }
        Err(e) => return s.problem_page(s.store_problem(&e)),
    };
    let (token, set_cookie) = s.0.csrf.for_form(&headers);
    let note = crate::commands::parked::attempts_note(&parked);
    let title = format!("Confirm: {} {id}", what.name());
    let mut r = s.html(&title, None, views::confirm(what, &parked, &note, &token));
    if let Some(c) = set_cookie.and_then(|c| HeaderValue::from_str(&c).ok()) {
        r.headers_mut().insert(header::SET_COOKIE, c);
    }
    r
}

/// The action form's fields (each optional, so that a missing one is refused with its reason
/// rather than by the extractor).
#[derive(Debug, Default, Deserialize)]
pub struct ActionForm {
    /// The CSRF token of the confirmation page.
    #[serde(default)]
    pub csrf: Option<String>,
    /// The operator token.
    #[serde(default)]
    pub token: Option<String>,
    /// Who acts.
    #[serde(default)]
    pub actor: Option<String>,
    /// Why.
    #[serde(default)]
    pub reason: Option<String>,
    /// `yes` when the confirmation is ticked.
    #[serde(default)]
    pub confirm: Option<String>,
}

/// Checks a POSTed action: enabled, same origin, CSRF, operator token, then its inputs. Returns
/// the actor as recorded and the reason.
fn check_action(
    s: &ConsoleState,
    headers: &HeaderMap,
    f: &ActionForm,
) -> Result<(String, String), Problem> {
    if !s.operator() {
        return Err(read_only());
    }
    if security::cross_origin(headers) {
        return Err(Problem::new(
            StatusCode::FORBIDDEN,
            "refused: the request comes from another origin",
            Some("act from the console's own pages"),
        ));
    }
    if !s.0.csrf.check(headers, f.csrf.as_deref()) {
        return Err(Problem::new(
            StatusCode::FORBIDDEN,
            "refused: missing or invalid CSRF token",
            Some(
                "open the action again from the event's page (tokens end when the console \
                 restarts; cookies must be enabled)",
            ),
        ));
    }
    let expected = s.0.config.console.operator_token.expose();
    if !security::token_matches(expected, f.token.as_deref().unwrap_or("")) {
        return Err(Problem::new(
            StatusCode::FORBIDDEN,
            "refused: wrong operator token",
            Some("type the token configured as console.operator_token"),
        ));
    }
    let reason = f.reason.as_deref().unwrap_or("").trim();
    let actor = f.actor.as_deref().unwrap_or("").trim();
    let missing = |what: &str| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            format!("{what} is required"),
            Some("go back and fill it in; nothing was changed"),
        )
    };
    if reason.is_empty() {
        return Err(missing("a reason"));
    }
    if actor.is_empty() {
        return Err(missing("your name (the actor)"));
    }
    if f.confirm.as_deref() != Some("yes") {
        return Err(missing("the confirmation"));
    }
    if reason.chars().count() > 1000 || actor.chars().count() > 200 {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "the reason (1000 characters) or the name (200) is too long",
            None,
        ));
    }
    Ok((format!("{actor} (console)"), reason.to_owned()))
}

/// Runs a confirmed action.
async fn act(
    State(s): State<ConsoleState>,
    Path((id, what)): Path<(String, String)>,
    headers: HeaderMap,
    Form(f): Form<ActionForm>,
) -> Response {
    let (actor, reason) = match check_action(&s, &headers, &f) {
        Ok(v) => v,
        Err(p) => return s.problem_page(p),
    };
    let (id, what) = match (event_id(&id), action(&what)) {
        (Ok(i), Ok(a)) => (i, a),
        (Err(p), _) | (_, Err(p)) => return s.problem_page(p),
    };
    match s.0.store.act(what, id, &actor, &reason).await {
        Ok(new_id) => {
            tracing::info!(event_id = %id, action = what.name(), actor = %actor, "console action");
            let new_id = new_id.map(|n| n.to_string());
            s.html(
                "Done",
                None,
                views::done(what, &id.to_string(), new_id.as_deref(), &actor),
            )
        }
        Err(e) => {
            let mut p = s.store_problem(&e);
            if e.kind == StoreErrorKind::Conflict && what == Action::Retry {
                p.hint = Some(
                    "an out-of-order event would be delivered after a later version: discard \
                     it with a reason instead"
                        .into(),
                );
            }
            s.problem_page(p)
        }
    }
}

/// Each configured consumer as `outbox status` shows it, with the warnings.
async fn load_consumers(s: &ConsoleState) -> (Vec<Value>, Vec<String>) {
    let mut warnings = Vec::new();
    let mut list = Vec::new();
    for c in &s.0.config.consumers {
        list.push(
            crate::commands::status::consumer_status(
                &s.0.config,
                c,
                s.0.store.pg_pool(),
                false,
                &mut warnings,
            )
            .await,
        );
    }
    (list, warnings)
}

async fn consumers(State(s): State<ConsoleState>) -> Response {
    let (list, warnings) = load_consumers(&s).await;
    s.html("Consumers", None, views::consumers(&list, &warnings))
}

async fn api_consumers(State(s): State<ConsoleState>) -> Response {
    let (list, warnings) = load_consumers(&s).await;
    json_response(
        StatusCode::OK,
        &json!({"consumers": list, "warnings": warnings}),
    )
}

async fn consumer(State(s): State<ConsoleState>, Path(name): Path<String>) -> Response {
    if !s.0.config.consumers.iter().any(|c| c.name == name) {
        return s.problem_page(Problem::new(
            StatusCode::NOT_FOUND,
            format!("no consumer {name:?} is configured"),
            None,
        ));
    }
    match crate::commands::consumer_parked::open_messages(&s.0.config, &name, LIST_LIMIT).await {
        Ok(messages) => s.html(
            &format!("Consumer {name}"),
            None,
            views::consumer_messages(&name, &messages),
        ),
        Err(e) => s.problem_page(Problem {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: e.message,
            hint: e.hint,
        }),
    }
}

/// Warns when the console is reachable from other hosts.
pub fn warn_if_exposed(addr: std::net::SocketAddr, config: &Config) {
    if addr.ip().is_loopback() {
        return;
    }
    let actions = if config.console.operator_token.is_empty() {
        "read-only"
    } else {
        "WITH operator actions"
    };
    tracing::warn!(
        %addr,
        "the console ({actions}) listens on a non-loopback address: anyone who reaches it reads \
         the outbox, payloads included; put it behind a reverse proxy with TLS and \
         authentication, or bind 127.0.0.1"
    );
    eprintln!(
        "warning: the console ({actions}) listens on {addr}, reachable from other hosts: put it \
         behind a reverse proxy with TLS and authentication, or bind 127.0.0.1"
    );
}

/// `outbox console`: serves the console on `console.listen` until SIGTERM/SIGINT, sampling
/// the backlog every `console.sample_interval` for the charts.
pub async fn run(config: &Config) -> Result<(), CliError> {
    let store = ConsoleStore::connect(config).await?;
    let history = History::new(config.console.history.0);
    let listen = &config.console.listen;
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        CliError::config(
            format!("cannot listen on {listen} for the console: {e}"),
            "set console.listen (or --listen) to a free address",
        )
    })?;
    let addr = listener
        .local_addr()
        .map_err(|e| CliError::failed(e.to_string()))?;
    warn_if_exposed(addr, config);
    let state = ConsoleState::new(config, store.clone(), history.clone(), None);
    eprintln!(
        "outbox console on http://{addr}/console ({}; outbox {})",
        if state.operator() {
            "operator actions enabled"
        } else {
            "read-only: set console.operator_token to enable actions"
        },
        store.table()
    );
    let every = config
        .console
        .sample_interval
        .0
        .max(std::time::Duration::from_secs(1));
    let sampler = tokio::spawn(async move {
        loop {
            match store.backlog().await {
                Ok(stats) => history.observe(Utc::now(), &stats),
                Err(e) => tracing::warn!(error = %e, "console: cannot read the backlog"),
            }
            tokio::time::sleep(every).await;
        }
    });
    let served = axum::serve(listener, app(state))
        .with_graceful_shutdown(crate::commands::relay::shutdown_signal())
        .await;
    sampler.abort();
    served.map_err(|e| CliError::failed(format!("the console stopped: {e}")))
}
