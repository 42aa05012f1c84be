//! RabbitMQ through [`lapin`] (feature `lapin`): a delivery's properties to a
//! [`Delivery`], a [`Settlement`] to `basic.ack`, `basic.nack` or `basic.reject`.
//!
//! [`RabbitMqConsumer`] is a ready consumer loop (concurrency, prefetch, reconnects,
//! graceful shutdown) and [`declare_quorum_queue`] the queue it needs; the same by hand,
//! with a dead-letter exchange on the queue (`x-dead-letter-exchange`) for what
//! [`Settlement::DeadLetter`] rejects:
//!
//! ```no_run
//! use futures_util::StreamExt;
//! use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr};
//! use sea_orm_inbox::{Inbox, ProcessError, Settlement, rabbitmq};
//!
//! # async fn consume(mut consumer: lapin::Consumer, db: DatabaseConnection, inbox: Inbox) -> Result<(), lapin::Error> {
//! while let Some(message) = consumer.next().await {
//!     let message = message?;
//!     let result = match rabbitmq::delivery(&message) {
//!         Ok(delivery) => {
//!             inbox
//!                 .process(&db, delivery, |txn| {
//!                     Box::pin(async move {
//!                         txn.execute_unprepared("UPDATE account SET balance = balance + 10").await?;
//!                         Ok::<_, DbErr>(())
//!                     })
//!                 })
//!                 .await
//!         }
//!         // No message_id property, or a nil one: dead-lettered below.
//!         Err(err) => Err(ProcessError::Inbox(err)),
//!     };
//!     let settlement = Settlement::for_delivery(&result, rabbitmq::delivery_count(&message));
//!     rabbitmq::settle(&message, settlement).await?;
//! }
//! # Ok(()) }
//! ```

use super::consume::{self, Connect, Incoming, Session};
use crate::{
    BoxError, ConsumerError, ConsumerOptions, ConsumerSummary, Delivery, Inbox, InboxError,
    MessageHandler, MessageId, OutboxMessage, PublishError, Publisher, Received, Settlement,
};
use ::lapin::ExchangeKind;
use ::lapin::message::Delivery as AmqpDelivery;
use ::lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use ::lapin::options::{
    BasicConsumeOptions, BasicQosOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use ::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use ::lapin::publisher_confirm::Confirmation;
use ::lapin::types::AMQPValue;
use ::lapin::types::FieldTable;
use ::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use chrono::DateTime;
use futures_util::StreamExt;
use sea_orm::DatabaseConnection;
use std::future::Future;
use std::time::Duration;
use tokio::sync::Mutex;

/// The longest a delivery is held before a delayed nack: RabbitMQ closes the channel of a
/// consumer that holds a delivery unacked longer than its `consumer_timeout` (30 minutes
/// by default), which would requeue everything the channel holds.
pub const MAX_NACK_DELAY: Duration = Duration::from_secs(600);

/// The [`Delivery`] of a RabbitMQ message: its key from the `message_id` property
/// ([`MessageId::from_broker_id`]), its send time from the `timestamp` property (seconds
/// since the epoch) when the producer set one. Both are the producer's, so every
/// redelivery carries the same.
///
/// # Errors
/// [`InboxError::EmptyKeyField`] when the message has no `message_id` (or an empty one),
/// [`InboxError::NilMessageId`] when it is the nil UUID, and
/// [`InboxError::OutOfRange`] for a `timestamp` no date can hold. All of them are
/// [permanent](InboxError::is_permanent): dead-letter the message
/// (`Err(ProcessError::Inbox(err))` settles as [`Settlement::DeadLetter`]).
pub fn delivery(message: &AmqpDelivery) -> Result<Delivery, InboxError> {
    let properties = &message.properties;
    let id = properties
        .message_id()
        .as_ref()
        .map_or("", |id| id.as_str());
    let delivery = Delivery::new(MessageId::from_broker_id(id)?);
    let Some(seconds) = *properties.timestamp() else {
        return Ok(delivery);
    };
    let sent_at = i64::try_from(seconds)
        .ok()
        .and_then(|seconds| DateTime::from_timestamp(seconds, 0))
        .ok_or_else(|| InboxError::OutOfRange {
            what: "the RabbitMQ timestamp property",
            value: seconds.to_string(),
            accepted: "the seconds of dates up to 262143-12-31".to_owned(),
            advice: "set it to the time the message was first sent, in seconds since the epoch",
        })?;
    Ok(delivery.sent_at(sent_at))
}

/// How often RabbitMQ has delivered this message, this delivery included: one more than
/// the `x-delivery-count` header of quorum queues, else 2 for a redelivery (classic queues
/// only flag it) and 1 for a first delivery. For [`Settlement::for_delivery`].
pub fn delivery_count(message: &AmqpDelivery) -> u32 {
    let earlier = message
        .properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.inner().get("x-delivery-count"))
        .and_then(|count| match count {
            AMQPValue::LongLongInt(n) => u32::try_from(*n).ok(),
            AMQPValue::LongInt(n) => u32::try_from(*n).ok(),
            AMQPValue::LongUInt(n) => Some(*n),
            AMQPValue::ShortInt(n) => u32::try_from(*n).ok(),
            AMQPValue::ShortUInt(n) => Some(u32::from(*n)),
            _ => None,
        });
    match earlier {
        Some(earlier) => earlier.saturating_add(1),
        None if message.redelivered => 2,
        None => 1,
    }
}

/// Tells RabbitMQ what became of `message`:
///
/// | settlement | call |
/// | --- | --- |
/// | `Ack` | `basic.ack` |
/// | `Nack(None)` | `basic.nack` with `requeue: true`: redelivered at once |
/// | `Nack(Some(delay))` | the same after `delay` (at most [`MAX_NACK_DELAY`]) |
/// | `DeadLetter` | `basic.reject` with `requeue: false`: to the queue's dead-letter exchange, or dropped when it has none |
///
/// RabbitMQ cannot requeue with a delay, so a delayed nack holds the message unacked for
/// the delay (RabbitMQ redelivers nothing it holds) from a task spawned on the current
/// tokio runtime, and this call returns at once. A held message counts against the
/// channel's prefetch (`basic.qos`), which slows the consumer while messages keep
/// failing. Outside a tokio runtime the nack is sent at once. If the delayed nack fails
/// (the channel closed meanwhile), RabbitMQ has requeued the message with the channel.
///
/// # Errors
/// The channel's error when the call cannot be sent (the channel or connection closed:
/// RabbitMQ then requeues every unacked message of the channel itself).
pub async fn settle(message: &AmqpDelivery, settlement: Settlement) -> Result<(), ::lapin::Error> {
    let acker = &message.acker;
    let requeue = BasicNackOptions {
        multiple: false,
        requeue: true,
    };
    match settlement {
        Settlement::Ack => acker.ack(BasicAckOptions::default()).await.map(drop),
        Settlement::DeadLetter => acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .map(drop),
        Settlement::Nack(Some(delay)) if !delay.is_zero() => {
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                return acker.nack(requeue).await.map(drop);
            };
            let acker = acker.clone();
            runtime.spawn(async move {
                tokio::time::sleep(delay.min(MAX_NACK_DELAY)).await;
                if let Err(err) = acker.nack(requeue).await {
                    tracing::warn!(error = %err, "a delayed nack failed; RabbitMQ requeues the message with its closed channel");
                }
            });
            Ok(())
        }
        Settlement::Nack(_) => acker.nack(requeue).await.map(drop),
    }
}

/// Publishes outbox messages to RabbitMQ with publisher confirms: a [`Publisher`] for a
/// [`Relay`](crate::Relay).
///
/// Each message goes to the exchange given to [`connect`](Self::connect) (`""`, the
/// default exchange, routes by queue name) with the message's destination as the routing
/// key, `mandatory` set (an unroutable message is a failed publish, not a silent drop),
/// and persistent. Its properties: `message_id` the outbox message id (which [`delivery`]
/// reads back on the consumer side), `timestamp` the row's
/// [first publish time](OutboxMessage::first_published_at) in whole seconds (the send time
/// an [admission floor](crate::AdmissionFloor) compares: the same on every republish, and
/// never the enqueue time of a message held back), the headers as string headers, and
/// the ordering key in the header [`KEY_HEADER`].
///
/// The publisher owns its connection and one channel in confirm mode, and outlives a
/// broker restart or a dropped connection: a publish that finds its channel or connection
/// closed opens a new one (with `confirm_select`) before publishing. A publish the lost
/// connection took down with it fails with [`PublishError::Transient`], and the relay
/// retries the row after its backoff, on the new connection. A connection that dies
/// without closing (a silent network) is noticed by the AMQP heartbeat the broker
/// negotiates; until then the relay's [`publish_timeout`](crate::RelayOptions::publish_timeout)
/// fails each publish.
///
/// Every failure is [`PublishError::Transient`], never [`PublishError::Rejected`]: what
/// RabbitMQ refuses can heal (an unroutable message, when a queue is bound to its routing
/// key; a `basic.nack` of a full queue, once it drains; a closed channel, by reconnecting).
/// A message that keeps failing is parked after [`max_attempts`](crate::RelayOptions::max_attempts).
///
/// ```no_run
/// use lapin::ConnectionProperties;
/// use sea_orm_inbox::{Relay, rabbitmq::RabbitMqPublisher};
///
/// # async fn run(db: sea_orm::DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
/// // lapin without its default runtime needs the caller's (here tokio-executor-trait and
/// // tokio-reactor-trait); reconnecting reuses these properties.
/// let properties = ConnectionProperties::default()
///     .with_executor(tokio_executor_trait::Tokio::current())
///     .with_reactor(tokio_reactor_trait::Tokio::current());
/// let publisher =
///     RabbitMqPublisher::connect("amqp://guest:guest@127.0.0.1:5672/%2f", properties, "").await?;
/// let relay = Relay::new(publisher);
/// relay.run(&db, std::future::pending()).await;
/// # Ok(()) }
/// ```
pub struct RabbitMqPublisher {
    uri: String,
    properties: ConnectionProperties,
    exchange: String,
    /// The connection and channel publishes use; replaced when found closed. A lock, so
    /// relays sharing the publisher open one new connection after a cut, not one each.
    link: Mutex<Link>,
}

/// The header carrying an outbox message's ordering key to RabbitMQ consumers.
pub const KEY_HEADER: &str = "x-outbox-key";

/// A publisher's connection, and its channel in confirm mode.
struct Link {
    connection: Connection,
    channel: Channel,
}

impl Link {
    async fn open(uri: &str, properties: &ConnectionProperties) -> Result<Self, ::lapin::Error> {
        let connection = Connection::connect(uri, properties.clone()).await?;
        let channel = confirming_channel(&connection).await?;
        Ok(Self {
            connection,
            channel,
        })
    }
}

/// A new channel of `connection`, in confirm mode: without it no publish is confirmed.
async fn confirming_channel(connection: &Connection) -> Result<Channel, ::lapin::Error> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

impl RabbitMqPublisher {
    /// Connects to the broker at `uri` (`amqp://user:password@host:5672/vhost`, or
    /// `amqps://`) with `properties`, opens a channel in confirm mode, and returns a
    /// publisher into `exchange` that reconnects with the same `uri` and `properties`
    /// whenever it finds its connection or channel closed.
    ///
    /// Give the publisher a connection of its own rather than sharing a consumer's:
    /// RabbitMQ's flow control blocks publishing connections, which would stall the
    /// consumer's acks with them.
    ///
    /// # Errors
    /// The first connection's error (the broker unreachable, wrong credentials or vhost,
    /// no executor or reactor in `properties` when lapin's default runtime is off): check
    /// the URI and the broker, then retry.
    pub async fn connect(
        uri: impl Into<String>,
        properties: ConnectionProperties,
        exchange: impl Into<String>,
    ) -> Result<Self, ::lapin::Error> {
        let uri = uri.into();
        let link = Link::open(&uri, &properties).await?;
        Ok(Self {
            uri,
            properties,
            exchange: exchange.into(),
            link: Mutex::new(link),
        })
    }

    /// The channel to publish on: the current one while it and its connection are open;
    /// else a new channel, on a new connection when the old one closed too.
    async fn channel(&self) -> Result<Channel, PublishError> {
        let mut link = self.link.lock().await;
        if link.connection.status().connected() && link.channel.status().connected() {
            return Ok(link.channel.clone());
        }
        let reopen = async {
            if link.connection.status().connected() {
                // The broker closed the channel alone (a channel error): the connection
                // serves on, and a new connection would leave this one open.
                link.channel = confirming_channel(&link.connection).await?;
            } else {
                *link = Link::open(&self.uri, &self.properties).await?;
            }
            Ok::<_, ::lapin::Error>(link.channel.clone())
        };
        reopen.await.map_err(|err| {
            PublishError::Transient(
                format!(
                    "the RabbitMQ channel was closed and reopening it failed: {err}; the next publish tries again"
                )
                .into(),
            )
        })
    }
}

impl Publisher for RabbitMqPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        let mut headers = FieldTable::default();
        for (name, value) in &message.headers {
            headers.insert(
                name.as_str().into(),
                AMQPValue::LongString(value.as_str().into()),
            );
        }
        if let Some(key) = &message.key {
            headers.insert(
                KEY_HEADER.into(),
                AMQPValue::LongString(key.as_str().into()),
            );
        }
        let timestamp = u64::try_from(message.first_published_at.timestamp()).unwrap_or(0);
        let properties = BasicProperties::default()
            .with_message_id(message.message_id.to_string().into())
            .with_timestamp(timestamp)
            .with_delivery_mode(2)
            .with_headers(headers);
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let transient = |err: ::lapin::Error| PublishError::Transient(Box::new(err));
        let confirmation = self
            .channel()
            .await?
            .basic_publish(
                &self.exchange,
                &message.destination,
                options,
                &message.payload,
                properties,
            )
            .await
            .map_err(transient)?
            .await
            .map_err(transient)?;
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(PublishError::Transient(
                format!(
                    "RabbitMQ returned the message unroutable: no queue is bound to routing key {:?} on exchange {:?}",
                    message.destination, self.exchange
                )
                .into(),
            )),
            Confirmation::Nack(_) => Err(PublishError::Transient(
                "RabbitMQ refused to confirm the message (basic.nack)".into(),
            )),
            // The publisher selects confirm mode on every channel it opens.
            Confirmation::NotRequested => Err(PublishError::Transient(
                "RabbitMQ sent no confirmation: the channel is not in confirm mode".into(),
            )),
        }
    }
}

// --- The consumer loop ----------------------------------------------------------------------

/// A running RabbitMQ consumer in a few lines: the broker-neutral loop of
/// [`ConsumerOptions`] (a task per delivery behind a semaphore, [`delivery`],
/// `Inbox::process`, [`settle`]; a delivery without a usable `message_id` is rejected to
/// the dead-letter exchange without running the handler) over a connection of its own,
/// re-opened with backoff when the broker or the network drops it. It declares nothing:
/// declare the queue first (at deployment, or with [`declare_quorum_queue`]).
///
/// ```no_run
/// use lapin::ConnectionProperties;
/// use sea_orm::{ConnectionTrait, DbErr};
/// use sea_orm_inbox::{Inbox, rabbitmq::RabbitMqConsumer};
///
/// # async fn run(db: sea_orm::DatabaseConnection, ctrl_c: std::future::Pending<()>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let properties = ConnectionProperties::default()
///     .with_executor(tokio_executor_trait::Tokio::current())
///     .with_reactor(tokio_reactor_trait::Tokio::current());
/// let consumer = RabbitMqConsumer::new("amqp://guest:guest@127.0.0.1:5672/%2f", properties, "orders");
/// let summary = consumer
///     .run(Inbox::new("billing.credit")?, db, |txn, message| {
///         let amount = message.payload.len() as i64; // parse the payload here
///         Box::pin(async move {
///             txn.execute_unprepared(&format!("UPDATE account SET balance = balance + {amount}")).await?;
///             Ok::<_, DbErr>(())
///         })
///     }, ctrl_c) // tokio::signal::ctrl_c() in a service
///     .await?;
/// println!("{summary}");
/// # Ok(()) }
/// ```
pub struct RabbitMqConsumer {
    uri: String,
    properties: ConnectionProperties,
    queue: String,
    options: ConsumerOptions,
}

impl RabbitMqConsumer {
    /// A consumer of `queue` at `uri` (`amqp://user:password@host:5672/vhost`), connecting
    /// with `properties` (on tokio without lapin's default runtime: its executor and
    /// reactor, as in the example), with the default [`ConsumerOptions`].
    pub fn new(
        uri: impl Into<String>,
        properties: ConnectionProperties,
        queue: impl Into<String>,
    ) -> Self {
        Self {
            uri: uri.into(),
            properties,
            queue: queue.into(),
            options: ConsumerOptions::default(),
        }
    }

    /// Replaces the loop's settings; the prefetch is the channel's `basic.qos`.
    pub fn with_options(mut self, options: ConsumerOptions) -> Self {
        self.options = options;
        self
    }

    /// Consumes until `shutdown` completes (`tokio::signal::ctrl_c()`, a channel's
    /// receive...), then stops taking deliveries, waits for those in flight up to the
    /// [grace period](ConsumerOptions::with_grace), closes the connection (RabbitMQ
    /// requeues what is unsettled, the messages held for a delayed nack included) and
    /// returns what it did. `handler` gets the transaction and the [`Received`] message,
    /// as the handler of [`Inbox::process`] gets the transaction.
    ///
    /// # Errors
    /// [`ConsumerError::Connect`] when the first connection, channel or `basic.consume`
    /// fails (a wrong URI or credentials, a missing queue). Later losses are reconnected,
    /// logged at WARN and counted in [`ConsumerSummary::reconnects`].
    pub async fn run<H, T, E>(
        self,
        inbox: Inbox,
        db: DatabaseConnection,
        handler: H,
        shutdown: impl Future + Send,
    ) -> Result<ConsumerSummary, ConsumerError>
    where
        H: MessageHandler<T, E>,
        T: Send + 'static,
        E: std::fmt::Display + Send + 'static,
    {
        let connector = AmqpConnect {
            uri: self.uri,
            properties: self.properties,
            queue: self.queue,
            prefetch: self.options.prefetch(),
        };
        consume::run(connector, self.options, inbox, db, handler, shutdown).await
    }
}

struct AmqpConnect {
    uri: String,
    properties: ConnectionProperties,
    queue: String,
    prefetch: u16,
}

impl Connect for AmqpConnect {
    type Session = AmqpSession;
    const BROKER: &'static str = "RabbitMQ";

    async fn connect(&mut self) -> Result<AmqpSession, BoxError> {
        let connection = Connection::connect(&self.uri, self.properties.clone()).await?;
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        // An empty tag: the broker names the consumer, unique per connection.
        let consumer = channel
            .basic_consume(
                &self.queue,
                "",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(AmqpSession {
            connection,
            consumer,
        })
    }
}

struct AmqpSession {
    connection: Connection,
    consumer: ::lapin::Consumer,
}

impl Session for AmqpSession {
    type Message = AmqpMessage;

    async fn next(&mut self) -> Option<Result<AmqpMessage, BoxError>> {
        let next = self.consumer.next().await?;
        Some(next.map(AmqpMessage).map_err(BoxError::from))
    }

    async fn close(self) {
        if self.connection.status().connected()
            && let Err(err) = self.connection.close(200, "consumer stopped").await
        {
            tracing::debug!(error = %err, "closing the consumer's connection failed; the broker requeues its unsettled messages when it notices");
        }
    }
}

struct AmqpMessage(AmqpDelivery);

impl Incoming for AmqpMessage {
    fn delivery(&self) -> Result<Delivery, InboxError> {
        delivery(&self.0)
    }

    fn delivery_count(&self) -> u32 {
        delivery_count(&self.0)
    }

    /// Never: a quorum queue dead-letters a message past its `x-delivery-limit` itself.
    fn last_delivery(&self) -> bool {
        false
    }

    fn received(&mut self, message_id: MessageId) -> Received {
        let properties = &self.0.properties;
        let headers = properties
            .headers()
            .as_ref()
            .map(|headers| {
                headers
                    .inner()
                    .iter()
                    .filter_map(|(name, value)| {
                        let text = match value {
                            AMQPValue::LongString(text) => text.to_string(),
                            AMQPValue::ShortString(text) => text.to_string(),
                            _ => return None,
                        };
                        Some((name.to_string(), text))
                    })
                    .collect()
            })
            .unwrap_or_default();
        Received {
            broker_id: properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string())
                .unwrap_or_default(),
            headers,
            payload: std::mem::take(&mut self.0.data),
            message_id,
            delivery_count: delivery_count(&self.0),
        }
    }

    async fn settle(&self, settlement: Settlement) -> Result<(), BoxError> {
        settle(&self.0, settlement).await.map_err(BoxError::from)
    }
}

// --- Topology -------------------------------------------------------------------------------

/// A quorum queue that dead-letters what cannot be processed, for
/// [`declare_quorum_queue`]: the queue, a `fanout` dead-letter exchange and a
/// dead-letter queue bound to it, all durable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuorumQueue {
    /// The queue consumers read.
    pub queue: String,
    /// Deliveries after which RabbitMQ dead-letters a message that keeps being nacked
    /// (`x-delivery-limit`; RabbitMQ 4 defaults to 20 when unset).
    pub delivery_limit: u32,
    /// The exchange `basic.reject` without requeue and the delivery limit send to
    /// (`x-dead-letter-exchange`).
    pub dead_letter_exchange: String,
    /// Where the dead letters wait for a human.
    pub dead_letter_queue: String,
}

impl QuorumQueue {
    /// `queue`, dead-lettering through the exchange `{queue}.dlx` into the queue
    /// `{queue}.dead`, with a delivery limit of 5.
    pub fn new(queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Self {
            dead_letter_exchange: format!("{queue}.dlx"),
            dead_letter_queue: format!("{queue}.dead"),
            delivery_limit: 5,
            queue,
        }
    }

    /// Sets the delivery limit.
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = limit;
        self
    }
}

/// Declares `topology` on `channel` (idempotent: a second declaration with the same
/// arguments is a no-op), so that no message can be redelivered without bound:
///
/// - the dead-letter exchange (`fanout`: a dead letter keeps its routing key, which the
///   dead-letter queue need not know) and the dead-letter queue bound to it, a quorum
///   queue too;
/// - the queue itself as a quorum queue (`x-queue-type: quorum`,
///   <https://www.rabbitmq.com/docs/quorum-queues>) with `x-delivery-limit`
///   (<https://www.rabbitmq.com/docs/quorum-queues#poison-message-handling>): past the
///   limit RabbitMQ dead-letters a message however it is nacked; and
///   `x-dead-letter-exchange` (<https://www.rabbitmq.com/docs/dlx>), where
///   [`Settlement::DeadLetter`] (`basic.reject`, `requeue: false`) sends it at once. Quorum
///   queues also count deliveries in `x-delivery-count`, which [`delivery_count`] reads
///   for the growing nack delay (a classic queue only flags a redelivery).
///
/// Dead-lettering is RabbitMQ's default `at-most-once` strategy: a dead letter is lost if
/// the dead-letter queue is unavailable at that moment. A queue already declared with
/// other arguments makes RabbitMQ close the channel with `PRECONDITION_FAILED`: delete it,
/// or change it with a policy instead.
///
/// # Errors
/// The channel's error for the first declaration or binding that fails.
pub async fn declare_quorum_queue(
    channel: &Channel,
    topology: &QuorumQueue,
) -> Result<(), ::lapin::Error> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let quorum = || {
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        arguments
    };
    channel
        .exchange_declare(
            &topology.dead_letter_exchange,
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_declare(&topology.dead_letter_queue, durable, quorum())
        .await?;
    channel
        .queue_bind(
            &topology.dead_letter_queue,
            &topology.dead_letter_exchange,
            "",
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut arguments = quorum();
    arguments.insert(
        "x-delivery-limit".into(),
        AMQPValue::LongUInt(topology.delivery_limit),
    );
    arguments.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(topology.dead_letter_exchange.as_str().into()),
    );
    channel
        .queue_declare(&topology.queue, durable, arguments)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::lapin::BasicProperties;
    use ::lapin::acker::Acker;
    use ::lapin::types::FieldTable;

    fn message(properties: BasicProperties, redelivered: bool) -> AmqpDelivery {
        AmqpDelivery {
            delivery_tag: 1,
            exchange: "".into(),
            routing_key: "orders".into(),
            redelivered,
            properties,
            data: Vec::new(),
            acker: Acker::mock(),
        }
    }

    #[test]
    fn the_key_and_send_time_come_from_the_producers_properties() {
        let properties = BasicProperties::default()
            .with_message_id("order-42".into())
            .with_timestamp(1_767_225_600);
        let delivery = delivery(&message(properties, false)).expect("a delivery");
        assert_eq!(
            delivery.message_id(),
            MessageId::from_broker_id("order-42").expect("a key")
        );
        assert_eq!(
            delivery.sent_time(),
            DateTime::from_timestamp(1_767_225_600, 0)
        );
    }

    #[test]
    fn what_no_redelivery_can_fix_is_a_permanent_error() {
        let cases = [
            BasicProperties::default(),
            BasicProperties::default()
                .with_message_id("00000000-0000-0000-0000-000000000000".into()),
            BasicProperties::default()
                .with_message_id("order-42".into())
                .with_timestamp(u64::MAX),
        ];
        for properties in cases {
            let err = delivery(&message(properties, false)).expect_err("refused");
            assert!(err.is_permanent(), "{err}");
        }
    }

    #[test]
    fn delivery_count_reads_quorum_queues_header_else_the_redelivered_flag() {
        assert_eq!(
            delivery_count(&message(BasicProperties::default(), false)),
            1
        );
        assert_eq!(
            delivery_count(&message(BasicProperties::default(), true)),
            2
        );
        let mut headers = FieldTable::default();
        headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(4));
        let quorum = BasicProperties::default().with_headers(headers);
        assert_eq!(delivery_count(&message(quorum, true)), 5);
    }
}
