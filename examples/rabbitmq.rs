//! A RabbitMQ consumer to copy: every delivery goes through `Inbox::process`, and the
//! `sea_orm_inbox::rabbitmq` adapter maps it in (message id, send time) and settles it
//! (ack, nack with a delay, reject to the dead-letter queue).
//!
//! The demo publishes four orders, one of them twice (a publisher retry), and one message
//! whose id was never set; it consumes until each is settled and prints the counts:
//! 4 credited, 1 duplicate acked, 1 dead-lettered.
//!
//! ```text
//! cargo run --example rabbitmq                     # local broker, SQLite file
//! AMQP_URL=amqp://user:pass@host:5672/%2f DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo run --example rabbitmq
//! ```

use futures_util::StreamExt;
use inbox_examples::{balance, connect_replica, credit_account, database_url, reset_account};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use sea_orm_inbox::{Inbox, ProcessError, Settlement, rabbitmq};
use sea_orm_inbox_migration::{Migrator, MigratorTrait};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const QUEUE: &str = "inbox-example.orders";
/// Where `Settlement::DeadLetter` sends a message: the queue's dead-letter exchange (here
/// the default exchange) routes it to this queue.
const DEAD_LETTERS: &str = "inbox-example.orders.dead";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let db = connect_replica(&database_url()).await?;
    Migrator::up(&db, None).await?;
    reset_account(&db).await?;
    let inbox = Inbox::new("example.credit-order")?;

    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current());
    let amqp = Connection::connect(&url, properties)
        .await
        .map_err(|e| format!("connect to RabbitMQ at {url}: {e}"))?;
    let channel = amqp.create_channel().await?;
    // A demo starts from empty queues; a service declares them once, at deployment.
    for queue in [QUEUE, DEAD_LETTERS] {
        channel
            .queue_delete(queue, QueueDeleteOptions::default())
            .await?;
    }
    let declare = QueueDeclareOptions::default();
    channel
        .queue_declare(DEAD_LETTERS, declare, FieldTable::default())
        .await?;
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    arguments.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(DEAD_LETTERS.into()),
    );
    channel.queue_declare(QUEUE, declare, arguments).await?;

    // The producer sets `message_id` once per message (every retry and redelivery carries
    // it) and `timestamp`, the send time an admission floor checks.
    let run = uuid::Uuid::new_v4();
    let orders: Vec<String> = (1..=4).map(|n| format!("order-{n}-{run}")).collect();
    let nil = uuid::Uuid::nil().to_string();
    let sent = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let published = [
        &orders[0], &orders[1], &orders[1], &orders[2], &orders[3], &nil,
    ];
    for id in published {
        let properties = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_timestamp(sent);
        let body = b"credit 1";
        channel
            .basic_publish("", QUEUE, BasicPublishOptions::default(), body, properties)
            .await?
            .await?;
    }

    let mut consumer = channel
        .basic_consume(
            QUEUE,
            "example",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let (mut settled, mut dead_lettered) = (0, 0);
    while settled < published.len() {
        let next = tokio::time::timeout(Duration::from_secs(30), consumer.next()).await;
        let message = next
            .map_err(|_| "no delivery for 30 s")?
            .ok_or("the consumer was cancelled")??;
        let result = match rabbitmq::delivery(&message) {
            Ok(delivery) => {
                inbox
                    .process(&db, delivery, |txn| Box::pin(credit_account(txn, 1)))
                    .await
            }
            // No usable message id: no retry can fix that.
            Err(err) => Err(ProcessError::Inbox(err)),
        };
        let settlement = Settlement::for_delivery(&result, rabbitmq::delivery_count(&message));
        rabbitmq::settle(&message, settlement).await?;
        println!("{result:?} -> {settlement:?}");
        match settlement {
            Settlement::Ack => settled += 1,
            Settlement::DeadLetter => (settled, dead_lettered) = (settled + 1, dead_lettered + 1),
            Settlement::Nack(_) => {} // comes back after the delay
        }
    }
    amqp.close(200, "done").await?;

    let counts = inbox.metrics().snapshot();
    let credited = balance(&db).await?;
    println!(
        "\ncredited {credited}, processed {}, duplicates {}, dead-lettered {dead_lettered}",
        counts.processed, counts.duplicates
    );
    if (credited, counts.processed, counts.duplicates, dead_lettered) != (4, 4, 1, 1) {
        return Err("expected 4 credited, 4 processed, 1 duplicate, 1 dead-lettered".into());
    }
    Ok(())
}
