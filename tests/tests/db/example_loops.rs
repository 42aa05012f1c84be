//! The examples' consumer loops (`examples/consumers.rs`: what `cargo run --example
//! rabbitmq|nats|outbox` run) against the local RabbitMQ and NATS JetStream, each test on
//! a queue or stream of its own: a poison message is dead-lettered within the delivery
//! limit, a `Permanent` one on its first delivery; concurrent deliveries and re-sent
//! copies apply each message once; a shutdown mid-run and a cut broker connection lose
//! nothing and apply nothing twice.
//!
//! The broker URLs come from `INBOX_TEST_AMQP_URL` and `INBOX_TEST_NATS_URL`, as in
//! `brokers.rs`.

use futures_util::StreamExt;
use inbox_examples::consumers::{self, DELIVERY_LIMIT, amqp_properties};
use inbox_tests::{Backend, CutProxy, committed, create_accounts, credit, with_migrated_db};
use lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use sea_orm::{DatabaseConnection, DbErr};
use sea_orm_inbox::jetstream::JetStreamConsumer;
use sea_orm_inbox::rabbitmq::{QuorumQueue, RabbitMqConsumer};
use sea_orm_inbox::{ConsumerOptions, ConsumerSummary, Inbox, Permanent};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The longest any wait of these tests may take; they normally take a few seconds.
const DEADLINE: Duration = Duration::from_secs(30);

pub(crate) fn env(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| panic!("set {var} to run the example loop tests"))
}

/// A quorum queue of the test's own, declared as the examples declare theirs (also the
/// queue of `loop_faults`).
pub(crate) struct Queue {
    pub(crate) url: String,
    connection: lapin::Connection,
    channel: lapin::Channel,
    pub(crate) topology: QuorumQueue,
}

impl Queue {
    pub(crate) async fn declare() -> Self {
        let url = env("INBOX_TEST_AMQP_URL");
        let connection = lapin::Connection::connect(&url, amqp_properties())
            .await
            .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
        let channel = connection.create_channel().await.expect("a channel");
        let name = format!("inbox-loop-{}", uuid::Uuid::new_v4().simple());
        let topology = consumers::declare_queue(&channel, &name)
            .await
            .expect("declare the example topology");
        Self {
            url,
            connection,
            channel,
            topology,
        }
    }

    pub(crate) async fn publish(&self, message_id: &str) {
        self.channel
            .basic_publish(
                "",
                &self.topology.queue,
                BasicPublishOptions::default(),
                b"credit 1",
                lapin::BasicProperties::default().with_message_id(message_id.into()),
            )
            .await
            .expect("publish")
            .await
            .expect("published");
    }

    pub(crate) async fn count(&self, queue: &str) -> u32 {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        self.channel
            .queue_declare(queue, passive, FieldTable::default())
            .await
            .expect("the queue exists")
            .message_count()
    }

    pub(crate) async fn dead_letters(&self) -> u32 {
        self.count(&self.topology.dead_letter_queue).await
    }

    pub(crate) async fn delete(self) {
        for queue in [&self.topology.queue, &self.topology.dead_letter_queue] {
            self.channel
                .queue_delete(queue, QueueDeleteOptions::default())
                .await
                .ok();
        }
        self.channel
            .exchange_delete(&self.topology.dead_letter_exchange, Default::default())
            .await
            .ok();
        self.connection.close(200, "test over").await.ok();
    }
}

/// A stream and durable consumer of the test's own, created as the examples create theirs,
/// with a count of the consumer's `MSG_TERMINATED` advisories (also the stream of
/// `loop_faults`).
pub(crate) struct Stream {
    client: async_nats::Client,
    pub(crate) js: async_nats::jetstream::Context,
    pub(crate) name: String,
    subject: String,
    terminated: Arc<AtomicU32>,
}

/// The durable consumer of every [`Stream`].
pub(crate) const CONSUMER: &str = "loop";

impl Stream {
    pub(crate) async fn create() -> Self {
        let url = env("INBOX_TEST_NATS_URL");
        let client = async_nats::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
        let js = async_nats::jetstream::new(client.clone());
        let run = uuid::Uuid::new_v4().simple().to_string();
        let (name, subject) = (format!("INBOX_LOOP_{run}"), format!("inbox-loop.{run}"));
        let mut advisories = client
            .subscribe(format!(
                "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{name}.{CONSUMER}"
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
        consumers::create_stream(&js, &name, &subject, CONSUMER)
            .await
            .expect("create the example stream");
        Self {
            client,
            js,
            name,
            subject,
            terminated,
        }
    }

    pub(crate) async fn publish(&self, message_id: &str) {
        let publish = async_nats::jetstream::message::PublishMessage::build()
            .payload("credit 1".into())
            .message_id(message_id);
        self.js
            .send_publish(self.subject.clone(), publish)
            .await
            .expect("publish")
            .await
            .expect("stored");
    }

    pub(crate) fn terminated(&self) -> u32 {
        self.terminated.load(Ordering::SeqCst)
    }

    pub(crate) async fn delete(self) {
        self.js.delete_stream(&self.name).await.ok();
    }
}

/// A loop running on a task, and the sender that stops it.
struct Running {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<ConsumerSummary, BoxError>>,
}

impl Running {
    async fn stop(self) -> ConsumerSummary {
        let _ = self.stop.send(());
        self.task
            .await
            .expect("the loop's task")
            .unwrap_or_else(|e| panic!("the loop failed: {e}"))
    }
}

/// How a handler of these tests behaves.
#[derive(Clone, Copy)]
enum Handler {
    /// Credits account 1 after `pause`.
    Credit { pause: Duration },
    /// Fails with an error a redelivery might fix (the examples' poison message).
    Fail,
    /// Fails with an error the application marks `Permanent`.
    FailPermanently,
}

/// Counts the handler's runs.
fn handler(
    behaviour: Handler,
    runs: Arc<AtomicU32>,
) -> impl for<'t> Fn(
    &'t sea_orm_inbox::ObservedTransaction,
    Arc<sea_orm_inbox::Received>,
) -> sea_orm_inbox::HandlerFuture<'t, (), BoxError>
+ Send
+ Sync
+ 'static {
    move |txn, _message| {
        runs.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            match behaviour {
                Handler::Credit { pause } => {
                    tokio::time::sleep(pause).await;
                    credit(txn, 1).await.map_err(BoxError::from)
                }
                Handler::Fail => Err(BoxError::from(DbErr::Custom(
                    "the payment provider refused the card".into(),
                ))),
                Handler::FailPermanently => {
                    Err(Permanent::new("the order names a product that does not exist").into())
                }
            }
        })
    }
}

fn inbox() -> Inbox {
    Inbox::new("loop.credit").expect("a valid consumer name")
}

fn start_rabbitmq(
    url: &str,
    queue: &str,
    db: &DatabaseConnection,
    inbox: &Inbox,
    behaviour: Handler,
    runs: &Arc<AtomicU32>,
) -> Running {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(consumers::consume_rabbitmq(
        url.to_owned(),
        Box::leak(queue.to_owned().into_boxed_str()),
        inbox.clone(),
        db.clone(),
        handler(behaviour, Arc::clone(runs)),
        stopped,
    ));
    Running { stop, task }
}

fn start_nats(
    client: &async_nats::Client,
    stream: &str,
    db: &DatabaseConnection,
    inbox: &Inbox,
    behaviour: Handler,
    runs: &Arc<AtomicU32>,
) -> Running {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(consumers::consume_nats(
        client.clone(),
        stream.to_owned(),
        CONSUMER.to_owned(),
        inbox.clone(),
        db.clone(),
        handler(behaviour, Arc::clone(runs)),
        stopped,
    ));
    Running { stop, task }
}

/// Waits until `done()` holds; fails the test with `what` after [`DEADLINE`].
pub(crate) async fn wait_for(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let waited = tokio::time::timeout(DEADLINE, async {
        while !done().await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "{what}: not within {DEADLINE:?}");
}

/// A message whose handler keeps failing goes through the rabbitmq and outbox examples'
/// loop and queue: RabbitMQ dead-letters it after `DELIVERY_LIMIT` deliveries. Before,
/// the examples' classic queue had no delivery limit: the loop nacked it forever.
#[tokio::test]
#[cfg_attr(not(inbox_amqp), ignore = "set INBOX_TEST_AMQP_URL")]
async fn rabbitmq_example_loop_dead_letters_a_failing_message_within_its_limit() {
    with_migrated_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        let queue = Queue::declare().await;
        let runs = Arc::new(AtomicU32::new(0));
        queue.publish("poison-1").await;
        let running = start_rabbitmq(
            &queue.url,
            &queue.topology.queue,
            &conn,
            &inbox(),
            Handler::Fail,
            &runs,
        );
        wait_for("the poison message dead-lettered", async || {
            queue.dead_letters().await == 1
        })
        .await;
        // Long enough for a delivery past the limit to come, if there were one.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let summary = running.stop().await;
        assert_eq!(
            runs.load(Ordering::SeqCst),
            DELIVERY_LIMIT,
            "delivered DELIVERY_LIMIT times, then dead-lettered; {summary}"
        );
        assert_eq!(summary.failed, u64::from(DELIVERY_LIMIT), "{summary}");
        queue.delete().await;
    })
    .await;
}

/// The same on the nats example's loop and stream: the loop terminates the message on the
/// consumer's last delivery (`max_deliver`), with a `MSG_TERMINATED` advisory.
#[tokio::test]
#[cfg_attr(not(inbox_nats), ignore = "set INBOX_TEST_NATS_URL")]
async fn nats_example_loop_terminates_a_failing_message_on_its_last_delivery() {
    with_migrated_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        let stream = Stream::create().await;
        let runs = Arc::new(AtomicU32::new(0));
        stream.publish("poison-1").await;
        let running = start_nats(
            &stream.client,
            &stream.name,
            &conn,
            &inbox(),
            Handler::Fail,
            &runs,
        );
        wait_for("the poison message terminated", async || {
            stream.terminated() == 1
        })
        .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let summary = running.stop().await;
        assert_eq!(
            runs.load(Ordering::SeqCst),
            DELIVERY_LIMIT,
            "delivered max_deliver times; {summary}"
        );
        assert_eq!(summary.dead_lettered, 1, "{summary}");
        stream.delete().await;
    })
    .await;
}

/// A handler error the application marks `Permanent` is dead-lettered on its first
/// delivery, through both example loops.
#[tokio::test]
#[cfg_attr(
    not(all(inbox_amqp, inbox_nats)),
    ignore = "set INBOX_TEST_AMQP_URL and INBOX_TEST_NATS_URL"
)]
async fn example_loops_dead_letter_a_permanent_error_on_its_first_delivery() {
    with_migrated_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        let queue = Queue::declare().await;
        let runs = Arc::new(AtomicU32::new(0));
        queue.publish("unknown-product").await;
        let running = start_rabbitmq(
            &queue.url,
            &queue.topology.queue,
            &conn,
            &inbox(),
            Handler::FailPermanently,
            &runs,
        );
        wait_for("RabbitMQ: dead-lettered", async || {
            queue.dead_letters().await == 1
        })
        .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let summary = running.stop().await;
        assert_eq!(runs.load(Ordering::SeqCst), 1, "RabbitMQ: {summary}");
        assert_eq!(summary.dead_lettered, 1, "RabbitMQ: {summary}");
        queue.delete().await;

        let stream = Stream::create().await;
        let runs = Arc::new(AtomicU32::new(0));
        stream.publish("unknown-product").await;
        let running = start_nats(
            &stream.client,
            &stream.name,
            &conn,
            &inbox(),
            Handler::FailPermanently,
            &runs,
        );
        wait_for("JetStream: terminated", async || stream.terminated() == 1).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let summary = running.stop().await;
        assert_eq!(runs.load(Ordering::SeqCst), 1, "JetStream: {summary}");
        assert_eq!(summary.dead_lettered, 1, "JetStream: {summary}");
        stream.delete().await;
    })
    .await;
}

const MESSAGES: u32 = 40;

/// `MESSAGES` messages, each published twice, through the rabbitmq example's loop (four
/// at a time): each applied once, every copy acked.
async fn rabbitmq_applies_each_message_once(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let queue = Queue::declare().await;
        for _copy in 0..2 {
            for n in 0..MESSAGES {
                queue.publish(&format!("order-{n}")).await;
            }
        }
        let (inbox, runs) = (inbox(), Arc::new(AtomicU32::new(0)));
        let pause = Duration::from_millis(20);
        let running = start_rabbitmq(
            &queue.url,
            &queue.topology.queue,
            &conn,
            &inbox,
            Handler::Credit { pause },
            &runs,
        );
        wait_for("every copy settled", async || {
            let seen = inbox.metrics().snapshot();
            seen.processed + seen.duplicates == u64::from(2 * MESSAGES)
        })
        .await;
        let summary = running.stop().await;
        assert_eq!(
            committed(&conn).await,
            (i64::from(MESSAGES), i64::from(MESSAGES)),
            "markers and effects == messages; {summary}"
        );
        assert_eq!(summary.acked, u64::from(2 * MESSAGES), "{summary}");
        assert_eq!(queue.count(&queue.topology.queue).await, 0);
        queue.delete().await;
    })
    .await;
}

/// The same through the nats example's loop (JetStream's 1 s duplicate window lets the
/// second copies through when published after it).
async fn nats_applies_each_message_once(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let stream = Stream::create().await;
        for copy in 0..2 {
            if copy == 1 {
                tokio::time::sleep(sea_orm_inbox::jetstream::DUPLICATE_WINDOW * 2).await;
            }
            for n in 0..MESSAGES {
                stream.publish(&format!("order-{n}")).await;
            }
        }
        let (inbox, runs) = (inbox(), Arc::new(AtomicU32::new(0)));
        let pause = Duration::from_millis(20);
        let running = start_nats(
            &stream.client,
            &stream.name,
            &conn,
            &inbox,
            Handler::Credit { pause },
            &runs,
        );
        wait_for("every copy settled", async || {
            let seen = inbox.metrics().snapshot();
            seen.processed + seen.duplicates == u64::from(2 * MESSAGES)
        })
        .await;
        let summary = running.stop().await;
        assert_eq!(
            committed(&conn).await,
            (i64::from(MESSAGES), i64::from(MESSAGES)),
            "markers and effects == messages; {summary}"
        );
        assert_eq!(summary.acked, u64::from(2 * MESSAGES), "{summary}");
        stream.delete().await;
    })
    .await;
}

mod concurrent_amqp {
    use super::*;

    inbox_tests::on_every_backend!(needs(inbox_amqp, "set INBOX_TEST_AMQP_URL"); rabbitmq_applies_each_message_once);
}

mod concurrent_nats {
    use super::*;

    inbox_tests::on_every_backend!(needs(inbox_nats, "set INBOX_TEST_NATS_URL"); nats_applies_each_message_once);
}

const SHUTDOWN_MESSAGES: u32 = 20;

/// The options of a loop stopped mid-run: four slow deliveries in flight and a grace
/// period shorter than each, so the shutdown abandons some.
fn impatient() -> ConsumerOptions {
    consumers::options()
        .expect("the examples' options")
        .with_grace(Duration::from_millis(100))
}

/// Stops a loop while deliveries are in flight, abandoning those past the grace period,
/// then runs the example's loop again until every message is applied: none lost, none
/// applied twice.
#[tokio::test]
#[cfg_attr(not(inbox_amqp), ignore = "set INBOX_TEST_AMQP_URL")]
async fn rabbitmq_shutdown_mid_run_loses_nothing() {
    with_migrated_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let queue = Queue::declare().await;
        for n in 0..SHUTDOWN_MESSAGES {
            queue.publish(&format!("order-{n}")).await;
        }
        let (first, runs) = (inbox(), Arc::new(AtomicU32::new(0)));
        let slow = Handler::Credit {
            pause: Duration::from_millis(300),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(
            RabbitMqConsumer::new(&queue.url, amqp_properties(), &queue.topology.queue)
                .with_options(impatient())
                .run(
                    first.clone(),
                    conn.clone(),
                    handler(slow, Arc::clone(&runs)),
                    stopped,
                ),
        );
        wait_for("a few processed", async || {
            first.metrics().snapshot().processed >= 4
        })
        .await;
        let _ = stop.send(());
        let stopped = task.await.expect("the task").expect("the loop");
        assert!(
            stopped.abandoned > 0,
            "the shutdown abandoned nothing in flight: {stopped}"
        );

        let fast = Handler::Credit {
            pause: Duration::ZERO,
        };
        let running = start_rabbitmq(
            &queue.url,
            &queue.topology.queue,
            &conn,
            &inbox(),
            fast,
            &runs,
        );
        wait_for("every message applied", async || {
            committed(&conn).await.0 == i64::from(SHUTDOWN_MESSAGES)
        })
        .await;
        let restarted = running.stop().await;
        let expected = i64::from(SHUTDOWN_MESSAGES);
        assert_eq!(
            committed(&conn).await,
            (expected, expected),
            "before: {stopped}; after: {restarted}"
        );
        assert_eq!(queue.count(&queue.topology.queue).await, 0, "{restarted}");
        assert_eq!(queue.dead_letters().await, 0);
        queue.delete().await;
    })
    .await;
}

/// The same on JetStream: what the shutdown abandoned comes back after the consumer's
/// `ack_wait` and is applied once.
#[tokio::test]
#[cfg_attr(not(inbox_nats), ignore = "set INBOX_TEST_NATS_URL")]
async fn nats_shutdown_mid_run_loses_nothing() {
    with_migrated_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let stream = Stream::create().await;
        for n in 0..SHUTDOWN_MESSAGES {
            stream.publish(&format!("order-{n}")).await;
        }
        let (first, runs) = (inbox(), Arc::new(AtomicU32::new(0)));
        let slow = Handler::Credit {
            pause: Duration::from_millis(300),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(
            JetStreamConsumer::new(stream.client.clone(), &stream.name, CONSUMER)
                .with_options(impatient())
                .run(
                    first.clone(),
                    conn.clone(),
                    handler(slow, Arc::clone(&runs)),
                    stopped,
                ),
        );
        wait_for("a few processed", async || {
            first.metrics().snapshot().processed >= 4
        })
        .await;
        let _ = stop.send(());
        let stopped = task.await.expect("the task").expect("the loop");
        assert!(
            stopped.abandoned > 0,
            "the shutdown abandoned nothing in flight: {stopped}"
        );

        let fast = Handler::Credit {
            pause: Duration::ZERO,
        };
        let running = start_nats(&stream.client, &stream.name, &conn, &inbox(), fast, &runs);
        wait_for("every message applied", async || {
            committed(&conn).await.0 == i64::from(SHUTDOWN_MESSAGES)
        })
        .await;
        let restarted = running.stop().await;
        let expected = i64::from(SHUTDOWN_MESSAGES);
        assert_eq!(
            committed(&conn).await,
            (expected, expected),
            "before: {stopped}; after: {restarted}"
        );
        assert_eq!(stream.terminated(), 0);
        stream.delete().await;
    })
    .await;
}

const CUT_MESSAGES: u32 = 30;

/// The example's loop consumes through a proxy that cuts its connection mid-run: the loop
/// reconnects by itself, and every message is applied once.
#[tokio::test]
#[cfg_attr(not(inbox_amqp), ignore = "set INBOX_TEST_AMQP_URL")]
async fn rabbitmq_loop_reconnects_after_a_cut_connection() {
    with_migrated_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let queue = Queue::declare().await;
        for n in 0..CUT_MESSAGES {
            queue.publish(&format!("order-{n}")).await;
        }
        let proxy = CutProxy::start(&queue.url).await;
        let (inbox, runs) = (inbox(), Arc::new(AtomicU32::new(0)));
        let steady = Handler::Credit {
            pause: Duration::from_millis(50),
        };
        let running = start_rabbitmq(
            proxy.url(),
            &queue.topology.queue,
            &conn,
            &inbox,
            steady,
            &runs,
        );
        wait_for("a few processed", async || {
            inbox.metrics().snapshot().processed >= 5
        })
        .await;
        assert!(
            proxy.cut() > 0,
            "the loop's connection ran through the proxy"
        );
        wait_for("every message applied after the cut", async || {
            committed(&conn).await.0 == i64::from(CUT_MESSAGES)
        })
        .await;
        let summary = running.stop().await;
        let expected = i64::from(CUT_MESSAGES);
        assert_eq!(committed(&conn).await, (expected, expected), "{summary}");
        assert!(summary.reconnects >= 1, "{summary}");
        assert_eq!(queue.count(&queue.topology.queue).await, 0, "{summary}");
        queue.delete().await;
    })
    .await;
}

/// The same on JetStream: the client reconnects through the proxy and the loop goes on
/// pulling; deliveries whose acks the cut lost come back after `ack_wait` as duplicates.
#[tokio::test]
#[cfg_attr(not(inbox_nats), ignore = "set INBOX_TEST_NATS_URL")]
async fn nats_loop_reconnects_after_a_cut_connection() {
    with_migrated_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let stream = Stream::create().await;
        for n in 0..CUT_MESSAGES {
            stream.publish(&format!("order-{n}")).await;
        }
        let proxy = CutProxy::start(&env("INBOX_TEST_NATS_URL")).await;
        let client = async_nats::connect(proxy.url())
            .await
            .expect("connect through the proxy");
        let (inbox, runs) = (inbox(), Arc::new(AtomicU32::new(0)));
        let steady = Handler::Credit {
            pause: Duration::from_millis(50),
        };
        let running = start_nats(&client, &stream.name, &conn, &inbox, steady, &runs);
        wait_for("a few processed", async || {
            inbox.metrics().snapshot().processed >= 5
        })
        .await;
        assert!(
            proxy.cut() > 0,
            "the loop's connection ran through the proxy"
        );
        wait_for("every message applied after the cut", async || {
            committed(&conn).await.0 == i64::from(CUT_MESSAGES)
        })
        .await;
        let summary = running.stop().await;
        let expected = i64::from(CUT_MESSAGES);
        assert_eq!(committed(&conn).await, (expected, expected), "{summary}");
        assert!(
            proxy.connections() >= 2,
            "the client reconnected through the proxy; {summary}"
        );
        stream.delete().await;
    })
    .await;
}
