//! Test-only helpers shared by the workspace's tests, so that each policy exists once:
//!
//! * **How tests find services.** PostgreSQL from `DATABASE_URL` (default
//!   `postgres://postgres@127.0.0.1:5432/postgres`), MySQL or MariaDB from `MYSQL_URL` (default
//!   `mysql://root@127.0.0.1:3306/test`), the broker from `KAFKA_BROKERS`, the tansu binary from
//!   `TANSU_BIN` or `~/.cargo/bin/tansu`. `scripts/test` provides them all.
//!   NATS with JetStream from `NATS_URL` (default `nats://127.0.0.1:4222`) and RabbitMQ from
//!   `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`), each checked for a listener
//!   before a test uses it ([`nats_url`], [`amqp_url`]).
//! * **The skip switch.** A test whose service is missing fails with what to do, unless
//!   `OUTBOX_SKIP_SERVICE_TESTS=1`; then it prints `SKIPPED` on stderr (past the harness's
//!   output capture, so a skip is never silent) and returns.
//! * **Isolation.** [`unique`] names (schemas, topics, groups) per test and run.
//! * **A broker of a test's own.** [`Tansu`] starts tansu on a free port with memory storage,
//!   for tests that stop and restart the broker; it is killed when dropped. [`NatsServer`] and
//!   [`RabbitNode`] do the same for NATS (JetStream, file storage in a directory of its own) and
//!   RabbitMQ (a second node with its own name, ports and data directory): outage tests stop
//!   and restart those, never the shared servers other tests use at the same time.
//! * **A connection pooler of a test's own.** [`PgBouncer`] starts PgBouncer (`PGBOUNCER_BIN`,
//!   else `pgbouncer` on the `PATH` or in `/usr/sbin`; `scripts/services.sh` installs it) on a
//!   free port in front of `DATABASE_URL`, in the pool mode the test asks for.
//!
//! * **The inbox engine on PostgreSQL** (feature `postgres-inbox`): [`pg_inbox`], a schema
//!   of the test's own with an effects table, handlers that record or refuse events, and the
//!   parking checks the transports' tests share.
//! * **The relay through an outage** (feature `relay-outage`): [`relay_outage`], the real
//!   relay draining an in-memory outbox through a stop and restart of a transport's own
//!   server, and the check of what the server stored, shared by the transports' relay tests.
//!
//! No dependencies beyond std without those features: any crate's tests can use it.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[cfg(feature = "postgres-inbox")]
pub mod pg_inbox;
#[cfg(feature = "relay-outage")]
pub mod relay_outage;

/// The skip switch.
pub const SKIP_VAR: &str = "OUTBOX_SKIP_SERVICE_TESTS";
/// The default PostgreSQL URL of tests.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The default MySQL / MariaDB URL of tests.
pub const DEFAULT_MYSQL_URL: &str = "mysql://root@127.0.0.1:3306/test";

/// Whether service tests may be skipped (`OUTBOX_SKIP_SERVICE_TESTS=1`).
pub fn skip_allowed() -> bool {
    std::env::var(SKIP_VAR).as_deref() == Ok("1")
}

/// Prints a skip notice past the harness's output capture.
pub fn report_skip(test: &str, why: &str) {
    let _ = writeln!(
        std::io::stderr().lock(),
        "SKIPPED {test}: {why} and {SKIP_VAR}=1"
    );
}

/// The value of a service variable. `None` (after a printed skip) only with the skip switch;
/// otherwise a panic saying what to do.
pub fn required_var(test: &str, var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v),
        _ if skip_allowed() => {
            report_skip(test, &format!("{var} is not set"));
            None
        }
        _ => panic!(
            "{test}: {var} is not set. Run `scripts/test` (it starts the services and exports \
             DATABASE_URL, MYSQL_URL, KAFKA_BROKERS and TANSU_BIN), set {var} yourself, or set {SKIP_VAR}=1 \
             to skip the service tests on purpose"
        ),
    }
}

/// PostgreSQL URL: `DATABASE_URL`, else the local default. Checks that something listens
/// there; otherwise skip (with the switch) or panic.
pub fn database_url(test: &str) -> Option<String> {
    let url = std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned());
    let addr = host_port(&url).unwrap_or(("127.0.0.1".into(), 5432));
    if TcpStream::connect_timeout(
        &format!("{}:{}", addr.0, addr.1)
            .parse()
            .unwrap_or_else(|_| "127.0.0.1:5432".parse().expect("address")),
        Duration::from_secs(3),
    )
    .is_ok()
    {
        return Some(url);
    }
    if skip_allowed() {
        report_skip(
            test,
            &format!("PostgreSQL at {}:{} is unreachable", addr.0, addr.1),
        );
        return None;
    }
    panic!(
        "{test}: PostgreSQL is required but {}:{} is unreachable. Start it (scripts/test does) \
         or set DATABASE_URL; set {SKIP_VAR}=1 to skip on purpose",
        addr.0, addr.1
    )
}

/// MySQL / MariaDB URL: `MYSQL_URL`, else the local default. Checks that something listens
/// there; otherwise skip (with the switch) or panic, as [`database_url`] does for PostgreSQL.
pub fn mysql_url(test: &str) -> Option<String> {
    let url = std::env::var("MYSQL_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_MYSQL_URL.to_owned());
    let (host, port) = host_port_or(&url, 3306).unwrap_or(("127.0.0.1".into(), 3306));
    if reachable(&host, port) {
        return Some(url);
    }
    if skip_allowed() {
        report_skip(
            test,
            &format!("MySQL/MariaDB at {host}:{port} is unreachable"),
        );
        return None;
    }
    panic!(
        "{test}: MySQL or MariaDB is required but {host}:{port} is unreachable. Start it \
         (scripts/test does) or set MYSQL_URL; set {SKIP_VAR}=1 to skip on purpose"
    )
}

fn reachable(host: &str, port: u16) -> bool {
    use std::net::ToSocketAddrs;
    (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|addr| TcpStream::connect_timeout(&addr, Duration::from_secs(3)).is_ok())
}

fn host_port(url: &str) -> Option<(String, u16)> {
    host_port_or(url, 5432)
}

fn host_port_or(url: &str, default_port: u16) -> Option<(String, u16)> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split(['/', '?']).next()?;
    let hostport = authority.rsplit('@').next()?;
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) => (h.to_owned(), p.parse().ok()?),
        None => (hostport.to_owned(), default_port),
    };
    let host = if host.is_empty() || host == "localhost" {
        "127.0.0.1".to_owned()
    } else {
        host
    };
    Some((host, port))
}

/// The default NATS URL of tests (the local server with JetStream).
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";
/// The default AMQP URL of tests (the local RabbitMQ, guest/guest, default vhost).
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// `var` if set, else `default`; `Some(url)` when something listens at its host and port
/// (`default_port` when the URL names none). Otherwise skip (with the switch) or panic naming
/// the service, the address and what to do.
fn reachable_service(
    test: &str,
    service: &str,
    var: &str,
    default: &str,
    default_port: u16,
) -> Option<String> {
    let url = std::env::var(var)
        .ok()
        .filter(|u| !u.trim().is_empty())
        .unwrap_or_else(|| default.to_owned());
    let (host, port) =
        host_port_or(&url, default_port).unwrap_or(("127.0.0.1".into(), default_port));
    let reachable = std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), port))
        .ok()
        .and_then(|mut addrs| addrs.next())
        .is_some_and(|addr| TcpStream::connect_timeout(&addr, Duration::from_secs(3)).is_ok());
    if reachable {
        return Some(url);
    }
    if skip_allowed() {
        report_skip(test, &format!("{service} at {host}:{port} is unreachable"));
        return None;
    }
    panic!(
        "{test}: {service} is required but nothing answers at {host}:{port}. Start it \
         (`source scripts/services.sh && ensure_{}` does) or set {var}; set {SKIP_VAR}=1 to skip \
         on purpose",
        service
            .split_whitespace()
            .next()
            .unwrap_or(service)
            .to_lowercase()
    )
}

/// The NATS URL (JetStream enabled): `NATS_URL`, else [`DEFAULT_NATS_URL`], checked for a
/// listener; skip (with the switch) or panic.
pub fn nats_url(test: &str) -> Option<String> {
    reachable_service(test, "NATS", "NATS_URL", DEFAULT_NATS_URL, 4222)
}

/// The AMQP URL of a RabbitMQ: `AMQP_URL`, else [`DEFAULT_AMQP_URL`], checked for a listener;
/// skip (with the switch) or panic.
pub fn amqp_url(test: &str) -> Option<String> {
    reachable_service(test, "RabbitMQ", "AMQP_URL", DEFAULT_AMQP_URL, 5672)
}

/// Kafka bootstrap servers from `KAFKA_BROKERS` (skip or panic as [`required_var`]).
pub fn brokers(test: &str) -> Option<String> {
    required_var(test, "KAFKA_BROKERS")
}

/// The tansu binary: `TANSU_BIN`, else `~/.cargo/bin/tansu` if it exists (skip or panic).
pub fn tansu_bin(test: &str) -> Option<PathBuf> {
    if let Ok(b) = std::env::var("TANSU_BIN") {
        if !b.trim().is_empty() {
            return Some(PathBuf::from(b));
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        let installed = PathBuf::from(home).join(".cargo/bin/tansu");
        if installed.is_file() {
            return Some(installed);
        }
    }
    if skip_allowed() {
        report_skip(
            test,
            "TANSU_BIN is not set and ~/.cargo/bin/tansu does not exist",
        );
        return None;
    }
    panic!(
        "{test}: TANSU_BIN is not set and ~/.cargo/bin/tansu does not exist; run `scripts/test` \
         (it installs tansu) or set TANSU_BIN, or set {SKIP_VAR}=1 to skip on purpose"
    )
}

/// A name no other test, process or earlier run uses: `<prefix>_<secs>_<pid>_<n>` with only
/// lowercase letters, digits and `_` (valid as a PostgreSQL identifier, a topic or a group).
/// The seconds let stale leftovers be recognised by age.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!(
        "{prefix}_{secs}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A free TCP port on 127.0.0.1 (free when asked; bind it soon).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Waits until `addr` accepts connections, up to `timeout`.
pub fn wait_port(addr: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if TcpStream::connect(addr).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// A tansu broker of a test's own (memory storage, free port), killed on drop.
#[derive(Debug)]
pub struct Tansu {
    bin: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl Tansu {
    /// Starts tansu and waits for its port.
    pub fn start(bin: PathBuf) -> Self {
        let mut t = Self {
            bin,
            port: free_port(),
            child: None,
        };
        t.restart();
        t
    }

    /// `127.0.0.1:<port>`.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Stops the broker (SIGKILL); its memory storage is gone.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port (topics must be created again).
    pub fn restart(&mut self) {
        self.stop();
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let child = Command::new(&self.bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start tansu at {}: {e}", self.bin.display()));
        self.child = Some(child);
        assert!(
            wait_port(&self.brokers(), Duration::from_secs(10)),
            "tansu did not open {}",
            self.brokers()
        );
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The PgBouncer binary: `PGBOUNCER_BIN`, else `pgbouncer` on the `PATH` or in `/usr/sbin`
/// (skip or panic as [`required_var`]).
pub fn pgbouncer_bin(test: &str) -> Option<PathBuf> {
    if let Ok(b) = std::env::var("PGBOUNCER_BIN") {
        if !b.trim().is_empty() {
            return Some(PathBuf::from(b));
        }
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|d| d.join("pgbouncer"))
        .find(|p| p.is_file());
    if found.is_some() {
        return found;
    }
    if skip_allowed() {
        report_skip(
            test,
            "PgBouncer is not installed and PGBOUNCER_BIN is not set",
        );
        return None;
    }
    panic!(
        "{test}: PgBouncer is not installed and PGBOUNCER_BIN is not set; run `scripts/test` (it \
         installs it: `apt-get install pgbouncer`) or set PGBOUNCER_BIN, or set {SKIP_VAR}=1 to \
         skip on purpose"
    )
}

/// User, password, host, port and database of a PostgreSQL URL (defaults: `postgres`, none,
/// `127.0.0.1`, 5432, `postgres`).
fn url_parts(url: &str) -> (String, Option<String>, String, u16, String) {
    let (host, port) = host_port(url).unwrap_or(("127.0.0.1".into(), 5432));
    let rest = url.split_once("://").map_or(url, |r| r.1);
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (user, password) = match authority.rsplit_once('@') {
        Some((info, _)) => match info.split_once(':') {
            Some((u, p)) => (u.to_owned(), Some(p.to_owned())),
            None => (info.to_owned(), None),
        },
        None => ("postgres".to_owned(), None),
    };
    let db = path.split('?').next().unwrap_or_default();
    let db = if db.is_empty() { "postgres" } else { db };
    (user, password, host, port, db.to_owned())
}

/// A PgBouncer of a test's own in front of the server at a PostgreSQL URL (free port, no
/// authentication towards the client, the URL's user and password towards the server), killed
/// on drop. When the test runs as root it switches to `nobody` (PgBouncer refuses root).
#[derive(Debug)]
pub struct PgBouncer {
    port: u16,
    user: String,
    db: String,
    dir: PathBuf,
    child: Child,
}

impl PgBouncer {
    /// Starts `bin` in `pool_mode` (`session` or `transaction`) with at most `pool_size`
    /// server connections, in front of `database_url`, and waits for its port.
    pub fn start(
        bin: &std::path::Path,
        database_url: &str,
        pool_mode: &str,
        pool_size: u32,
    ) -> Self {
        let (user, password, host, server_port, db) = url_parts(database_url);
        let port = free_port();
        let dir = std::env::temp_dir().join(unique("pgbouncer"));
        std::fs::create_dir_all(&dir).expect("pgbouncer directory");
        let password = password
            .map(|p| format!(" password={p}"))
            .unwrap_or_default();
        let ini = format!(
            "[databases]\n* = host={host} port={server_port} user={user}{password}\n\
             [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
             auth_type = any\npool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\n\
             max_client_conn = 200\nignore_startup_parameters = extra_float_digits,options\n"
        );
        let config = dir.join("pgbouncer.ini");
        std::fs::write(&config, ini).expect("pgbouncer.ini");
        let log = std::fs::File::create(dir.join("pgbouncer.log")).expect("pgbouncer.log");
        let root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
        let mut cmd = Command::new(bin);
        if root {
            cmd.args(["-u", "nobody"]);
        }
        let child = cmd
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start PgBouncer at {}: {e}", bin.display()));
        let bouncer = Self {
            port,
            user,
            db,
            dir,
            child,
        };
        assert!(
            wait_port(&format!("127.0.0.1:{port}"), Duration::from_secs(10)),
            "PgBouncer did not open port {port}: {}",
            bouncer.log()
        );
        bouncer
    }

    /// The URL clients connect to (the server's user and database, through the pooler).
    pub fn url(&self) -> String {
        format!(
            "postgres://{}@127.0.0.1:{}/{}",
            self.user, self.port, self.db
        )
    }

    /// What PgBouncer logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The nats-server binary: `NATS_SERVER_BIN`, else `nats-server` on the `PATH`, else
/// `/usr/sbin/nats-server` (Debian's package). Skip (with the switch) or panic.
pub fn nats_server_bin(test: &str) -> Option<PathBuf> {
    if let Ok(b) = std::env::var("NATS_SERVER_BIN") {
        if !b.trim().is_empty() {
            return Some(PathBuf::from(b));
        }
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("nats-server"))
            .find(|p| p.is_file())
    });
    if let Some(p) = on_path.or_else(|| {
        let debian = PathBuf::from("/usr/sbin/nats-server");
        debian.is_file().then_some(debian)
    }) {
        return Some(p);
    }
    if skip_allowed() {
        report_skip(
            test,
            "no nats-server binary (NATS_SERVER_BIN, PATH, /usr/sbin)",
        );
        return None;
    }
    panic!(
        "{test}: no nats-server binary: install it (`apt-get install nats-server`) or set \
         NATS_SERVER_BIN; set {SKIP_VAR}=1 to skip on purpose"
    )
}

/// A nats-server of a test's own: JetStream with file storage in a directory of its own, on a
/// free port; killed (SIGKILL) on drop, its directory removed. Streams survive
/// [`restart`](Self::restart) (file storage), as on a production server.
#[derive(Debug)]
pub struct NatsServer {
    bin: PathBuf,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts the server and waits for its port.
    pub fn start(bin: PathBuf) -> Self {
        let dir = std::env::temp_dir().join(unique("outbox_nats"));
        std::fs::create_dir_all(&dir).expect("nats storage directory");
        let mut s = Self {
            bin,
            port: free_port(),
            dir,
            child: None,
        };
        s.restart();
        s
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The directory of its file storage (`-sd`): a test that stops the server may change
    /// what is there before [`restart`](Self::restart), as a crash that lost writes would.
    pub fn storage_dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Kills the server (SIGKILL): what it stored stays in its directory.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port and directory.
    pub fn restart(&mut self) {
        self.stop();
        let port = self.port.to_string();
        let child = Command::new(&self.bin)
            .args(["-a", "127.0.0.1", "-p", &port, "-js", "-sd"])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        self.child = Some(child);
        assert!(
            wait_port(&format!("127.0.0.1:{}", self.port), Duration::from_secs(10)),
            "nats-server did not open port {}",
            self.port
        );
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A RabbitMQ node of a test's own, beside the shared one: its own node name, AMQP and
/// distribution ports, data and log directories, and configuration file (so the system's
/// listener setting does not apply), run by the `rabbitmq-server` script in the foreground.
/// Stopping it kills the Erlang VM (SIGKILL, by its pid file); durable exchanges, queues and
/// persistent messages survive [`restart`](Self::restart). Killed on drop, its directory
/// removed. A node takes a few seconds to start.
///
/// Plugins named in `plugins` (e.g. `rabbitmq_consistent_hash_exchange`) are enabled on it.
#[derive(Debug)]
pub struct RabbitNode {
    name: String,
    port: u16,
    dist_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl RabbitNode {
    /// Starts a node with `plugins` enabled (skip or panic when `rabbitmq-server` is missing)
    /// and waits until it accepts AMQP connections.
    pub fn start(test: &str, plugins: &[&str]) -> Option<Self> {
        if !PathBuf::from("/usr/sbin/rabbitmq-server").is_file() {
            if skip_allowed() {
                report_skip(test, "rabbitmq-server is not installed");
                return None;
            }
            panic!(
                "{test}: /usr/sbin/rabbitmq-server is missing: install it (`apt-get install \
                 rabbitmq-server`); set {SKIP_VAR}=1 to skip on purpose"
            );
        }
        let name = unique("outboxrmq");
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&dir).expect("rabbitmq directory");
        let port = free_port();
        let mut dist_port = free_port();
        while dist_port == port {
            dist_port = free_port();
        }
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("listeners.tcp.local = 127.0.0.1:{port}\nloopback_users = none\n"),
        )
        .expect("rabbitmq.conf");
        std::fs::write(
            dir.join("enabled_plugins"),
            format!("[{}].\n", plugins.join(",")),
        )
        .expect("enabled_plugins");
        // The script runs the node as the `rabbitmq` user, who must own the directory.
        let _ = Command::new("chown")
            .args(["-R", "rabbitmq:rabbitmq"])
            .arg(&dir)
            .status();
        let mut node = Self {
            name,
            port,
            dist_port,
            dir,
            child: None,
        };
        node.restart();
        Some(node)
    }

    /// `amqp://guest:guest@127.0.0.1:<port>/%2f`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// Kills the node's Erlang VM (SIGKILL) and the script around it.
    pub fn stop(&mut self) {
        self.signal("-KILL");
    }

    /// Stops the node as an operator or an orchestrator would (SIGTERM: the Erlang VM shuts
    /// down in order, closing client connections with `CONNECTION_FORCED`), waiting up to 30 s.
    ///
    /// Seen with RabbitMQ 3.10 here: after a SIGKILL shortly after a quorum queue was declared,
    /// the restarted node no longer knows the queue's Raft member (its registration was not
    /// yet on disk), and the queue has no leader ("leader not known") for good. Outage tests
    /// that need the queue afterwards stop the node this way.
    pub fn stop_gracefully(&mut self) {
        self.signal("-TERM");
    }

    fn signal(&mut self, signal: &str) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
            let pid = pid.trim();
            if !pid.is_empty() {
                let _ = Command::new("kill").args([signal, pid]).status();
                // The VM is gone when its pid no longer answers signal 0.
                let deadline = Instant::now() + Duration::from_secs(30);
                while Command::new("kill")
                    .args(["-0", pid])
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
                    && Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        let _ = std::fs::remove_file(self.dir.join("pid"));
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // The node's port is free once the VM is gone.
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(format!("127.0.0.1:{}", self.port)).is_ok()
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts the node again (same name, ports and data), waiting up to 60 s for AMQP.
    pub fn restart(&mut self) {
        self.stop();
        let d = |sub: &str| self.dir.join(sub);
        let child = Command::new("/usr/sbin/rabbitmq-server")
            .env("RABBITMQ_NODENAME", format!("{}@localhost", self.name))
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d("mnesia"))
            .env("RABBITMQ_LOG_BASE", d("log"))
            .env("RABBITMQ_CONFIG_FILE", d("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", d("pid"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start rabbitmq-server");
        self.child = Some(child);
        assert!(
            wait_port(&format!("127.0.0.1:{}", self.port), Duration::from_secs(60)),
            "the RabbitMQ node {} did not open port {} (log: {})",
            self.name,
            self.port,
            d("log").display()
        );
    }
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_names_are_identifiers_and_differ() {
        let a = unique("t");
        let b = unique("t");
        assert_ne!(a, b);
        assert!(a
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_'));
    }

    #[test]
    fn pooler_settings_come_from_the_url() {
        assert_eq!(
            url_parts("postgres://app:pw@db.example:6543/shop?sslmode=disable"),
            (
                "app".into(),
                Some("pw".into()),
                "db.example".into(),
                6543,
                "shop".into()
            )
        );
        assert_eq!(
            url_parts("postgres://127.0.0.1"),
            (
                "postgres".into(),
                None,
                "127.0.0.1".into(),
                5432,
                "postgres".into()
            )
        );
        assert_eq!(
            host_port_or("amqp://guest:guest@127.0.0.1/%2f", 5672),
            Some(("127.0.0.1".into(), 5672))
        );
        assert_eq!(
            host_port_or("nats://127.0.0.1:4333", 4222),
            Some(("127.0.0.1".into(), 4333))
        );
    }

    #[test]
    fn host_and_port_come_from_the_url() {
        assert_eq!(
            host_port("postgres://u:p@db.example:6543/x"),
            Some(("db.example".into(), 6543))
        );
        assert_eq!(
            host_port("postgres://localhost/x"),
            Some(("127.0.0.1".into(), 5432))
        );
        assert_eq!(
            host_port_or("mysql://root@127.0.0.1/test", 3306),
            Some(("127.0.0.1".into(), 3306))
        );
        assert_eq!(
            host_port_or("mysql://u:p@db:3307/x?ssl-mode=disabled", 3306),
            Some(("db".into(), 3307))
        );
    }
}
