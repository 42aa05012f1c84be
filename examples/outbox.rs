//! The outbox to copy: an order service writes each order's event into the outbox in the
//! order's own transaction, two relays (each with its own pool, as two replicas would)
//! publish the events to RabbitMQ with publisher confirms, and a consumer loop
//! (`RabbitMqConsumer`) with its own inbox credits an account once per event, from a
//! quorum queue with a delivery limit and a dead-letter exchange, so no event is
//! redelivered without bound.
//!
//! The demo places four orders and rolls a fifth back (its event is never published),
//! then makes one event go out twice, as after a relay that died before marking it sent:
//! same message id, so the consumer's inbox acks the repeat as a duplicate. It prints
//! the counts: 4 published, 4 credited, 1 duplicate.
//!
//! ```text
//! cargo run --example outbox                       # local broker, SQLite file
//! AMQP_URL=amqp://user:pass@host:5672/%2f OUTBOX_DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_demo \
//!     cargo run --example outbox
//! ```
//!
//! Give it a database of its own (`OUTBOX_DATABASE_URL`, by default the SQLite file
//! `outbox-demo.sqlite`), not the other demos' `DATABASE_URL`: it runs
//! `MigratorWithOutbox`, which records `CreateOutbox`, and SeaORM then refuses the other
//! demos' `Migrator`, which does not list it.

use inbox_examples::consumers::{self, amqp_properties};
use inbox_examples::{balance, connect_replica, credit_account, reset_account};
use lapin::Connection;
use lapin::options::QueueDeleteOptions;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement, TransactionTrait};
use sea_orm_inbox::rabbitmq::RabbitMqPublisher;
use sea_orm_inbox::{Inbox, OutboxExt, OutgoingMessage, Relay, outbox_backlog};
use sea_orm_inbox_migration::{MigratorTrait, MigratorWithOutbox};
use std::time::Duration;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The demo's database: `OUTBOX_DATABASE_URL`, or a SQLite file of its own.
fn database_url() -> String {
    std::env::var("OUTBOX_DATABASE_URL")
        .unwrap_or_else(|_| "sqlite://outbox-demo.sqlite?mode=rwc".to_owned())
}

const QUEUE: &str = "outbox-example.orders";

/// The order service's handler: the order and its event, through the transaction it is
/// given (a `DatabaseTransaction` here; the transaction of `Inbox::process` works alike).
async fn place_order<C: ConnectionTrait>(txn: &C, order: u32) -> Result<(), BoxError> {
    // ... the order's own rows, through `txn` ...
    let event = OutgoingMessage::new(QUEUE, format!("order {order} placed"))
        .key(format!("customer-{}", order % 2)) // a customer's events go out in order
        .header("content-type", "text/plain");
    txn.enqueue(event).await?;
    Ok(())
}

/// Starts a relay replica on its own pool and RabbitMQ connection (which the publisher
/// reopens after a broker restart), publishing into `QUEUE` through the default exchange.
async fn relay_replica(
    amqp_url: &str,
) -> Result<(Relay<RabbitMqPublisher>, DatabaseConnection), BoxError> {
    let publisher = RabbitMqPublisher::connect(amqp_url, amqp_properties(), "").await?;
    let pool = connect_replica(&database_url()).await?;
    Ok((Relay::new(publisher), pool))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let db = connect_replica(&database_url()).await?;
    MigratorWithOutbox::up(&db, None).await?;
    reset_account(&db).await?;
    // A demo starts from an empty outbox; a service keeps its rows until the purge.
    db.execute_unprepared("DELETE FROM outbox").await?;

    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let amqp = Connection::connect(&url, amqp_properties())
        .await
        .map_err(|e| format!("connect to RabbitMQ at {url}: {e}"))?;
    let channel = amqp.create_channel().await?;
    // An older run's queue may be a classic one, which a quorum declaration refuses.
    for queue in [QUEUE.to_owned(), format!("{QUEUE}.dead")] {
        channel
            .queue_delete(&queue, QueueDeleteOptions::default())
            .await?;
    }
    let topology = consumers::declare_queue(&channel, QUEUE).await?;

    // The order service: four orders commit with their events, the fifth rolls back.
    for order in 1..=5 {
        let txn = db.begin().await?;
        place_order(&txn, order).await?;
        if order == 5 {
            txn.rollback().await?; // the order failed: its event is gone with it
        } else {
            txn.commit().await?;
        }
    }

    // Two relay replicas drain the outbox; neither publishes an event the other did.
    let replicas = [relay_replica(&url).await?, relay_replica(&url).await?];
    let mut published = 0;
    while outbox_backlog(&db).await?.pending > 0 {
        for (relay, pool) in &replicas {
            published += relay.relay_once(pool).await?.published;
        }
    }
    // A relay that died after the broker confirmed an event, before marking it sent: the
    // row's lease ends and a relay publishes it again, with the same message id.
    let first: Option<i64> = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT MIN(id) FROM outbox",
        ))
        .await?
        .map(|row| row.try_get_by_index(0))
        .transpose()?;
    let forget = Query::update()
        .table(Alias::new("outbox"))
        .value(Alias::new("sent_at"), Expr::cust("NULL"))
        .and_where(Expr::col(Alias::new("id")).eq(first))
        .to_owned();
    db.execute(&forget).await?;
    let republished = replicas[0].0.relay_once(&replicas[0].1).await?.published;

    // The consumer: its own inbox, crediting the account once per event, on a task of
    // its own until every delivery is settled (a service stops it on ctrl-c).
    let inbox = Inbox::new("example.credit-per-order")?;
    let expected = published + republished;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn(consumers::consume_rabbitmq(
        url.clone(),
        QUEUE,
        inbox.clone(),
        db.clone(),
        |txn, _message| Box::pin(async move { credit_account(txn, 1).await }),
        stopped,
    ));
    consumers::until(Duration::from_secs(10), async || {
        let seen = inbox.metrics().snapshot();
        seen.processed + seen.duplicates >= expected
    })
    .await;
    let _ = stop.send(());
    let summary = consumer.await??;
    println!("{summary}");

    let counts = inbox.metrics().snapshot();
    println!(
        "published {published} (+{republished} republished), credited {}, duplicates {}, balance {}",
        counts.processed,
        counts.duplicates,
        balance(&db).await?
    );
    for queue in [&topology.queue, &topology.dead_letter_queue] {
        channel
            .queue_delete(queue, QueueDeleteOptions::default())
            .await?;
    }
    amqp.close(200, "demo over").await?;
    if (published, counts.processed, counts.duplicates) != (4, 4, 1) {
        return Err("expected 4 published, 4 credited, 1 duplicate".into());
    }
    Ok(())
}
