//! A TCP proxy of the test's own between a client and the shared NATS server, which can
//! partition the network without touching the server (other tests use it at the same time).
//!
//! [`Proxy::partition`] black-holes every connection relayed so far: bytes either way are read
//! and dropped, so the client's writes (an ack, a request) vanish as over a broken link, and
//! its connection looks alive (no error, no reconnect: nothing it sends meanwhile is resent
//! later). New connections are refused. [`Proxy::heal`] closes the black-holed connections
//! (the client sees them drop and reconnects) and relays new ones again.
//!
//! Plain threads and blocking sockets: nothing here needs the test's runtime.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct Shared {
    /// Whether the network is up (relaying; new connections accepted).
    up: AtomicBool,
    /// Bumped by every heal: a connection of an older generation relays nothing any more.
    generation: AtomicU64,
    /// Both sockets of every connection relayed so far.
    sockets: Mutex<Vec<TcpStream>>,
}

impl Shared {
    fn relays(&self, generation: u64) -> bool {
        self.up.load(Ordering::SeqCst) && self.generation.load(Ordering::SeqCst) == generation
    }
}

/// A proxy on a free local port in front of `upstream` (`host:port`).
pub struct Proxy {
    port: u16,
    shared: Arc<Shared>,
}

impl Proxy {
    /// Starts relaying to `upstream`.
    pub fn start(upstream: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let shared = Arc::new(Shared::default());
        shared.up.store(true, Ordering::SeqCst);
        let upstream = upstream.to_owned();
        {
            let shared = shared.clone();
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    let Ok(client) = client else { break };
                    if !shared.up.load(Ordering::SeqCst) {
                        let _ = client.shutdown(Shutdown::Both);
                        continue;
                    }
                    let (shared, upstream) = (shared.clone(), upstream.clone());
                    std::thread::spawn(move || serve(client, &upstream, &shared));
                }
            });
        }
        Proxy { port, shared }
    }

    /// A NATS URL through the proxy.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Black-holes every connection and refuses new ones (see the module docs).
    pub fn partition(&self) {
        self.shared.up.store(false, Ordering::SeqCst);
    }

    /// Closes the black-holed connections and relays again.
    pub fn heal(&self) {
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        for s in self
            .shared
            .sockets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain(..)
        {
            let _ = s.shutdown(Shutdown::Both);
        }
        self.shared.up.store(true, Ordering::SeqCst);
    }
}

/// Relays one client connection to the server (both ways) while its generation relays.
fn serve(client: TcpStream, upstream: &str, shared: &Arc<Shared>) {
    let generation = shared.generation.load(Ordering::SeqCst);
    let Ok(server) = TcpStream::connect(upstream) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (Ok(c2), Ok(s2), Ok(c3), Ok(s3)) = (
        client.try_clone(),
        server.try_clone(),
        client.try_clone(),
        server.try_clone(),
    ) else {
        return;
    };
    shared
        .sockets
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .extend([c3, s3]);
    {
        let shared = shared.clone();
        std::thread::spawn(move || pump(s2, c2, &shared, generation));
    }
    pump(client, server, shared, generation);
}

/// Copies `from` to `to` while the connection's generation relays, dropping the bytes
/// otherwise; closes both at the end of either.
fn pump(mut from: TcpStream, mut to: TcpStream, shared: &Shared, generation: u64) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if shared.relays(generation) && to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
