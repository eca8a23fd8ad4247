//! A proxy of the test's own between a store's pool and the server, which can hold back one
//! statement of the store before the server sees it: a claim stopped between two of its
//! statements (say, after its plain candidate read and before its locking read by primary key)
//! while the test commits changes on other connections. No statement of the store has a lock
//! wait there, so a lock held elsewhere cannot stop it at that point.
//!
//! The proxy reads the client's packets of the MySQL protocol in the clear (its pool connects
//! with `ssl-mode=DISABLED`): a command that starts a sequence (`COM_QUERY`,
//! `COM_STMT_PREPARE`) carries its statement's text; `COM_STMT_EXECUTE` names a statement
//! prepared earlier on the connection, by the id the server's answer to the prepare gave.
//! Plain threads and blocking sockets: nothing here needs the test's runtime.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions, MySqlSslMode};
use sqlx::MySqlPool;
use tokio::sync::oneshot;

/// The statement to hold back and the two signals of the hold.
struct Armed {
    parts: Vec<String>,
    reached: oneshot::Sender<()>,
    resume: mpsc::Receiver<()>,
}

type Gate = Arc<Mutex<Option<Armed>>>;

/// Per connection: the text of a prepare waiting for the server's answer, and the statements
/// prepared so far by id.
type Statements = Arc<Mutex<(Option<String>, HashMap<u32, String>)>>;

/// A proxy in front of the server at `MYSQL_URL` and a pool of connections through it.
pub struct Proxy {
    gate: Gate,
    /// Both sockets of every connection relayed so far.
    sockets: Arc<Mutex<Vec<TcpStream>>>,
    pub pool: MySqlPool,
}

/// A statement held back (or about to be): [`Held::reached`] waits for it, [`Held::resume`]
/// (or dropping this) lets it through.
pub struct Held {
    reached: Option<oneshot::Receiver<()>>,
    resume: mpsc::Sender<()>,
}

impl Held {
    /// Waits until the statement is held back in the proxy (at most 10 s).
    pub async fn reached(&mut self) {
        let r = self.reached.take().expect("reached() once");
        tokio::time::timeout(Duration::from_secs(10), r)
            .await
            .expect("the statement to hold never came")
            .expect("the proxy went away");
    }

    /// Lets the statement through to the server.
    pub fn resume(self) {
        let _ = self.resume.send(());
    }
}

impl Proxy {
    /// Starts the proxy on a free local port and opens a pool of at most `max` connections
    /// through it.
    pub async fn start(max: u32) -> Proxy {
        let url = outbox_test_support::mysql_url("outbox-mysql tests").expect("MYSQL_URL");
        let opts: MySqlConnectOptions = url.parse().expect("MYSQL_URL parses");
        let upstream = format!("{}:{}", opts.get_host(), opts.get_port());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let gate: Gate = Arc::new(Mutex::new(None));
        let sockets: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        {
            let (gate, sockets) = (gate.clone(), sockets.clone());
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    let Ok(client) = client else { break };
                    let (gate, sockets, upstream) =
                        (gate.clone(), sockets.clone(), upstream.clone());
                    std::thread::spawn(move || serve(client, &upstream, &gate, &sockets));
                }
            });
        }
        let pool = MySqlPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(20))
            .connect_with(
                opts.host("127.0.0.1")
                    .port(port)
                    .ssl_mode(MySqlSslMode::Disabled),
            )
            .await
            .expect("a pool through the proxy");
        Proxy {
            gate,
            sockets,
            pool,
        }
    }

    /// Cuts every connection relayed so far, as a network failure would: the server sees its
    /// sessions' sockets close (and rolls back their transactions), the pool its connections.
    pub fn cut_all(&self) {
        for s in self.sockets.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Arms the proxy: the next statement whose text contains every one of `parts` is held
    /// back before the server sees it, until [`Held::resume`].
    pub fn hold_next(&self, parts: &[&str]) -> Held {
        let (reached_tx, reached_rx) = oneshot::channel();
        let (resume_tx, resume_rx) = mpsc::channel();
        *self.gate.lock().unwrap() = Some(Armed {
            parts: parts.iter().map(|p| p.to_string()).collect(),
            reached: reached_tx,
            resume: resume_rx,
        });
        Held {
            reached: Some(reached_rx),
            resume: resume_tx,
        }
    }
}

/// One packet: its 4-byte header (length, sequence id) and its payload.
fn packet(from: &mut TcpStream) -> Option<([u8; 4], Vec<u8>)> {
    let mut header = [0u8; 4];
    from.read_exact(&mut header).ok()?;
    let len =
        usize::from(header[0]) | (usize::from(header[1]) << 8) | (usize::from(header[2]) << 16);
    let mut payload = vec![0u8; len];
    from.read_exact(&mut payload).ok()?;
    Some((header, payload))
}

/// Holds the calling connection's statement `text` back if the proxy is armed for it.
fn hold_if_armed(gate: &Gate, text: &str) {
    let armed = {
        let mut g = gate.lock().unwrap();
        if g.as_ref()
            .is_some_and(|a| a.parts.iter().all(|p| text.contains(p.as_str())))
        {
            g.take()
        } else {
            None
        }
    };
    if let Some(a) = armed {
        let _ = a.reached.send(());
        let _ = a.resume.recv();
    }
}

/// Relays one client connection to the server, holding back the armed statement.
fn serve(mut client: TcpStream, upstream: &str, gate: &Gate, sockets: &Mutex<Vec<TcpStream>>) {
    let Ok(mut server) = TcpStream::connect(upstream) else {
        return;
    };
    if let (Ok(c), Ok(s)) = (client.try_clone(), server.try_clone()) {
        sockets.lock().unwrap().extend([c, s]);
    }
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let statements: Statements = Arc::default();
    let (Ok(mut from_server), Ok(mut to_client)) = (server.try_clone(), client.try_clone()) else {
        return;
    };
    {
        let statements = statements.clone();
        std::thread::spawn(move || {
            while let Some((header, payload)) = packet(&mut from_server) {
                {
                    let mut s = statements.lock().unwrap();
                    if header[3] == 1 {
                        if let Some(text) = s.0.take() {
                            // COM_STMT_PREPARE_OK: 0x00, then the statement id.
                            if payload.len() >= 5 && payload[0] == 0 {
                                let id = u32::from_le_bytes([
                                    payload[1], payload[2], payload[3], payload[4],
                                ]);
                                s.1.insert(id, text);
                            }
                        }
                    }
                }
                if to_client.write_all(&header).is_err() || to_client.write_all(&payload).is_err() {
                    break;
                }
            }
            let _ = to_client.shutdown(Shutdown::Both);
            let _ = from_server.shutdown(Shutdown::Both);
        });
    }
    while let Some((header, payload)) = packet(&mut client) {
        if header[3] == 0 {
            let text = match payload.first() {
                Some(0x03) => Some(String::from_utf8_lossy(&payload[1..]).into_owned()),
                Some(0x16) => {
                    let text = String::from_utf8_lossy(&payload[1..]).into_owned();
                    statements.lock().unwrap().0 = Some(text.clone());
                    Some(text)
                }
                Some(0x17) if payload.len() >= 5 => {
                    let id = u32::from_le_bytes([payload[1], payload[2], payload[3], payload[4]]);
                    statements.lock().unwrap().1.get(&id).cloned()
                }
                _ => None,
            };
            if let Some(text) = text {
                hold_if_armed(gate, &text);
            }
        }
        if server.write_all(&header).is_err() || server.write_all(&payload).is_err() {
            break;
        }
    }
    let _ = server.shutdown(Shutdown::Both);
    let _ = client.shutdown(Shutdown::Both);
}
