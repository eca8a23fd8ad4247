//! Test-only helpers shared by the workspace's tests, so that each policy exists once:
//!
//! * **How tests find services.** PostgreSQL from `DATABASE_URL` (default
//!   `postgres://postgres@127.0.0.1:5432/postgres`), MySQL or MariaDB from `MYSQL_URL` (default
//!   `mysql://root@127.0.0.1:3306/test`), the broker from `KAFKA_BROKERS`, the tansu binary from
//!   `TANSU_BIN` or `~/.cargo/bin/tansu`. `scripts/test` provides them all.
//! * **The skip switch.** A test whose service is missing fails with what to do, unless
//!   `OUTBOX_SKIP_SERVICE_TESTS=1`; then it prints `SKIPPED` on stderr (past the harness's
//!   output capture, so a skip is never silent) and returns.
//! * **Isolation.** [`unique`] names (schemas, topics, groups) per test and run.
//! * **A broker of a test's own.** [`Tansu`] starts tansu on a free port with memory storage,
//!   for tests that stop and restart the broker; it is killed when dropped.
//!
//! No dependencies beyond std: any crate's tests can use it.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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
