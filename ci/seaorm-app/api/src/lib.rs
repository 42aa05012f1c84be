//! The application's consumer: a RabbitMQ queue read by the library's consumer loop
//! (`sea_orm_inbox::rabbitmq::RabbitMqConsumer`), every delivery through `Inbox::process`,
//! one ledger row per message. Run as many replicas as you like against one database: a
//! message published twice, or redelivered to another replica, is credited once.
//!
//! Configured by `DATABASE_URL`, `AMQP_URL` (default: the local broker, guest/guest) and
//! `AMQP_QUEUE` (default `seaorm-app.orders`). It declares the queue (a quorum queue with a
//! delivery limit and a dead-letter exchange, [`topology`]), consumes until SIGTERM or
//! Ctrl-C, then prints its counts. The loop's events go to stdout (the library's at
//! DEBUG: one line per delivery, `the loop settled the delivery`, in the delivery's
//! `inbox.delivery{broker_id=..}` span), which ci/seaorm-app.sh reads.

use entity::ledger;
use lapin::{Connection, ConnectionProperties};
use sea_orm::{ActiveModelTrait, ActiveValue::Set, Database};
use sea_orm_inbox::rabbitmq::{QuorumQueue, RabbitMqConsumer, declare_quorum_queue};
use sea_orm_inbox::{ConsumerOptions, ConsumerSummary, Inbox, Permanent};
use std::process::ExitCode;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::prelude::*;

/// The consumer name: the inbox key is (message id, consumer).
const CONSUMER: &str = "seaorm-app.ledger";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The queue `queue` as the app runs it: a quorum queue that RabbitMQ dead-letters a
/// message from after 5 deliveries, into `<queue>.dead` through the exchange
/// `<queue>.dlx`, and at once when the loop rejects one.
pub fn topology(queue: &str) -> QuorumQueue {
    QuorumQueue::new(queue)
}

/// `AMQP_URL`, or the local broker with its default user.
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// `AMQP_QUEUE`, or `seaorm-app.orders`.
pub fn queue_name() -> String {
    std::env::var("AMQP_QUEUE").unwrap_or_else(|_| "seaorm-app.orders".into())
}

/// lapin's connection properties on the current tokio runtime (lapin is built without one).
pub fn amqp_properties() -> ConnectionProperties {
    ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current())
}

/// A connection to RabbitMQ driven by the current tokio runtime.
///
/// # Errors
/// When the broker cannot be reached or refuses the credentials.
pub async fn connect_amqp(url: &str) -> Result<Connection, BoxError> {
    Connection::connect(url, amqp_properties())
        .await
        .map_err(|e| format!("connect to RabbitMQ at {url}: {e}").into())
}

/// Runs the consumer; a failure is a failed exit.
pub fn main() -> ExitCode {
    // The library's events at DEBUG (one per delivery), everything else at WARN.
    let targets = Targets::new()
        .with_target("sea_orm_inbox", LevelFilter::DEBUG)
        .with_default(LevelFilter::WARN);
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .without_time()
                .with_ansi(false)
                .with_filter(targets),
        )
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("seaorm-app: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(summary) => {
            println!("seaorm-app: stopped: {}", counts(&summary));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("seaorm-app: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<ConsumerSummary, BoxError> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let db = Database::connect(&url).await?;
    // The schema is the migrator's job (`sea-orm-cli migrate up`, at deployment); a
    // replica only checks it, once, and refuses to start with the migration to run.
    sea_orm_inbox::verify_schema(&db).await?;
    let (amqp_url, queue) = (amqp_url(), queue_name());
    let amqp = connect_amqp(&amqp_url).await?;
    let channel = amqp.create_channel().await?;
    declare_quorum_queue(&channel, &topology(&queue)).await?;
    amqp.close(200, "declared").await?;

    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let shutdown = async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    };
    let options = ConsumerOptions::default()
        .with_concurrency(4)?
        .with_prefetch(4)?;
    let summary = RabbitMqConsumer::new(amqp_url, amqp_properties(), queue)
        .with_options(options)
        .run(
            Inbox::new(CONSUMER)?,
            db,
            |txn, message| {
                let message_id = message.message_id.as_uuid();
                let amount = std::str::from_utf8(&message.payload)
                    .ok()
                    .and_then(|text| text.parse().ok());
                Box::pin(async move {
                    let amount: i64 =
                        amount.ok_or_else(|| Permanent::new("the payload is no amount"))?;
                    let row = ledger::ActiveModel {
                        message_id: Set(message_id),
                        amount: Set(amount),
                        ..Default::default()
                    };
                    row.insert(txn).await?;
                    Ok::<_, BoxError>(())
                })
            },
            shutdown,
        )
        .await?;
    Ok(summary)
}

/// The summary's counts as ci/seaorm-app.sh reads them.
fn counts(summary: &ConsumerSummary) -> String {
    format!(
        "deliveries={} processed={} duplicates={} dead_lettered={} nacked={} settle_failures={} abandoned={} reconnects={}",
        summary.received,
        summary.processed,
        summary.duplicates,
        summary.dead_lettered,
        summary.nacked,
        summary.settle_failures,
        summary.abandoned,
        summary.reconnects
    )
}
