//! A NATS JetStream consumer to copy: `JetStreamConsumer` runs every message through
//! `Inbox::process` a few at a time and settles it (ack, nak with a delay, term); the
//! stream's duplicate window is short (`jetstream::create_stream`) and the durable
//! consumer delivers a message at most `max_deliver` times
//! (`jetstream::create_durable_consumer`), the loop terminating it on the last, so no
//! message is redelivered without bound.
//!
//! The demo publishes four orders, one of them again after JetStream's duplicate window
//! (a re-send the server lets through), one message whose id was never set and one whose
//! handler always fails; it consumes until each is settled, stops the loop and prints the
//! counts: 4 credited, 1 duplicate acked, 2 terminated (the id-less one at once, the
//! failing one on its last delivery), each seen as a `MSG_TERMINATED` advisory.
//!
//! ```text
//! cargo run --example nats                         # local server, SQLite file
//! NATS_URL=nats://host:4222 DATABASE_URL=mysql://root@127.0.0.1:3306/test cargo run --example nats
//! ```

use async_nats::jetstream::{self, message::PublishMessage};
use futures_util::StreamExt;
use inbox_examples::consumers;
use inbox_examples::{balance, connect_replica, credit_account, database_url, reset_account};
use sea_orm::DbErr;
use sea_orm_inbox::Inbox;
use sea_orm_inbox::jetstream::DUPLICATE_WINDOW;
use sea_orm_inbox_migration::{Migrator, MigratorTrait};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const STREAM: &str = "INBOX_EXAMPLE";
const SUBJECT: &str = "inbox-example.orders";
const CONSUMER: &str = "example";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let db = connect_replica(&database_url()).await?;
    Migrator::up(&db, None).await?;
    reset_account(&db).await?;
    let inbox = Inbox::new("example.credit-order")?;

    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let client = async_nats::connect(&url)
        .await
        .map_err(|e| format!("connect to NATS at {url}: {e}"))?;
    let js = jetstream::new(client.clone());
    // A demo starts from an empty stream; a service creates it once, at deployment.
    js.delete_stream(STREAM).await.ok();
    consumers::create_stream(&js, STREAM, SUBJECT, CONSUMER).await?;
    // Where terminated messages are announced: a dead-letter stream would capture these.
    let terminated = Arc::new(AtomicU32::new(0));
    let mut advisories = client
        .subscribe(format!(
            "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{STREAM}.{CONSUMER}"
        ))
        .await?;
    let counter = Arc::clone(&terminated);
    tokio::spawn(async move {
        while advisories.next().await.is_some() {
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });

    // The producer sets `Nats-Msg-Id` once per message; every retry and redelivery
    // carries it.
    let run = uuid::Uuid::new_v4();
    let orders: Vec<String> = (1..=4).map(|n| format!("order-{n}-{run}")).collect();
    let poison = format!("poison-{run}");
    let nil = uuid::Uuid::nil().to_string();
    let published = [
        &orders[0], &orders[1], &orders[2], &orders[3], &nil, &poison, &orders[1],
    ];
    for (n, id) in published.into_iter().enumerate() {
        if n == published.len() - 1 {
            tokio::time::sleep(DUPLICATE_WINDOW * 2).await;
        }
        let message = PublishMessage::build()
            .payload("credit 1".into())
            .message_id(id);
        js.send_publish(SUBJECT, message).await?.await?;
    }

    // The consumer, on a task of its own: the handler gets the transaction and the
    // message. A service stops it on `tokio::signal::ctrl_c()`; the demo once the orders
    // are settled and both dead letters were announced.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn(consumers::consume_nats(
        client.clone(),
        STREAM.to_owned(),
        CONSUMER.to_owned(),
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
    consumers::until(Duration::from_secs(30), async || {
        let seen = inbox.metrics().snapshot();
        seen.processed + seen.duplicates == 5 && terminated.load(Ordering::SeqCst) == 2
    })
    .await;
    let _ = stop.send(());
    let summary = consumer.await??;
    js.delete_stream(STREAM).await?;

    let counts = inbox.metrics().snapshot();
    let credited = balance(&db).await?;
    let terminated = terminated.load(Ordering::SeqCst);
    println!("{summary}");
    println!(
        "\ncredited {credited}, processed {}, duplicates {}, terminated {terminated}",
        counts.processed, counts.duplicates
    );
    if (credited, counts.processed, counts.duplicates, terminated) != (4, 4, 1, 2) {
        return Err("expected 4 credited, 4 processed, 1 duplicate, 2 terminated".into());
    }
    Ok(())
}
