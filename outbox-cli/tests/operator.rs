//! What an operator trial of the `outbox` command found broken (issue 23): exit codes that say
//! what a supervisor should do, configuration errors reported before any service is contacted,
//! exact GRANT statements, `/readyz` that follows the broker both ways, and failure metrics
//! labelled with what the relay did. Each drives the binary as an operator would.

mod common;

use common::text;

/// A broker address where nothing listens.
const NO_BROKER: &str = "127.0.0.1:1";

/// Runs `outbox relay --no-http` with a broker that cannot be reached and `envs`.
fn relay_without_broker(
    env: &common::TestEnv,
    envs: &[(&str, &str)],
    args: &[&str],
) -> std::process::Output {
    env.cmd()
        .env("KAFKA_BROKERS", NO_BROKER)
        .env("OUTBOX_KAFKA__METADATA_TIMEOUT", "2s")
        .envs(envs.iter().copied())
        .args(["relay", "--no-http"])
        .args(args)
        .output()
        .unwrap()
}

/// Environment, flags, and the key or value the error must name.
type BadValue<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str], &'a str);

/// A configuration error exits 2 with the key and its fix while the broker (or the database) is
/// unreachable, instead of 3 "cannot reach the broker", which hid it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configuration_errors_exit_2_before_any_service_is_contacted() {
    let env = env_or_skip!("op_config_before_network", 0);
    env.migrate();
    // Control: a sound configuration with the broker down is exit 3, naming the broker.
    let out = relay_without_broker(&env, &[], &[]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(NO_BROKER),
        "{}",
        text(&out)
    );
    let no_database = [("DATABASE_URL", "postgres://app@127.0.0.1:1/shop")];
    // Each bad value, once with the database reachable and once with it unreachable too.
    let cases: &[BadValue<'_>] = &[
        // The trial's case: a lease shorter than the delivery timeout plus the margin.
        (
            &[
                ("OUTBOX_OUTBOX__LEASE", "10s"),
                ("OUTBOX_KAFKA__DELIVERY_TIMEOUT", "30s"),
            ],
            &[],
            "outbox.lease",
        ),
        // A lease above the store's limit.
        (&[("OUTBOX_OUTBOX__LEASE", "2h")], &[], "outbox.lease"),
        // An unsafe producer property.
        (&[], &["--producer-property", "acks=1"], "acks=1"),
        // A retry policy whose first ceiling exceeds its largest.
        (
            &[
                ("OUTBOX_RELAY__RETRY_BASE", "10s"),
                ("OUTBOX_RELAY__RETRY_MAX", "1s"),
            ],
            &[],
            "[relay] retry",
        ),
    ];
    for (envs, args, named) in cases {
        for database_down in [false, true] {
            let mut all: Vec<(&str, &str)> = envs.to_vec();
            if database_down {
                all.extend_from_slice(&no_database);
            }
            let out = relay_without_broker(&env, &all, args);
            assert_eq!(
                out.status.code(),
                Some(2),
                "{envs:?} {args:?} (database down: {database_down}): {}",
                text(&out)
            );
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(named), "{named}: {err}");
            assert!(!err.contains("cannot reach"), "{err}");
            assert!(!err.contains("cannot connect"), "{err}");
        }
    }
    env.drop_schema().await;
}
