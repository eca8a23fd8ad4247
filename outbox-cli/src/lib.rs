//! # outbox-cli: the `outbox` command
//!
//! The command teams deploy to operate a transactional outbox on PostgreSQL (or MySQL /
//! MariaDB) and Kafka, NATS JetStream or RabbitMQ (`[transport] kind`, see [`transport`]):
//! schema migrations, the relay daemon with `/metrics`, `/healthz` and `/readyz`, status, parked
//! events, replay, cleanup, configuration checks and reconciliation, and a web console
//! ([`console`]). A library with the
//! commands ([`commands`]) plus a thin binary (`src/bin/outbox.rs`), on the model of sqlx-cli;
//! it depends on `outbox-core`, the store crates, `outbox-kafka`, `outbox-nats` and
//! `outbox-rabbitmq` (cargo features `kafka`, `nats` and `rabbitmq`, all on by default; a
//! build without `kafka` compiles no rdkafka / librdkafka) and `outbox-inbox`, never on the
//! testkit.
//!
//! ```sh
//! cargo install --path outbox-cli
//! outbox migrate
//! outbox relay            # until SIGTERM; scrape http://127.0.0.1:9464/metrics
//! outbox status
//! outbox parked list
//! ```
//!
#![doc = include_str!("../docs/commands.md")]
//!
#![doc = include_str!("../docs/config.md")]
//!
#![doc = include_str!("../docs/metrics.md")]
//!
#![doc = include_str!("../docs/console.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod commands;
pub mod config;
pub mod console;
pub mod consumer_inbox;
pub mod db;
pub mod error;
pub mod health;
pub mod kafka;
pub mod logging;
pub mod metered;
pub mod metrics;
pub mod mysql;
pub mod opt;
pub mod output;
pub mod relays;
pub mod store;
pub mod suggest;
pub mod transport;
pub mod trend;

use serde_json::{json, Map, Value};

pub use config::Config;
pub use error::{CliError, ErrorKind};

use opt::{Command, GlobalOpts, Opt};

/// Flag values as a nested map for the configuration's top layer.
fn overrides(g: &GlobalOpts, command: &Command) -> Value {
    let mut root = Map::new();
    let mut set = |path: &[&str], v: Value| {
        let mut node = &mut root;
        for key in &path[..path.len() - 1] {
            node = node
                .entry(key.to_string())
                .or_insert_with(|| Value::Object(Map::new()))
                .as_object_mut()
                .expect("object");
        }
        node.insert(path[path.len() - 1].to_owned(), v);
    };
    if let Some(v) = &g.database_url {
        set(&["database", "url"], json!(v));
    }
    if let Some(v) = &g.brokers {
        set(&["kafka", "brokers"], json!(v));
    }
    if let Some(v) = &g.schema {
        set(&["outbox", "schema"], json!(v));
    }
    if let Some(v) = &g.table {
        set(&["outbox", "table"], json!(v));
    }
    if let Some(v) = &g.log_format {
        set(&["log", "format"], json!(v));
    }
    if let Some(v) = &g.log_level {
        set(&["log", "level"], json!(v));
    }
    if let Some(v) = &g.color {
        set(&["log", "color"], json!(v));
    }
    if let Command::Relay(r) = command {
        if let Some(v) = r.workers {
            set(&["relay", "workers"], json!(v));
        }
        if let Some(v) = r.batch_size {
            set(&["relay", "batch_size"], json!(v));
        }
        if let Some(v) = &r.topic {
            set(&["kafka", "topic"], json!(v));
        }
        if let Some(v) = &r.claim_mode {
            set(&["outbox", "claim_mode"], json!(v));
        }
        if let Some(v) = &r.lease {
            set(&["outbox", "lease"], json!(v));
        }
        if let Some(v) = &r.delivery_timeout {
            // The chosen transport's; the others' are not read.
            for section in ["kafka", "nats", "rabbitmq"] {
                set(&[section, "delivery_timeout"], json!(v));
            }
        }
        for (k, v) in &r.producer_properties {
            set(&["kafka", "producer", k], json!(v));
        }
        if let Some(v) = &r.listen {
            set(&["http", "listen"], json!(v));
        }
        if r.no_http {
            set(&["http", "enabled"], json!(false));
        }
        if r.no_cleanup {
            set(&["cleanup", "enabled"], json!(false));
        }
        if let Some(v) = &r.owner {
            set(&["relay", "owner"], json!(v));
        }
        if r.no_prefetch {
            set(&["relay", "prefetch"], json!(false));
        }
    }
    if let Command::Console(c) = command {
        if let Some(v) = &c.listen {
            set(&["console", "listen"], json!(v));
        }
    }
    Value::Object(root)
}

/// Runs one command: loads the configuration, sets up logging and calls the command. Returns
/// the process exit code (see [`error`]). Errors go to stderr (and, with `--json`, as
/// `{"error": ...}` to stdout).
pub async fn run(opt: Opt) -> u8 {
    let json = opt.global.json;
    // Generated from the command line's definition: no configuration to load.
    let generated = match &opt.command {
        Command::Completions(o) => Some(commands::help::completions(o.shell)),
        Command::Man(o) => Some(commands::help::man(o.dir.as_deref())),
        _ => None,
    };
    if let Some(result) = generated {
        return match result {
            Ok(()) => 0,
            Err(e) => report(&e, json),
        };
    }
    if let Err(e) = transport::refuse_kafka_flags(&kafka_flags(&opt), transport::Built::THIS) {
        return report(&e, json);
    }
    let loaded = config::Config::load(
        opt.global.config.as_deref(),
        &overrides(&opt.global, &opt.command),
    );
    let config = match loaded {
        Ok((c, _)) => c,
        Err(e) => return report(&e, json),
    };
    let level_given = opt.global.log_level.is_some() || !config.log.level.eq("info");
    // librdkafka repeats a connection failure every few hundred milliseconds, and the adapters
    // log each destination check (run for /readyz every stats interval); the relay logs broker
    // state changes itself (circuit breaker, readiness), once each, and the start-up warnings.
    let default_level = match opt.command {
        Command::Relay(_) => {
            "info,librdkafka=off,outbox_kafka::publisher=error,outbox_nats::publisher=error,\
             outbox_rabbitmq::publisher=error"
        }
        // A missing exchange is an answer `topics` expects (and reports itself).
        Command::Topics(_) => {
            "warn,librdkafka=off,lapin=off,outbox_kafka=error,outbox_nats=error,\
             outbox_rabbitmq=error"
        }
        _ => "warn,librdkafka=off,outbox_kafka=error,outbox_nats=error,outbox_rabbitmq=error",
    };
    logging::init(&config.log, level_given, default_level);
    let out = output::Output::new(json, &config.log.color).wide(opt.global.wide);
    let result = match opt.command {
        Command::Migrate(o) => commands::migrate::run(&config, &o, &out).await,
        Command::Relay(_) => commands::relay::run(&config, &out).await,
        Command::Status(o) => commands::status::run(&config, &o, &out).await,
        Command::Parked(p) => commands::parked::run(&config, p, &out).await,
        Command::Replay(o) => commands::replay::run(&config, &o, &out).await,
        Command::Cleanup(o) => commands::cleanup::run(&config, &o, &out).await,
        Command::Check(o) => commands::check::run(&config, &o, &out).await,
        Command::Reconcile(o) => commands::reconcile::run(&config, &o, &out).await,
        Command::Topics(t) => commands::topics::run(&config, t, &out).await,
        Command::Console(_) => console::run(&config).await,
        Command::Config => commands::show_config(&config, &out),
        Command::Completions(_) | Command::Man(_) => Ok(()),
    };
    match result {
        Ok(()) => 0,
        Err(e) => report(&e, json),
    }
}

/// The Kafka-only flags given on the command line (refused by a build without Kafka).
fn kafka_flags(opt: &Opt) -> Vec<&'static str> {
    let mut flags = Vec::new();
    if opt.global.brokers.is_some() {
        flags.push("--brokers");
    }
    if let Command::Relay(r) = &opt.command {
        if r.topic.is_some() {
            flags.push("--topic");
        }
        if !r.producer_properties.is_empty() {
            flags.push("--producer-property");
        }
    }
    flags
}

fn report(e: &CliError, json: bool) -> u8 {
    eprintln!("{e}");
    if json && !e.reported {
        println!("{}", e.to_json());
    }
    e.exit_code()
}
