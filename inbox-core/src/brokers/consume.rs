//! The consumer loop every broker adapter runs ([`rabbitmq::RabbitMqConsumer`],
//! [`jetstream::JetStreamConsumer`], `sqs::SqsConsumer`): a task per delivery behind a semaphore, each through
//! [`Inbox::process`] and settled by [`NackDelay::settle`]; a reconnect with backoff after
//! the broker or the connection is lost; a graceful shutdown that stops taking
//! deliveries, lets the ones in flight finish within a grace period and returns a
//! [`ConsumerSummary`]. The adapters supply only the connection and the message mapping.
//! Kafka's loop (`kafka::KafkaGroupConsumer`, feature `rdkafka`) keeps a partition's
//! records in order, so it runs a task per partition instead, with the same options,
//! summary and error.
//!
//! [`rabbitmq::RabbitMqConsumer`]: crate::rabbitmq::RabbitMqConsumer
//! [`jetstream::JetStreamConsumer`]: crate::jetstream::JetStreamConsumer

use crate::{BoxError, InboxError, NackDelay};
#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
use crate::{Delivery, HandlerFuture, Inbox, MessageId, ObservedTransaction, Outcome, Settlement};
#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
use sea_orm::DatabaseConnection;
#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
use std::convert::Infallible;
use std::fmt;
#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
use std::future::Future;
#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
use std::sync::Arc;
use std::time::Duration;
#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
use tokio::task::JoinSet;
#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
use tracing::Instrument;

/// Why a consumer loop did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The first connection failed: the loop reconnects after losses, but a target that
    /// never answered is more likely a wrong address, credentials or name than an outage.
    #[error(
        "could not start consuming from {broker}: {source}; check the address, the credentials and that the queue (JetStream: the stream and its durable consumer; Kafka: the client settings and topics) exists, then start the consumer again"
    )]
    Connect {
        /// `RabbitMQ`, `JetStream`, `Kafka` or `SQS`.
        broker: &'static str,
        /// The broker client's error.
        #[source]
        source: BoxError,
    },
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
/// One delivery as the handler of a consumer loop sees it, beside the transaction.
#[derive(Clone, Debug)]
pub struct Received {
    /// The message body.
    pub payload: Vec<u8>,
    /// The message's headers whose values are text (RabbitMQ: string-valued headers;
    /// JetStream: every header, a repeated one once per value).
    pub headers: Vec<(String, String)>,
    /// The inbox key derived from the broker's id ([`MessageId::from_broker_id`]).
    pub message_id: MessageId,
    /// The broker's own id, as the producer set it (RabbitMQ's `message_id` property,
    /// JetStream's `Nats-Msg-Id` header): what to grep for in the producer's logs.
    pub broker_id: String,
    /// How often the broker has delivered this message, this delivery included.
    pub delivery_count: u32,
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
/// The handler a consumer loop runs per delivery (`RabbitMqConsumer::run`,
/// `JetStreamConsumer::run`, `SqsConsumer::run`): given the delivery's transaction and the
/// [`Received`] message, the future of its business writes, as the handler of
/// [`Inbox::process`] gets the transaction. Every closure or function of that shape that
/// can be shared by the loop's tasks implements it; name it in your own code that passes
/// a handler on to a loop (`H: MessageHandler<T, E>`).
pub trait MessageHandler<T, E>:
    for<'t> Fn(&'t ObservedTransaction, Arc<Received>) -> HandlerFuture<'t, T, E>
    + Send
    + Sync
    + 'static
{
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
impl<F, T, E> MessageHandler<T, E> for F where
    F: for<'t> Fn(&'t ObservedTransaction, Arc<Received>) -> HandlerFuture<'t, T, E>
        + Send
        + Sync
        + 'static
{
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
impl Received {
    /// The first value of header `name`, if the message carries it.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(header, _)| header == name)
            .map(|(_, value)| value.as_str())
    }
}

/// The settings of a consumer loop; every one has a default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConsumerOptions {
    concurrency: usize,
    prefetch: u16,
    nack_delay: NackDelay,
    grace: Duration,
    reconnect_first: Duration,
    reconnect_max: Duration,
}

impl Default for ConsumerOptions {
    /// 8 deliveries at a time, a prefetch of 16, [`NackDelay::default`], 30 s of grace at
    /// shutdown, reconnects after 100 ms doubling to 30 s.
    fn default() -> Self {
        Self {
            concurrency: 8,
            prefetch: 16,
            nack_delay: NackDelay::default(),
            grace: Duration::from_secs(30),
            reconnect_first: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(30),
        }
    }
}

impl ConsumerOptions {
    /// The most deliveries processed at once, each in a task of its own holding one
    /// pooled connection: keep it at or below the pool's `max_connections`.
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] for 0.
    pub fn with_concurrency(mut self, concurrency: usize) -> Result<Self, InboxError> {
        if concurrency == 0 {
            return Err(InboxError::out_of_range(
                "the consumer's concurrency",
                concurrency,
                1..=usize::MAX,
                "allow at least one delivery at a time",
            ));
        }
        self.concurrency = concurrency;
        Ok(self)
    }

    /// How many unsettled deliveries the broker may send ahead (RabbitMQ's `basic.qos`
    /// prefetch count, JetStream's pull batch). Above the concurrency, so a task finds its
    /// next delivery waiting; a delivery held for a delayed nack counts against it on
    /// RabbitMQ.
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] for 0 (to RabbitMQ, 0 means no limit at all).
    pub fn with_prefetch(mut self, prefetch: u16) -> Result<Self, InboxError> {
        if prefetch == 0 {
            return Err(InboxError::out_of_range(
                "the consumer's prefetch",
                prefetch,
                1..=u16::MAX,
                "allow the broker at least one delivery ahead",
            ));
        }
        self.prefetch = prefetch;
        Ok(self)
    }

    /// The defaults with `prefetch` records ahead, for a loop whose broker needs more than
    /// the default (a constant in range: no check needed).
    #[cfg(feature = "rdkafka")]
    pub(crate) fn default_with_prefetch(prefetch: std::num::NonZeroU16) -> Self {
        Self {
            prefetch: prefetch.get(),
            ..Self::default()
        }
    }

    /// The redelivery delay of a failed delivery (see [`NackDelay`]).
    pub fn with_nack_delay(mut self, nack_delay: NackDelay) -> Self {
        self.nack_delay = nack_delay;
        self
    }

    /// How long a shutdown waits for the deliveries in flight. Past it they are
    /// abandoned: the handler's transaction rolls back, nothing is settled and the broker
    /// redelivers the message (RabbitMQ when the connection closes, JetStream after the
    /// consumer's `ack_wait`).
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// The pause before reconnecting after a lost connection: `first`, doubling with each
    /// failed attempt up to `max`.
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] when `first` is zero (a broker down would be redialled
    /// in a tight loop) or above `max`.
    pub fn with_reconnect_backoff(
        mut self,
        first: Duration,
        max: Duration,
    ) -> Result<Self, InboxError> {
        if first.is_zero() || first > max {
            return Err(InboxError::out_of_range(
                "the first reconnect pause",
                first,
                Duration::from_millis(1)..=max,
                "choose a pause above zero and no longer than the longest one",
            ));
        }
        (self.reconnect_first, self.reconnect_max) = (first, max);
        Ok(self)
    }

    /// The concurrency (see [`with_concurrency`](Self::with_concurrency)).
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// The prefetch (see [`with_prefetch`](Self::with_prefetch)).
    pub fn prefetch(&self) -> u16 {
        self.prefetch
    }

    /// The redelivery delay (see [`with_nack_delay`](Self::with_nack_delay)).
    pub fn nack_delay(&self) -> NackDelay {
        self.nack_delay
    }

    /// The shutdown's grace period (see [`with_grace`](Self::with_grace)).
    pub fn grace(&self) -> Duration {
        self.grace
    }

    #[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
    fn reconnect_pause(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.reconnect_first
            .saturating_mul(1 << doublings)
            .min(self.reconnect_max)
    }
}

/// What a consumer loop did from its start to its shutdown.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerSummary {
    /// Deliveries taken from the broker.
    pub received: u64,
    /// Deliveries whose handler committed ([`Outcome::Processed`]).
    pub processed: u64,
    /// Deliveries of messages already processed ([`Outcome::Duplicate`]).
    pub duplicates: u64,
    /// Deliveries the admission floor refused ([`Outcome::Refused`]).
    pub refused: u64,
    /// Deliveries whose processing failed (the handler's error, or the inbox's).
    pub failed: u64,
    /// Deliveries without a usable message id, dead-lettered without running the handler.
    pub unmappable: u64,
    /// Deliveries acknowledged (Kafka: records whose stored offset advanced).
    pub acked: u64,
    /// Deliveries nacked for a redelivery (Kafka: failed records read again).
    pub nacked: u64,
    /// Deliveries dead-lettered (RabbitMQ `basic.reject` without requeue, JetStream `term`).
    pub dead_lettered: u64,
    /// Settlements the broker could not be told (the connection was lost): it redelivers
    /// those messages.
    pub settle_failures: u64,
    /// Settlements the broker refused because the delivery was no longer this consumer's
    /// (SQS: the receipt handle expired, the message was delivered again meanwhile): not a
    /// failure of the handler; the later delivery settles the message.
    pub stale_settlements: u64,
    /// Deliveries in flight past the shutdown's grace period, or whose handler panicked:
    /// rolled back and left unsettled, so the broker redelivers them.
    pub abandoned: u64,
    /// Connections re-opened after a loss.
    pub reconnects: u64,
    /// Kafka: records whose stored offset had moved (another consumer took the partition
    /// in a rebalance): rolled back, nothing applied.
    pub fenced: u64,
    /// Kafka: rebalances this consumer took part in (assignments and revocations).
    pub rebalances: u64,
    /// Kafka: partitions paused because their records waiting reached the prefetch.
    pub pauses: u64,
    /// Kafka: seeks to a stored offset (after an assignment) or back to a failed record.
    pub seeks: u64,
}

impl fmt::Display for ConsumerSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "received {}, processed {}, duplicates {}, refused {}, failed {}, unmappable {}; acked {}, nacked {}, dead-lettered {}, settle failures {}, stale settlements {}, abandoned {}, reconnects {}; fenced {}, rebalances {}, pauses {}, seeks {}",
            self.received,
            self.processed,
            self.duplicates,
            self.refused,
            self.failed,
            self.unmappable,
            self.acked,
            self.nacked,
            self.dead_lettered,
            self.settle_failures,
            self.stale_settlements,
            self.abandoned,
            self.reconnects,
            self.fenced,
            self.rebalances,
            self.pauses,
            self.seeks
        )
    }
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
/// What became of one delivery.
enum Ended {
    Processed,
    Duplicate,
    Refused,
    Failed,
    Unmappable,
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
impl Ended {
    /// The `outcome` field of the loop's per-delivery event.
    fn label(&self) -> &'static str {
        match self {
            Self::Processed => "processed",
            Self::Duplicate => "duplicate",
            Self::Refused => "refused",
            Self::Failed => "failed",
            Self::Unmappable => "unmappable",
        }
    }
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
/// Whether the broker was told a delivery's settlement.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Told {
    Yes,
    /// The broker could not be reached.
    Failed,
    /// The delivery was no longer this consumer's ([`Incoming::is_stale`]).
    Stale,
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
struct Tally {
    ended: Ended,
    settlement: Settlement,
    told: Told,
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
impl ConsumerSummary {
    fn count(&mut self, tally: Tally) {
        let ended = match tally.ended {
            Ended::Processed => &mut self.processed,
            Ended::Duplicate => &mut self.duplicates,
            Ended::Refused => &mut self.refused,
            Ended::Failed => &mut self.failed,
            Ended::Unmappable => &mut self.unmappable,
        };
        *ended += 1;
        match tally.told {
            Told::Yes => {}
            Told::Failed => {
                self.settle_failures += 1;
                return;
            }
            Told::Stale => {
                self.stale_settlements += 1;
                return;
            }
        }
        let settled = match tally.settlement {
            Settlement::Ack => &mut self.acked,
            Settlement::Nack(_) => &mut self.nacked,
            Settlement::DeadLetter => &mut self.dead_lettered,
        };
        *settled += 1;
    }
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
/// A broker message as the loop handles it.
pub(crate) trait Incoming: Send + 'static {
    /// The message's [`Delivery`], or why it has none (dead-lettered).
    fn delivery(&self) -> Result<Delivery, InboxError>;
    /// How often the broker delivered it, this delivery included.
    fn delivery_count(&self) -> u32;
    /// Whether the broker will not deliver it again after this delivery, so a nack would
    /// drop it without a dead-letter path.
    fn last_delivery(&self) -> bool;
    /// The handler's view of it; takes the payload out.
    fn received(&mut self, message_id: MessageId) -> Received;
    /// Tells the broker `settlement`.
    fn settle(&self, settlement: Settlement) -> impl Future<Output = Result<(), BoxError>> + Send;
    /// Whether `error`, from [`settle`](Self::settle), says the delivery was no longer
    /// this consumer's to settle (SQS's expired receipt handle) rather than a failure.
    fn is_stale(&self, _error: &BoxError) -> bool {
        false
    }
    /// Runs beside the handler, then beside the settlement until it is done, and never
    /// completes: SQS extends the message's visibility timeout from it until the message
    /// is settled. Nothing by default.
    ///
    /// A settlement that sets what the beats set (SQS: a nack's visibility, or a dead
    /// letter's hidden for 12 h) must be the last change the broker sees, so its
    /// [`settle`](Self::settle) stops the beats itself: it waits for a beat in flight
    /// (which it can, as this future is still polled) and no beat starts after it.
    fn keep_alive(&self) -> impl Future<Output = Infallible> + Send {
        std::future::pending()
    }
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
/// One connection's stream of deliveries.
pub(crate) trait Session: Send {
    type Message: Incoming;
    /// The next delivery; `None` or an error when the connection or consumer is lost.
    fn next(&mut self) -> impl Future<Output = Option<Result<Self::Message, BoxError>>> + Send;
    /// Ends the session once its settlements are out (RabbitMQ requeues what it still
    /// holds when its connection closes).
    fn close(self) -> impl Future<Output = ()> + Send;
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
/// Opens sessions: the first at the start, more after a loss.
pub(crate) trait Connect: Send {
    type Session: Session;
    /// The broker's name, for the logs.
    const BROKER: &'static str;
    fn connect(&mut self) -> impl Future<Output = Result<Self::Session, BoxError>> + Send;
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
/// What the delivery tasks share.
struct Shared<H> {
    inbox: Inbox,
    db: DatabaseConnection,
    handler: H,
    nack_delay: NackDelay,
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
/// Runs the loop until `shutdown` completes; the first connection's failure is returned.
pub(crate) async fn run<C, H, T, E>(
    mut connector: C,
    options: ConsumerOptions,
    inbox: Inbox,
    db: DatabaseConnection,
    handler: H,
    shutdown: impl Future + Send,
) -> Result<ConsumerSummary, ConsumerError>
where
    C: Connect,
    H: MessageHandler<T, E>,
    T: Send + 'static,
    E: fmt::Display + Send + 'static,
{
    let broker = C::BROKER;
    let first = connector.connect().await;
    let mut session = Some(first.map_err(|source| ConsumerError::Connect { broker, source })?);
    let shared = Arc::new(Shared {
        inbox,
        db,
        handler,
        nack_delay: options.nack_delay,
    });
    let permits = Arc::new(Semaphore::new(options.concurrency));
    let mut tasks = JoinSet::new();
    let mut summary = ConsumerSummary::default();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut failures = 0_u32;
    'running: loop {
        let Some(current) = session.as_mut() else {
            failures += 1;
            let pause = options.reconnect_pause(failures);
            tokio::select! {
                biased;
                _ = &mut shutdown => break 'running,
                () = tokio::time::sleep(pause) => {}
            }
            let connected = tokio::select! {
                biased;
                _ = &mut shutdown => break 'running,
                connected = connector.connect() => connected,
            };
            match connected {
                Ok(connected) => {
                    tracing::warn!(broker, attempts = failures, "reconnected; consuming again");
                    summary.reconnects += 1;
                    failures = 0;
                    session = Some(connected);
                }
                Err(err) => {
                    tracing::warn!(broker, error = %err, attempts = failures, "reconnecting failed; trying again after a pause");
                }
            }
            continue;
        };
        // A permit first: a delivery is taken only when a task can run it at once.
        let permit = tokio::select! {
            biased;
            _ = &mut shutdown => break 'running,
            permit = Arc::clone(&permits).acquire_owned() => permit,
        };
        let Ok(permit) = permit else {
            break 'running; // never closed: the loop owns the semaphore
        };
        while let Some(joined) = tasks.try_join_next() {
            count_joined(&mut summary, joined);
        }
        let next = tokio::select! {
            biased;
            _ = &mut shutdown => break 'running,
            next = current.next() => next,
        };
        match next {
            Some(Ok(message)) => {
                summary.received += 1;
                tasks.spawn(handle(message, Arc::clone(&shared), permit));
            }
            lost => {
                let error = match lost {
                    Some(Err(err)) => err.to_string(),
                    _ => "the consumer's stream ended".to_owned(),
                };
                tracing::warn!(
                    broker,
                    error,
                    "the connection or consumer was lost; reconnecting (the broker redelivers what was unsettled)"
                );
                if let Some(lost) = session.take() {
                    lost.close().await;
                }
            }
        }
    }
    let drained = tokio::time::timeout(options.grace, async {
        while let Some(joined) = tasks.join_next().await {
            count_joined(&mut summary, joined);
        }
    })
    .await;
    if drained.is_err() {
        let left = tasks.len();
        tracing::warn!(broker, abandoned = left, grace = ?options.grace, "deliveries still in flight after the grace period are abandoned: rolled back, left for the broker to redeliver");
        tasks.shutdown().await;
        summary.abandoned += u64::try_from(left).unwrap_or(u64::MAX);
    }
    if let Some(session) = session {
        session.close().await;
    }
    tracing::info!(broker, %summary, "the consumer stopped");
    Ok(summary)
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
fn count_joined(summary: &mut ConsumerSummary, joined: Result<Tally, tokio::task::JoinError>) {
    match joined {
        Ok(tally) => summary.count(tally),
        Err(err) => {
            tracing::error!(error = %err, "a delivery's task panicked; its transaction rolled back and the message is left unsettled for the broker to redeliver");
            summary.abandoned += 1;
        }
    }
}

#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
/// Processes and settles one delivery; `_permit` frees its slot when the task ends.
async fn handle<M, H, T, E>(
    mut message: M,
    shared: Arc<Shared<H>>,
    _permit: OwnedSemaphorePermit,
) -> Tally
where
    M: Incoming,
    H: MessageHandler<T, E>,
    T: Send + 'static,
    E: fmt::Display + Send + 'static,
{
    let count = message.delivery_count();
    let delivery = message.delivery().map(|delivery| {
        let received = Arc::new(message.received(delivery.message_id()));
        (delivery, received)
    });
    let span = match &delivery {
        Ok((_, received)) => tracing::info_span!(
            "inbox.delivery",
            broker_id = %received.broker_id,
            message_id = %received.message_id,
            delivery_count = count,
        ),
        Err(_) => tracing::Span::none(),
    };
    // One heartbeat for the whole delivery, the handler and then the settlement, so that
    // its beats keep their schedule from the receive (a second one would first send every
    // beat the handler's time had left behind).
    let keep_alive = message.keep_alive().instrument(span.clone());
    let mut keep_alive = std::pin::pin!(keep_alive);
    let (ended, mut settlement) = match delivery {
        Err(err) => {
            tracing::warn!(error = %err, delivery_count = count, "a delivery without a usable message id: dead-lettered without running the handler");
            (Ended::Unmappable, Settlement::DeadLetter)
        }
        Ok((delivery, received)) => {
            let process = shared
                .inbox
                .process(&shared.db, delivery, |txn| {
                    (shared.handler)(txn, Arc::clone(&received))
                })
                .instrument(span.clone());
            let result = tokio::select! {
                result = process => result,
                never = &mut keep_alive => match never {},
            };
            let settlement = shared.nack_delay.settle(&result, count);
            let ended = match &result {
                Ok(Outcome::Processed(_)) => Ended::Processed,
                Ok(Outcome::Duplicate) => Ended::Duplicate,
                Ok(Outcome::Refused(_)) => Ended::Refused,
                Err(err) => {
                    span.in_scope(
                        || tracing::warn!(error = %err, ?settlement, "the delivery failed"),
                    );
                    Ended::Failed
                }
            };
            (ended, settlement)
        }
    };
    if matches!(settlement, Settlement::Nack(_)) && message.last_delivery() {
        // The broker would drop it silently after this nack: dead-letter it instead.
        settlement = Settlement::DeadLetter;
    }
    // A delete, or a dead letter's move, can take longer than the visibility the last beat
    // left (the client's retries with backoff, a slow broker): beating on until it is done
    // keeps the message from being delivered again meanwhile. A nack sets when the message
    // comes back (SQS: its visibility), so no beat may land after it; leaving the heartbeat
    // unpolled would not stop a beat whose request is already out, it would only keep the
    // nack from seeing that beat finish. The message's `settle` stops its own beats.
    let settled = tokio::select! {
        biased;
        settled = message.settle(settlement) => settled,
        never = &mut keep_alive => match never {},
    };
    let told = match settled {
        Ok(()) => Told::Yes,
        Err(err) if message.is_stale(&err) => {
            span.in_scope(|| tracing::info!(error = %err, ?settlement, "the delivery was no longer this consumer's to settle; the broker delivered the message again, and that delivery settles it"));
            Told::Stale
        }
        Err(err) => {
            span.in_scope(|| tracing::warn!(error = %err, ?settlement, "settling failed; the broker redelivers the message"));
            Told::Failed
        }
    };
    span.in_scope(|| {
        tracing::debug!(
            outcome = ended.label(),
            ?settlement,
            settled = told == Told::Yes,
            stale = told == Told::Stale,
            "the loop settled the delivery"
        )
    });
    Tally {
        ended,
        settlement,
        told,
    }
}

#[cfg(all(
    test,
    feature = "sqlite",
    any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs")
))]
/// [`handle`] of `message` with `handler` and [`NackDelay::default`] on a migrated
/// in-memory SQLite database, for the tests of an adapter's messages: the settlement the
/// broker was told, `None` when it was not.
pub(crate) async fn handle_on_sqlite<M, H, T, E>(message: M, handler: H) -> Option<Settlement>
where
    M: Incoming,
    H: MessageHandler<T, E>,
    T: Send + 'static,
    E: fmt::Display + Send + 'static,
{
    use sea_orm_migration::MigratorTrait;
    let db = sea_orm::Database::connect("sqlite::memory:")
        .await
        .expect("SQLite");
    sea_orm_inbox_migration::Migrator::up(&db, None)
        .await
        .expect("the inbox's tables");
    let shared = Arc::new(Shared {
        inbox: Inbox::new("heartbeat").expect("a consumer name"),
        db,
        handler,
        nack_delay: NackDelay::default(),
    });
    let permit = Arc::new(Semaphore::new(1))
        .acquire_owned()
        .await
        .expect("a permit");
    let tally = handle(message, shared, permit).await;
    (tally.told == Told::Yes).then_some(tally.settlement)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
    #[test]
    fn reconnect_pauses_double_up_to_the_longest() {
        let options = ConsumerOptions::default()
            .with_reconnect_backoff(Duration::from_millis(100), Duration::from_secs(1))
            .expect("in range");
        let pauses: Vec<_> = [1, 2, 3, 4, 5, 40]
            .into_iter()
            .map(|failures| options.reconnect_pause(failures).as_millis())
            .collect();
        assert_eq!(pauses, [100, 200, 400, 800, 1000, 1000]);
    }

    /// The heartbeat of [`handle`] against a message whose settlement is slow.
    #[cfg(all(
        feature = "sqlite",
        any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs")
    ))]
    mod heartbeat {
        use super::*;
        use std::sync::Mutex;
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

        /// Beats wanted while a settlement runs: its call returns once it has seen them.
        const BEATS: usize = 3;
        const BEAT: Duration = Duration::from_millis(10);
        /// How long a settlement waits for the beats before it gives up and returns: far
        /// more than [`BEATS`] beats take on a loaded machine.
        const PATIENCE: Duration = Duration::from_secs(2);

        /// What a [`Slow`] message saw.
        #[derive(Default)]
        struct Seen {
            settling: AtomicBool,
            beats_while_settling: AtomicUsize,
            settlements: Mutex<Vec<Settlement>>,
        }

        /// A message whose settlement takes until it has seen [`BEATS`] beats, or
        /// [`PATIENCE`] without: a delete outlasting the visibility the last beat left.
        struct Slow {
            id: &'static str,
            seen: Arc<Seen>,
        }

        impl Incoming for Slow {
            fn delivery(&self) -> Result<Delivery, InboxError> {
                MessageId::from_broker_id(self.id).map(Delivery::new)
            }

            fn delivery_count(&self) -> u32 {
                1
            }

            fn last_delivery(&self) -> bool {
                false
            }

            fn received(&mut self, message_id: MessageId) -> Received {
                Received {
                    payload: Vec::new(),
                    headers: Vec::new(),
                    message_id,
                    broker_id: self.id.to_owned(),
                    delivery_count: 1,
                }
            }

            async fn settle(&self, settlement: Settlement) -> Result<(), BoxError> {
                if let Ok(mut settlements) = self.seen.settlements.lock() {
                    settlements.push(settlement);
                }
                self.seen.settling.store(true, Ordering::SeqCst);
                let _ = tokio::time::timeout(PATIENCE, async {
                    while self.seen.beats_while_settling.load(Ordering::SeqCst) < BEATS {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                })
                .await;
                Ok(())
            }

            async fn keep_alive(&self) -> Infallible {
                loop {
                    tokio::time::sleep(BEAT).await;
                    if self.seen.settling.load(Ordering::SeqCst) {
                        self.seen
                            .beats_while_settling
                            .fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        }

        fn succeeds(
            _txn: &ObservedTransaction,
            _message: Arc<Received>,
        ) -> HandlerFuture<'_, (), String> {
            Box::pin(async { Ok(()) })
        }

        fn fails(
            _txn: &ObservedTransaction,
            _message: Arc<Received>,
        ) -> HandlerFuture<'_, (), String> {
            Box::pin(async { Err("a transient failure".to_owned()) })
        }

        /// [`handle`] of a [`Slow`] message `id` with `handler`: what it settled, and the
        /// beats its settlement saw.
        async fn settle_slowly<H: MessageHandler<(), String>>(
            id: &'static str,
            handler: H,
        ) -> (Vec<Settlement>, usize) {
            let seen = Arc::new(Seen::default());
            let message = Slow {
                id,
                seen: Arc::clone(&seen),
            };
            let told = handle_on_sqlite(message, handler).await;
            assert!(told.is_some(), "the fake settles every delivery");
            let settlements = seen
                .settlements
                .lock()
                .map(|s| s.clone())
                .unwrap_or_default();
            (
                settlements,
                seen.beats_while_settling.load(Ordering::SeqCst),
            )
        }

        /// The delete after a committed handler runs beside the heartbeat: a delete slower
        /// than the visibility left does not hand the message to another consumer.
        #[tokio::test]
        async fn an_ack_is_settled_beside_the_heartbeat() {
            let (settlements, beats) = settle_slowly("order-1", succeeds).await;
            assert_eq!(settlements, [Settlement::Ack]);
            assert!(
                beats >= BEATS,
                "{beats} beats while the delete ran for {PATIENCE:?}: the heartbeat stopped before the settlement"
            );
        }

        /// So does a dead letter's move, here of a message without a usable id (the
        /// handler never runs).
        #[tokio::test]
        async fn a_dead_letter_is_settled_beside_the_heartbeat() {
            let (settlements, beats) = settle_slowly("", succeeds).await;
            assert_eq!(settlements, [Settlement::DeadLetter]);
            assert!(
                beats >= BEATS,
                "{beats} beats while the dead letter's move ran for {PATIENCE:?}: the heartbeat stopped before the settlement"
            );
        }

        /// So does a nack's visibility change: a beat whose request was out when the
        /// handler returned lands whether the loop polls it or not, so the loop polls it
        /// to its end and the message's `settle` waits for it and starts no beat after
        /// (SQS: `sqs::consumer::tests`, against the message and the client themselves).
        #[tokio::test]
        async fn a_nack_is_settled_beside_the_heartbeat() {
            let (settlements, beats) = settle_slowly("order-2", fails).await;
            assert!(
                matches!(settlements[..], [Settlement::Nack(Some(_))]),
                "{settlements:?}"
            );
            assert!(
                beats >= BEATS,
                "{beats} beats while the nack ran for {PATIENCE:?}: a beat in flight at the nack could not finish before it"
            );
        }
    }

    #[test]
    fn options_refuse_what_cannot_work() {
        let options = ConsumerOptions::default();
        assert!(options.with_concurrency(0).is_err());
        assert!(options.with_prefetch(0).is_err());
        assert!(
            options
                .with_reconnect_backoff(Duration::ZERO, Duration::from_secs(1))
                .is_err()
        );
        assert!(
            options
                .with_reconnect_backoff(Duration::from_secs(2), Duration::from_secs(1))
                .is_err()
        );
    }
}
