//! The application's consumer: a RabbitMQ queue read through the `sea_orm_inbox::rabbitmq`
//! adapter, every delivery through `Inbox::process`, one ledger row per message. Run as
//! many replicas as you like against one database: a message published twice, or
//! redelivered to another replica, is credited once.
//!
//! Configured by `DATABASE_URL`, `AMQP_URL` (default: the local broker, guest/guest) and
//! `AMQP_QUEUE` (default `seaorm-app.orders`). It declares the queue with a dead-letter
//! exchange ([`Topology`]), consumes until SIGTERM or Ctrl-C, then prints its counts.

use entity::ledger;
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicQosOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use sea_orm::{
    ActiveModelTrait, ActiveValue::Set, ConnectionTrait, Database, DatabaseConnection, DbErr,
};
use sea_orm_inbox::{Inbox, Outcome, ProcessError, Settlement, rabbitmq};
use std::process::ExitCode;
use uuid::Uuid;

/// The consumer name: the inbox key is (message id, consumer).
const CONSUMER: &str = "seaorm-app.ledger";
/// Deliveries RabbitMQ hands a replica before it acks one: a replica holds few messages
/// another replica could take.
const PREFETCH: u16 = 1;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A work queue and where RabbitMQ sends what the consumer dead-letters: the queue's
/// `x-dead-letter-exchange`, a fanout exchange, routes rejected messages to the
/// dead-letter queue, where they wait for a human.
pub struct Topology {
    /// The queue the replicas consume.
    pub queue: String,
    /// The queue's dead-letter exchange: `<queue>.dead-letter`.
    pub dead_letter_exchange: String,
    /// The queue bound to it: `<queue>.dead`.
    pub dead_letter_queue: String,
}

impl Topology {
    /// The work queue `queue` with its dead-letter exchange and queue.
    pub fn named(queue: &str) -> Self {
        Self {
            queue: queue.to_owned(),
            dead_letter_exchange: format!("{queue}.dead-letter"),
            dead_letter_queue: format!("{queue}.dead"),
        }
    }

    /// Declares the three, durable. Idempotent: every replica (and the producer) may call
    /// it; RabbitMQ refuses it (`PRECONDITION_FAILED`) if the queue exists with other
    /// arguments.
    ///
    /// # Errors
    /// The broker's refusal, or a closed channel.
    pub async fn declare(&self, channel: &Channel) -> Result<(), lapin::Error> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .exchange_declare(
                &self.dead_letter_exchange,
                ExchangeKind::Fanout,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_declare(&self.dead_letter_queue, durable, FieldTable::default())
            .await?;
        channel
            .queue_bind(
                &self.dead_letter_queue,
                &self.dead_letter_exchange,
                "",
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(self.dead_letter_exchange.as_str().into()),
        );
        channel
            .queue_declare(&self.queue, durable, arguments)
            .await
            .map(drop)
    }
}

/// `AMQP_URL`, or the local broker with its default user.
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// `AMQP_QUEUE`, or `seaorm-app.orders`.
pub fn queue_name() -> String {
    std::env::var("AMQP_QUEUE").unwrap_or_else(|_| "seaorm-app.orders".into())
}

/// A connection to RabbitMQ driven by the current tokio runtime.
///
/// # Errors
/// When the broker cannot be reached or refuses the credentials.
pub async fn connect_amqp(url: &str) -> Result<Connection, BoxError> {
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current());
    Connection::connect(url, properties)
        .await
        .map_err(|e| format!("connect to RabbitMQ at {url}: {e}").into())
}

/// Runs the consumer; a failure is a failed exit.
pub fn main() -> ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("seaorm-app: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(counts) => {
            println!("seaorm-app: stopped: {counts}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("seaorm-app: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What one replica did with its deliveries.
#[derive(Default)]
struct Counts {
    deliveries: u64,
    processed: u64,
    duplicates: u64,
    dead_lettered: u64,
    nacked: u64,
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "deliveries={} processed={} duplicates={} dead_lettered={} nacked={}",
            self.deliveries, self.processed, self.duplicates, self.dead_lettered, self.nacked
        )
    }
}

async fn run() -> Result<Counts, BoxError> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let db = Database::connect(&url).await?;
    // The schema is the migrator's job (`sea-orm-cli migrate up`, at deployment); a
    // replica only checks it, once, and refuses to start with the migration to run.
    sea_orm_inbox::verify_schema(&db).await?;
    let inbox = Inbox::new(CONSUMER)?;

    let amqp = connect_amqp(&amqp_url()).await?;
    let channel = amqp.create_channel().await?;
    let topology = Topology::named(&queue_name());
    topology.declare(&channel).await?;
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await?;
    let tag = format!("seaorm-app-{}", std::process::id());
    let consumer = channel
        .basic_consume(
            &topology.queue,
            &tag,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;

    let counts = consume(&db, &inbox, consumer).await?;
    // Closing the channel requeues what this replica held unsettled (a delayed nack).
    amqp.close(200, "shutting down").await?;
    db.close().await?;
    Ok(counts)
}

/// The replica's loop, until SIGTERM or Ctrl-C; the delivery in hand is settled first.
async fn consume(
    db: &DatabaseConnection,
    inbox: &Inbox,
    mut consumer: lapin::Consumer,
) -> Result<Counts, BoxError> {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    println!("seaorm-app: {} consuming", consumer.tag());
    let mut counts = Counts::default();
    loop {
        let message = tokio::select! {
            _ = terminate.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            next = consumer.next() => match next {
                Some(message) => message?,
                None => return Err("RabbitMQ cancelled the consumer".into()),
            },
        };
        let result = match rabbitmq::delivery(&message) {
            Ok(delivery) => {
                let message_id = delivery.message_id().as_uuid();
                let amount = 10; // a real handler parses it from `message.data`
                inbox
                    .process(db, delivery, |txn| {
                        Box::pin(credit(txn, message_id, amount))
                    })
                    .await
            }
            // No message_id, or a nil one: no redelivery can fix it.
            Err(err) => Err(ProcessError::Inbox(err)),
        };
        let settlement = Settlement::for_delivery(&result, rabbitmq::delivery_count(&message));
        rabbitmq::settle(&message, settlement).await?;

        counts.deliveries += 1;
        match (&result, settlement) {
            (Ok(Outcome::Processed(())), _) => counts.processed += 1,
            (Ok(Outcome::Duplicate), _) => counts.duplicates += 1,
            (_, Settlement::DeadLetter) => counts.dead_lettered += 1,
            _ => counts.nacked += 1,
        }
        let id = message.properties.message_id().as_ref();
        let id = id.map_or("(none)", |id| id.as_str());
        match result {
            Ok(outcome) => println!("seaorm-app: {id}: {outcome:?} -> {settlement:?}"),
            Err(err) => println!("seaorm-app: {id}: {err} -> {settlement:?}"),
        }
    }
    Ok(counts)
}

/// The business write, through the inbox's transaction only.
async fn credit(txn: &impl ConnectionTrait, message_id: Uuid, amount: i64) -> Result<(), DbErr> {
    ledger::ActiveModel {
        message_id: Set(message_id),
        amount: Set(amount),
        ..Default::default()
    }
    .insert(txn)
    .await
    .map(drop)
}
