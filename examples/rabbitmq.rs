//! Two replicas consume from RabbitMQ through `Inbox::process`: publisher re-sends, one
//! replica dying between commit and ack, handlers failing once and being nacked. Every
//! message must have exactly one effect and every copy must end up acked.
//!
//! ```text
//! cargo run --example rabbitmq                     # local broker, SQLite file
//! AMQP_URL=amqp://user:pass@host:5672/%2f DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo run --example rabbitmq
//! ```
//!
//! The broker loop is in `examples/scenario/rabbitmq.rs`; what both broker demos share
//! (the handler, the counts, the check) in `examples/scenario/mod.rs`.

use inbox_examples::scenario::{BoxError, Broker, demo_main};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    demo_main(Broker::RabbitMq).await
}
