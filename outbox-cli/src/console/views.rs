//! The console's pages: maud templates (every interpolated value is HTML-escaped; nothing is
//! marked pre-escaped but the fixed style sheet and the numbers of the SVG charts). No script,
//! nothing loaded from elsewhere.

use std::time::Duration;

use chrono::{DateTime, Utc};
use maud::{html, Markup, PreEscaped, DOCTYPE};
use outbox_core::{AuditEntry, LatencySummary, OutboxStats, ParkedEvent};
use serde_json::Value;

use super::history::Sample;
use super::store::{relay_rows, Action, ClaimHolder, RelayRow, RowState};
use crate::output::age;
use crate::relays::Relays;

const STYLE: &str = "
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
header{background:#1d2430;color:#fff;padding:.6em 1.2em;display:flex;gap:1.5em;align-items:center}
header a{color:#cfe0ff;text-decoration:none}header b{color:#fff}
.mode{margin-left:auto;font-size:12px;padding:.2em .6em;border-radius:3px}
.ro{background:#4b5563}.op{background:#b45309}
main{padding:1em 1.2em;max-width:1100px}
table{border-collapse:collapse;background:#fff;margin:.5em 0 1.2em;width:100%}
th,td{border:1px solid #d6dae1;padding:.3em .5em;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600}
.num{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;gap:1em;flex-wrap:wrap}
.card{background:#fff;border:1px solid #d6dae1;padding:.6em 1em;min-width:10em}
.card b{display:block;font-size:22px}
.warn{color:#b45309}.error{color:#b91c1c;font-weight:600}.ok{color:#15803d}
pre{background:#fff;border:1px solid #d6dae1;padding:.6em;overflow:auto;max-height:24em}
form.act{background:#fff;border:1px solid #d6dae1;padding:1em;max-width:36em}
form.act label{display:block;margin:.5em 0 .2em}
form.act input[type=text],form.act input[type=password],form.act textarea{width:100%;box-sizing:border-box}
.buttons a{display:inline-block;margin-right:.6em;padding:.3em .8em;background:#1d4ed8;color:#fff;text-decoration:none;border-radius:3px}
.buttons a.danger{background:#b91c1c}
svg{background:#fff;border:1px solid #d6dae1}
svg text{font:11px system-ui,sans-serif;fill:#4b5563}
.note{color:#4b5563;font-size:13px}
code.release{white-space:nowrap;background:#fef3c7;padding:.1em .3em}
";

/// What every page shows in its header.
pub(super) struct Frame<'a> {
    /// The page's title.
    pub title: &'a str,
    /// Operator actions are enabled (an operator token is configured).
    pub operator: bool,
    /// `schema.table`.
    pub table: &'a str,
    /// Reload every this many seconds.
    pub refresh: Option<u32>,
}

/// A whole page around `body`.
pub(super) fn page(f: &Frame<'_>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                @if let Some(r) = f.refresh { meta http-equiv="refresh" content=(r); }
                title { "outbox console · " (f.title) }
                style { (PreEscaped(STYLE)) }
            }
            body {
                header {
                    b { "outbox console" }
                    a href="/console" { "Overview" }
                    a href="/console/parked" { "Parked events" }
                    a href="/console/consumers" { "Consumers" }
                    @if f.operator {
                        span.mode.op title="console.operator_token is set" { "operator actions enabled" }
                    } @else {
                        span.mode.ro title="set console.operator_token to enable actions" { "read-only" }
                    }
                }
                main {
                    h1 { (f.title) }
                    (body)
                }
                footer.note style="padding:0 1.2em 1em" {
                    "outbox " (f.table) " · rendered " (Utc::now().format("%Y-%m-%d %H:%M:%S UTC"))
                }
            }
        }
    }
}

/// An error page's body.
pub(super) fn failure(message: &str, hint: Option<&str>) -> Markup {
    html! {
        p.error { (message) }
        @if let Some(h) = hint { p { (h) } }
        p { a href="/console" { "Back to the overview" } }
    }
}

fn secs(v: Option<f64>) -> String {
    age(v.map(Duration::from_secs_f64))
}

/// The smallest of 1, 2, 5 times a power of ten that is at least `v` (1 for nothing).
fn nice_ceiling(v: f64) -> f64 {
    if v.is_nan() || v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let power = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * power)
}

/// An inline SVG line chart of `points` (time, value) over the `window` ending `now`.
pub(super) fn chart(
    title: &str,
    points: &[(DateTime<Utc>, Option<f64>)],
    now: DateTime<Utc>,
    window: Duration,
    label: fn(f64) -> String,
) -> Markup {
    const W: f64 = 520.0;
    const H: f64 = 170.0;
    const LEFT: f64 = 70.0;
    const TOP: f64 = 22.0;
    const BOTTOM: f64 = 22.0;
    const RIGHT: f64 = 10.0;
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let span = window.as_secs_f64().max(1.0);
    let max = points.iter().filter_map(|(_, v)| *v).fold(0.0f64, f64::max);
    let top = nice_ceiling(max * 1.05);
    let x = |t: DateTime<Utc>| {
        let ago = (now - t).num_milliseconds() as f64 / 1000.0;
        LEFT + (1.0 - (ago / span).clamp(0.0, 1.0)) * pw
    };
    let y = |v: f64| TOP + ph - (v / top).clamp(0.0, 1.0) * ph;
    // Gaps (no value) split the line.
    let mut lines: Vec<String> = Vec::new();
    let mut current = String::new();
    for (t, v) in points {
        match v {
            Some(v) => current.push_str(&format!("{:.1},{:.1} ", x(*t), y(*v))),
            None if !current.is_empty() => lines.push(std::mem::take(&mut current)),
            None => {}
        }
    }
    if !current.is_empty() {
        lines.push(current);
    }
    let last = points.iter().rev().find_map(|(t, v)| v.map(|v| (*t, v)));
    let minutes = (span / 60.0).round() as u64;
    html! {
        svg width=(W) height=(H) viewBox={"0 0 " (W) " " (H)} role="img" aria-label=(title) {
            text x=(LEFT) y="14" style="font-weight:600;fill:#1d2430" { (title) }
            @for frac in [0.0, 0.5, 1.0] {
                line x1=(LEFT) x2=(W - RIGHT) y1=(y(top * frac)) y2=(y(top * frac))
                    stroke="#e5e7eb" {}
                text x=(LEFT - 4.0) y=(y(top * frac) + 4.0) text-anchor="end" {
                    (label(top * frac))
                }
            }
            text x=(LEFT) y=(H - 6.0) { "-" (minutes) " min" }
            text x=(W - RIGHT) y=(H - 6.0) text-anchor="end" { "now" }
            @for l in &lines {
                polyline points=(l) fill="none" stroke="#1d4ed8" stroke-width="1.8" {}
            }
            @if let Some((t, v)) = last {
                circle cx=(x(t)) cy=(y(v)) r="3" fill="#1d4ed8" {}
            }
            @if points.len() < 2 {
                text x=(LEFT + pw / 2.0) y=(TOP + ph / 2.0) text-anchor="middle" {
                    "collecting samples…"
                }
            }
        }
    }
}

fn count(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn seconds(v: f64) -> String {
    age(Some(Duration::from_secs_f64(v.max(0.0))))
}

/// What the overview shows.
pub(super) struct Overview<'a> {
    /// The backlog now.
    pub stats: &'a OutboxStats,
    /// Publish latency and flow over `window`.
    pub latency: &'a LatencySummary,
    /// The latency window.
    pub window: Duration,
    /// The history for the charts.
    pub samples: &'a [Sample],
    /// How far back the charts look.
    pub history: Duration,
    /// The relay registry (or why it could not be read).
    pub relays: &'a Relays,
    /// Relays holding claims now, or why they could not be read.
    pub claims: &'a Result<Vec<ClaimHolder>, String>,
    /// The relay serving this console: its owner and readiness (`/readyz`).
    pub this_relay: Option<(String, Value)>,
    /// Consumers configured.
    pub consumers: usize,
}

/// The overview's body.
pub(super) fn overview(o: &Overview<'_>) -> Markup {
    let s = o.stats;
    let now = Utc::now();
    let backlog: Vec<_> = o
        .samples
        .iter()
        .map(|x| (x.at, Some(x.unpublished as f64)))
        .collect();
    let oldest: Vec<_> = o
        .samples
        .iter()
        .map(|x| (x.at, Some(x.oldest_claimable_age_seconds.unwrap_or(0.0))))
        .collect();
    html! {
        div.cards {
            div.card { "backlog (unpublished)" b #backlog { (s.unpublished) } }
            div.card { "oldest claimable" b #oldest { (age(s.oldest_claimable_age)) } }
            div.card { "parked" b #parked {
                @if s.parked > 0 { a.warn href="/console/parked" { (s.parked) } } @else { "0" }
            } }
            div.card { "blocked behind parked" b { (s.blocked) } }
            div.card { "in flight" b { (s.in_flight) } }
            div.card { "published in " (humantime::format_duration(o.window)) b { (o.latency.count) } }
        }
        h2 { "Over the last " (humantime::format_duration(o.history)) }
        div.cards {
            (chart("backlog (events)", &backlog, now, o.history, count))
            (chart("oldest claimable event (age)", &oldest, now, o.history, seconds))
        }
        p.note { (o.samples.len()) " sample(s); the relay samples every relay.stats_interval, \
            `outbox console` every console.sample_interval, and each visit of this page adds one." }
        h2 { "Latency (created to acknowledged), last " (humantime::format_duration(o.window)) }
        table { tr { th { "published" } th { "p50" } th { "p90" } th { "p99" } th { "max" } th { "created" } }
            tr {
                td.num { (o.latency.count) }
                td.num { (secs(o.latency.p50)) } td.num { (secs(o.latency.p90)) }
                td.num { (secs(o.latency.p99)) } td.num { (secs(o.latency.max)) }
                td.num { (o.latency.created) @if o.latency.created_estimated { " (estimated)" } }
            }
        }
        @if let Some(n) = o.latency.sample {
            p.note { "Estimated: a busy window's percentiles and largest are those of its latest "
                (n) " publications, and the published count is scaled from them." }
        }
        h2 #relays { "Live relays" }
        @if let Some((owner, ready)) = &o.this_relay {
            p { "This console is served by relay " b { (owner) } ": "
                @if ready["ready"].as_bool() == Some(true) { span.ok { "ready" } }
                @else { span.error { "not ready" } " (" (ready.to_string()) ")" }
            }
        }
        (relays(o.relays, o.claims))
        p { (o.consumers) " consumer(s) configured: " a href="/console/consumers" { "lag, parked and waiting messages" } "." }
    }
}

/// The registry's relays beside the claims each holds, holders the registry does not know
/// included, and the command that ends a dead relay's claims.
fn relays(relays: &Relays, claims: &Result<Vec<ClaimHolder>, String>) -> Markup {
    let held: &[ClaimHolder] = claims.as_deref().unwrap_or(&[]);
    let rows = relay_rows(relays, held);
    let live = relays.live();
    let stale = relays.entries.len() - live;
    html! {
        @if let Some(e) = &relays.error {
            p.error #registry-error { (e) }
        } @else if live == 0 {
            p.error #no-relay { "No relay runs: no live relay in the registry, so nothing \
                publishes the backlog." @if stale > 0 { " " (stale) " stale entr" @if stale == 1 { "y" } @else { "ies" } " below." } }
        } @else {
            p #relay-count { (live) " live relay(s)" @if stale > 0 { ", " span.error { (stale) " stale" } } "." }
        }
        @if let Err(e) = claims { p.error { "cannot read the claims: " (e) } }
        @if !rows.is_empty() {
            table #relay-list {
                tr { th { "relay (owner-worker)" } th { "state" } th { "host" } th { "pid" } th { "version" }
                     th { "mode" } th { "started" } th { "last heartbeat" } th { "held at heartbeat" }
                     th { "aggregates claimed now" } th { "lease until" } th { "to do" } }
                @for r in &rows { (relay_row(r, claims.is_ok())) }
            }
        }
        p.note { "A relay registers each worker, heartbeats every relay.heartbeat_interval and \
            deregisters when it stops; it is stale once its last heartbeat is older than "
            (outbox_core::store::STALE_AFTER_HEARTBEATS) " of its intervals (killed, or cut off \
            from the database). Claims now are the unexpired leases (lease mode; a locked-mode \
            claim leaves no row, and an idle relay holds none). Check that a stale relay is gone \
            (host, pid) before running its command; `outbox status` shows the same registry." }
    }
}

fn relay_row(r: &RelayRow<'_>, claims_read: bool) -> Markup {
    let state = r.state();
    let dash = || html! { span.note { "-" } };
    html! {
        tr class={ "relay-" (state.as_str()) } {
            td { (r.owner) }
            td { @match state {
                RowState::Live => span.ok { "live" },
                RowState::Stale => span.error { "stale" },
                RowState::Unregistered => span.warn { "unregistered" },
            } }
            @match r.entry {
                Some((e, now)) => {
                    @let reg = &e.registration;
                    td { (reg.host) } td.num { (reg.pid) } td { (reg.version) } td { (reg.claim_mode) }
                    td { (crate::relays::since(e)) }
                    td { (age(Some(e.heartbeat_age))) " ago" }
                    td.num { (e.held) @if let Some(n) = now { " (now " (n) ")" } }
                }
                None => { @for _ in 0..7 { td { (dash()) } } }
            }
            @match r.claims {
                Some(c) => {
                    td.num { (c.aggregates) }
                    td { (c.lease_until.map(|t| t.format("%H:%M:%S UTC").to_string()).unwrap_or_default()) }
                }
                None if claims_read => { td.num { "0" } td { (dash()) } }
                None => { td.num { "?" } td { (dash()) } }
            }
            td {
                @if let Some(cmd) = r.release_command() {
                    "if it is gone: " code.release { (cmd) }
                } @else if state == RowState::Unregistered {
                    span.note { "not in the registry (a relay older than the registry, or its \
                        registration failed): whether it runs is unknown" }
                }
            }
        }
    }
}

/// The parked events' list.
pub(super) fn parked_list(parked: &[ParkedEvent]) -> Markup {
    let now = Utc::now();
    html! {
        @if parked.is_empty() {
            p.ok { "No parked events." }
        } @else {
            p { (parked.len()) " parked event(s), oldest first. Each blocks its aggregate's later events." }
            table #parked-events {
                tr { th { "event id" } th { "aggregate" } th { "version" } th { "type" } th { "kind" }
                     th { "last error" } th { "attempts" } th { "parked for" } }
                @for p in parked {
                    @let e = &p.envelope;
                    tr {
                        td { a href={"/console/parked/" (e.event_id)} { (e.event_id) } }
                        td { (e.aggregate_type) "/" (e.aggregate_id) }
                        td.num { (e.aggregate_version) }
                        td { (e.event_type) }
                        td { (p.reason.kind.as_str()) }
                        td { (p.reason.error.kind) ": " (p.reason.error.message) }
                        td.num { (p.attempts) }
                        td { (age((now - p.parked_at).to_std().ok())) }
                    }
                }
            }
        }
    }
}

/// The payload as text when it is (pretty JSON when it parses), else its size.
fn payload_text(p: &ParkedEvent) -> String {
    let bytes = &p.envelope.payload.bytes;
    if let Ok(v) = serde_json::from_slice::<Value>(bytes) {
        return serde_json::to_string_pretty(&v).unwrap_or_default();
    }
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_owned(),
        Err(_) => format!("({} bytes of binary data)", bytes.len()),
    }
}

/// One parked event (or what is left of it: its audit trail) with the actions.
pub(super) fn parked_event(
    id: &str,
    parked: Option<&ParkedEvent>,
    trail: &[AuditEntry],
    note: Option<&str>,
    operator: bool,
) -> Markup {
    html! {
        @match parked {
            Some(p) => {
                @let e = &p.envelope;
                table #event {
                    tr { th { "event id" } td { (e.event_id) } }
                    tr { th { "aggregate" } td { (e.aggregate_type) "/" (e.aggregate_id) " v" (e.aggregate_version) } }
                    tr { th { "event type" } td { (e.event_type) } }
                    tr { th { "created" } td { (e.created_at.to_rfc3339()) } }
                    tr { th { "parked" } td { (p.parked_at.to_rfc3339()) } }
                    tr { th { "kind" } td { (p.reason.kind.as_str()) } }
                    tr { th { "last error" } td { (p.reason.error.kind) " (" (p.reason.error.class.as_str()) "): " (p.reason.error.message) } }
                    @if let Some(n) = note { tr { th { "earlier attempts" } td { (n) } } }
                    tr { th { "payload" } td { (e.payload.bytes.len()) " bytes, " (e.payload.content_type) } }
                }
                h2 { "Payload" }
                pre #payload { (payload_text(p)) }
                h2 { "Actions" }
                @if operator {
                    p.buttons {
                        a #retry href={"/console/parked/" (id) "/retry"} { "Retry…" }
                        a #reissue href={"/console/parked/" (id) "/reissue"} { "Re-issue…" }
                        a.danger #discard href={"/console/parked/" (id) "/discard"} { "Discard…" }
                    }
                    p.note { "Each asks for a reason, your name, the operator token and a confirmation; \
                        the store audits it." }
                } @else {
                    p.note { "Read-only: set console.operator_token (OUTBOX_CONSOLE__OPERATOR_TOKEN) \
                        to retry, discard or re-issue from here, or use `outbox parked retry|discard|reissue`." }
                }
            }
            None => p { "Event " (id) " is not parked (any more)." }
        }
        h2 { "Audit trail" }
        @if trail.is_empty() {
            p { "No operator action yet." }
        } @else {
            table #audit {
                tr { th { "at" } th { "action" } th { "actor" } th { "reason" } th { "new event id" } }
                @for a in trail {
                    tr { td { (a.at.to_rfc3339()) } td { (a.action.as_str()) } td { (a.actor) }
                         td { (a.reason) } td { (a.new_event_id.map(|i| i.to_string()).unwrap_or_default()) } }
                }
            }
        }
    }
}

/// What an action does, for its confirmation page.
fn consequence(action: Action) -> &'static str {
    match action {
        Action::Retry => {
            "The event becomes claimable again with its id, its attempts reset: the \
                         relay publishes it, then its aggregate's later events."
        }
        Action::Discard => {
            "The event is never published; its aggregate's later events flow \
                           again. This cannot be undone."
        }
        Action::Reissue => {
            "A copy with a new event id replaces it (the original is marked \
                           discarded); the copy names the original, so inboxes apply the two \
                           once."
        }
    }
}

/// The confirmation step of `action` on a parked event.
pub(super) fn confirm(action: Action, p: &ParkedEvent, note: &str, csrf: &str) -> Markup {
    let e = &p.envelope;
    let name = action.name();
    html! {
        p { "You are about to " b { (name) } " parked event " b { (e.event_id) } " ("
            (e.aggregate_type) "/" (e.aggregate_id) " v" (e.aggregate_version) ", " (e.event_type) ")." }
        p { (consequence(action)) }
        p.note { (note) }
        form.act #action method="post" action={"/console/parked/" (e.event_id) "/" (name)} {
            input type="hidden" name="csrf" value=(csrf);
            label for="reason" { "Reason (what was fixed, or why it goes; recorded in the audit trail)" }
            textarea #reason name="reason" required rows="3" maxlength="1000" {}
            label for="actor" { "Your name (recorded as the actor)" }
            input #actor type="text" name="actor" required maxlength="200";
            label for="token" { "Operator token" }
            input #token type="password" name="token" required autocomplete="current-password";
            label { input #confirm type="checkbox" name="confirm" value="yes" required;
                " I confirm the " (name) " of this event" }
            p { button #submit type="submit" { "Confirm " (name) } " "
                a href={"/console/parked/" (e.event_id)} { "Cancel" } }
        }
    }
}

/// What an action did.
pub(super) fn done(action: Action, id: &str, new_id: Option<&str>, actor: &str) -> Markup {
    html! {
        p.ok #outcome {
            @match (action, new_id) {
                (Action::Reissue, Some(n)) => { "Re-issued " (id) " as " a href={"/console/parked/" (n)} { (n) } "; the original is discarded." },
                (Action::Retry, _) => { "Retried " (id) ": claimable again." },
                _ => { "Discarded " (id) ": its aggregate's later events flow again." },
            }
            " Audited as " b { (actor) } "."
        }
        p { a href={"/console/parked/" (id)} { "See the event's audit trail" } " · " a href="/console/parked" { "Parked events" } }
    }
}

fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The consumers (each `status`'s JSON of it).
pub(super) fn consumers(list: &[Value], warnings: &[String]) -> Markup {
    html! {
        @if list.is_empty() {
            p { "No consumers configured ([[consumers]] in the configuration)." }
        } @else {
            table #consumers {
                tr { th { "consumer" } th { "group" } th { "lag" } th { "inbox registrations" }
                     th { "parked" } th { "waiting" } th { "oldest parked" } }
                @for c in list {
                    @let name = c["name"].as_str().unwrap_or("");
                    tr {
                        td { a href={"/console/consumers/" (name)} { (name) } }
                        td { (cell(&c["group"])) }
                        td.num { @if c["lag"].is_null() { span.note { (cell(&c["lag_error"])) } } @else { (cell(&c["lag"])) } }
                        td.num { @if c["inbox_registrations"].is_null() { span.error { (cell(&c["inbox_error"])) } } @else { (cell(&c["inbox_registrations"])) } }
                        td.num { @if c["parked"].is_null() { span.error { (cell(&c["parked_error"])) } } @else { (cell(&c["parked"])) } }
                        td.num { (cell(&c["waiting"])) }
                        td { (secs(c["oldest_parked_age_seconds"].as_f64())) }
                    }
                }
            }
        }
        @for w in warnings { p.warn { "warning: " (w) } }
    }
}

/// A consumer's open parked messages (each `parked list --consumer`'s JSON of it).
pub(super) fn consumer_messages(name: &str, messages: &[Value]) -> Markup {
    html! {
        @if messages.is_empty() {
            p.ok { "No open parked messages of consumer " (name) "." }
        } @else {
            p { (messages.len()) " open message(s): parked heads and the messages waiting behind them. \
                Act on them with `outbox parked discard|retry ID --consumer " (name) "`." }
            table #messages {
                tr { th { "id" } th { "status" } th { "aggregate" } th { "version" } th { "type" }
                     th { "kind" } th { "reason" } th { "attempts" } th { "parked at" } th { "retry requested" } }
                @for m in messages {
                    tr {
                        td.num { (cell(&m["id"])) } td { (cell(&m["status"])) }
                        td { (cell(&m["aggregate_type"])) "/" (cell(&m["aggregate_id"])) }
                        td.num { (cell(&m["aggregate_version"])) } td { (cell(&m["event_type"])) }
                        td { (cell(&m["kind"])) } td { (cell(&m["reason"])) } td.num { (cell(&m["attempts"])) }
                        td { (cell(&m["parked_at"])) }
                        td { (cell(&m["retry_request"]["requested_by"])) }
                    }
                }
            }
        }
        p { a href="/console/consumers" { "All consumers" } }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_tops_are_round() {
        for (v, top) in [
            (0.0, 1.0),
            (1.05, 2.0),
            (3.0, 5.0),
            (7.0, 10.0),
            (0.3, 0.5),
            (1200.0, 2000.0),
        ] {
            assert!(
                (nice_ceiling(v) - top).abs() < 1e-9,
                "{v} -> {}",
                nice_ceiling(v)
            );
        }
        assert_eq!(count(2.0), "2");
        assert_eq!(count(2.5), "2.5");
    }

    /// Every value in a page is escaped, in text and in attributes.
    #[test]
    fn user_data_is_escaped_in_text_and_attributes() {
        let page = chart(
            "<b>\"x\"</b>",
            &[],
            Utc::now(),
            Duration::from_secs(60),
            count,
        )
        .into_string();
        assert!(!page.contains("<b>"), "{page}");
        assert!(
            page.contains("aria-label=\"&lt;b&gt;&quot;x&quot;&lt;/b&gt;\""),
            "{page}"
        );
    }
}
