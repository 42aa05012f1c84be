//! Waking relays in other processes on PostgreSQL: a waker that is `notifying` sends a
//! debounced `pg_notify` after the commit, and a relay that is `listening` wakes on it,
//! so a row another process committed goes out without waiting for the relay's poll.
//! Each "process" has a pool of its own; the relay polls once a minute, so a publish
//! within a second can only come from the notification.

use inbox_tests::{Backend, TestDb, on_pgbouncer, scalar_i64, with_migrated_outbox_db};
use sea_orm::{DatabaseConnection, TransactionTrait};
use sea_orm_inbox::{
    OUTBOX_CHANNEL, OutboxError, OutboxExt, OutboxMessage, OutboxWaker, OutgoingMessage,
    PublishError, Publisher, Relay, RelayOptions,
};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// A relay that finds a row by its poll would take this long.
const POLL: Duration = Duration::from_secs(60);
/// What a woken relay must stay under; far below [`POLL`].
const WOKEN_WITHIN: Duration = Duration::from_secs(1);

/// Reports each published payload with the instant it was published.
struct Timed(mpsc::UnboundedSender<(Vec<u8>, Instant)>);

impl Publisher for Timed {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        let _ = self.0.send((message.payload.clone(), Instant::now()));
        Ok(())
    }
}

/// Two "processes" on pools of their own: a relay polling once a minute (listening when
/// asked), and a writer whose waker notifies.
struct Scene {
    stop: tokio::sync::oneshot::Sender<()>,
    published: mpsc::UnboundedReceiver<(Vec<u8>, Instant)>,
    relay: tokio::task::JoinHandle<()>,
    writer: DatabaseConnection,
    waker: OutboxWaker,
}

impl Scene {
    /// Starts the relay; when `listen`, returns once its LISTEN session is up. The
    /// writer's waker sends at most one NOTIFY per `window`.
    async fn start(db: &TestDb, listen: bool) -> Self {
        Self::start_debounced(db, listen, OutboxWaker::NOTIFY_DEBOUNCE).await
    }

    async fn start_debounced(db: &TestDb, listen: bool, window: Duration) -> Self {
        let listen_url = listen.then(|| db.url().to_owned());
        Self::start_listening_at(db, listen_url, window).await
    }

    /// The relay listens on `listen_url` (the server itself: `LISTEN` needs a session),
    /// while its statements and the writer's go through `db`'s own URL.
    async fn start_listening_at(db: &TestDb, listen_url: Option<String>, window: Duration) -> Self {
        let listen = listen_url.is_some();
        let (sender, published) = mpsc::unbounded_channel();
        let mut relay = Relay::new(Timed(sender))
            .with_options(RelayOptions {
                poll_interval: POLL,
                ..RelayOptions::default()
            })
            .expect("valid options");
        if let Some(url) = listen_url {
            relay = relay.listening(url).expect("a PostgreSQL URL");
        }
        let pool = db.connect().await;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let relay = tokio::spawn(async move {
            relay
                .run(&pool, async {
                    let _ = stopped.await;
                })
                .await;
            pool.close().await.ok();
        });
        let writer = db.connect().await;
        if listen {
            wait_for_listener(&writer).await;
        } else {
            // The relay's first pass (at start) is over.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let waker = if window == OutboxWaker::NOTIFY_DEBOUNCE {
            OutboxWaker::default().notifying(writer.clone())
        } else {
            OutboxWaker::default().notifying_debounced(writer.clone(), window)
        }
        .expect("PostgreSQL notifies");
        Self {
            stop,
            published,
            relay,
            writer,
            waker,
        }
    }

    async fn finish(self) {
        self.stop.send(()).ok();
        self.relay.await.expect("the relay stops");
        self.writer.close().await.ok();
    }
}

/// Waits until the server shows a session listening on the channel.
async fn wait_for_listener(conn: &DatabaseConnection) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let query = format!(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND query = 'LISTEN \"{OUTBOX_CHANNEL}\"'"
    );
    while scalar_i64(conn, &query).await == 0 {
        assert!(Instant::now() < deadline, "the relay never listened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Its first wake (the catch-up pass on connecting) is over by then.
    tokio::time::sleep(Duration::from_millis(200)).await;
}

async fn enqueue_one(conn: &DatabaseConnection, payload: Vec<u8>) {
    let txn = conn.begin().await.expect("begin");
    txn.enqueue(OutgoingMessage::new("wake.test", payload))
        .await
        .expect("enqueue");
    txn.commit().await.expect("commit");
}

/// p50 and max of `latencies`.
fn summary(latencies: &mut [Duration]) -> (Duration, Duration) {
    latencies.sort();
    (
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn a_row_another_process_committed_goes_out_on_its_notify() {
    const MESSAGES: usize = 30;
    with_migrated_outbox_db(Backend::Postgres, async |db| {
        let mut scene = Scene::start(db, true).await;
        let mut latencies = Vec::with_capacity(MESSAGES);
        for n in 0..MESSAGES {
            let payload = format!("row {n}").into_bytes();
            enqueue_one(&scene.writer, payload.clone()).await;
            let committed = Instant::now();
            scene.waker.wake();
            let (got, at) = tokio::time::timeout(WOKEN_WITHIN, scene.published.recv())
                .await
                .unwrap_or_else(|_| panic!("row {n} not published within {WOKEN_WITHIN:?}"))
                .expect("the relay runs");
            assert_eq!(got, payload);
            latencies.push(at - committed);
            // Past the debounce window, so each row measures a leading-edge NOTIFY.
            tokio::time::sleep(OutboxWaker::NOTIFY_DEBOUNCE * 2).await;
        }
        let (p50, max) = summary(&mut latencies);
        println!("commit to publish across pools, {MESSAGES} rows: p50 {p50:?}, max {max:?}");
        scene.finish().await;
    })
    .await;
}

/// The control: without `listening`, the same row waits for the poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn without_listening_a_row_another_process_committed_waits_for_the_poll() {
    with_migrated_outbox_db(Backend::Postgres, async |db| {
        let mut scene = Scene::start(db, false).await;
        enqueue_one(&scene.writer, b"unheard".to_vec()).await;
        scene.waker.wake();
        assert!(
            tokio::time::timeout(WOKEN_WITHIN, scene.published.recv())
                .await
                .is_err(),
            "a relay that does not listen cannot have been woken"
        );
        scene.finish().await;
    })
    .await;
}

/// A burst of wakes sends about one NOTIFY per debounce window, and the last one (the
/// window's trailing edge) still brings the burst's last rows out at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn a_burst_of_wakes_is_debounced_and_loses_no_row() {
    burst_of_wakes(OutboxWaker::NOTIFY_DEBOUNCE).await;
}

/// `notifying_debounced` holds to its own window: a burst that the default window would
/// answer with dozens of NOTIFYs gets a handful, and still loses no row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn a_longer_window_sends_fewer_notifies_and_loses_no_row() {
    burst_of_wakes(Duration::from_millis(150)).await;
}

/// 60 enqueues, each woken, through a waker debounced to `window`: counts the NOTIFYs on
/// a listener of the test's own and checks every row goes out without the poll.
async fn burst_of_wakes(window: Duration) {
    use sea_orm::sqlx::postgres::PgListener;
    const BURST: usize = 60;
    with_migrated_outbox_db(Backend::Postgres, async |db| {
        let mut counter = PgListener::connect(db.url()).await.expect("listen");
        counter.listen(OUTBOX_CHANNEL).await.expect("listen");
        let mut scene = Scene::start_debounced(db, true, window).await;
        let started = Instant::now();
        for n in 0..BURST {
            enqueue_one(&scene.writer, format!("burst {n}").into_bytes()).await;
            scene.waker.wake();
        }
        let burst = started.elapsed();
        let last_commit = Instant::now();
        let mut last_publish = last_commit;
        for _ in 0..BURST {
            let (_, at) = tokio::time::timeout(WOKEN_WITHIN * 2, scene.published.recv())
                .await
                .expect("every row of the burst is published without waiting for the poll")
                .expect("the relay runs");
            last_publish = last_publish.max(at);
        }
        let mut notifies = 0u32;
        while let Ok(Ok(_)) =
            tokio::time::timeout(Duration::from_millis(300), counter.recv()).await
        {
            notifies += 1;
        }
        let windows = burst.as_millis() / window.as_millis() + 2;
        println!(
            "{BURST} wakes in {burst:?}, window {window:?}: {notifies} NOTIFYs (at most {windows}); last row out {:?} after its commit",
            last_publish.saturating_duration_since(last_commit)
        );
        assert!(notifies >= 1, "the burst sent no NOTIFY");
        assert!(
            u128::from(notifies) <= windows,
            "{notifies} NOTIFYs for {BURST} wakes in {burst:?}: not debounced to {window:?}"
        );
        scene.finish().await;
    })
    .await;
}

/// Behind PgBouncer in transaction mode (the guide's settings) the writer's waker still
/// reaches a relay listening on the server: its NOTIFY holds no bound value, which a
/// transaction pooler cannot carry outside a transaction (26000).
async fn a_wake_through_the_transaction_pooler_reaches_the_listening_relay(backend: Backend) {
    const WOKEN_THROUGH_POOLER: Duration = Duration::from_secs(3);
    let server = std::env::var("INBOX_TEST_POSTGRES_URL")
        .expect("set INBOX_TEST_POSTGRES_URL: the relay listens on the server, not the pooler");
    with_migrated_outbox_db(backend, async |db| {
        let listen_url = db.url_at(&server);
        let mut scene =
            Scene::start_listening_at(db, Some(listen_url), OutboxWaker::NOTIFY_DEBOUNCE).await;
        for n in 0..3 {
            let payload = format!("pooled {n}").into_bytes();
            enqueue_one(&scene.writer, payload.clone()).await;
            scene.waker.wake();
            let (got, _) = tokio::time::timeout(WOKEN_THROUGH_POOLER, scene.published.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!("row {n} not published within {WOKEN_THROUGH_POOLER:?} (poll: {POLL:?})")
                })
                .expect("the relay runs");
            assert_eq!(got, payload);
        }
        scene.finish().await;
    })
    .await;
}

on_pgbouncer!(a_wake_through_the_transaction_pooler_reaches_the_listening_relay);

/// Only PostgreSQL has the channel: elsewhere both sides refuse at set-up, not later.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn notify_and_listen_are_refused_off_postgres() {
    with_migrated_outbox_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        assert!(matches!(
            OutboxWaker::default().notifying(conn.clone()),
            Err(OutboxError::InvalidOptions { .. })
        ));
        let (published, _received) = mpsc::unbounded_channel();
        assert!(matches!(
            Relay::new(Timed(published)).listening("mysql://root@127.0.0.1:3306/test"),
            Err(OutboxError::InvalidOptions { .. })
        ));
        conn.close().await.ok();
    })
    .await;
}
