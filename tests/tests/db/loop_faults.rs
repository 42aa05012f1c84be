//! Issue 30's proof of the consumer loops under a broker outage, as an application runs
//! them: three replicas of `RabbitMqConsumer` (or `JetStreamConsumer`), each with a pool
//! and a broker connection of its own through a [`CutProxy`]; every message published
//! twice; a poison message the handler fails `Permanent`. Mid-run the proxy cuts every
//! connection and refuses new ones for [`OUTAGE`] (the machine's broker keeps running; the
//! second copies are published to it meanwhile), then lets them through again.
//!
//! Checked: 0 lost and 0 applied twice (ledger rows == distinct ids == messages), every
//! copy settled and nothing left in the queue or pending on the consumer, each replica
//! reconnected, and the poison message dead-lettered on its first delivery (the handler
//! ran once for it).
//!
//! The broker URLs come from `INBOX_TEST_AMQP_URL` and `INBOX_TEST_NATS_URL`.

use futures_util::StreamExt;
use inbox_examples::consumers::{self, amqp_properties};
use inbox_tests::{Backend, CutProxy, TestDb, run, scalar_i64, stmt, with_migrated_db};
use lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use sea_orm::{ConnectionTrait, DatabaseConnection};
use sea_orm_inbox::jetstream::JetStreamConsumer;
use sea_orm_inbox::rabbitmq::{QuorumQueue, RabbitMqConsumer};
use sea_orm_inbox::{
    BoxError, ConsumerOptions, ConsumerSummary, HandlerFuture, Inbox, ObservedTransaction,
    Permanent, Received,
};
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
/// The longest any wait may take; the run normally takes about ten seconds.
const DEADLINE: Duration = Duration::from_secs(60);

fn env(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| panic!("set {var} to run the loop fault tests"))
}

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

/// Waits until `done()` holds; fails the test with `what` after [`DEADLINE`].
async fn wait_for(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let waited = tokio::time::timeout(DEADLINE, async {
        while !done().await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "{what}: not within {DEADLINE:?}");
}

/// The replicas' loops on tasks, and the senders that stop them.
struct Replicas {
    stops: Vec<oneshot::Sender<()>>,
    tasks: Vec<JoinHandle<Result<ConsumerSummary, sea_orm_inbox::ConsumerError>>>,
}

impl Replicas {
    async fn stop(self) -> Vec<ConsumerSummary> {
        for stop in self.stops {
            let _ = stop.send(());
        }
        let mut summaries = Vec::new();
        for task in self.tasks {
            let summary = task.await.expect("the loop's task");
            summaries.push(summary.unwrap_or_else(|e| panic!("a loop failed: {e}")));
        }
        summaries
    }
}

/// What every proof checks at the end, and prints: the counts of the run.
fn report(broker: &str, backend: Backend, summaries: &[ConsumerSummary], poison_runs: u32) {
    let sum = |field: fn(&ConsumerSummary) -> u64| summaries.iter().map(field).sum::<u64>();
    eprintln!(
        "loop_faults {broker} {backend:?}: {} messages x2 + 1 poison; deliveries {}, processed {}, duplicates {}, nacked {}, dead-lettered {}, settle failures {}, abandoned {}, reconnects {:?}, poison deliveries {poison_runs}",
        MESSAGES,
        sum(|s| s.received),
        sum(|s| s.processed),
        sum(|s| s.duplicates),
        sum(|s| s.nacked),
        sum(|s| s.dead_lettered),
        sum(|s| s.settle_failures),
        sum(|s| s.abandoned),
        summaries.iter().map(|s| s.reconnects).collect::<Vec<_>>(),
    );
}

/// Checks shared by both brokers, after the replicas stopped.
async fn check_ledger(conn: &DatabaseConnection, summaries: &[ConsumerSummary], poison_runs: u32) {
    let expected = i64::from(MESSAGES);
    assert_eq!(
        ledger(conn).await,
        (expected, expected),
        "ledger (rows, distinct ids) == messages: none lost, none applied twice; {summaries:?}"
    );
    let processed: u64 = summaries.iter().map(|s| s.processed).sum();
    assert_eq!(processed, u64::from(MESSAGES), "{summaries:?}");
    assert_eq!(
        poison_runs, 1,
        "the Permanent message is dead-lettered on its first delivery"
    );
}

async fn rabbitmq_replicas_survive_a_broker_outage(backend: Backend) {
    with_migrated_db(backend, async |db: &TestDb| {
        let conn = db.connect().await;
        create_ledger(&conn).await;
        let url = env("INBOX_TEST_AMQP_URL");
        let publisher = lapin::Connection::connect(&url, amqp_properties())
            .await
            .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
        let channel = publisher.create_channel().await.expect("a channel");
        let name = format!("inbox-faults-{}", uuid::Uuid::new_v4().simple());
        let topology = consumers::declare_queue(&channel, &name)
            .await
            .expect("declare the queue");
        let publish = async |id: &str| {
            channel
                .basic_publish(
                    "",
                    &topology.queue,
                    BasicPublishOptions::default(),
                    b"credit 1",
                    lapin::BasicProperties::default().with_message_id(id.into()),
                )
                .await
                .expect("publish")
                .await
                .expect("published");
        };
        let count = async |queue: &str| {
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            channel
                .queue_declare(queue, passive, FieldTable::default())
                .await
                .expect("the queue exists")
                .message_count()
        };
        publish(POISON).await;
        for n in 0..MESSAGES {
            publish(&format!("order-{n}")).await;
        }

        let proxy = CutProxy::start(&url).await;
        let (inbox, poison_runs) = (inbox(), Arc::new(AtomicU32::new(0)));
        let mut replicas = Replicas {
            stops: Vec::new(),
            tasks: Vec::new(),
        };
        for _ in 0..REPLICAS {
            let (stop, stopped) = oneshot::channel::<()>();
            let consumer = RabbitMqConsumer::new(proxy.url(), amqp_properties(), &topology.queue)
                .with_options(options());
            let pool = db.connect().await;
            let handler = handler(Arc::clone(&poison_runs));
            replicas.stops.push(stop);
            replicas.tasks.push(tokio::spawn(consumer.run(
                inbox.clone(),
                pool,
                handler,
                stopped,
            )));
        }
        wait_for(
            "the poison message dead-lettered, a few processed",
            async || {
                count(&topology.dead_letter_queue).await == 1
                    && inbox.metrics().snapshot().processed >= 20
            },
        )
        .await;
        let cut = proxy.cut_and_refuse();
        assert_eq!(
            cut, REPLICAS as u64,
            "each replica's connection ran through the proxy"
        );
        let in_outage = inbox.metrics().snapshot();
        for n in 0..MESSAGES {
            publish(&format!("order-{n}")).await;
        }
        tokio::time::sleep(OUTAGE).await;
        proxy.restore();
        assert!(
            in_outage.processed < u64::from(MESSAGES),
            "the cut came mid-run: {in_outage:?}"
        );
        // Every copy settled: each id processed once, the rest duplicates, the queue empty
        // and no delivery for longer than the longest nack delay (a held nack is invisible
        // to a passive declaration).
        let mut last = (0, 0);
        let mut quiet_since = tokio::time::Instant::now();
        wait_for("every copy settled and the replicas quiet", async || {
            let seen = inbox.metrics().snapshot();
            let now = (
                seen.processed,
                seen.duplicates + seen.handler_errors + seen.failures,
            );
            if now != last {
                (last, quiet_since) = (now, tokio::time::Instant::now());
            }
            seen.processed == u64::from(MESSAGES)
                && seen.duplicates >= u64::from(MESSAGES)
                && count(&topology.queue).await == 0
                && quiet_since.elapsed() > Duration::from_millis(1500)
        })
        .await;
        let summaries = replicas.stop().await;
        let runs = poison_runs.load(Ordering::SeqCst);
        report("RabbitMQ", backend, &summaries, runs);
        check_ledger(&conn, &summaries, runs).await;
        for summary in &summaries {
            assert!(
                summary.reconnects >= 1,
                "each replica's loop reconnected: {summary}"
            );
        }
        assert!(
            proxy.refused() > 0,
            "the replicas tried to reconnect during the outage"
        );
        assert_eq!(
            count(&topology.queue).await,
            0,
            "nothing left unsettled: {summaries:?}"
        );
        assert_eq!(
            count(&topology.dead_letter_queue).await,
            1,
            "only the poison message dead-lettered"
        );
        delete_queue(&channel, &topology).await;
        publisher.close(200, "test over").await.ok();
    })
    .await;
}

async fn delete_queue(channel: &lapin::Channel, topology: &QuorumQueue) {
    for queue in [&topology.queue, &topology.dead_letter_queue] {
        channel
            .queue_delete(queue, QueueDeleteOptions::default())
            .await
            .ok();
    }
    channel
        .exchange_delete(&topology.dead_letter_exchange, Default::default())
        .await
        .ok();
}

const DURABLE: &str = "faults";

async fn nats_replicas_survive_a_broker_outage(backend: Backend) {
    with_migrated_db(backend, async |db: &TestDb| {
        let conn = db.connect().await;
        create_ledger(&conn).await;
        let url = env("INBOX_TEST_NATS_URL");
        let client = async_nats::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
        let js = async_nats::jetstream::new(client.clone());
        let run_id = uuid::Uuid::new_v4().simple().to_string();
        let (name, subject) = (
            format!("INBOX_FAULTS_{run_id}"),
            format!("inbox-faults.{run_id}"),
        );
        let mut advisories = client
            .subscribe(format!(
                "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{name}.{DURABLE}"
            ))
            .await
            .expect("subscribe to the advisory");
        let terminated = Arc::new(AtomicU32::new(0));
        let counter = Arc::clone(&terminated);
        tokio::spawn(async move {
            while advisories.next().await.is_some() {
                counter.fetch_add(1, Ordering::SeqCst);
            }
        });
        consumers::create_stream(&js, &name, &subject, DURABLE)
            .await
            .expect("create the stream");
        let publish = async |id: &str| {
            let message = async_nats::jetstream::message::PublishMessage::build()
                .payload("credit 1".into())
                .message_id(id);
            js.send_publish(subject.clone(), message)
                .await
                .expect("publish")
                .await
                .expect("stored");
        };
        publish(POISON).await;
        for n in 0..MESSAGES {
            publish(&format!("order-{n}")).await;
        }

        let proxy = CutProxy::start(&url).await;
        let (inbox, poison_runs) = (inbox(), Arc::new(AtomicU32::new(0)));
        let mut replicas = Replicas {
            stops: Vec::new(),
            tasks: Vec::new(),
        };
        let mut clients = Vec::new();
        for _ in 0..REPLICAS {
            let (stop, stopped) = oneshot::channel::<()>();
            let replica_client = async_nats::connect(proxy.url())
                .await
                .expect("connect through the proxy");
            clients.push(replica_client.clone());
            let consumer =
                JetStreamConsumer::new(replica_client, &name, DURABLE).with_options(options());
            let pool = db.connect().await;
            let handler = handler(Arc::clone(&poison_runs));
            replicas.stops.push(stop);
            replicas.tasks.push(tokio::spawn(consumer.run(
                inbox.clone(),
                pool,
                handler,
                stopped,
            )));
        }
        wait_for(
            "the poison message terminated, a few processed",
            async || {
                terminated.load(Ordering::SeqCst) == 1 && inbox.metrics().snapshot().processed >= 20
            },
        )
        .await;
        let cut = proxy.cut_and_refuse();
        assert_eq!(
            cut, REPLICAS as u64,
            "each replica's connection ran through the proxy"
        );
        let in_outage = inbox.metrics().snapshot();
        // Past the stream's duplicate window: the second copies are stored, not dropped.
        tokio::time::sleep(sea_orm_inbox::jetstream::DUPLICATE_WINDOW * 2).await;
        for n in 0..MESSAGES {
            publish(&format!("order-{n}")).await;
        }
        tokio::time::sleep(OUTAGE.saturating_sub(sea_orm_inbox::jetstream::DUPLICATE_WINDOW * 2))
            .await;
        proxy.restore();
        assert!(
            in_outage.processed < u64::from(MESSAGES),
            "the cut came mid-run: {in_outage:?}"
        );
        // Every copy settled: nothing pending or awaiting an ack on the durable consumer
        // (what the cut lost comes back after its ack_wait, 5 s, as a duplicate).
        let mut durable = js
            .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
                DURABLE, &name,
            )
            .await
            .expect("the durable consumer");
        wait_for("every copy settled", async || {
            let seen = inbox.metrics().snapshot();
            let info = durable.info().await.expect("the consumer's info");
            seen.processed == u64::from(MESSAGES)
                && seen.duplicates >= u64::from(MESSAGES)
                && info.num_pending == 0
                && info.num_ack_pending == 0
        })
        .await;
        let summaries = replicas.stop().await;
        let runs = poison_runs.load(Ordering::SeqCst);
        report("JetStream", backend, &summaries, runs);
        let connects: Vec<u64> = clients
            .iter()
            .map(|c| c.statistics().connects.load(Ordering::SeqCst))
            .collect();
        eprintln!(
            "loop_faults JetStream {backend:?}: client connects {connects:?}, refused {}",
            proxy.refused()
        );
        check_ledger(&conn, &summaries, runs).await;
        for (summary, connects) in summaries.iter().zip(&connects) {
            assert!(
                summary.reconnects >= 1 || *connects >= 2,
                "each replica reconnected (its loop, or its client): {summary}, connects {connects}"
            );
        }
        assert!(
            proxy.refused() > 0,
            "the replicas tried to reconnect during the outage"
        );
        assert_eq!(
            terminated.load(Ordering::SeqCst),
            1,
            "only the poison message terminated"
        );
        js.delete_stream(&name).await.ok();
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
