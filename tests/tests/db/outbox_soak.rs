//! The outbox's fault soak, end to end on real servers and brokers (issue 19), per backend:
//!
//! - 300 messages wait in an input RabbitMQ queue of the run's own. Two consumer replicas
//!   (a pool, a connection and an [`Inbox`] each) consume them through `Inbox::process`;
//!   each handler writes one business row and enqueues one event (`txn.enqueue`, its id
//!   derived from the input message's) in the handler's transaction. Every event has one
//!   of 16 ordering keys.
//! - Two relays (a pool each) publish the events: the even ones to a second RabbitMQ
//!   queue, the odd ones to a JetStream stream. A downstream consumer with its own inbox
//!   (consumer `soak.downstream`) reads both and writes one effect row per event.
//! - Faults, mid-stream:
//!   1. a third relay runs in a child process (this test binary again, running
//!      [`child_relay`]), which stops inside its publisher right after the 5th broker
//!      confirmation, before marking anything sent, and is killed there with SIGKILL; its
//!      leases end and the other relays publish its rows again, with the same ids;
//!   2. every connection of the relays to RabbitMQ is cut (a TCP proxy in front of the
//!      broker closes them) right before a relay publishes, once a third of the events
//!      went out; the publisher reconnects;
//!   3. PostgreSQL and MariaDB, a database restart as its clients see it, twice: the
//!      handler of input message 100 cuts every connection of the replicas and relays
//!      (a proxy in front of the server closes them) with its own transaction open; and
//!      once half the events went out, the first COMMIT after a broker confirmation (a
//!      relay's marking, as a rule) reaches the server, which commits, its reply is lost
//!      with the connection, and every other connection is cut. Simulated: the system
//!      server is shared with the suites running in parallel, so it is not restarted
//!      here (`postgres_restart` does that, alone). SQLite is embedded: it has no
//!      connection to cut, and skips this fault;
//!   4. a poison event, for a queue declared `x-max-length: 0` with
//!      `x-overflow: reject-publish`, which RabbitMQ refuses (`basic.nack`) every time: it
//!      is retried, parked dead after its attempts, and its key stops no other key.
//! - The counts are printed, and appended to `$INBOX_SOAK_REPORT` (CI prints that file):
//!   every consumed message has exactly one business row, one sent outbox row and one
//!   downstream effect, none lost, none applied twice, however many copies the brokers
//!   carried; the poison row is dead with RabbitMQ's refusal as its error.

use futures_util::StreamExt;
use inbox_tests::{
    Backend, CutProxy, LostReplyProxy, StopsAfterConfirms, append_to_soak_report, connect_url, run,
    run_and_kill_child_relay, scalar_i64, stmt, with_migrated_outbox_db,
};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use sea_orm::{ConnectionTrait, DatabaseConnection};
use sea_orm_inbox::jetstream::JetStreamPublisher;
use sea_orm_inbox::rabbitmq::RabbitMqPublisher;
use sea_orm_inbox::{
    Inbox, OutboxExt, OutboxMessage, OutgoingMessage, ProcessError, PublishError, Publisher, Relay,
    RelayOptions, Settlement, jetstream, list_dead_messages, rabbitmq,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use uuid::Uuid;

/// Input messages per backend: enough for every fault to land mid-stream, few enough for
/// a backend's run to take 8-15 s on two shared cores (most of it the child's lease).
const MESSAGES: usize = 300;
/// Ordering keys of the events: a dead or leased row holds up its own key only.
const KEYS: usize = 16;
/// The relays' lease: how long the rows of the killed child wait before the other relays
/// publish them again.
const LEASE: Duration = Duration::from_secs(4);
/// The attempts a row gets: the poison row uses them all; a healthy row loses at most one
/// per fault (the child's claim, a cut broker, a cut database), so it never gets near.
const MAX_ATTEMPTS: u32 = 6;
/// How long the whole run may take before it fails with its counts so far.
const DEADLINE: Duration = Duration::from_secs(90);
/// Broker confirmations the child relay gets before it stops, unmarked, and is killed.
const CHILD_CONFIRMS: usize = 5;
/// The child relay's database URL, set only for the child process.
const CHILD_DB_URL: &str = "INBOX_OUTBOX_SOAK_CHILD_DB_URL";
/// The child relay's test, as the child process's filter names it.
const CHILD_TEST: &str = "outbox_soak::child_relay";
/// The JetStream subjects start with this; every other destination is a RabbitMQ queue.
const SUBJECT_PREFIX: &str = "outbox-soak.";
/// The queue that refuses every message (the poison's destination) starts with this.
const REFUSING_PREFIX: &str = "outbox-soak-full-";
/// The input message whose handler cuts every database connection, its transaction open.
const CUT_IN_HANDLER: i64 = MESSAGES as i64 / 3;
/// The inbox consumer names of the replicas and of the downstream consumer.
const UPSTREAM: &str = "soak.orders";
const DOWNSTREAM: &str = "soak.downstream";
/// A queue or stream a failed run leaves behind deletes itself after this.
const LEFTOVER_EXPIRES: Duration = Duration::from_secs(600);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn env(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| panic!("set {var} to run this test"))
}

/// The names of one run's queues and stream.
struct Names {
    input: String,
    output: String,
    full: String,
    stream: String,
    subject: String,
}

impl Names {
    fn new() -> Self {
        let run = Uuid::new_v4().simple().to_string();
        Self {
            input: format!("outbox-soak-in-{run}"),
            output: format!("outbox-soak-out-{run}"),
            full: format!("{REFUSING_PREFIX}{run}"),
            stream: format!("OUTBOX_SOAK_{run}"),
            subject: format!("{SUBJECT_PREFIX}{run}"),
        }
    }

    /// Where the event of input message `n` goes: even to RabbitMQ, odd to JetStream.
    fn destination(&self, n: i64) -> &str {
        if n % 2 == 0 {
            &self.output
        } else {
            &self.subject
        }
    }
}

/// What the run's parts count as they go.
#[derive(Default)]
struct Tally {
    /// Confirmed publishes per outbox message id: the relays', and the child's it printed.
    published: Mutex<HashMap<Uuid, u32>>,
    /// Input deliveries the replicas handled (redeliveries included).
    input_deliveries: AtomicU64,
    /// Input messages a replica's `process` reported processed.
    processed: AtomicU64,
    /// Deliveries of events to the downstream consumer (repeated copies included).
    downstream_deliveries: AtomicU64,
}

impl Tally {
    fn record_publish(&self, id: Uuid) {
        *self
            .published
            .lock()
            .expect("the tally's lock")
            .entry(id)
            .or_default() += 1;
    }

    /// (all confirmed publishes, distinct messages published)
    fn publishes(&self) -> (u64, u64) {
        let published = self.published.lock().expect("the tally's lock");
        (
            published.values().map(|n| u64::from(*n)).sum(),
            published.len() as u64,
        )
    }
}

/// lapin's connection properties on the test's tokio runtime.
fn amqp_properties() -> ConnectionProperties {
    ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current())
}

async fn amqp_connect(url: &str) -> Result<Connection, lapin::Error> {
    Connection::connect(url, amqp_properties()).await
}

/// The library's RabbitMQ publisher into the default exchange, on a connection of its own.
async fn rabbitmq_publisher(url: &str) -> RabbitMqPublisher {
    RabbitMqPublisher::connect(url, amqp_properties(), "")
        .await
        .expect("connect the publisher to RabbitMQ")
}

/// The faults the soak's parts fire themselves, each once, at the moment it must hit.
struct Faults {
    /// The proxy between the replicas and relays and the database (none on SQLite).
    db: Option<Arc<LostReplyProxy>>,
    /// The proxy between the relays and RabbitMQ.
    broker: CutProxy,
    /// Set by the replica that cut every database connection from inside its handler.
    db_cut_in_handler: Arc<AtomicBool>,
    /// Set by the relay that cut the broker connections right before a publish.
    broker_cut: AtomicBool,
    /// The broker connections that cut closed.
    broker_connections_cut: AtomicU64,
    /// Set by the relay that armed the database proxy to lose the next COMMIT's reply.
    commit_reply_armed: AtomicBool,
}

impl Faults {
    /// Fault 2: every broker connection cut right before a RabbitMQ publish of an event,
    /// once a third of the events went out.
    fn before_publish(&self, message: &OutboxMessage, tally: &Tally) {
        let event_to_rabbitmq = !message.destination.starts_with(SUBJECT_PREFIX)
            && !message.destination.starts_with(REFUSING_PREFIX);
        if event_to_rabbitmq
            && tally.publishes().1 >= MESSAGES as u64 / 3
            && !self.broker_cut.swap(true, Ordering::SeqCst)
        {
            self.broker_connections_cut
                .store(self.broker.cut(), Ordering::SeqCst);
        }
    }

    /// Fault 3, second half: once half the events went out, the first COMMIT after a
    /// broker confirmation (this batch's marking, unless another relay or replica commits
    /// first) reaches the database, which commits, and its reply is lost with the
    /// connection; the driver then cuts every other connection, as a restart would.
    fn after_confirm(&self, tally: &Tally) {
        if let Some(db) = &self.db
            && tally.publishes().1 >= MESSAGES as u64 / 2
            && !self.commit_reply_armed.swap(true, Ordering::SeqCst)
        {
            db.arm();
        }
    }
}

/// The relays' publisher: JetStream for the subjects, RabbitMQ for the rest; counts what
/// the brokers confirmed, and fires the relays' faults (none in the child). The poison
/// goes to RabbitMQ directly, past the proxy: its refusals are the only errors it records.
struct Routed<'t> {
    rabbitmq: RabbitMqPublisher,
    refusing: RabbitMqPublisher,
    jetstream: JetStreamPublisher,
    tally: &'t Tally,
    faults: Option<&'t Faults>,
}

impl<'t> Routed<'t> {
    async fn connect(amqp_url: &str, tally: &'t Tally, faults: Option<&'t Faults>) -> Self {
        let nats = async_nats::connect(env("INBOX_TEST_NATS_URL"))
            .await
            .expect("connect to NATS");
        Self {
            rabbitmq: rabbitmq_publisher(amqp_url).await,
            refusing: rabbitmq_publisher(&env("INBOX_TEST_AMQP_URL")).await,
            jetstream: JetStreamPublisher::new(async_nats::jetstream::new(nats)),
            tally,
            faults,
        }
    }
}

impl Publisher for Routed<'_> {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        if let Some(faults) = self.faults {
            faults.before_publish(message, self.tally);
        }
        if message.destination.starts_with(SUBJECT_PREFIX) {
            self.jetstream.publish(message).await?;
        } else if message.destination.starts_with(REFUSING_PREFIX) {
            self.refusing.publish(message).await?;
        } else {
            self.rabbitmq.publish(message).await?;
        }
        self.tally.record_publish(message.message_id.as_uuid());
        if let Some(faults) = self.faults {
            faults.after_confirm(self.tally);
        }
        Ok(())
    }
}

/// Relay options with a short lease and fast retries, so the faults resolve within the
/// run.
fn relay_options(child: bool) -> RelayOptions {
    RelayOptions {
        batch_size: if child { 10 } else { 20 },
        lease: LEASE,
        publish_timeout: Duration::from_secs(2),
        max_attempts: MAX_ATTEMPTS,
        backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(200),
        poll_interval: Duration::from_millis(100),
    }
}

/// The child relay process of the soak (fault 1): relays the soak's outbox until it stops
/// in its publisher (see [`StopsAfterConfirms`]) and is killed there. Only the soak runs
/// it, with the database in `INBOX_OUTBOX_SOAK_CHILD_DB_URL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the outbox soak's child relay: the soak runs it in a process of its own and kills it"]
async fn child_relay() {
    let url = std::env::var(CHILD_DB_URL).unwrap_or_else(|_| {
        panic!("{CHILD_TEST} is the outbox soak's child relay process: only the soak runs it")
    });
    let db = connect_url(&url, 2).await;
    let tally = Tally::default();
    let publisher = StopsAfterConfirms::new(
        Routed::connect(&env("INBOX_TEST_AMQP_URL"), &tally, None).await,
        CHILD_CONFIRMS,
    );
    let relay = Relay::new(publisher)
        .with_options(relay_options(true))
        .expect("valid options");
    relay.run(&db, std::future::pending()).await;
}

/// Declares a queue of the run's own with `arguments` (and an expiry).
async fn declare(channel: &Channel, queue: &str, mut arguments: FieldTable) {
    let expires = u32::try_from(LEFTOVER_EXPIRES.as_millis()).expect("fits");
    arguments.insert("x-expires".into(), AMQPValue::LongUInt(expires));
    channel
        .queue_declare(queue, QueueDeclareOptions::default(), arguments)
        .await
        .unwrap_or_else(|e| panic!("declare queue {queue}: {e}"));
}

/// Publishes the input messages 0..MESSAGES (the number as the body, a random message id)
/// with publisher confirms.
async fn publish_input(channel: &Channel, queue: &str) {
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    let mut confirmations = Vec::with_capacity(MESSAGES);
    for n in 0..MESSAGES {
        let properties =
            BasicProperties::default().with_message_id(Uuid::new_v4().to_string().into());
        let confirm = channel
            .basic_publish(
                "",
                queue,
                BasicPublishOptions::default(),
                n.to_string().as_bytes(),
                properties,
            )
            .await
            .expect("publish an input message");
        confirmations.push(confirm);
    }
    for confirm in confirmations {
        let confirmation = confirm.await.expect("a confirmation");
        assert!(
            matches!(confirmation, Confirmation::Ack(None)),
            "{confirmation:?}"
        );
    }
}

/// The number in a message body.
fn number(body: &[u8]) -> i64 {
    std::str::from_utf8(body)
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(|| panic!("a message body that is not a number: {body:?}"))
}

/// One consumer replica: its own RabbitMQ connection (prefetch 10) and its own pool;
/// consumes until `stop`. The handler writes the business row and enqueues the event.
async fn replica(
    amqp_url: &str,
    names: &Names,
    db: &DatabaseConnection,
    tally: &Tally,
    faults: &Faults,
    mut stop: watch::Receiver<bool>,
) -> Inbox {
    let inbox = Inbox::new(UPSTREAM).expect("valid name");
    let connection = amqp_connect(amqp_url).await.expect("connect to RabbitMQ");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .basic_qos(10, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut consumer = channel
        .basic_consume(
            &names.input,
            "",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume the input");
    let backend = db.get_database_backend();
    loop {
        let message = tokio::select! {
            _ = stop.changed() => break,
            next = consumer.next() => next.expect("the input consumer ended").expect("a delivery"),
        };
        tally.input_deliveries.fetch_add(1, Ordering::Relaxed);
        let n = number(&message.data);
        let delivery = rabbitmq::delivery(&message).expect("an input message id");
        let incoming = delivery.message_id();
        let result = inbox
            .process(db, delivery, |txn| {
                let event = OutgoingMessage::new(names.destination(n), n.to_string())
                    .message_id(incoming.outgoing(UPSTREAM, 0))
                    .key(format!("k{}", n % KEYS as i64));
                // Fault 3, first half: the connections cut under an open transaction.
                let cut = match &faults.db {
                    Some(proxy) if n == CUT_IN_HANDLER => {
                        Some((Arc::clone(proxy), Arc::clone(&faults.db_cut_in_handler)))
                    }
                    _ => None,
                };
                Box::pin(async move {
                    txn.execute_raw(stmt(
                        backend,
                        "INSERT INTO soak_business (n) VALUES (?)",
                        vec![n.into()],
                    ))
                    .await?;
                    txn.enqueue(event).await?;
                    if let Some((proxy, fired)) = cut
                        && !fired.swap(true, Ordering::SeqCst)
                    {
                        proxy.heal();
                    }
                    Ok::<_, BoxError>(())
                })
            })
            .await;
        if matches!(result, Ok(sea_orm_inbox::Outcome::Processed(()))) {
            tally.processed.fetch_add(1, Ordering::Relaxed);
        }
        assert!(
            !matches!(Settlement::of(&result), Settlement::DeadLetter),
            "input message {n} would be dead-lettered: {result:?}"
        );
        rabbitmq::settle(&message, Settlement::of(&result))
            .await
            .expect("settle an input message");
    }
    connection.close(200, "replica stopping").await.ok();
    inbox
}

/// The downstream consumer's handler: one effect row per event.
async fn apply(
    inbox: &Inbox,
    db: &DatabaseConnection,
    delivery: Result<sea_orm_inbox::Delivery, sea_orm_inbox::InboxError>,
    body: &[u8],
) -> Result<sea_orm_inbox::Outcome<()>, ProcessError<sea_orm::DbErr>> {
    let n = number(body);
    let backend = db.get_database_backend();
    let delivery = delivery.map_err(ProcessError::Inbox)?;
    inbox
        .process(db, delivery, |txn| {
            Box::pin(async move {
                txn.execute_raw(stmt(
                    backend,
                    "INSERT INTO soak_effect (n) VALUES (?)",
                    vec![n.into()],
                ))
                .await
                .map(drop)
            })
        })
        .await
}

/// How the downstream consumer settles an event: a transient failure (a busy SQLite file)
/// is redelivered; nothing may be dead-lettered, that would lose the effect.
fn downstream_settlement(
    result: &Result<sea_orm_inbox::Outcome<()>, ProcessError<sea_orm::DbErr>>,
) -> Settlement {
    let settlement = Settlement::of(result);
    assert_ne!(settlement, Settlement::DeadLetter, "{result:?}");
    settlement
}

/// The downstream consumer of the RabbitMQ events, until `stop`.
async fn downstream_rabbitmq(
    amqp_url: &str,
    queue: &str,
    inbox: &Inbox,
    db: &DatabaseConnection,
    tally: &Tally,
    mut stop: watch::Receiver<bool>,
) {
    let connection = amqp_connect(amqp_url).await.expect("connect to RabbitMQ");
    let channel = connection.create_channel().await.expect("channel");
    let mut consumer = channel
        .basic_consume(
            queue,
            "",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume the events");
    loop {
        let message = tokio::select! {
            _ = stop.changed() => break,
            next = consumer.next() => next.expect("the event consumer ended").expect("a delivery"),
        };
        tally.downstream_deliveries.fetch_add(1, Ordering::Relaxed);
        let result = apply(inbox, db, rabbitmq::delivery(&message), &message.data).await;
        rabbitmq::settle(&message, downstream_settlement(&result))
            .await
            .expect("settle an event");
    }
    connection.close(200, "downstream stopping").await.ok();
}

/// The downstream consumer of the JetStream events, until `stop`.
async fn downstream_jetstream(
    consumer: &async_nats::jetstream::consumer::PullConsumer,
    inbox: &Inbox,
    db: &DatabaseConnection,
    tally: &Tally,
    mut stop: watch::Receiver<bool>,
) {
    let mut messages = consumer.messages().await.expect("the event stream");
    loop {
        let message = tokio::select! {
            _ = stop.changed() => break,
            next = messages.next() => next.expect("the event stream ended").expect("a delivery"),
        };
        tally.downstream_deliveries.fetch_add(1, Ordering::Relaxed);
        let result = apply(inbox, db, jetstream::delivery(&message), &message.payload).await;
        jetstream::settle(&message, downstream_settlement(&result))
            .await
            .expect("settle an event");
    }
}

/// Waits until `ready` holds, checking every 50 ms, or fails naming `what` at the run's
/// deadline.
async fn until(started: Instant, what: &str, mut ready: impl FnMut() -> bool) {
    while !ready() {
        assert!(
            started.elapsed() < DEADLINE,
            "{what}: not reached within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The counts the database holds at the end.
#[derive(Debug)]
struct Stored {
    business: i64,
    business_distinct: i64,
    outbox: i64,
    sent: i64,
    dead: i64,
    effects: i64,
    effects_distinct: i64,
}

impl Stored {
    async fn read(db: &DatabaseConnection) -> Self {
        Self {
            business: scalar_i64(db, "SELECT COUNT(*) FROM soak_business").await,
            business_distinct: scalar_i64(db, "SELECT COUNT(DISTINCT n) FROM soak_business").await,
            outbox: scalar_i64(db, "SELECT COUNT(*) FROM outbox").await,
            sent: scalar_i64(db, "SELECT COUNT(*) FROM outbox WHERE sent_at IS NOT NULL").await,
            dead: scalar_i64(db, "SELECT COUNT(*) FROM outbox WHERE dead_at IS NOT NULL").await,
            effects: scalar_i64(db, "SELECT COUNT(*) FROM soak_effect").await,
            effects_distinct: scalar_i64(db, "SELECT COUNT(DISTINCT n) FROM soak_effect").await,
        }
    }

    /// Every input message consumed, relayed and applied downstream, the poison parked.
    fn settled(&self) -> bool {
        let n = MESSAGES as i64;
        self.business_distinct == n
            && self.sent == n
            && self.dead == 1
            && self.effects_distinct == n
    }
}

async fn outbox_soak(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let started = Instant::now();
        let amqp_url = env("INBOX_TEST_AMQP_URL");
        let direct = db.connect().await;
        run(&direct, "CREATE TABLE soak_business (n BIGINT NOT NULL)").await;
        run(&direct, "CREATE TABLE soak_effect (n BIGINT NOT NULL)").await;
        let names = Names::new();

        // The brokers: the input, output and refusing queues, and the event stream.
        let admin = amqp_connect(&amqp_url).await.expect("connect to RabbitMQ");
        let channel = admin.create_channel().await.expect("channel");
        declare(&channel, &names.input, FieldTable::default()).await;
        declare(&channel, &names.output, FieldTable::default()).await;
        let mut refusing = FieldTable::default();
        refusing.insert("x-max-length".into(), AMQPValue::LongInt(0));
        refusing.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        declare(&channel, &names.full, refusing).await;
        let nats = async_nats::connect(env("INBOX_TEST_NATS_URL"))
            .await
            .expect("connect to NATS");
        let js = async_nats::jetstream::new(nats);
        let stream = js
            .create_stream(async_nats::jetstream::stream::Config {
                name: names.stream.clone(),
                subjects: vec![names.subject.clone()],
                max_age: LEFTOVER_EXPIRES,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await
            .expect("create the event stream");
        let events = stream
            .create_consumer(async_nats::jetstream::consumer::pull::Config {
                durable_name: Some("downstream".into()),
                ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
                ..Default::default()
            })
            .await
            .expect("the event consumer");

        // Fault 4 waits in the outbox from the start, under a key of its own.
        let poison = direct
            .enqueue(OutgoingMessage::new(names.full.clone(), "poison").key("poison"))
            .await
            .expect("enqueue the poison event");
        publish_input(&channel, &names.input).await;

        // The replicas and relays reach the database through a proxy that can cut every
        // connection (fault 3), and the relays reach RabbitMQ through one (fault 2).
        let faults = Faults {
            db: match backend {
                Backend::Sqlite => None,
                _ => Some(Arc::new(LostReplyProxy::start(db).await)),
            },
            broker: CutProxy::start(&amqp_url).await,
            db_cut_in_handler: Arc::default(),
            broker_cut: AtomicBool::default(),
            broker_connections_cut: AtomicU64::default(),
            commit_reply_armed: AtomicBool::default(),
        };
        let mut pools = Vec::new();
        for _ in 0..4 {
            pools.push(match &faults.db {
                Some(proxy) => proxy.connect().await,
                None => db.connect().await,
            });
        }
        let tally = Tally::default();
        let relays = [
            Relay::new(Routed::connect(faults.broker.url(), &tally, Some(&faults)).await)
                .with_options(relay_options(false))
                .expect("valid options"),
            Relay::new(Routed::connect(faults.broker.url(), &tally, Some(&faults)).await)
                .with_options(relay_options(false))
                .expect("valid options"),
        ];
        let downstream = Inbox::new(DOWNSTREAM).expect("valid name");
        let (stop_consumers, consumers_stop) = watch::channel(false);
        let (start_relays, relays_started) = watch::channel(false);
        let (stop_relays, relays_stop) = watch::channel(false);
        let mut child_confirmed = Vec::new();

        let relay = |index: usize| {
            let mut started_rx = relays_started.clone();
            let mut stop_rx = relays_stop.clone();
            let relay = &relays[index];
            let pool = &pools[2 + index];
            async move {
                started_rx.wait_for(|go| *go).await.ok();
                relay
                    .run(pool, async move {
                        stop_rx.wait_for(|stop| *stop).await.ok();
                    })
                    .await;
            }
        };
        let driver = async {
            // Fault 1: a relay killed between the broker's confirmation and its mark.
            // A quarter of the events are in (every key has some): the child's first batch
            // is full, the poison row (the oldest) and 9 events of 9 keys.
            until(started, "a quarter of the input consumed", || {
                tally.processed.load(Ordering::Relaxed) >= MESSAGES as u64 / 4
            })
            .await;
            child_confirmed =
                run_and_kill_child_relay(CHILD_TEST, &[(CHILD_DB_URL, db.url())], CHILD_CONFIRMS)
                    .await;
            for id in &child_confirmed {
                tally.record_publish(*id);
            }
            start_relays.send_replace(true);
            // Fault 3, second half: once a relay's COMMIT reply was lost, every other
            // connection goes too, as in a restart.
            if let Some(proxy) = &faults.db {
                until(started, "a COMMIT reply lost", || {
                    proxy.replies_dropped() > 0
                })
                .await;
                proxy.heal();
            }
            loop {
                let stored = Stored::read(&direct).await;
                if stored.settled() {
                    break;
                }
                assert!(
                    started.elapsed() < DEADLINE,
                    "not settled within {DEADLINE:?}: {stored:?}, publishes {:?}",
                    tally.publishes()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            stop_relays.send_replace(true);
            // Every copy the brokers still hold reaches the downstream consumer before it
            // stops, so the counts include the late repeats.
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            loop {
                let queued = channel
                    .queue_declare(&names.output, passive, FieldTable::default())
                    .await
                    .expect("the output queue's state")
                    .message_count();
                let info = events.get_info().await.expect("the event consumer's state");
                if queued == 0 && info.num_pending == 0 && info.num_ack_pending == 0 {
                    break;
                }
                assert!(
                    started.elapsed() < DEADLINE,
                    "the brokers still hold events"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            stop_consumers.send_replace(true);
        };
        let (upstream_a, upstream_b, (), (), (), (), ()) = tokio::join!(
            replica(
                &amqp_url,
                &names,
                &pools[0],
                &tally,
                &faults,
                consumers_stop.clone()
            ),
            replica(
                &amqp_url,
                &names,
                &pools[1],
                &tally,
                &faults,
                consumers_stop.clone()
            ),
            relay(0),
            relay(1),
            downstream_rabbitmq(
                &amqp_url,
                &names.output,
                &downstream,
                &direct,
                &tally,
                consumers_stop.clone()
            ),
            downstream_jetstream(
                &events,
                &downstream,
                &direct,
                &tally,
                consumers_stop.clone()
            ),
            driver,
        );

        let stored = Stored::read(&direct).await;
        let (publishes, distinct) = tally.publishes();
        let relayed = relays
            .iter()
            .map(|relay| relay.metrics().snapshot())
            .fold((0, 0, 0), |(failed, dead, lost), m| {
                (failed + m.failed, dead + m.dead, lost + m.lost_leases)
            });
        let up = [
            upstream_a.metrics().snapshot(),
            upstream_b.metrics().snapshot(),
        ];
        let down = downstream.metrics().snapshot();
        let line = format!(
            "outbox soak on {backend:?}: consumed {consumed} ({deliveries} input deliveries, \
             {up_dup} duplicates), business rows {business}, events enqueued {events}, \
             publishes {publishes} ({republished} republished copies; child relay \
             confirmed {child} before SIGKILL), downstream deliveries {down_deliveries}, \
             downstream effects {effects} ({down_dup} duplicates dropped), dead rows {dead}; \
             faults: child relay SIGKILLed, {broker_cut} broker connections cut before a \
             publish ({conns} relay connections to RabbitMQ through the cut proxy), database: {db_faults}; {failed} failed \
             publishes, {lost} lost leases; replicas: {retries} transient retries, \
             {up_failed} deliveries failed and nacked; {secs:.1} s",
            consumed = stored.business_distinct,
            deliveries = tally.input_deliveries.load(Ordering::Relaxed),
            up_dup = up[0].duplicates + up[1].duplicates,
            business = stored.business,
            events = stored.outbox - 1,
            republished = publishes - distinct,
            child = child_confirmed.len(),
            down_deliveries = tally.downstream_deliveries.load(Ordering::Relaxed),
            effects = stored.effects,
            down_dup = down.duplicates,
            dead = stored.dead,
            broker_cut = faults.broker_connections_cut.load(Ordering::SeqCst),
            db_faults = if faults.db.is_some() {
                "every connection cut inside a handler's transaction, later a COMMIT reply \
                 lost after a broker confirmation and every connection cut"
            } else {
                "none (SQLite is embedded: no connection to cut)"
            },
            retries = up[0].transient_retries + up[1].transient_retries,
            up_failed =
                up[0].failures + up[0].handler_errors + up[1].failures + up[1].handler_errors,
            failed = relayed.0,
            lost = relayed.2,
            conns = faults.broker.connections(),
            secs = started.elapsed().as_secs_f64(),
        );
        println!("{line}");
        append_to_soak_report(&line);

        // Exactly once, end to end.
        let n = MESSAGES as i64;
        assert_eq!(
            (stored.business, stored.business_distinct),
            (n, n),
            "one business row per consumed message: {line}"
        );
        assert_eq!(
            (stored.outbox, stored.sent, stored.dead),
            (n + 1, n, 1),
            "one event per message, all sent, the poison dead: {line}"
        );
        assert_eq!(
            (stored.effects, stored.effects_distinct),
            (n, n),
            "one downstream effect per message, 0 lost, 0 applied twice: {line}"
        );
        assert_eq!(
            scalar_i64(
                &direct,
                &format!("SELECT COUNT(*) FROM soak_effect WHERE n < 0 OR n >= {n}")
            )
            .await,
            0
        );
        // The faults happened, and did what they should.
        assert_eq!(child_confirmed.len(), CHILD_CONFIRMS);
        assert!(
            child_confirmed
                .iter()
                .all(|id| tally.published.lock().expect("lock")[id] >= 2),
            "every message the killed child had confirmed was published again: {line}"
        );
        assert!(
            faults.broker_connections_cut.load(Ordering::SeqCst) >= 1,
            "the broker cut closed a connection: {line}"
        );
        // Both relays' first connections were cut: the relay that fired the cut, about to
        // publish to RabbitMQ, needed a new one.
        assert!(
            faults.broker.connections() > 2,
            "a relay's publisher reconnected after the cut: {line}"
        );
        if let Some(proxy) = &faults.db {
            assert!(
                faults.db_cut_in_handler.load(Ordering::SeqCst),
                "a handler cut the database connections: {line}"
            );
            proxy.expect_reply_dropped();
        }
        assert!(
            publishes > distinct,
            "repeated copies were published: {line}"
        );
        let dead = list_dead_messages(&direct, 10)
            .await
            .expect("the dead rows");
        assert_eq!(dead.len(), 1, "{dead:?}");
        assert_eq!(dead[0].message_id, poison, "{dead:?}");
        assert_eq!(dead[0].attempts, MAX_ATTEMPTS, "{dead:?}");
        let error = dead[0].last_error.as_deref().unwrap_or_default();
        assert!(error.contains("basic.nack"), "{error}");
        assert_eq!(relayed.1, 1, "only the poison died: {line}");

        channel
            .queue_delete(&names.input, QueueDeleteOptions::default())
            .await
            .ok();
        channel
            .queue_delete(&names.output, QueueDeleteOptions::default())
            .await
            .ok();
        channel
            .queue_delete(&names.full, QueueDeleteOptions::default())
            .await
            .ok();
        js.delete_stream(&names.stream).await.ok();
        admin.close(200, "soak over").await.ok();
        for pool in pools {
            pool.close().await.ok();
        }
        direct.close().await.ok();
    })
    .await;
}

/// One test per backend; each needs both brokers and its database.
mod sqlite {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[cfg_attr(
        not(all(inbox_amqp, inbox_nats)),
        ignore = "set INBOX_TEST_AMQP_URL and INBOX_TEST_NATS_URL"
    )]
    async fn outbox_soak() {
        super::outbox_soak(inbox_tests::Backend::Sqlite).await
    }
}

mod postgres {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[cfg_attr(
        not(all(inbox_amqp, inbox_nats)),
        ignore = "set INBOX_TEST_AMQP_URL and INBOX_TEST_NATS_URL"
    )]
    #[cfg_attr(
        all(inbox_amqp, inbox_nats, not(inbox_postgres)),
        ignore = "set INBOX_TEST_POSTGRES_URL"
    )]
    async fn outbox_soak() {
        super::outbox_soak(inbox_tests::Backend::Postgres).await
    }
}

mod mysql {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[cfg_attr(
        not(all(inbox_amqp, inbox_nats)),
        ignore = "set INBOX_TEST_AMQP_URL and INBOX_TEST_NATS_URL"
    )]
    #[cfg_attr(
        all(inbox_amqp, inbox_nats, not(inbox_mysql)),
        ignore = "set INBOX_TEST_MYSQL_URL"
    )]
    async fn outbox_soak() {
        super::outbox_soak(inbox_tests::Backend::MySql).await
    }
}
