//! Issue 30's proof of the consumer loops under a broker outage, as an application runs
//! them: three replicas of `RabbitMqConsumer` (or `JetStreamConsumer`), each with a pool
//! and a broker connection of its own through one [`CutProxy`]; every message published
//! twice. Mid-run the proxy cuts every connection and refuses new ones for [`OUTAGE`] (the
//! machine's broker keeps running; the second copies are published to it meanwhile), then
//! lets them through again. After the outage comes a poison message the handler fails
//! `Permanent`: no cut can take its settlement, so its first delivery must be its last.
//!
//! Checked: 0 lost and 0 applied twice (ledger rows == distinct ids == messages), every
//! copy settled and nothing left in the queue or pending on the consumer, each replica
//! reconnected, and the poison message dead-lettered on its first delivery (the handler
//! ran once for it). The queue and stream are `example_loops`' (the examples' topology).

use super::example_loops::{CONSUMER, Queue, Stream, env, wait_for};
use inbox_examples::consumers::{self, amqp_properties};
use inbox_tests::{Backend, CutProxy, TestDb, run, scalar_i64, stmt, with_migrated_db};
use sea_orm::{ConnectionTrait, DatabaseConnection};
use sea_orm_inbox::jetstream::JetStreamConsumer;
use sea_orm_inbox::rabbitmq::RabbitMqConsumer;
use sea_orm_inbox::{
    BoxError, ConsumerError, ConsumerOptions, ConsumerSummary, HandlerFuture, Inbox,
    ObservedTransaction, Permanent, Received,
};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Distinct messages, each published twice.
const MESSAGES: u32 = 150;
/// Consumer loops, each with a pool and a broker connection of its own.
const REPLICAS: usize = 3;
/// How long the proxy refuses connections after the cut.
const OUTAGE: Duration = Duration::from_secs(3);
/// The broker id of the message the handler fails `Permanent`.
const POISON: &str = "poison-1";

fn inbox() -> Inbox {
    Inbox::new("faults.ledger").expect("a valid consumer name")
}

/// The examples' settings, and reconnects after 100 ms doubling to 1 s (the default's
/// 30 s ceiling would only make the test wait).
fn options() -> ConsumerOptions {
    consumers::options()
        .expect("the examples' options")
        .with_reconnect_backoff(Duration::from_millis(100), Duration::from_secs(1))
        .expect("in range")
}

/// One ledger row per handler run that committed: a message applied twice shows as two
/// rows of one broker id (no unique index hides it).
async fn create_ledger(conn: &DatabaseConnection) {
    run(
        conn,
        "CREATE TABLE loop_ledger (broker_id VARCHAR(64) NOT NULL)",
    )
    .await;
}

/// (rows, distinct broker ids) of the ledger.
async fn ledger(conn: &DatabaseConnection) -> (i64, i64) {
    (
        scalar_i64(conn, "SELECT COUNT(*) FROM loop_ledger").await,
        scalar_i64(conn, "SELECT COUNT(DISTINCT broker_id) FROM loop_ledger").await,
    )
}

/// The application's handler: a ledger row per message, after a pause that keeps
/// deliveries in flight when the cut comes; the poison message fails `Permanent`.
fn handler(
    poison_runs: Arc<AtomicU32>,
) -> impl for<'t> Fn(&'t ObservedTransaction, Arc<Received>) -> HandlerFuture<'t, (), BoxError>
+ Send
+ Sync
+ 'static {
    move |txn, message| {
        let poison = message.broker_id == POISON;
        if poison {
            poison_runs.fetch_add(1, Ordering::SeqCst);
        }
        Box::pin(async move {
            if poison {
                return Err(Permanent::new("the order names a product that does not exist").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            let insert = stmt(
                txn.get_database_backend(),
                "INSERT INTO loop_ledger (broker_id) VALUES (?)",
                vec![message.broker_id.clone().into()],
            );
            txn.execute_raw(insert).await?;
            Ok(())
        })
    }
}

/// One proof run: the replicas, the shared inbox (its counters see every replica) and how
/// often the handler ran for the poison message.
struct Run {
    inbox: Inbox,
    poison_runs: Arc<AtomicU32>,
    stops: Vec<oneshot::Sender<()>>,
    tasks: Vec<JoinHandle<Result<ConsumerSummary, ConsumerError>>>,
}

impl Run {
    /// Starts [`REPLICAS`] loops, each made by `start(inbox, its own pool, handler,
    /// shutdown)`.
    async fn start<F>(
        db: &TestDb,
        start: impl Fn(Inbox, DatabaseConnection, oneshot::Receiver<()>, Arc<AtomicU32>) -> F,
    ) -> Self
    where
        F: Future<Output = Result<ConsumerSummary, ConsumerError>> + Send + 'static,
    {
        let mut run = Self {
            inbox: inbox(),
            poison_runs: Arc::new(AtomicU32::new(0)),
            stops: Vec::new(),
            tasks: Vec::new(),
        };
        for _ in 0..REPLICAS {
            let (stop, stopped) = oneshot::channel::<()>();
            let pool = db.connect().await;
            let replica = start(
                run.inbox.clone(),
                pool,
                stopped,
                Arc::clone(&run.poison_runs),
            );
            run.stops.push(stop);
            run.tasks.push(tokio::spawn(replica));
        }
        run
    }

    /// Waits until the replicas processed a few messages, then cuts every connection
    /// through `proxy` and refuses new ones while `during` runs and for [`OUTAGE`].
    async fn outage(&self, proxy: &CutProxy, during: impl AsyncFnOnce()) {
        wait_for("a few processed before the cut", async || {
            self.inbox.metrics().snapshot().processed >= 20
        })
        .await;
        let cut = proxy.cut_and_refuse();
        let at_cut = self.inbox.metrics().snapshot();
        assert_eq!(
            cut, REPLICAS as u64,
            "each replica's connection ran through the proxy"
        );
        during().await;
        tokio::time::sleep(OUTAGE).await;
        proxy.restore();
        assert!(
            proxy.refused() > 0,
            "the replicas tried to reconnect during the outage"
        );
        assert!(
            at_cut.processed < u64::from(MESSAGES),
            "the cut came mid-run: {at_cut:?}"
        );
    }

    /// Every copy and the poison message settled (`settled` asks the broker), with no
    /// delivery for longer than the longest nack delay (a message RabbitMQ holds for a
    /// delayed nack is invisible to it); then the replicas stopped: their summaries, after
    /// the checks both brokers share.
    async fn finish(
        self,
        broker: &str,
        backend: Backend,
        conn: &DatabaseConnection,
        mut settled: impl AsyncFnMut() -> bool,
    ) -> Vec<ConsumerSummary> {
        let (mut last, mut quiet_since) = (None, tokio::time::Instant::now());
        wait_for("every copy and the poison message settled", async || {
            let seen = self.inbox.metrics().snapshot();
            if last != Some(seen) {
                (last, quiet_since) = (Some(seen), tokio::time::Instant::now());
            }
            seen.processed + seen.duplicates >= u64::from(2 * MESSAGES)
                && quiet_since.elapsed() > Duration::from_millis(1500)
                && settled().await
        })
        .await;
        for stop in self.stops {
            let _ = stop.send(());
        }
        let mut summaries = Vec::new();
        for task in self.tasks {
            let summary = task.await.expect("the loop's task");
            summaries.push(summary.unwrap_or_else(|e| panic!("a loop failed: {e}")));
        }
        let poison_runs = self.poison_runs.load(Ordering::SeqCst);
        let sum = |field: fn(&ConsumerSummary) -> u64| summaries.iter().map(field).sum::<u64>();
        eprintln!(
            "loop_faults {broker} {backend:?}: {MESSAGES} messages x2 + 1 poison; deliveries {}, processed {}, duplicates {}, nacked {}, dead-lettered {}, settle failures {}, abandoned {}, reconnects {:?}, poison deliveries {poison_runs}",
            sum(|s| s.received),
            sum(|s| s.processed),
            sum(|s| s.duplicates),
            sum(|s| s.nacked),
            sum(|s| s.dead_lettered),
            sum(|s| s.settle_failures),
            sum(|s| s.abandoned),
            summaries.iter().map(|s| s.reconnects).collect::<Vec<_>>(),
        );
        let expected = i64::from(MESSAGES);
        assert_eq!(
            ledger(conn).await,
            (expected, expected),
            "ledger (rows, distinct ids) == messages: none lost, none applied twice; {summaries:?}"
        );
        assert_eq!(sum(|s| s.processed), u64::from(MESSAGES), "{summaries:?}");
        assert_eq!(
            poison_runs, 1,
            "the Permanent message is dead-lettered on its first delivery; {summaries:?}"
        );
        summaries
    }
}

async fn rabbitmq_replicas_survive_a_broker_outage(backend: Backend) {
    with_migrated_db(backend, async |db: &TestDb| {
        let conn = db.connect().await;
        create_ledger(&conn).await;
        let queue = Queue::declare().await;
        for n in 0..MESSAGES {
            queue.publish(&format!("order-{n}")).await;
        }
        let proxy = CutProxy::start(&queue.url).await;
        let name = &queue.topology.queue;
        let run = Run::start(db, |inbox, pool, stopped, poison_runs| {
            RabbitMqConsumer::new(proxy.url(), amqp_properties(), name)
                .with_options(options())
                .run(inbox, pool, handler(poison_runs), stopped)
        })
        .await;
        run.outage(&proxy, async || {
            for n in 0..MESSAGES {
                queue.publish(&format!("order-{n}")).await;
            }
        })
        .await;
        queue.publish(POISON).await;
        let summaries = run
            .finish("RabbitMQ", backend, &conn, async || {
                queue.count(name).await == 0 && queue.dead_letters().await == 1
            })
            .await;
        for summary in &summaries {
            assert!(
                summary.reconnects >= 1,
                "each replica's loop reconnected: {summary}"
            );
        }
        queue.delete().await;
    })
    .await;
}

async fn nats_replicas_survive_a_broker_outage(backend: Backend) {
    with_migrated_db(backend, async |db: &TestDb| {
        let conn = db.connect().await;
        create_ledger(&conn).await;
        let stream = Stream::create().await;
        for n in 0..MESSAGES {
            stream.publish(&format!("order-{n}")).await;
        }
        let proxy = CutProxy::start(&env("INBOX_TEST_NATS_URL")).await;
        let mut clients = Vec::new();
        for _ in 0..REPLICAS {
            let client = async_nats::connect(proxy.url())
                .await
                .expect("connect through the proxy");
            clients.push(client);
        }
        let name = &stream.name;
        let next_client = std::sync::Mutex::new(clients.clone().into_iter());
        let run = Run::start(db, |inbox, pool, stopped, poison_runs| {
            let client = next_client
                .lock()
                .expect("not poisoned")
                .next()
                .expect("a client per replica");
            JetStreamConsumer::new(client, name, CONSUMER)
                .with_options(options())
                .run(inbox, pool, handler(poison_runs), stopped)
        })
        .await;
        run.outage(&proxy, async || {
            // Past the stream's duplicate window: the second copies are stored, not dropped.
            tokio::time::sleep(sea_orm_inbox::jetstream::DUPLICATE_WINDOW * 2).await;
            for n in 0..MESSAGES {
                stream.publish(&format!("order-{n}")).await;
            }
        })
        .await;
        stream.publish(POISON).await;
        // What the cut lost comes back after the consumer's ack_wait (5 s).
        let mut durable = stream
            .js
            .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
                CONSUMER, name,
            )
            .await
            .expect("the durable consumer");
        let summaries = run
            .finish("JetStream", backend, &conn, async || {
                let info = durable.info().await.expect("the consumer's info");
                info.num_pending == 0 && info.num_ack_pending == 0 && stream.terminated() == 1
            })
            .await;
        let connects: Vec<u64> = clients
            .iter()
            .map(|client| client.statistics().connects.load(Ordering::SeqCst))
            .collect();
        eprintln!(
            "loop_faults JetStream {backend:?}: client connects {connects:?}, refused {}",
            proxy.refused()
        );
        for (summary, connects) in summaries.iter().zip(&connects) {
            assert!(
                summary.reconnects >= 1 || *connects >= 2,
                "each replica reconnected (its loop, or its client): {summary}, connects {connects}"
            );
        }
        stream.delete().await;
    })
    .await;
}

mod amqp {
    use super::*;

    inbox_tests::on_every_backend!(needs(inbox_amqp, "set INBOX_TEST_AMQP_URL"); rabbitmq_replicas_survive_a_broker_outage);
}

mod nats {
    use super::*;

    inbox_tests::on_every_backend!(needs(inbox_nats, "set INBOX_TEST_NATS_URL"); nats_replicas_survive_a_broker_outage);
}
