//! The broker adapters, one file per broker holding its whole mapping (delivery,
//! settlement, publisher, consumer loop, topology), and the [`Publisher`] trait they
//! implement for the outbox.

#[cfg(feature = "async-nats")]
pub mod jetstream;
mod publisher;
#[cfg(feature = "lapin")]
pub mod rabbitmq;

pub use publisher::{BoxError, PublishError, Publisher};
