//! A TCP proxy between a test's pool and a database server that loses one COMMIT reply.
//!
//! It forwards every byte both ways until it is [armed](LostReplyProxy::arm). The next
//! COMMIT a client sends (PostgreSQL: a simple `Query` or an extended-protocol `Parse` of
//! `COMMIT`; MySQL/MariaDB: a `COM_QUERY` of `COMMIT`) still reaches the server, which
//! commits and answers; the proxy swallows that answer and cuts the connection, as a
//! network failure between the server's commit and the client would. The client sees its
//! connection die in the middle of COMMIT and cannot tell whether it committed.
//!
//! A statement outside a transaction commits on its own, without a COMMIT message:
//! [`arm_next_execute`](LostReplyProxy::arm_next_execute) loses the reply of the next
//! prepared statement executed (PostgreSQL: `Execute`; MySQL: `COM_STMT_EXECUTE`), which is
//! how sqlx runs every statement with bind values. A new connection's session setup, pings,
//! prepares and transaction control (`BEGIN`, `COMMIT`: text queries) do not count.
//!
//! The proxy records each reply it dropped. A test calls
//! [`expect_reply_dropped`](LostReplyProxy::expect_reply_dropped) after the operation
//! under test, and dropping an armed proxy that never dropped a reply panics, so a test
//! whose COMMIT took another path fails loudly instead of passing without the fault.
//!
//! # Partitions
//!
//! The same proxy also plays a network partition, as a NAT or load balancer that silently
//! drops a flow: [`partition`](LostReplyProxy::partition) stops forwarding in both
//! directions while every socket stays open (no reset, no close: each side just hears
//! nothing, and new connections are accepted but never reach the server);
//! [`partition_at_commit`](LostReplyProxy::partition_at_commit) lets the next COMMIT reach
//! the server and starts the partition right behind it, so its reply is lost in the black
//! hole rather than with a closed connection;
//! [`partition_before_commit`](LostReplyProxy::partition_before_commit) swallows the COMMIT
//! itself, leaving the transaction open on the server with its locks. [`heal`](LostReplyProxy::heal) ends it the
//! way such a device does once it has forgotten the flows: every connection that lived
//! through the partition is cut, later ones are forwarded again.
//!
//! The proxy also counts the error replies the server sends (PostgreSQL's
//! `ErrorResponse`, MySQL's `ERR` packet; see [`error_replies`](LostReplyProxy::error_replies)):
//! each is a failed statement the server may write into its log. And it logs the SQL of
//! every statement the clients run ([`statements`](LostReplyProxy::statements)): a text
//! query as sent, a prepared statement's text at each execution (the text of its prepare,
//! found by the name or id the execution gives).
//!
//! SQLite is embedded: there is no network between the client and the database, so the
//! proxy (and every lost-reply test) exists only for the server backends.

use crate::cut_proxy::{bind_ephemeral, url_parts};
use crate::{
    Backend, TestDb, connect_pool, connect_pool_with, create_accounts, scalar_i64, with_migrated_db,
};
use futures_util::FutureExt;
use sea_orm::{ConnectOptions, DatabaseConnection};
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The wire protocol the proxy reads to find the COMMIT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocol {
    Postgres,
    MySql,
}

/// Which message's reply an armed proxy loses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Trigger {
    Commit,
    NextExecute,
    /// A COMMIT, whose reply the partition it starts swallows.
    PartitionAtCommit,
    /// A prepared statement's execution, whose reply the partition it starts swallows.
    PartitionAtExecute,
    /// A COMMIT, which the partition it starts swallows before the server sees it.
    PartitionBeforeCommit,
}

/// One statement a client ran through the proxy, as [`LostReplyProxy::statements`] logs
/// it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SentStatement {
    /// A text query (PostgreSQL's simple `Query`, MySQL's `COM_QUERY`), as sent: one
    /// round trip, however many statements its text holds.
    Text(String),
    /// The execution of a prepared statement (PostgreSQL's `Bind`, MySQL's
    /// `COM_STMT_EXECUTE`): the text it was prepared from.
    Prepared(String),
}

impl SentStatement {
    /// The statement's SQL.
    pub fn sql(&self) -> &str {
        match self {
            Self::Text(sql) | Self::Prepared(sql) => sql,
        }
    }
}

/// What one connection's client prepared, for the log to name each execution: shared by
/// the two directions, since MySQL's server picks the statement id in its reply.
#[derive(Debug, Default)]
struct Prepared {
    /// PostgreSQL: statement name -> text.
    by_name: HashMap<String, String>,
    /// MySQL: the text of the `COM_STMT_PREPARE` waiting for its reply.
    awaiting_id: Option<String>,
    /// MySQL: statement id -> text.
    by_id: HashMap<u32, String>,
}

/// What a chunk of client bytes completed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Seen {
    commit: bool,
    execute: bool,
    /// Round trips that carry SQL: MySQL's `COM_QUERY` and `COM_STMT_EXECUTE`, PostgreSQL's
    /// simple `Query` and the `Sync` after an extended-protocol `Execute` (a prepare or a
    /// pool's ping is not one).
    round_trips: u32,
    /// The statements run, in order (see [`SentStatement`]).
    statements: Vec<SentStatement>,
}

impl Seen {
    fn is_nothing(&self) -> bool {
        !self.commit && !self.execute
    }

    fn fires(&self, trigger: Trigger) -> bool {
        match trigger {
            Trigger::Commit | Trigger::PartitionAtCommit | Trigger::PartitionBeforeCommit => {
                self.commit
            }
            Trigger::NextExecute | Trigger::PartitionAtExecute => self.execute,
        }
    }
}

/// What all connections of one proxy share.
#[derive(Debug, Default)]
struct Faults {
    /// Set by `arm*`, taken by the first message it fires on.
    armed: Mutex<Option<Trigger>>,
    /// How many times the proxy was armed.
    armings: AtomicU32,
    /// COMMIT replies swallowed (each followed by a cut connection, or by a partition).
    dropped: AtomicU32,
    /// While set, nothing is forwarded either way and new connections reach nothing.
    partitioned: AtomicBool,
    /// Bumped by every heal: the connections that saw an older value end.
    heals: watch::Sender<u64>,
    /// Error replies the server sent.
    errors: AtomicU32,
    /// Round trips that carried SQL (see [`Seen::round_trips`]).
    round_trips: AtomicU32,
    /// The statements run (see [`SentStatement`]).
    statements: Mutex<Vec<SentStatement>>,
}

/// A proxy on an ephemeral 127.0.0.1 port in front of a test database's server.
pub struct LostReplyProxy {
    backend: Backend,
    url: String,
    faults: Arc<Faults>,
    acceptor: JoinHandle<()>,
}

impl LostReplyProxy {
    /// Starts a proxy in front of `db`'s server, or returns `None` (with a note on stderr)
    /// on SQLite, which has no network to lose a reply on (panics there).
    pub async fn start(db: &TestDb) -> Self {
        let protocol = match db.backend {
            Backend::Sqlite => {
                panic!(
                    "an embedded SQLite database has no network, so no COMMIT reply can be \
                     lost between the server and the client: use on_server_backends!"
                )
            }
            Backend::Postgres | Backend::PgBouncer => Protocol::Postgres,
            Backend::MySql => Protocol::MySql,
        };
        let (listener, port) = bind_ephemeral().await;
        let (upstream, url) = route(&db.url, protocol, port);
        let faults = Arc::new(Faults::default());
        let acceptor = tokio::spawn(accept(listener, upstream, protocol, Arc::clone(&faults)));
        Self {
            backend: db.backend,
            url,
            faults,
            acceptor,
        }
    }

    /// A new pool whose connections all go through the proxy.
    pub async fn connect(&self) -> DatabaseConnection {
        self.connect_with(5).await
    }

    /// A new pool of at most `max_connections` whose connections all go through the proxy
    /// (one, to count a client's round trips: a pool of more may open a connection, and
    /// send its session set-up, whenever the last one is not back yet).
    pub async fn connect_with(&self, max_connections: u32) -> DatabaseConnection {
        connect_pool(&self.url, self.backend, max_connections).await
    }

    /// [`connect_with`](Self::connect_with), with the pool's options adjusted last by
    /// `configure` (a helper of the library under test, say).
    pub async fn connect_configured(
        &self,
        max_connections: u32,
        configure: impl FnOnce(&mut ConnectOptions),
    ) -> DatabaseConnection {
        connect_pool_with(&self.url, self.backend, max_connections, configure).await
    }

    /// Loses the reply of the next COMMIT any connection sends (once).
    pub fn arm(&self) {
        self.arm_for(Trigger::Commit);
    }

    /// Loses the reply of the next prepared statement any connection executes (once): for
    /// a statement with bind values that commits on its own, outside a transaction.
    pub fn arm_next_execute(&self) {
        self.arm_for(Trigger::NextExecute);
    }

    /// Starts a partition now: nothing is forwarded either way on any connection, open or
    /// new, and every socket stays open.
    pub fn partition(&self) {
        self.faults.partitioned.store(true, Ordering::SeqCst);
    }

    /// Lets the next COMMIT any connection sends reach the server, and starts a partition
    /// right behind it: the server commits, its reply is lost in the partition, and the
    /// client's connection stays open, silent (once).
    pub fn partition_at_commit(&self) {
        self.arm_for(Trigger::PartitionAtCommit);
    }

    /// Starts a partition at the next COMMIT any connection sends, which it swallows: the
    /// server never sees it, and the transaction stays open there with every lock it took,
    /// its client silent (once).
    pub fn partition_before_commit(&self) {
        self.arm_for(Trigger::PartitionBeforeCommit);
    }

    /// Lets the next prepared statement any connection executes reach the server, and
    /// starts a partition right behind it: the server runs it (inside its transaction, if
    /// any, which then holds its locks), and its reply is lost in the partition (once).
    pub fn partition_at_next_execute(&self) {
        self.arm_for(Trigger::PartitionAtExecute);
    }

    /// Whether a partition is on.
    pub fn is_partitioned(&self) -> bool {
        self.faults.partitioned.load(Ordering::SeqCst)
    }

    /// Ends the partition: every connection opened before now is cut (both sockets
    /// closed), later connections are forwarded again.
    pub fn heal(&self) {
        self.faults.partitioned.store(false, Ordering::SeqCst);
        self.faults.heals.send_modify(|heals| *heals += 1);
    }

    fn arm_for(&self, trigger: Trigger) {
        self.faults.armings.fetch_add(1, Ordering::SeqCst);
        *self.faults.armed.lock().expect("the proxy's lock") = Some(trigger);
    }

    /// Error replies the server sent through the proxy so far (PostgreSQL's
    /// `ErrorResponse`, MySQL's `ERR` packet).
    pub fn error_replies(&self) -> u32 {
        self.faults.errors.load(Ordering::SeqCst)
    }

    /// The round trips that carried SQL through the proxy so far (see
    /// [`reset_round_trips`](Self::reset_round_trips)): what a client paid in waits on the
    /// network, whichever statements they were.
    pub fn round_trips(&self) -> u32 {
        self.faults.round_trips.load(Ordering::SeqCst)
    }

    /// Starts [`round_trips`](Self::round_trips) again from 0, and
    /// [`statements`](Self::statements) from an empty log.
    pub fn reset_round_trips(&self) {
        self.faults.round_trips.store(0, Ordering::SeqCst);
        self.faults
            .statements
            .lock()
            .expect("the proxy's lock")
            .clear();
    }

    /// Every statement the clients ran through the proxy so far (see
    /// [`reset_round_trips`](Self::reset_round_trips)), in the order the proxy saw them:
    /// what the server executed, its session set-up included.
    pub fn statements(&self) -> Vec<SentStatement> {
        self.faults
            .statements
            .lock()
            .expect("the proxy's lock")
            .clone()
    }

    /// COMMIT replies dropped so far.
    pub fn replies_dropped(&self) -> u32 {
        self.faults.dropped.load(Ordering::SeqCst)
    }

    /// Panics unless every arming dropped a reply: the fault under test really happened.
    pub fn expect_reply_dropped(&self) {
        let (armings, dropped) = (
            self.faults.armings.load(Ordering::SeqCst),
            self.replies_dropped(),
        );
        assert!(
            armings > 0 && dropped == armings,
            "the proxy was armed {armings} times but dropped {dropped} replies: the \
             operation under test never sent its COMMIT (or statement) through the proxy, \
             so this test did not exercise a lost reply"
        );
    }
}

impl Drop for LostReplyProxy {
    fn drop(&mut self) {
        self.acceptor.abort();
        // No relay outlives the proxy: connections left in a partition would keep their
        // clients (and a pool's release ping) waiting forever.
        self.heal();
        let armings = self.faults.armings.load(Ordering::SeqCst);
        if armings > self.replies_dropped() && !std::thread::panicking() {
            panic!(
                "the proxy was armed {armings} times but dropped {} replies: the test did \
                 not exercise a lost reply",
                self.replies_dropped()
            );
        }
    }
}

/// The server's `host:port` from a test database URL, and the same URL pointed at the
/// proxy's port, with TLS off so the proxy can read the protocol.
fn route(url: &str, protocol: Protocol, proxy_port: u16) -> (String, String) {
    let (scheme, user, host_port, path) = url_parts(url);
    let default_port = match protocol {
        Protocol::Postgres => 5432,
        Protocol::MySql => 3306,
    };
    let upstream = if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:{default_port}")
    };
    let no_tls = match protocol {
        Protocol::Postgres => "sslmode=disable",
        Protocol::MySql => "ssl-mode=disabled",
    };
    let separator = if path.contains('?') { '&' } else { '?' };
    let through = format!("{scheme}://{user}127.0.0.1:{proxy_port}{path}{separator}{no_tls}");
    (upstream, through)
}

async fn accept(listener: TcpListener, upstream: String, protocol: Protocol, faults: Arc<Faults>) {
    while let Ok((client, _)) = listener.accept().await {
        let healed = faults.heals.subscribe();
        if faults.partitioned.load(Ordering::SeqCst) {
            // The client's SYN reached the device, nothing behind it ever answers.
            tokio::spawn(hold_until_healed(client, healed));
            continue;
        }
        let Ok(server) = TcpStream::connect(&upstream).await else {
            // The client sees its connection refused, as with the server down.
            continue;
        };
        tokio::spawn(relay(client, server, protocol, Arc::clone(&faults), healed));
    }
}

/// Keeps a connection opened during a partition open and silent until the next heal.
async fn hold_until_healed(client: TcpStream, mut healed: watch::Receiver<u64>) {
    healed.changed().await.ok();
    drop(client);
}

/// Copies one connection both ways until either side closes, a COMMIT reply is lost, or a
/// heal cuts it.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    protocol: Protocol,
    faults: Arc<Faults>,
    mut healed: watch::Receiver<u64>,
) {
    client.set_nodelay(true).ok();
    server.set_nodelay(true).ok();
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let losing_reply = AtomicBool::new(false);
    let prepared = Mutex::new(Prepared::default());
    // Whichever direction ends first ends the connection: dropping the halves closes both
    // sockets, so the client sees the cut right after its COMMIT.
    tokio::select! {
        () = requests(client_read, server_write, protocol, &faults, &losing_reply, &prepared) => {}
        () = replies(server_read, client_write, protocol, &faults, &losing_reply, &prepared) => {}
        _ = healed.changed() => {}
    }
}

/// Client to server: forwards everything, and once armed, flags the first message the
/// trigger fires on before the server can see it.
async fn requests(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    protocol: Protocol,
    faults: &Faults,
    losing_reply: &AtomicBool,
    prepared: &Mutex<Prepared>,
) {
    let mut framer = Framer::new(protocol);
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        if faults.partitioned.load(Ordering::SeqCst) {
            return silent_end(faults).await;
        }
        let read = from.read(&mut chunk).await.unwrap_or(0);
        if read == 0 {
            return silent_end(faults).await;
        }
        // Read before the framer's verdict: the chunk that starts a partition still goes
        // through.
        let mut partitioned = faults.partitioned.load(Ordering::SeqCst);
        let seen = framer.push(&chunk[..read], prepared);
        faults
            .round_trips
            .fetch_add(seen.round_trips, Ordering::SeqCst);
        faults
            .statements
            .lock()
            .expect("the proxy's lock")
            .extend_from_slice(&seen.statements);
        if !seen.is_nothing() {
            let mut armed = faults.armed.lock().expect("the proxy's lock");
            match *armed {
                Some(trigger @ (Trigger::PartitionAtCommit | Trigger::PartitionAtExecute))
                    if seen.fires(trigger) =>
                {
                    *armed = None;
                    faults.partitioned.store(true, Ordering::SeqCst);
                    faults.dropped.fetch_add(1, Ordering::SeqCst);
                }
                Some(Trigger::PartitionBeforeCommit) if seen.commit => {
                    *armed = None;
                    faults.partitioned.store(true, Ordering::SeqCst);
                    faults.dropped.fetch_add(1, Ordering::SeqCst);
                    partitioned = true;
                }
                Some(trigger) if seen.fires(trigger) => {
                    *armed = None;
                    losing_reply.store(true, Ordering::SeqCst);
                }
                _ => {}
            }
        }
        if partitioned {
            continue;
        }
        if to.write_all(&chunk[..read]).await.is_err() {
            return;
        }
    }
}

/// Server to client: forwards everything until the flagged COMMIT's reply arrives, which
/// it drops and records before returning (cutting the connection).
async fn replies(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    protocol: Protocol,
    faults: &Faults,
    losing_reply: &AtomicBool,
    prepared: &Mutex<Prepared>,
) {
    let mut framer = ReplyFramer::new(protocol);
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        if faults.partitioned.load(Ordering::SeqCst) {
            return silent_end(faults).await;
        }
        let read = from.read(&mut chunk).await.unwrap_or(0);
        if read == 0 {
            return silent_end(faults).await;
        }
        // The client sends its COMMIT only after reading every earlier reply, so the first
        // bytes after the flag are the COMMIT's answer: the server has committed. (PostgreSQL
        // answers an extended-protocol statement at its Sync, after the implicit commit.)
        if losing_reply.load(Ordering::SeqCst) {
            faults.dropped.fetch_add(1, Ordering::SeqCst);
            return;
        }
        if faults.partitioned.load(Ordering::SeqCst) {
            continue;
        }
        faults
            .errors
            .fetch_add(framer.push(&chunk[..read], prepared), Ordering::SeqCst);
        if to.write_all(&chunk[..read]).await.is_err() {
            return;
        }
    }
}

/// The end of one direction: the connection ends at once, unless a partition is on. Then
/// the direction stops reading until a heal cuts the connection: what its sender writes
/// is never consumed (a server sending a large reply ends up blocked, as behind a real
/// partition), and a close is hidden from the other side (a server that ends an abandoned
/// session sends its FIN into the black hole).
async fn silent_end(faults: &Faults) {
    if faults.partitioned.load(Ordering::SeqCst) {
        std::future::pending::<()>().await;
    }
}

/// Splits the client's byte stream into protocol messages and spots COMMITs and
/// prepared-statement executions.
struct Framer {
    protocol: Protocol,
    buffer: Vec<u8>,
    /// PostgreSQL: still in the startup phase, whose messages carry no type byte.
    startup: bool,
    /// PostgreSQL: an `Execute` since the last `Sync`.
    executed: bool,
}

/// PostgreSQL's SSLRequest and GSSENCRequest codes: after them the client sends another
/// untyped startup message.
const PG_ENCRYPTION_REQUESTS: [u32; 2] = [80_877_103, 80_877_104];
/// MySQL's COM_QUERY and COM_STMT_EXECUTE command bytes (a command opens sequence 0).
const MYSQL_COM_QUERY: u8 = 0x03;
const MYSQL_COM_STMT_PREPARE: u8 = 0x16;
const MYSQL_COM_STMT_EXECUTE: u8 = 0x17;

impl Framer {
    fn new(protocol: Protocol) -> Self {
        Self {
            protocol,
            buffer: Vec::new(),
            startup: true,
            executed: false,
        }
    }

    /// Appends `bytes` and reports what the messages they completed hold; `prepared`
    /// learns the statements they prepare.
    fn push(&mut self, bytes: &[u8], prepared: &Mutex<Prepared>) -> Seen {
        self.buffer.extend_from_slice(bytes);
        let mut seen = Seen::default();
        while let Some(len) = self.next_len() {
            if len > self.buffer.len() {
                break;
            }
            let message: Vec<u8> = self.buffer.drain(..len).collect();
            seen.execute |= self.is_execute(&message);
            // PostgreSQL's startup messages carry no type byte (MySQL's handshake packets
            // never open sequence 0, which every command does).
            if self.protocol == Protocol::MySql || !self.startup {
                let mut prepared = prepared.lock().expect("the proxy's lock");
                seen.statements
                    .extend(self.statement(&message, &mut prepared));
            }
            seen.round_trips += u32::from(self.is_round_trip(&message));
            seen.commit |= self.is_commit(&message);
        }
        seen
    }

    /// The statement `message` runs, if it runs one; a prepare is remembered in
    /// `prepared` (MySQL's until its reply gives the id).
    fn statement(&self, message: &[u8], prepared: &mut Prepared) -> Option<SentStatement> {
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        match self.protocol {
            Protocol::Postgres => {
                let body = message.get(5..).unwrap_or_default();
                let mut fields = body.split(|&b| b == 0);
                match message.first() {
                    Some(b'Q') => Some(SentStatement::Text(text(cstr(body)))),
                    // Parse: statement name, query text.
                    Some(b'P') => {
                        let name = text(fields.next().unwrap_or_default());
                        let sql = text(fields.next().unwrap_or_default());
                        prepared.by_name.insert(name, sql);
                        None
                    }
                    // Bind: portal name, statement name.
                    Some(b'B') => {
                        let name = text(fields.nth(1).unwrap_or_default());
                        let sql = prepared.by_name.get(&name).cloned();
                        Some(SentStatement::Prepared(
                            sql.unwrap_or_else(|| format!("<unknown statement {name}>")),
                        ))
                    }
                    _ => None,
                }
            }
            Protocol::MySql if message.get(3) == Some(&0) => {
                let payload = message.get(5..).unwrap_or_default();
                match message.get(4) {
                    Some(&MYSQL_COM_QUERY) => Some(SentStatement::Text(text(payload))),
                    Some(&MYSQL_COM_STMT_PREPARE) => {
                        prepared.awaiting_id = Some(text(payload));
                        None
                    }
                    Some(&MYSQL_COM_STMT_EXECUTE) => {
                        let id = payload.get(..4)?;
                        let id = u32::from_le_bytes([id[0], id[1], id[2], id[3]]);
                        let sql = prepared.by_id.get(&id).cloned();
                        Some(SentStatement::Prepared(
                            sql.unwrap_or_else(|| format!("<unknown statement {id}>")),
                        ))
                    }
                    _ => None,
                }
            }
            Protocol::MySql => None,
        }
    }

    /// The length of the message at the front of the buffer, once its header is in.
    fn next_len(&self) -> Option<usize> {
        let b = &self.buffer;
        match self.protocol {
            Protocol::Postgres if self.startup => {
                let len = u32::from_be_bytes(b.get(..4)?.try_into().ok()?);
                Some(len as usize)
            }
            Protocol::Postgres => {
                let len = u32::from_be_bytes(b.get(1..5)?.try_into().ok()?);
                Some(1 + len as usize)
            }
            Protocol::MySql => {
                let header = b.get(..3)?;
                let len = u32::from_le_bytes([header[0], header[1], header[2], 0]);
                Some(4 + len as usize)
            }
        }
    }

    /// Whether `message` executes a prepared statement.
    fn is_execute(&self, message: &[u8]) -> bool {
        match self.protocol {
            Protocol::Postgres => !self.startup && message.first() == Some(&b'E'),
            Protocol::MySql => {
                message.get(3) == Some(&0) && message.get(4) == Some(&MYSQL_COM_STMT_EXECUTE)
            }
        }
    }

    /// Whether `message` ends a round trip that carries SQL (read before `is_commit`,
    /// which ends the PostgreSQL startup phase).
    fn is_round_trip(&mut self, message: &[u8]) -> bool {
        match self.protocol {
            Protocol::Postgres if self.startup => false,
            Protocol::Postgres => match message.first() {
                Some(b'Q') => true,
                Some(b'E') => {
                    self.executed = true;
                    false
                }
                Some(b'S') => std::mem::take(&mut self.executed),
                _ => false,
            },
            Protocol::MySql => {
                message.get(3) == Some(&0)
                    && matches!(
                        message.get(4),
                        Some(&MYSQL_COM_QUERY | &MYSQL_COM_STMT_EXECUTE)
                    )
            }
        }
    }

    fn is_commit(&mut self, message: &[u8]) -> bool {
        match self.protocol {
            Protocol::Postgres if self.startup => {
                let code = message.get(4..8).and_then(|c| c.try_into().ok());
                let code = code.map(u32::from_be_bytes).unwrap_or(0);
                self.startup = PG_ENCRYPTION_REQUESTS.contains(&code);
                false
            }
            Protocol::Postgres => {
                let body = message.get(5..).unwrap_or_default();
                match message.first() {
                    Some(b'Q') => is_commit_sql(cstr(body)),
                    // Parse: statement name, then the query text.
                    Some(b'P') => {
                        let query = body.splitn(2, |&b| b == 0).nth(1).unwrap_or_default();
                        is_commit_sql(cstr(query))
                    }
                    _ => false,
                }
            }
            // A command starts a new sequence (id 0); handshake packets never do.
            Protocol::MySql => {
                message.get(3) == Some(&0)
                    && message.get(4) == Some(&MYSQL_COM_QUERY)
                    && is_commit_sql(message.get(5..).unwrap_or_default())
            }
        }
    }
}

/// Splits the server's byte stream into protocol messages and counts the error replies.
/// The server's messages all carry their length from the first byte on: the proxy's
/// routes turn TLS off, so PostgreSQL never answers an untyped SSLRequest.
struct ReplyFramer {
    protocol: Protocol,
    buffer: Vec<u8>,
}

/// MySQL's ERR packet header byte.
const MYSQL_ERR: u8 = 0xff;

impl ReplyFramer {
    fn new(protocol: Protocol) -> Self {
        Self {
            protocol,
            buffer: Vec::new(),
        }
    }

    /// Appends `bytes` and counts the error replies among the messages they completed;
    /// the reply to a MySQL prepare gives `prepared` its statement's id.
    fn push(&mut self, bytes: &[u8], prepared: &Mutex<Prepared>) -> u32 {
        self.buffer.extend_from_slice(bytes);
        let mut errors = 0;
        loop {
            let b = &self.buffer;
            let (len, is_error) = match self.protocol {
                Protocol::Postgres => {
                    let Some(header) = b.get(1..5) else { break };
                    let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
                    (1 + len as usize, b[0] == b'E')
                }
                Protocol::MySql => {
                    let Some(header) = b.get(..4) else { break };
                    let len = u32::from_le_bytes([header[0], header[1], header[2], 0]);
                    (4 + len as usize, b.get(4) == Some(&MYSQL_ERR))
                }
            };
            if len > b.len() {
                break;
            }
            errors += u32::from(is_error);
            if self.protocol == Protocol::MySql {
                prepared_id(b, &mut prepared.lock().expect("the proxy's lock"));
            }
            self.buffer.drain(..len);
        }
        errors
    }
}

/// Files the text of a MySQL prepare under the id its reply `packet` gives (the first
/// packet of the reply, sequence 1: `0x00`, then the id), or forgets it when the prepare
/// failed.
fn prepared_id(packet: &[u8], prepared: &mut Prepared) {
    if packet.get(3) != Some(&1) {
        return;
    }
    let Some(sql) = prepared.awaiting_id.take() else {
        return;
    };
    if let (Some(0), Some(id)) = (packet.get(4), packet.get(5..9)) {
        let id = u32::from_le_bytes([id[0], id[1], id[2], id[3]]);
        prepared.by_id.insert(id, sql);
    }
}

/// The bytes before the first NUL.
fn cstr(bytes: &[u8]) -> &[u8] {
    bytes.split(|&b| b == 0).next().unwrap_or_default()
}

fn is_commit_sql(sql: &[u8]) -> bool {
    let sql = String::from_utf8_lossy(sql);
    sql.trim()
        .trim_end_matches(';')
        .trim()
        .eq_ignore_ascii_case("COMMIT")
}

/// A migrated test database behind a [`LostReplyProxy`]: a direct pool (the healthy
/// replica, set-up and checks), the proxy, and a pool through it (the replica under test).
/// Account 1 (balance 0) exists for handlers to credit.
pub struct ProxiedDb {
    pub direct: DatabaseConnection,
    /// The database's own URL, for more direct pools ([`connect_url`](crate::connect_url)).
    pub direct_url: String,
    pub proxy: Arc<LostReplyProxy>,
    pub through_proxy: DatabaseConnection,
}

impl ProxiedDb {
    /// Waits until the proxy's partition is on, and returns when it was seen.
    pub async fn partition_started(&self) -> Instant {
        while !self.proxy.is_partitioned() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Instant::now()
    }

    /// The balance of account 1, read through the direct pool.
    pub async fn balance(&self) -> i64 {
        scalar_i64(&self.direct, "SELECT balance FROM account WHERE id = 1").await
    }

    /// The markers in the inbox, counted through the direct pool.
    pub async fn markers(&self) -> i64 {
        scalar_i64(&self.direct, "SELECT COUNT(*) FROM inbox").await
    }
}

/// Runs `body` on a [`ProxiedDb`] of `backend`, then heals any partition (a pool cannot
/// close while a connection of it waits in the black hole), closes the pools, checks the
/// proxy (see [`LostReplyProxy::expect_reply_dropped`]) and drops the database, also when
/// `body` panics; the body's panic wins over the proxy check's.
pub async fn with_proxied_db<T>(backend: Backend, body: impl AsyncFnOnce(&ProxiedDb) -> T) -> T {
    with_migrated_db(backend, async |db| {
        let proxy = Arc::new(LostReplyProxy::start(db).await);
        let direct = db.connect().await;
        let through_proxy = proxy.connect().await;
        create_accounts(&direct).await;
        let fixture = ProxiedDb {
            direct,
            direct_url: db.url().to_owned(),
            proxy,
            through_proxy,
        };
        let outcome = AssertUnwindSafe(body(&fixture)).catch_unwind().await;
        fixture.proxy.heal();
        fixture.through_proxy.close().await.ok();
        fixture.direct.close().await.ok();
        let checked = std::panic::catch_unwind(AssertUnwindSafe(|| drop(fixture.proxy)));
        let value = outcome.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        checked.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        value
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn none() -> Mutex<Prepared> {
        Mutex::default()
    }

    #[test]
    fn logs_each_execution_by_the_text_it_was_prepared_from() {
        let prepared = none();
        let mut framer = Framer::new(Protocol::Postgres);
        framer.push(&pg_startup(196_608), &prepared);
        let parse = pg(b'P', b"sqlx_s_1\0INSERT INTO inbox VALUES ($1)\0\0\0");
        let bind = pg(b'B', b"\0sqlx_s_1\0\0\0\0\0\0\0");
        let stream = [
            pg(b'Q', b"BEGIN\0"),
            parse,
            pg(b'S', b""),
            bind.clone(),
            bind,
        ]
        .concat();
        let (first, rest) = stream.split_at(20);
        let mut logged = framer.push(first, &prepared).statements;
        logged.extend(framer.push(rest, &prepared).statements);
        let insert = SentStatement::Prepared("INSERT INTO inbox VALUES ($1)".into());
        assert_eq!(
            logged,
            [SentStatement::Text("BEGIN".into()), insert.clone(), insert]
        );

        let prepared = none();
        let mut framer = Framer::new(Protocol::MySql);
        let mut replies = ReplyFramer::new(Protocol::MySql);
        let logged = framer
            .push(&mysql(0, b"\x16UPDATE account SET balance = ?"), &prepared)
            .statements;
        assert!(logged.is_empty(), "{logged:?}");
        replies.push(&mysql(1, &[0, 7, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]), &prepared);
        let logged = [
            framer.push(&mysql(0, b"\x17\x07\0\0\0\0\x01\0\0\0"), &prepared),
            framer.push(&mysql(0, b"\x03COMMIT"), &prepared),
        ]
        .map(|seen| seen.statements)
        .concat();
        assert_eq!(
            logged,
            [
                SentStatement::Prepared("UPDATE account SET balance = ?".into()),
                SentStatement::Text("COMMIT".into())
            ]
        );
    }

    fn pg(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut message = vec![kind];
        message.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        message.extend_from_slice(body);
        message
    }

    #[test]
    fn counts_error_replies_split_across_reads() {
        let mut framer = ReplyFramer::new(Protocol::Postgres);
        let stream = [
            pg(b'C', b"INSERT 0 1\0"),
            pg(b'E', b"SERROR\0C23505\0\0"),
            pg(b'Z', b"E"),
        ]
        .concat();
        let (first, rest) = stream.split_at(14);
        assert_eq!(framer.push(first, &none()) + framer.push(rest, &none()), 1);

        let mut framer = ReplyFramer::new(Protocol::MySql);
        let ok = [7, 0, 0, 1, 0, 1, 0, 2, 0, 0, 0];
        let err = [
            9, 0, 0, 1, 0xff, 0x26, 0x04, b'#', b'2', b'3', b'0', b'0', b'0',
        ];
        assert_eq!(
            framer.push(&ok, &none())
                + framer.push(&err[..3], &none())
                + framer.push(&err[3..], &none()),
            1
        );
    }

    fn pg_startup(code: u32) -> Vec<u8> {
        let mut message = 8u32.to_be_bytes().to_vec();
        message.extend_from_slice(&code.to_be_bytes());
        message
    }

    fn mysql(sequence: u8, payload: &[u8]) -> Vec<u8> {
        let len = (payload.len() as u32).to_le_bytes();
        let mut packet = vec![len[0], len[1], len[2], sequence];
        packet.extend_from_slice(payload);
        packet
    }

    #[test]
    fn finds_a_postgres_commit_split_across_reads_after_startup() {
        let commit = |framer: &mut Framer, bytes: &[u8]| framer.push(bytes, &none()).commit;
        let mut framer = Framer::new(Protocol::Postgres);
        assert!(!commit(&mut framer, &pg_startup(80_877_103)));
        assert!(!commit(&mut framer, &pg_startup(196_608)));
        assert!(!commit(
            &mut framer,
            &pg(b'Q', b"UPDATE account SET balance = 1\0")
        ));
        let message = pg(b'Q', b"COMMIT\0");
        assert!(!commit(&mut framer, &message[..4]));
        assert!(commit(&mut framer, &message[4..]));
        assert!(commit(&mut framer, &pg(b'P', b"s1\0commit;\0\0\0")));
        assert!(!commit(&mut framer, &pg(b'P', b"s2\0COMMIT_LOG\0\0\0")));
    }

    #[test]
    fn finds_a_mysql_commit_query_only() {
        let commit = |framer: &mut Framer, bytes: &[u8]| framer.push(bytes, &none()).commit;
        let mut framer = Framer::new(Protocol::MySql);
        assert!(!commit(
            &mut framer,
            &mysql(1, b"\x03COMMIT handshake-like")
        ));
        assert!(!commit(&mut framer, &mysql(0, b"\x03START TRANSACTION")));
        assert!(!commit(&mut framer, &mysql(0, b"\x16COMMIT")));
        assert!(commit(&mut framer, &mysql(0, b"\x03COMMIT")));
    }

    #[test]
    fn executions_are_prepared_statements_only() {
        let execute = |framer: &mut Framer, bytes: &[u8]| framer.push(bytes, &none()).execute;
        let mut framer = Framer::new(Protocol::Postgres);
        assert!(!execute(&mut framer, &pg_startup(196_608)));
        assert!(!execute(&mut framer, &pg(b'P', b"s1\0UPDATE inbox\0\0\0")));
        assert!(!execute(&mut framer, &pg(b'S', b"")));
        assert!(!execute(&mut framer, &pg(b'Q', b"BEGIN\0")));
        assert!(execute(&mut framer, &pg(b'E', b"\0\0\0\0\0")));
        let mut framer = Framer::new(Protocol::MySql);
        assert!(!execute(&mut framer, &mysql(1, b"\x17handshake-like")));
        assert!(!execute(&mut framer, &mysql(0, b"\x0e")));
        assert!(!execute(&mut framer, &mysql(0, b"\x16UPDATE inbox")));
        assert!(!execute(&mut framer, &mysql(0, b"\x03SET sql_mode = ''")));
        assert!(execute(&mut framer, &mysql(0, b"\x17\x01\0\0\0")));
    }

    #[tokio::test]
    #[should_panic(expected = "did not exercise a lost reply")]
    async fn an_armed_proxy_that_dropped_nothing_fails_the_test() {
        let proxy = LostReplyProxy {
            backend: Backend::Postgres,
            url: String::new(),
            faults: Arc::default(),
            acceptor: tokio::spawn(async {}),
        };
        proxy.arm();
        drop(proxy);
    }

    #[test]
    fn points_the_url_at_the_proxy_without_tls() {
        let (upstream, through) = route(
            "postgres://postgres@127.0.0.1:5432/inbox_t_1",
            Protocol::Postgres,
            4000,
        );
        assert_eq!(upstream, "127.0.0.1:5432");
        assert_eq!(
            through,
            "postgres://postgres@127.0.0.1:4000/inbox_t_1?sslmode=disable"
        );
        let (upstream, through) = route(
            "mysql://root@localhost/db?charset=utf8mb4",
            Protocol::MySql,
            4001,
        );
        assert_eq!(upstream, "localhost:3306");
        assert_eq!(
            through,
            "mysql://root@127.0.0.1:4001/db?charset=utf8mb4&ssl-mode=disabled"
        );
    }
}
