//! A plain TCP proxy that can cut every connection through it at once: a broker (or any
//! server) whose connections drop, as when it restarts or a load balancer forgets its
//! flows. Unlike [`LostReplyProxy`](crate::LostReplyProxy) it reads no protocol, so it
//! fits RabbitMQ's AMQP as well as anything else. [`CutProxy::cut_and_refuse`] plays an
//! outage: the connections drop and new ones are refused until [`CutProxy::restore`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the acceptor and the connections share.
#[derive(Debug, Default)]
struct Shared {
    /// Bumped by every [`CutProxy::cut`]: the connections that saw an older value end.
    cuts: watch::Sender<u64>,
    /// Connections forwarding now.
    open: AtomicU64,
    /// Connections forwarded since the start.
    forwarded: AtomicU64,
    /// While set, the acceptor closes every new connection at once.
    refusing: AtomicBool,
    /// Connections closed at once while refusing.
    refused: AtomicU64,
}

/// A proxy on an ephemeral 127.0.0.1 port in front of `upstream` (`host:port`).
pub struct CutProxy {
    url: String,
    shared: Arc<Shared>,
    acceptor: JoinHandle<()>,
}

impl CutProxy {
    /// Starts a proxy in front of the server of `url` (`scheme://[user@]host:port/...`);
    /// [`url`](Self::url) is the same URL pointed at the proxy.
    pub async fn start(url: &str) -> Self {
        let (listener, port) = bind_ephemeral().await;
        let (upstream, url) = reroute(url, port);
        let shared = Arc::new(Shared::default());
        let acceptor = tokio::spawn(accept(listener, upstream, Arc::clone(&shared)));
        Self {
            url,
            shared,
            acceptor,
        }
    }

    /// The server's URL through the proxy.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// How many connections the proxy forwarded since it started (open and ended): the
    /// first connections and every reconnection after a [`cut`](Self::cut).
    pub fn connections(&self) -> u64 {
        self.shared.forwarded.load(Ordering::SeqCst)
    }

    /// Closes every connection open through the proxy (both sockets), and returns how many
    /// there were; later connections are forwarded again.
    pub fn cut(&self) -> u64 {
        let open = self.shared.open.load(Ordering::SeqCst);
        self.shared.cuts.send_modify(|cuts| *cuts += 1);
        open
    }

    /// [`cut`](Self::cut), and from now on closes every new connection as soon as it is
    /// accepted (the client sees the server go away mid-handshake), until
    /// [`restore`](Self::restore): a broker that is down for a while.
    pub fn cut_and_refuse(&self) -> u64 {
        self.shared.refusing.store(true, Ordering::SeqCst);
        self.cut()
    }

    /// Forwards new connections again after [`cut_and_refuse`](Self::cut_and_refuse).
    pub fn restore(&self) {
        self.shared.refusing.store(false, Ordering::SeqCst);
    }

    /// How many connections were refused: the clients' attempts during the outage.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.acceptor.abort();
        self.shared.cuts.send_modify(|cuts| *cuts += 1);
    }
}

/// The `host:port` of `url`, and `url` with it replaced by `127.0.0.1:port`.
/// A listener on an ephemeral 127.0.0.1 port, and that port.
pub(crate) async fn bind_ephemeral() -> (TcpListener, u16) {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the proxy to an ephemeral 127.0.0.1 port");
    let port = listener
        .local_addr()
        .expect("the proxy's local address")
        .port();
    (listener, port)
}

/// A server URL's parts: scheme, `user@` (empty without a user), `host[:port]`, and the
/// rest from the first `/`.
pub(crate) fn url_parts(url: &str) -> (&str, String, &str, &str) {
    let (scheme, rest) = url.split_once("://").expect("a server URL has a scheme");
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (user, host_port) = match authority.rsplit_once('@') {
        Some((user, host_port)) => (format!("{user}@"), host_port),
        None => (String::new(), authority),
    };
    (scheme, user, host_port, path)
}

fn reroute(url: &str, port: u16) -> (String, String) {
    let (scheme, user, host_port, path) = url_parts(url);
    assert!(
        host_port.contains(':'),
        "{url}: give the server's port explicitly, the proxy reads no scheme's default"
    );
    (
        host_port.to_owned(),
        format!("{scheme}://{user}127.0.0.1:{port}{path}"),
    )
}

async fn accept(listener: TcpListener, upstream: String, shared: Arc<Shared>) {
    while let Ok((client, _)) = listener.accept().await {
        if shared.refusing.load(Ordering::SeqCst) {
            shared.refused.fetch_add(1, Ordering::SeqCst);
            drop(client);
            continue;
        }
        let cut = shared.cuts.subscribe();
        let Ok(server) = TcpStream::connect(&upstream).await else {
            // The client sees its connection closed, as with the server down.
            continue;
        };
        tokio::spawn(forward(client, server, Arc::clone(&shared), cut));
    }
}

/// Copies one connection both ways until either side closes or a cut ends it; dropping
/// both streams closes both sockets.
async fn forward(
    mut client: TcpStream,
    mut server: TcpStream,
    shared: Arc<Shared>,
    mut cut: watch::Receiver<u64>,
) {
    shared.open.fetch_add(1, Ordering::SeqCst);
    shared.forwarded.fetch_add(1, Ordering::SeqCst);
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        _ = cut.changed() => {}
    }
    shared.open.fetch_sub(1, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::reroute;

    #[test]
    fn points_the_url_at_the_proxy() {
        assert_eq!(
            reroute("amqp://guest:guest@127.0.0.1:5672/%2f", 4000),
            (
                "127.0.0.1:5672".to_owned(),
                "amqp://guest:guest@127.0.0.1:4000/%2f".to_owned()
            )
        );
        assert_eq!(
            reroute("nats://localhost:4222", 4001),
            (
                "localhost:4222".to_owned(),
                "nats://127.0.0.1:4001".to_owned()
            )
        );
    }
}
