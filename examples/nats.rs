//! A NATS JetStream consumer to copy: every message goes through `Inbox::process`, and the
//! `sea_orm_inbox::jetstream` adapter maps it in (`Nats-Msg-Id`, the stored time) and
//! settles it (ack, nak with a delay, term).
//!
//! The demo publishes four orders, one of them again after JetStream's duplicate window
//! (a publisher retry the server cannot recognise), and one message whose id was never
//! set; it consumes until each is settled and prints the counts: 4 credited, 1 duplicate
//! acked, 1 terminated.
//!
//! ```text
//! cargo run --example nats                         # local server, SQLite file
//! NATS_URL=nats://host:4222 DATABASE_URL=mysql://root@127.0.0.1:3306/test cargo run --example nats
//! ```

use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{self, message::PublishMessage, stream};
use futures_util::StreamExt;
use inbox_examples::{balance, connect_replica, credit_account, database_url, reset_account};
use sea_orm_inbox::{Inbox, ProcessError, Settlement, jetstream as adapter};
use sea_orm_inbox_migration::{Migrator, MigratorTrait};
use std::time::Duration;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const STREAM: &str = "INBOX_EXAMPLE";
const SUBJECT: &str = "inbox-example.orders";
/// JetStream drops a publish whose `Nats-Msg-Id` it saw this recently: short here, so the
/// demo's late retry gets through and the inbox has to catch it.
const DUPLICATE_WINDOW: Duration = Duration::from_millis(500);

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
    let stream = js
        .create_stream(stream::Config {
            name: STREAM.to_owned(),
            subjects: vec![SUBJECT.to_owned()],
            duplicate_window: DUPLICATE_WINDOW,
            ..stream::Config::default()
        })
        .await?;
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("example".to_owned()),
            ack_policy: AckPolicy::Explicit,
            ..pull::Config::default()
        })
        .await?;

    // The producer sets `Nats-Msg-Id` once per message; every retry and redelivery
    // carries it.
    let run = uuid::Uuid::new_v4();
    let orders: Vec<String> = (1..=4).map(|n| format!("order-{n}-{run}")).collect();
    let nil = uuid::Uuid::nil().to_string();
    let published = [
        &orders[0], &orders[1], &orders[2], &orders[3], &nil, &orders[1],
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

    let mut messages = consumer.messages().await?;
    let (mut settled, mut terminated) = (0, 0);
    while settled < published.len() {
        let next = tokio::time::timeout(Duration::from_secs(30), messages.next()).await;
        let message = next
            .map_err(|_| "no message for 30 s")?
            .ok_or("the consumer stopped")??;
        let result = match adapter::delivery(&message) {
            Ok(delivery) => {
                inbox
                    .process(&db, delivery, |txn| Box::pin(credit_account(txn, 1)))
                    .await
            }
            // No usable message id: no retry can fix that.
            Err(err) => Err(ProcessError::Inbox(err)),
        };
        let settlement = Settlement::for_delivery(&result, adapter::delivery_count(&message));
        adapter::settle(&message, settlement).await?;
        println!("{result:?} -> {settlement:?}");
        match settlement {
            Settlement::Ack => settled += 1,
            Settlement::DeadLetter => (settled, terminated) = (settled + 1, terminated + 1),
            Settlement::Nack(_) => {} // comes back after the delay
        }
    }
    // Acks are published without waiting for a reply: push them out before leaving.
    client.flush().await?;
    js.delete_stream(STREAM).await?;

    let counts = inbox.metrics().snapshot();
    let credited = balance(&db).await?;
    println!(
        "\ncredited {credited}, processed {}, duplicates {}, terminated {terminated}",
        counts.processed, counts.duplicates
    );
    if (credited, counts.processed, counts.duplicates, terminated) != (4, 4, 1, 1) {
        return Err("expected 4 credited, 4 processed, 1 duplicate, 1 terminated".into());
    }
    Ok(())
}
