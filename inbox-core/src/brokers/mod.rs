//! The broker adapters, one file per broker holding its whole mapping (delivery,
//! settlement, publisher, consumer loop, topology), and the [`Publisher`] trait they
//! implement for the outbox.

#[cfg(any(
    feature = "lapin",
    feature = "async-nats",
    feature = "rdkafka",
    feature = "aws-sdk-sqs"
))]
mod consume;
#[cfg(feature = "async-nats")]
pub mod jetstream;
#[cfg(feature = "rdkafka")]
pub mod kafka;
mod publisher;
#[cfg(feature = "lapin")]
pub mod rabbitmq;
#[cfg(feature = "aws-sdk-sqs")]
pub mod sqs;

#[cfg(any(
    feature = "lapin",
    feature = "async-nats",
    feature = "rdkafka",
    feature = "aws-sdk-sqs"
))]
pub use consume::{ConsumerError, ConsumerOptions, ConsumerSummary};
#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
pub use consume::{MessageHandler, Received};
pub use publisher::{BoxError, PublishError, Publisher};
