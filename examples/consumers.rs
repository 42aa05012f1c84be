//! The consumer loops and the broker topology of the broker examples (`rabbitmq`, `nats`,
//! `outbox`), kept here so the tests drive the very loops the examples run
//! (`tests/tests/db/example_loops.rs`): none can redeliver a poison message without bound.

use lapin::{Channel, ConnectionProperties};
use sea_orm::DatabaseConnection;
use sea_orm_inbox::jetstream::{DurableConsumer, JetStreamConsumer};
use sea_orm_inbox::rabbitmq::{QuorumQueue, RabbitMqConsumer};
use sea_orm_inbox::{
    BoxError, ConsumerOptions, ConsumerSummary, Inbox, InboxError, MessageHandler, NackDelay,
};
use std::future::Future;
use std::time::Duration;

/// How often RabbitMQ delivers a message that keeps failing before it dead-letters it
/// (one more than the quorum queue's `x-delivery-limit`), and JetStream's `max_deliver`.
pub const DELIVERY_LIMIT: u32 = 3;

/// lapin's connection properties on tokio (the workspace builds lapin without a runtime).
pub fn amqp_properties() -> ConnectionProperties {
    ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current())
}

/// The examples' loop settings: four deliveries at a time, and redeliveries after 100 ms
/// doubling to 1 s, so a failing message reaches its delivery limit within seconds
/// (a service keeps the default, 1 s doubling to a minute).
pub fn options() -> Result<ConsumerOptions, InboxError> {
    let fast = NackDelay::new(Duration::from_millis(100), Duration::from_secs(1))?;
    Ok(ConsumerOptions::default()
        .with_concurrency(4)?
        .with_prefetch(8)?
        .with_grace(Duration::from_secs(10))
        .with_nack_delay(fast))
}

/// Declares `queue` as the examples run it: a quorum queue that RabbitMQ dead-letters a
/// message from after [`DELIVERY_LIMIT`] deliveries, and into `{queue}.dead` at once on
/// `Settlement::DeadLetter`. Returns the topology (its dead-letter queue's name).
pub async fn declare_queue(channel: &Channel, queue: &str) -> Result<QuorumQueue, lapin::Error> {
    let topology = QuorumQueue::new(queue).delivery_limit(DELIVERY_LIMIT - 1);
    sea_orm_inbox::rabbitmq::declare_quorum_queue(channel, &topology).await?;
    Ok(topology)
}

/// The examples' RabbitMQ loop over `queue` (declared by [`declare_queue`]) until
/// `shutdown`.
pub async fn consume_rabbitmq<H, T, E>(
    url: String,
    queue: &str,
    inbox: Inbox,
    db: DatabaseConnection,
    handler: H,
    shutdown: impl Future + Send,
) -> Result<ConsumerSummary, BoxError>
where
    H: MessageHandler<T, E>,
    T: Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    RabbitMqConsumer::new(url, amqp_properties(), queue)
        .with_options(options()?)
        .run(inbox, db, handler, shutdown)
        .await
        .map_err(BoxError::from)
}

/// Creates the examples' stream `name` over `subject` and its durable consumer
/// `consumer`: JetStream delivers a failing message at most [`DELIVERY_LIMIT`] times,
/// and the loop terminates it on the last.
pub async fn create_stream(
    js: &async_nats::jetstream::Context,
    name: &str,
    subject: &str,
    consumer: &str,
) -> Result<(), async_nats::Error> {
    let stream =
        sea_orm_inbox::jetstream::create_stream(js, name, vec![subject.to_owned()]).await?;
    let durable = DurableConsumer::new(consumer)
        .max_deliver(i64::from(DELIVERY_LIMIT))
        .ack_wait(Duration::from_secs(5))
        .backoff(Vec::new());
    sea_orm_inbox::jetstream::create_durable_consumer(&stream, &durable).await?;
    Ok(())
}

/// The examples' JetStream loop over `consumer` of `stream` until `shutdown`.
pub async fn consume_nats<H, T, E>(
    client: async_nats::Client,
    stream: String,
    consumer: String,
    inbox: Inbox,
    db: DatabaseConnection,
    handler: H,
    shutdown: impl Future + Send,
) -> Result<ConsumerSummary, BoxError>
where
    H: MessageHandler<T, E>,
    T: Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    JetStreamConsumer::new(client, stream, consumer)
        .with_options(options()?)
        .run(inbox, db, handler, shutdown)
        .await
        .map_err(BoxError::from)
}

/// Completes once `done()` says so, checked every 50 ms, or after `limit` (the examples
/// must end by themselves; their final check then says what is missing).
pub async fn until(limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let _ = tokio::time::timeout(limit, async {
        while !done().await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}
