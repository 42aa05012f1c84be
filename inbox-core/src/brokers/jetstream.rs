//! NATS JetStream through [`async_nats`] (feature `async-nats`): a message's `Nats-Msg-Id`
//! header and metadata to a [`Delivery`], a [`Settlement`] to `ack`, `nak` with a delay or
//! `term`.
//!
//! [`JetStreamConsumer`] is a ready consumer loop (concurrency, prefetch, reconnects,
//! graceful shutdown), and [`create_stream`] and [`create_durable_consumer`] the stream
//! and consumer it needs; the same by hand, over a pull consumer with explicit acks:
//!
//! ```no_run
//! use futures_util::StreamExt;
//! use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr};
//! use sea_orm_inbox::{Inbox, ProcessError, Settlement, jetstream};
//!
//! # async fn consume(consumer: async_nats::jetstream::consumer::PullConsumer, db: DatabaseConnection, inbox: Inbox) -> Result<(), async_nats::Error> {
//! let mut messages = consumer.messages().await?;
//! while let Some(message) = messages.next().await {
//!     let message = message?;
//!     let result = match jetstream::delivery(&message) {
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
//!         // No Nats-Msg-Id header, or a nil one: terminated below.
//!         Err(err) => Err(ProcessError::Inbox(err)),
//!     };
//!     let settlement = Settlement::for_delivery(&result, jetstream::delivery_count(&message));
//!     jetstream::settle(&message, settlement).await?;
//! }
//! # Ok(()) }
//! ```

use super::consume::{self, Connect, Incoming, Session};
use crate::{
    BoxError, ConsumerError, ConsumerOptions, ConsumerSummary, Delivery, Inbox, InboxError,
    MessageHandler, MessageId, OutboxMessage, PublishError, Publisher, Received, Settlement,
};
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{AckKind, Message};
use chrono::{DateTime, SecondsFormat, Utc};
use futures_util::StreamExt;
use sea_orm::DatabaseConnection;
use std::future::Future;
use std::time::Duration;

/// The [`Delivery`] of a JetStream message: its key from the `Nats-Msg-Id` header
/// ([`MessageId::from_broker_id`]; the header JetStream itself deduplicates publishes by),
/// its send time from the [`SENT_AT_HEADER`] when the producer set one (as
/// [`JetStreamPublisher`] does: the same on every publish of an outbox row, also one the
/// stream stored again after its duplicate window), else from the message metadata (the
/// time the stream stored it, the same on every redelivery). A message with neither (not
/// from a consumer with acks) gets no send time.
///
/// # Errors
/// [`InboxError::EmptyKeyField`] when the message has no `Nats-Msg-Id` (or an empty one),
/// [`InboxError::NilMessageId`] when it is the nil UUID, [`InboxError::OutOfRange`] for a
/// [`SENT_AT_HEADER`] that is not an RFC 3339 time. All of them are
/// [permanent](InboxError::is_permanent): terminate the message
/// (`Err(ProcessError::Inbox(err))` settles as [`Settlement::DeadLetter`]).
pub fn delivery(message: &Message) -> Result<Delivery, InboxError> {
    let headers = message.headers.as_ref();
    let id = headers
        .and_then(|headers| headers.get(NATS_MESSAGE_ID))
        .map_or("", |id| id.as_str());
    let delivery = Delivery::new(MessageId::from_broker_id(id)?);
    if let Some(sent) = headers
        .and_then(|headers| headers.get(SENT_AT_HEADER))
        .map(|sent| sent.as_str())
    {
        let sent_at = DateTime::parse_from_rfc3339(sent).map_err(|_| InboxError::OutOfRange {
            what: "the Outbox-Sent-At header",
            value: sent.to_owned(),
            accepted: "an RFC 3339 time, e.g. 2026-12-04T12:00:00.000000Z".to_owned(),
            advice: "set it to the time the message was first sent, or leave it out",
        })?;
        return Ok(delivery.sent_at(sent_at.with_timezone(&Utc)));
    }
    let published = message.info().ok().and_then(|info| {
        let nanos = i64::try_from(info.published.unix_timestamp_nanos()).ok()?;
        Some(DateTime::from_timestamp_nanos(nanos))
    });
    Ok(match published {
        Some(sent_at) => delivery.sent_at(sent_at),
        None => delivery,
    })
}

/// How often JetStream has delivered this message, this delivery included (its metadata's
/// `delivered`; 1 without metadata). For [`Settlement::for_delivery`].
pub fn delivery_count(message: &Message) -> u32 {
    message
        .info()
        .ok()
        .and_then(|info| u32::try_from(info.delivered).ok())
        .unwrap_or(1)
        .max(1)
}

/// Tells JetStream what became of `message`:
///
/// | settlement | call |
/// | --- | --- |
/// | `Ack` | `ack()` |
/// | `Nack(delay)` | `ack_with(AckKind::Nak(delay))`: redelivered after the delay |
/// | `DeadLetter` | `ack_with(AckKind::Term)`: never redelivered; the server publishes a `MSG_TERMINATED` advisory, which a dead-letter stream can capture |
///
/// Acks are published without waiting for the server's reply: flush the client
/// (`client.flush()`) before the process exits.
///
/// # Errors
/// The client's error when the ack cannot be published.
pub async fn settle(message: &Message, settlement: Settlement) -> Result<(), async_nats::Error> {
    match settlement {
        Settlement::Ack => message.ack().await,
        Settlement::Nack(delay) => message.ack_with(AckKind::Nak(delay)).await,
        Settlement::DeadLetter => message.ack_with(AckKind::Term).await,
    }
}

/// Publishes outbox messages to JetStream and waits for each publish ack: a [`Publisher`]
/// for a [`Relay`](crate::Relay).
///
/// The destination is the subject; the outbox message id goes out as `Nats-Msg-Id`, so
/// JetStream itself drops a republish (after a relay died before marking its row sent)
/// within the stream's duplicate window, and the ack of such a repeat counts as success.
/// The headers go as headers, the ordering key as the header [`KEY_HEADER`], the send time
/// as the header [`SENT_AT_HEADER`].
///
/// ```no_run
/// use sea_orm_inbox::{Relay, jetstream::JetStreamPublisher};
///
/// # async fn run(client: async_nats::Client, db: sea_orm::DatabaseConnection) {
/// let relay = Relay::new(JetStreamPublisher::new(async_nats::jetstream::new(client)));
/// relay.run(&db, std::future::pending()).await;
/// # }
/// ```
pub struct JetStreamPublisher {
    context: async_nats::jetstream::Context,
}

/// The header carrying an outbox message's ordering key to NATS consumers.
pub const KEY_HEADER: &str = "Outbox-Key";

/// The header carrying an outbox message's send time, its
/// [first publish time](OutboxMessage::first_published_at) in RFC 3339 with microseconds,
/// which [`delivery`] reads back. JetStream's own stored time would not do: a republish
/// the stream stores again (after its duplicate window) gets a later one.
pub const SENT_AT_HEADER: &str = "Outbox-Sent-At";

impl JetStreamPublisher {
    /// A publisher through `context`.
    pub fn new(context: async_nats::jetstream::Context) -> Self {
        Self { context }
    }
}

impl Publisher for JetStreamPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        let mut publish = PublishMessage::build()
            .payload(message.payload.clone().into())
            .message_id(message.message_id.to_string());
        for (name, value) in &message.headers {
            publish = publish.header(name.as_str(), value.as_str());
        }
        if let Some(key) = &message.key {
            publish = publish.header(KEY_HEADER, key.as_str());
        }
        publish = publish.header(
            SENT_AT_HEADER,
            message
                .first_published_at
                .to_rfc3339_opts(SecondsFormat::Micros, true)
                .as_str(),
        );
        let transient = |err: async_nats::jetstream::context::PublishError| {
            PublishError::Transient(Box::new(err))
        };
        // A duplicate ack (JetStream already stored this id) is a success too.
        self.context
            .send_publish(message.destination.clone(), publish)
            .await
            .map_err(transient)?
            .await
            .map_err(transient)?;
        Ok(())
    }
}

// --- The consumer loop ----------------------------------------------------------------------

/// A running JetStream consumer in a few lines: the broker-neutral loop of
/// [`ConsumerOptions`] (a task per delivery behind a semaphore, [`delivery`],
/// `Inbox::process`, [`settle`]; a message without a usable `Nats-Msg-Id` is terminated
/// without running the handler) over a durable pull consumer, pulled in batches of the
/// [prefetch](ConsumerOptions::with_prefetch). The client reconnects by itself after a
/// lost connection; the loop re-opens the consumer's pull stream when it fails or ends,
/// with backoff. It creates nothing: create the stream and the consumer first (at
/// deployment, or with [`create_stream`] and [`create_durable_consumer`]).
///
/// On the consumer's last delivery ([`max_deliver`](DurableConsumer::max_deliver)) a
/// failure that would be nak'ed is terminated instead: JetStream would otherwise stop
/// delivering it with only a `MAX_DELIVERIES` advisory, and this way every dead letter
/// leaves the same `MSG_TERMINATED` advisory.
///
/// ```no_run
/// use sea_orm::{ConnectionTrait, DbErr};
/// use sea_orm_inbox::{Inbox, jetstream::JetStreamConsumer};
///
/// # async fn run(db: sea_orm::DatabaseConnection, ctrl_c: std::future::Pending<()>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let client = async_nats::connect("nats://127.0.0.1:4222").await?;
/// let summary = JetStreamConsumer::new(client, "ORDERS", "billing")
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
pub struct JetStreamConsumer {
    client: async_nats::Client,
    stream: String,
    consumer: String,
    options: ConsumerOptions,
}

impl JetStreamConsumer {
    /// A consumer of the durable pull consumer `consumer` on `stream`, through `client`,
    /// with the default [`ConsumerOptions`].
    pub fn new(
        client: async_nats::Client,
        stream: impl Into<String>,
        consumer: impl Into<String>,
    ) -> Self {
        Self {
            client,
            stream: stream.into(),
            consumer: consumer.into(),
            options: ConsumerOptions::default(),
        }
    }

    /// Replaces the loop's settings; the prefetch is the pull batch (the consumer's own
    /// `max_ack_pending` caps what all its clients hold at once).
    pub fn with_options(mut self, options: ConsumerOptions) -> Self {
        self.options = options;
        self
    }

    /// Consumes until `shutdown` completes (`tokio::signal::ctrl_c()`, a channel's
    /// receive...), then stops taking deliveries, waits for those in flight up to the
    /// [grace period](ConsumerOptions::with_grace), flushes the client so their acks reach
    /// the server, and returns what it did. Messages left unsettled (abandoned, or pulled
    /// but not started) are redelivered after the consumer's `ack_wait`. `handler` gets
    /// the transaction and the [`Received`] message.
    ///
    /// # Errors
    /// [`ConsumerError::Connect`] when the stream or the consumer cannot be found, or the
    /// first pull fails. Later losses are retried, logged at WARN and counted in
    /// [`ConsumerSummary::reconnects`].
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
        let connector = JsConnect {
            context: async_nats::jetstream::new(self.client.clone()),
            client: self.client,
            stream: self.stream,
            consumer: self.consumer,
            prefetch: usize::from(self.options.prefetch()),
        };
        consume::run(connector, self.options, inbox, db, handler, shutdown).await
    }
}

struct JsConnect {
    client: async_nats::Client,
    context: async_nats::jetstream::Context,
    stream: String,
    consumer: String,
    prefetch: usize,
}

impl Connect for JsConnect {
    type Session = JsSession;
    const BROKER: &'static str = "JetStream";

    async fn connect(&mut self) -> Result<JsSession, BoxError> {
        let consumer: PullConsumer = self
            .context
            .get_consumer_from_stream(&self.consumer, &self.stream)
            .await?;
        let max_deliver = consumer.cached_info().config.max_deliver;
        let messages = consumer
            .stream()
            .max_messages_per_batch(self.prefetch)
            .messages()
            .await?;
        Ok(JsSession {
            client: self.client.clone(),
            messages,
            max_deliver,
        })
    }
}

struct JsSession {
    client: async_nats::Client,
    messages: async_nats::jetstream::consumer::pull::Stream,
    max_deliver: i64,
}

impl Session for JsSession {
    type Message = JsMessage;

    async fn next(&mut self) -> Option<Result<JsMessage, BoxError>> {
        let next = self.messages.next().await?;
        let max_deliver = self.max_deliver;
        Some(
            next.map(|message| JsMessage {
                message,
                max_deliver,
            })
            .map_err(BoxError::from),
        )
    }

    async fn close(self) {
        if let Err(err) = self.client.flush().await {
            tracing::warn!(error = %err, "flushing the acks failed; JetStream redelivers what they settled after its ack wait");
        }
    }
}

struct JsMessage {
    message: Message,
    /// The consumer's `max_deliver`; -1 or 0 for no limit.
    max_deliver: i64,
}

impl Incoming for JsMessage {
    fn delivery(&self) -> Result<Delivery, InboxError> {
        delivery(&self.message)
    }

    fn delivery_count(&self) -> u32 {
        delivery_count(&self.message)
    }

    fn last_delivery(&self) -> bool {
        self.max_deliver > 0 && i64::from(delivery_count(&self.message)) >= self.max_deliver
    }

    fn received(&mut self, message_id: MessageId) -> Received {
        let headers = self.message.headers.as_ref();
        Received {
            payload: self.message.payload.to_vec(),
            headers: headers
                .map(|headers| {
                    headers
                        .iter()
                        .flat_map(|(name, values)| {
                            values
                                .iter()
                                .map(move |value| (name.to_string(), value.to_string()))
                        })
                        .collect()
                })
                .unwrap_or_default(),
            broker_id: headers
                .and_then(|headers| headers.get(NATS_MESSAGE_ID))
                .map(|id| id.to_string())
                .unwrap_or_default(),
            message_id,
            delivery_count: delivery_count(&self.message),
        }
    }

    async fn settle(&self, settlement: Settlement) -> Result<(), BoxError> {
        settle(&self.message, settlement).await
    }
}

// --- Topology -------------------------------------------------------------------------------

/// The duplicate window [`create_stream`] gives a stream: 1 s. JetStream drops a publish
/// whose `Nats-Msg-Id` it stored within the window and acks it as a duplicate
/// (<https://docs.nats.io/using-nats/developer/develop_jetstream/model_deep_dive#message-deduplication>);
/// its default of two minutes silently drops a message the application sends again on
/// purpose (a re-send after fixing what got it terminated, whose inbox marker does not
/// exist). The inbox deduplicates at the consumer for as long as its markers are kept,
/// so the window only needs to absorb a client's immediate retry of a publish whose ack
/// was lost. JetStream has no zero window (0 means the default).
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(1);

/// Creates the stream `name` over `subjects` with the [`DUPLICATE_WINDOW`] (or returns
/// it when it exists: its configuration is left as it is; check
/// `stream.cached_info().config.duplicate_window` to be sure).
///
/// # Errors
/// The server's refusal (a name or subjects overlapping another stream's).
pub async fn create_stream(
    context: &async_nats::jetstream::Context,
    name: &str,
    subjects: Vec<String>,
) -> Result<async_nats::jetstream::stream::Stream, async_nats::jetstream::context::CreateStreamError>
{
    context
        .get_or_create_stream(async_nats::jetstream::stream::Config {
            name: name.to_owned(),
            subjects,
            duplicate_window: DUPLICATE_WINDOW,
            ..async_nats::jetstream::stream::Config::default()
        })
        .await
}

/// A durable pull consumer with explicit acks that gives up on a message after a bounded
/// number of deliveries, for [`create_durable_consumer`]
/// (<https://docs.nats.io/nats-concepts/jetstream/consumers>).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DurableConsumer {
    /// The durable name.
    pub name: String,
    /// Deliveries after which JetStream stops redelivering a message
    /// (`max_deliver`). At the limit the server publishes the advisory
    /// `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>` and leaves the
    /// message in the stream, acked by no one and delivered no more: there is no
    /// dead-letter queue. [`JetStreamConsumer`] terminates the message on its last
    /// delivery instead (advisory `MSG_TERMINATED`), so capture that advisory, or both, in
    /// a stream of its own to keep dead letters.
    pub max_deliver: i64,
    /// How long the server waits for an ack before redelivering (`ack_wait`); the first
    /// step of `backoff` replaces it when set.
    pub ack_wait: Duration,
    /// The waits before each redelivery after an ack that never came (`backoff`, at most
    /// `max_deliver` entries; the last repeats). A nak with a delay, as the loop sends,
    /// uses its own delay.
    pub backoff: Vec<Duration>,
    /// The most messages delivered and unacked at once over all of the consumer's clients
    /// (`max_ack_pending`): above the loops' prefetch times the replicas.
    pub max_ack_pending: i64,
}

impl DurableConsumer {
    /// `name` with `max_deliver` 5, `ack_wait` 30 s, a backoff of 1 s, 5 s, 30 s and 60 s,
    /// and `max_ack_pending` 1,000.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            max_deliver: 5,
            ack_wait: Duration::from_secs(30),
            backoff: [1, 5, 30, 60].map(Duration::from_secs).to_vec(),
            max_ack_pending: 1_000,
        }
    }

    /// Sets `max_deliver`.
    pub fn max_deliver(mut self, max_deliver: i64) -> Self {
        self.max_deliver = max_deliver;
        self
    }

    /// Sets `ack_wait`.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Sets `backoff` (empty: every redelivery waits `ack_wait`).
    pub fn backoff(mut self, backoff: Vec<Duration>) -> Self {
        self.backoff = backoff;
        self
    }
}

/// Creates `consumer` on `stream` (explicit acks), or returns it when it exists with the
/// same configuration.
///
/// # Errors
/// The server's refusal: a consumer of that name with another configuration, or a
/// `backoff` longer than `max_deliver`.
pub async fn create_durable_consumer(
    stream: &async_nats::jetstream::stream::Stream,
    consumer: &DurableConsumer,
) -> Result<PullConsumer, async_nats::jetstream::stream::ConsumerError> {
    stream
        .create_consumer(pull::Config {
            durable_name: Some(consumer.name.clone()),
            ack_policy: AckPolicy::Explicit,
            max_deliver: consumer.max_deliver,
            ack_wait: consumer.ack_wait,
            backoff: consumer.backoff.clone(),
            max_ack_pending: consumer.max_ack_pending,
            ..pull::Config::default()
        })
        .await
}
