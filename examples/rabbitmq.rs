//! A RabbitMQ consumer to copy: `RabbitMqConsumer` runs every delivery through
//! `Inbox::process` a few at a time and settles it (ack, nack with a delay, reject to the
//! dead-letter queue); the queue is a quorum queue with a delivery limit and a
//! dead-letter exchange (`rabbitmq::declare_quorum_queue`), so no message is redelivered
//! without bound.
//!
//! The demo publishes four orders, one of them twice (a publisher retry), one message
//! whose id was never set and one whose handler always fails; it consumes until each is
//! settled, stops the loop and prints the counts: 4 credited, 1 duplicate acked, 2
//! dead-lettered (the id-less one at once, the failing one after its delivery limit).
//!
//! ```text
//! cargo run --example rabbitmq                     # local broker, SQLite file
//! AMQP_URL=amqp://user:pass@host:5672/%2f DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo run --example rabbitmq
//! ```

use inbox_examples::consumers::{self, amqp_properties};
use inbox_examples::{balance, connect_replica, credit_account, database_url, reset_account};
use lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use sea_orm::DbErr;
use sea_orm_inbox::Inbox;
use sea_orm_inbox_migration::{Migrator, MigratorTrait};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const QUEUE: &str = "inbox-example.orders";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let db = connect_replica(&database_url()).await?;
    Migrator::up(&db, None).await?;
    reset_account(&db).await?;
    let inbox = Inbox::new("example.credit-order")?;

    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let amqp = Connection::connect(&url, amqp_properties())
        .await
        .map_err(|e| format!("connect to RabbitMQ at {url}: {e}"))?;
    let channel = amqp.create_channel().await?;
    // A demo starts from empty queues (an older run's may be a classic queue, which a
    // quorum declaration refuses); a service declares them once, at deployment.
    for queue in [QUEUE.to_owned(), format!("{QUEUE}.dead")] {
        channel
            .queue_delete(&queue, QueueDeleteOptions::default())
            .await?;
    }
    let topology = consumers::declare_queue(&channel, QUEUE).await?;

    // The producer sets `message_id` once per message (every retry and redelivery carries
    // it) and `timestamp`, the send time an admission floor checks.
    let run = uuid::Uuid::new_v4();
    let orders: Vec<String> = (1..=4).map(|n| format!("order-{n}-{run}")).collect();
    let poison = format!("poison-{run}");
    let nil = uuid::Uuid::nil().to_string();
    let sent = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let published = [
        &orders[0], &orders[1], &orders[1], &orders[2], &orders[3], &nil, &poison,
    ];
    for id in published {
        let properties = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_timestamp(sent);
        channel
            .basic_publish(
                "",
                QUEUE,
                BasicPublishOptions::default(),
                b"credit 1",
                properties,
            )
            .await?
            .await?;
    }

    // The consumer, on a task of its own: the handler gets the transaction and the
    // message. A service stops it on `tokio::signal::ctrl_c()`; the demo once the orders
    // are settled and both dead letters arrived.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn(consumers::consume_rabbitmq(
        url.clone(),
        QUEUE,
        inbox.clone(),
        db.clone(),
        |txn, message| {
            let poisoned = message.broker_id.starts_with("poison-");
            Box::pin(async move {
                if poisoned {
                    return Err(DbErr::Custom("this order can never be credited".into()));
                }
                credit_account(txn, 1).await
            })
        },
        stopped,
    ));
    let dead_letters = async || {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let queue =
            channel.queue_declare(&topology.dead_letter_queue, passive, FieldTable::default());
        queue.await.map_or(0, |queue| queue.message_count())
    };
    consumers::until(Duration::from_secs(30), async || {
        let seen = inbox.metrics().snapshot();
        seen.processed + seen.duplicates == 5 && dead_letters().await == 2
    })
    .await;
    let _ = stop.send(());
    let summary = consumer.await??;
    let dead_lettered = dead_letters().await;
    amqp.close(200, "done").await?;

    let counts = inbox.metrics().snapshot();
    let credited = balance(&db).await?;
    println!("{summary}");
    println!(
        "\ncredited {credited}, processed {}, duplicates {}, dead-lettered {dead_lettered}",
        counts.processed, counts.duplicates
    );
    if (credited, counts.processed, counts.duplicates, dead_lettered) != (4, 4, 1, 2) {
        return Err("expected 4 credited, 4 processed, 1 duplicate, 2 dead-lettered".into());
    }
    Ok(())
}
