//! [`SqsConsumer`]: the shared consumer loop over long-polling receives, with the
//! visibility heartbeat.

use super::{
    MAX_BATCH, MAX_VISIBILITY, SYSTEM_ATTRIBUTES, SettleError, SqsQueue, broker_id, delivery_count,
    sqs_id, whole_seconds,
};
use crate::brokers::consume::{self, Connect, Incoming, Session};
use crate::{
    BoxError, ConsumerError, ConsumerOptions, ConsumerSummary, Delivery, Inbox, InboxError,
    MessageHandler, MessageId, Received, Settlement,
};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::Message;
use sea_orm::DatabaseConnection;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A running SQS consumer: the broker-neutral loop of [`ConsumerOptions`] (a task per
/// delivery behind a semaphore, [`delivery`](super::delivery), `Inbox::process`, [`SqsQueue::settle`]; a
/// message without a usable id is dead-lettered without running the handler) over long
/// polling `ReceiveMessage` calls.
///
/// - Each receive asks for no more messages than there are free task slots (at most the
///   [prefetch](ConsumerOptions::with_prefetch) and [`MAX_BATCH`]), so no message waits
///   unseen in memory while its visibility timeout runs.
/// - Receives use this consumer's [visibility timeout](Self::with_visibility_timeout)
///   (default 30 s). While a handler runs, and on until its message is deleted or moved to
///   the dead-letter queue, a heartbeat extends the message's visibility by the timeout
///   again every [heartbeat interval](Self::with_heartbeat) (default a third of the
///   timeout), so neither a long handler nor a slow delete (the client's retries, a slow
///   endpoint) sees its message delivered to another replica meanwhile. A nack (and a dead
///   letter hidden for want of a dead-letter queue) stops it first: it waits for a beat
///   still out and starts its own `ChangeMessageVisibility` after it, so that the nack's
///   delay, not the full timeout, sets when the message returns. When a message is
///   delivered again anyway (a stalled replica, the heartbeat off), the inbox decides: the
///   second delivery waits for the first's claim and becomes a duplicate.
/// - Dead letters go to the configured dead-letter queue, else to the target of the
///   queue's redrive policy, else are hidden for 12 h (see [`SqsQueue`]).
/// - A settlement whose receipt handle expired counts in
///   [`ConsumerSummary::stale_settlements`], not as a failure.
///
/// ```no_run
/// use sea_orm::{ConnectionTrait, DbErr};
/// use sea_orm_inbox::{Inbox, sqs::SqsConsumer};
///
/// # async fn run(client: aws_sdk_sqs::Client, db: sea_orm::DatabaseConnection, ctrl_c: std::future::Pending<()>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let summary = SqsConsumer::new(client, "https://sqs.eu-west-1.amazonaws.com/123456789012/payments")
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
#[derive(Clone, Debug)]
pub struct SqsConsumer {
    queue: SqsQueue,
    options: ConsumerOptions,
    visibility_timeout: Duration,
    wait_time: Duration,
    heartbeat: Option<Duration>,
}

impl SqsConsumer {
    /// The longest long poll SQS allows.
    pub const MAX_WAIT_TIME: Duration = Duration::from_secs(20);

    /// A consumer of the queue at `url` through `client`, with the default
    /// [`ConsumerOptions`], a 30 s visibility timeout, the heartbeat every 10 s, and
    /// 20 s long polls.
    pub fn new(client: Client, url: impl Into<String>) -> Self {
        Self::of(SqsQueue::new(client, url))
    }

    /// A consumer of `queue` (its id attribute and dead-letter queue).
    pub fn of(queue: SqsQueue) -> Self {
        let visibility_timeout = Duration::from_secs(30);
        Self {
            queue,
            options: ConsumerOptions::default(),
            visibility_timeout,
            wait_time: Self::MAX_WAIT_TIME,
            heartbeat: Some(visibility_timeout / 3),
        }
    }

    /// Replaces the loop's settings; the prefetch caps one receive (with [`MAX_BATCH`]).
    pub fn with_options(mut self, options: ConsumerOptions) -> Self {
        self.options = options;
        self
    }

    /// The visibility timeout of each receive, in whole seconds; the heartbeat, if on,
    /// becomes a third of it.
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] below 1 s or above 12 h.
    pub fn with_visibility_timeout(mut self, timeout: Duration) -> Result<Self, InboxError> {
        if timeout < Duration::from_secs(1) || timeout > MAX_VISIBILITY {
            return Err(InboxError::out_of_range(
                "the SQS visibility timeout",
                timeout,
                Duration::from_secs(1)..=MAX_VISIBILITY,
                "choose one longer than most handlers run (the heartbeat covers the rest)",
            ));
        }
        self.visibility_timeout = timeout;
        self.heartbeat = self.heartbeat.map(|_| timeout / 3);
        Ok(self)
    }

    /// Extends a running handler's message visibility every `interval` (`None`: never).
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] for an interval of zero or not shorter than the
    /// visibility timeout (the extension would come too late).
    pub fn with_heartbeat(mut self, interval: Option<Duration>) -> Result<Self, InboxError> {
        if let Some(interval) = interval
            && (interval.is_zero() || interval >= self.visibility_timeout)
        {
            return Err(InboxError::out_of_range(
                "the SQS heartbeat interval",
                interval,
                Duration::from_millis(1)..=self.visibility_timeout,
                "choose an interval well below the visibility timeout (a third of it by default)",
            ));
        }
        self.heartbeat = interval;
        Ok(self)
    }

    /// How long one receive waits for messages (long polling; at most 20 s).
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] above [`MAX_WAIT_TIME`](Self::MAX_WAIT_TIME).
    pub fn with_wait_time(mut self, wait: Duration) -> Result<Self, InboxError> {
        if wait > Self::MAX_WAIT_TIME {
            return Err(InboxError::out_of_range(
                "the SQS long poll",
                wait,
                Duration::ZERO..=Self::MAX_WAIT_TIME,
                "SQS waits at most 20 s per receive",
            ));
        }
        self.wait_time = wait;
        Ok(self)
    }

    /// Consumes until `shutdown` completes, then stops receiving, waits for the deliveries
    /// in flight up to the [grace period](ConsumerOptions::with_grace) and returns what it
    /// did. A long poll in progress is dropped: messages it would have returned come back
    /// after their visibility timeout. `handler` gets the transaction and the
    /// [`Received`] message (headers: the message's string attributes).
    ///
    /// # Errors
    /// [`ConsumerError::Connect`] when the queue's attributes cannot be read (a wrong URL,
    /// credentials, an endpoint not answering). Later failures of a receive are retried
    /// after a pause, logged at WARN and counted in [`ConsumerSummary::reconnects`].
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
        let connector = SqsConnect {
            queue: self.queue,
            resolved: None,
            receiving: Receiving {
                visibility_timeout: self.visibility_timeout,
                wait_time: self.wait_time,
                heartbeat: self.heartbeat,
                concurrency: self.options.concurrency(),
                prefetch: usize::from(self.options.prefetch()).min(MAX_BATCH),
            },
            in_flight: Arc::default(),
        };
        consume::run(connector, self.options, inbox, db, handler, shutdown).await
    }
}

/// How a session receives: the consumer's settings.
#[derive(Clone, Copy)]
struct Receiving {
    visibility_timeout: Duration,
    wait_time: Duration,
    heartbeat: Option<Duration>,
    concurrency: usize,
    /// The most messages one receive asks for.
    prefetch: usize,
}

struct SqsConnect {
    queue: SqsQueue,
    /// The queue with its dead-letter queue looked up, after the first connect.
    resolved: Option<Arc<SqsQueue>>,
    receiving: Receiving,
    in_flight: Arc<AtomicUsize>,
}

impl Connect for SqsConnect {
    type Session = SqsSession;
    const BROKER: &'static str = "SQS";

    async fn connect(&mut self) -> Result<SqsSession, BoxError> {
        let queue = match &self.resolved {
            Some(queue) => Arc::clone(queue),
            None => {
                let mut queue = self.queue.clone();
                queue.use_redrive_policy().await?;
                let queue = Arc::new(queue);
                self.resolved = Some(Arc::clone(&queue));
                queue
            }
        };
        Ok(SqsSession {
            queue,
            buffered: VecDeque::new(),
            receiving: self.receiving,
            in_flight: Arc::clone(&self.in_flight),
        })
    }
}

struct SqsSession {
    queue: Arc<SqsQueue>,
    buffered: VecDeque<SqsMessage>,
    receiving: Receiving,
    /// Messages handed to the loop and not yet settled: a receive asks for no more than
    /// the slots left.
    in_flight: Arc<AtomicUsize>,
}

impl SqsSession {
    async fn receive(&mut self) -> Result<(), BoxError> {
        let receiving = self.receiving;
        let free = receiving
            .concurrency
            .saturating_sub(self.in_flight.load(Ordering::Acquire))
            .clamp(1, receiving.prefetch.max(1));
        let mut receive = self
            .queue
            .client
            .receive_message()
            .queue_url(&self.queue.url)
            .max_number_of_messages(i32::try_from(free).unwrap_or(1))
            .wait_time_seconds(whole_seconds(
                receiving.wait_time,
                SqsConsumer::MAX_WAIT_TIME,
            ))
            .visibility_timeout(whole_seconds(receiving.visibility_timeout, MAX_VISIBILITY))
            .message_attribute_names("All");
        for name in SYSTEM_ATTRIBUTES {
            receive = receive.message_system_attribute_names(name);
        }
        // SQS starts the visibility timeout somewhere between the request and the
        // response: the heartbeat and the 12 h cap count from the request, the safe bound
        // (a slow response would otherwise eat the heartbeat's margin).
        let received_at = Instant::now();
        let answer = receive
            .send()
            .await
            .map_err(|err| BoxError::from(DisplayErrorContext(err).to_string()))?;
        for message in answer.messages() {
            self.buffered.push_back(SqsMessage::new(
                message.clone(),
                Arc::clone(&self.queue),
                received_at,
                receiving,
            ));
        }
        Ok(())
    }
}

impl Session for SqsSession {
    type Message = SqsMessage;

    async fn next(&mut self) -> Option<Result<SqsMessage, BoxError>> {
        loop {
            if let Some(mut message) = self.buffered.pop_front() {
                message.in_flight = Some(InFlight::new(&self.in_flight));
                return Some(Ok(message));
            }
            if let Err(err) = self.receive().await {
                return Some(Err(err));
            }
        }
    }

    async fn close(self) {}
}

/// Counts a message in its session's in-flight messages until dropped.
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(count))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

struct SqsMessage {
    message: Message,
    queue: Arc<SqsQueue>,
    received_at: Instant,
    visibility_timeout: Duration,
    heartbeat: Option<Duration>,
    /// Set when the settlement starts: a beat that finds the receipt handle gone after
    /// that crossed the delete, not a redelivery.
    settling: AtomicBool,
    /// Held by a beat while its visibility change is out; a settlement that changes the
    /// visibility itself takes it to stop the heartbeat, so that its change is the last
    /// one SQS sees. A beat's request, once handed to the client's connection, reaches
    /// SQS whether its future is polled or dropped: only waiting for it orders the two.
    beats: tokio::sync::Mutex<Beats>,
    in_flight: Option<InFlight>,
}

/// Whether the heartbeat may still start a beat.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Beats {
    On,
    /// A settlement set the visibility: a beat now would undo it.
    Stopped,
}

impl SqsMessage {
    fn new(
        message: Message,
        queue: Arc<SqsQueue>,
        received_at: Instant,
        receiving: Receiving,
    ) -> Self {
        Self {
            message,
            queue,
            received_at,
            visibility_timeout: receiving.visibility_timeout,
            heartbeat: receiving.heartbeat,
            settling: AtomicBool::new(false),
            beats: tokio::sync::Mutex::new(Beats::On),
            in_flight: None,
        }
    }
}

impl Incoming for SqsMessage {
    fn delivery(&self) -> Result<Delivery, InboxError> {
        self.queue.delivery(&self.message)
    }

    fn delivery_count(&self) -> u32 {
        delivery_count(&self.message)
    }

    fn last_delivery(&self) -> bool {
        // A nack never drops a message: the redrive policy moves it after its last
        // receive, and without one it stays until the retention period.
        false
    }

    fn received(&mut self, message_id: MessageId) -> Received {
        let headers = self
            .message
            .message_attributes()
            .map(|attributes| {
                attributes
                    .iter()
                    .filter_map(|(name, value)| {
                        Some((name.clone(), value.string_value()?.to_owned()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        Received {
            payload: self.message.body().unwrap_or_default().as_bytes().to_vec(),
            headers,
            broker_id: broker_id(&self.message, &self.queue.id_attribute).to_owned(),
            message_id,
            delivery_count: delivery_count(&self.message),
        }
    }

    async fn settle(&self, settlement: Settlement) -> Result<(), BoxError> {
        self.settling.store(true, Ordering::Release);
        if self.queue.changes_visibility(settlement) {
            // Once held, no beat is out; every later one finds the heartbeat stopped.
            *self.beats.lock().await = Beats::Stopped;
        }
        self.queue
            .settle_received(&self.message, settlement, self.received_at)
            .await
            .map_err(BoxError::from)
    }

    fn is_stale(&self, error: &BoxError) -> bool {
        matches!(
            error.downcast_ref::<SettleError>(),
            Some(SettleError::ReceiptExpired { .. })
        )
    }

    async fn keep_alive(&self) -> Infallible {
        let Some(interval) = self.heartbeat else {
            return std::future::pending().await;
        };
        let mut next = self.received_at + interval;
        loop {
            tokio::time::sleep_until(next.into()).await;
            next += interval;
            // The guard ends with the beat: a heartbeat that stops below must not keep it,
            // or a nack would wait for it forever.
            let changed = {
                let beats = self.beats.lock().await;
                if *beats == Beats::Stopped {
                    break;
                }
                let left = MAX_VISIBILITY.saturating_sub(self.received_at.elapsed());
                self.queue
                    .change_visibility(&self.message, self.visibility_timeout, left)
                    .await
            };
            match changed {
                Ok(()) => {
                    tracing::debug!(
                        sqs_message_id = sqs_id(&self.message),
                        "visibility extended while the handler runs"
                    );
                }
                Err(err @ SettleError::ReceiptExpired { .. })
                    if self.settling.load(Ordering::Acquire) =>
                {
                    tracing::debug!(error = %err, sqs_message_id = sqs_id(&self.message), "a beat crossed the settlement's delete");
                    break;
                }
                Err(err @ SettleError::ReceiptExpired { .. }) => {
                    tracing::warn!(error = %err, "the visibility heartbeat came too late: the message was delivered again; the inbox decides which delivery applies it");
                    break;
                }
                Err(err) => {
                    tracing::warn!(error = %err, "extending the visibility failed; trying again at the next beat");
                }
            }
        }
        std::future::pending().await
    }
}

/// The heartbeat against a nack, through the SDK's client over a fake SQS that holds a
/// beat's request as a slow connection would.
#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use crate::{ObservedTransaction, Permanent};
    use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
    use aws_smithy_runtime_api::client::http::{
        HttpConnector, HttpConnectorFuture, SharedHttpConnector, http_client_fn,
    };
    use aws_smithy_runtime_api::client::orchestrator::{HttpRequest, HttpResponse};
    use aws_smithy_runtime_api::http::StatusCode;
    use aws_smithy_types::body::SdkBody;
    use std::sync::Mutex;
    use tokio::sync::{Notify, oneshot, watch};

    const VISIBILITY: Duration = Duration::from_secs(30);
    const BEAT: Duration = Duration::from_millis(20);
    /// How long after the handler failed SQS holds a beat that no settlement's change
    /// released. The fixed loop's settlement waits for the beat, so only this ends it;
    /// before the fix, the settlement's change went out at once, well within it, and
    /// released the beat.
    const HOLD: Duration = Duration::from_secs(1);
    /// Far longer than anything here takes on a loaded machine.
    const PATIENCE: Duration = Duration::from_secs(10);

    /// SQS behind a slow connection: the `ChangeMessageVisibility` of a beat (to the full
    /// timeout) lands once a settlement's own change has landed, or [`HOLD`] after the
    /// handler failed (or, refusing beats, is refused at once as an expired receipt
    /// handle); every other call lands at once. A request lands whether its future is
    /// still polled or not: once the client has handed it to the connection, it is out.
    #[derive(Debug)]
    struct Sqs {
        refuses_beats: bool,
        /// The visibility timeouts set, in seconds, in the order they landed.
        landed: Mutex<Vec<i64>>,
        beats: watch::Sender<Beating>,
        /// Whether the handler has failed.
        failed: watch::Sender<bool>,
        settlement_landed: Notify,
    }

    /// The beats [`Sqs`] holds right now, and those it refused.
    #[derive(Debug, Default)]
    struct Beating {
        held: usize,
        refused: usize,
    }

    impl Sqs {
        fn new(refuses_beats: bool) -> Arc<Self> {
            Arc::new(Self {
                refuses_beats,
                landed: Mutex::default(),
                beats: watch::Sender::default(),
                failed: watch::Sender::new(false),
                settlement_landed: Notify::new(),
            })
        }

        fn land(&self, seconds: i64) {
            if let Ok(mut landed) = self.landed.lock() {
                landed.push(seconds);
            }
        }

        /// Waits until `beats` holds of the beats.
        async fn until_beats(&self, beats: impl FnMut(&Beating) -> bool) {
            let mut watched = self.beats.subscribe();
            let waited = tokio::time::timeout(PATIENCE, watched.wait_for(beats)).await;
            assert!(
                matches!(waited, Ok(Ok(_))),
                "the beats: not within {PATIENCE:?}"
            );
        }

        /// Waits until the handler has failed.
        async fn until_failed(&self) {
            let mut failed = self.failed.subscribe();
            let waited = tokio::time::timeout(PATIENCE, failed.wait_for(|f| *f)).await;
            assert!(
                matches!(waited, Ok(Ok(_))),
                "the handler's failure: not within {PATIENCE:?}"
            );
        }
    }

    #[derive(Clone, Debug)]
    struct Connection(Arc<Sqs>);

    impl HttpConnector for Connection {
        fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
            let sqs = Arc::clone(&self.0);
            // A ReceiveMessage has a VisibilityTimeout too.
            let changes_visibility =
                request.headers().get("x-amz-target") == Some("AmazonSQS.ChangeMessageVisibility");
            let visibility = request
                .body()
                .bytes()
                .filter(|_| changes_visibility)
                .and_then(|body| serde_json::from_slice::<serde_json::Value>(body).ok())
                .and_then(|body| body["VisibilityTimeout"].as_i64());
            let (answer, answered) = oneshot::channel();
            tokio::spawn(async move {
                let full = i64::try_from(VISIBILITY.as_secs()).expect("in range");
                match visibility {
                    Some(seconds) if seconds == full && sqs.refuses_beats => {
                        sqs.beats.send_modify(|beats| beats.refused += 1);
                        let _ = answer.send(false);
                        return;
                    }
                    Some(seconds) if seconds == full => {
                        sqs.beats.send_modify(|beats| beats.held += 1);
                        tokio::select! {
                            () = sqs.settlement_landed.notified() => {}
                            () = async {
                                sqs.until_failed().await;
                                tokio::time::sleep(HOLD).await;
                            } => {}
                        }
                        sqs.land(seconds);
                        sqs.beats.send_modify(|beats| beats.held -= 1);
                    }
                    Some(seconds) => {
                        sqs.land(seconds);
                        sqs.settlement_landed.notify_one();
                    }
                    None => {}
                }
                let _ = answer.send(true);
            });
            HttpConnectorFuture::new(async move {
                let response = if answered.await.unwrap_or(true) {
                    HttpResponse::new(
                        StatusCode::try_from(200).expect("a status"),
                        SdkBody::from("{}"),
                    )
                } else {
                    let mut expired = HttpResponse::new(
                        StatusCode::try_from(400).expect("a status"),
                        SdkBody::from(
                            r#"{"__type":"com.amazonaws.sqs#ReceiptHandleIsInvalid","message":"The receipt handle has expired."}"#,
                        ),
                    );
                    expired
                        .headers_mut()
                        .insert("x-amzn-query-error", "ReceiptHandleIsInvalid;Sender");
                    expired
                };
                Ok(response)
            })
        }
    }

    /// A received message of a queue without a dead-letter queue on [`Sqs`], with a beat
    /// every [`BEAT`].
    fn received(sqs: &Arc<Sqs>) -> SqsMessage {
        let connection = Connection(Arc::clone(sqs));
        let config = aws_sdk_sqs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new("eu-west-1"))
            .credentials_provider(Credentials::new("test", "test", None, None, "test"))
            .endpoint_url("http://sqs.test")
            .http_client(http_client_fn(move |_, _| {
                SharedHttpConnector::new(connection.clone())
            }))
            .build();
        let queue = SqsQueue::new(
            Client::from_conf(config),
            "http://sqs.test/000000000000/orders",
        );
        let message = Message::builder()
            .message_id("order-1")
            .receipt_handle("receipt-1")
            .body("{}")
            .build();
        let receiving = Receiving {
            visibility_timeout: VISIBILITY,
            wait_time: Duration::ZERO,
            heartbeat: Some(BEAT),
            concurrency: 1,
            prefetch: 1,
        };
        SqsMessage::new(message, Arc::new(queue), Instant::now(), receiving)
    }

    /// [`consume`]'s handling of a [`received`] message whose handler fails with
    /// `failure()` while a beat is held: what the loop told SQS, and the visibility
    /// changes SQS saw, in order, once no beat is held any more.
    async fn fail_during_a_beat<E>(
        sqs: Arc<Sqs>,
        failure: fn() -> E,
    ) -> (Option<Settlement>, Vec<i64>)
    where
        E: std::fmt::Display + Send + 'static,
    {
        let waits = Arc::clone(&sqs);
        let told = consume::handle_on_sqlite(received(&sqs), move |_: &ObservedTransaction, _| {
            let sqs = Arc::clone(&waits);
            Box::pin(async move {
                sqs.until_beats(|beats| beats.held > 0 || beats.refused > 0)
                    .await;
                sqs.failed.send_replace(true);
                Err::<(), _>(failure())
            })
        })
        .await;
        sqs.until_beats(|beats| beats.held == 0).await;
        let landed = sqs.landed.lock().map(|l| l.clone()).unwrap_or_default();
        (told, landed)
    }

    /// A nack's `ChangeMessageVisibility` is the last one SQS sees: a beat out when the
    /// handler failed lands first, so the message returns after the nack's delay, not
    /// after the full visibility timeout.
    #[tokio::test]
    async fn a_nack_lands_after_the_beat_in_flight() {
        let (told, landed) =
            fail_during_a_beat(Sqs::new(false), || "a transient failure".to_owned()).await;
        assert_eq!(told, Some(Settlement::Nack(Some(Duration::from_secs(1)))));
        assert_eq!(
            landed,
            [30, 1],
            "visibility changes in the order SQS saw them (30: the beat, 1: the nack)"
        );
    }

    /// So is a dead letter's 12 h hiding, on a queue without a dead-letter queue.
    #[tokio::test]
    async fn a_dead_letter_hidden_lands_after_the_beat_in_flight() {
        let (told, landed) =
            fail_during_a_beat(Sqs::new(false), || Permanent::new("a malformed order")).await;
        assert_eq!(told, Some(Settlement::DeadLetter));
        assert!(
            matches!(landed[..], [30, hidden] if hidden > 43_000),
            "visibility changes in the order SQS saw them (30: the beat, about 43,200: the dead letter): {landed:?}"
        );
    }

    /// A heartbeat that a refused beat ended (the receipt handle expired: the message was
    /// delivered again) holds nothing a later nack waits for.
    #[tokio::test]
    async fn a_nack_after_the_heartbeat_ended_is_not_held_up() {
        let handled = tokio::time::timeout(
            PATIENCE,
            fail_during_a_beat(Sqs::new(true), || "a transient failure".to_owned()),
        )
        .await;
        let Ok((told, landed)) = handled else {
            panic!("the nack waited {PATIENCE:?} for a heartbeat that had ended");
        };
        assert_eq!(told, Some(Settlement::Nack(Some(Duration::from_secs(1)))));
        assert_eq!(landed, [1], "the nack's change, no beat");
    }
}
