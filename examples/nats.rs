//! Two replicas pull from a NATS JetStream durable consumer through `Inbox::process`:
//! duplicate publishes, one replica dying between commit and ack (JetStream redelivers
//! after the ack wait), handlers failing once and being nacked. Every message must have
//! exactly one effect and every copy must end up acked.
//!
//! ```text
//! cargo run --example nats                         # local server, SQLite file
//! NATS_URL=nats://host:4222 DATABASE_URL=mysql://root@127.0.0.1:3306/test cargo run --example nats
//! ```
//!
//! The broker loop is in `examples/scenario/nats.rs`; what both broker demos share (the
//! handler, the counts, the check) in `examples/scenario/mod.rs`.

use inbox_examples::scenario::{BoxError, Broker, demo_main};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    demo_main(Broker::Nats).await
}
