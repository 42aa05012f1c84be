//! The Kafka consumer loop ([`KafkaGroupConsumer`]): one task per assigned partition, fed
//! by the one task that polls the consumer, so partitions run in parallel and each in
//! order.
//!
//! Why not rdkafka's `split_partition_queue`: with a subscription, partitions come and go
//! at every rebalance, a split queue stops at each assignment and must be split again, and
//! records fetched before the split still arrive on the main queue. Here the polling task
//! owns every call that changes what the consumer fetches (seek, pause, resume), in order
//! with the records it hands out, and stamps each record with its partition's seek count:
//! a partition task drops what was fetched before its own latest seek.

use super::{BatchResult, KafkaError, KafkaInbox, RecordOutcome, commit_hint, stored_offset};
use crate::brokers::consume::{ConsumerError, ConsumerOptions, ConsumerSummary};
use crate::{BoxError, HandlerFuture, MAX_CLAIM_BATCH, ObservedTransaction};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use sea_orm::DatabaseConnection;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinSet;

/// The handler [`KafkaGroupConsumer::run`] takes, named once for the loop's parts.
trait RecordHandler:
    for<'t> Fn(&'t ObservedTransaction, Arc<OwnedMessage>) -> HandlerFuture<'t, (), BoxError>
    + Send
    + Sync
    + 'static
{
}

impl<H> RecordHandler for H where
    H: for<'t> Fn(&'t ObservedTransaction, Arc<OwnedMessage>) -> HandlerFuture<'t, (), BoxError>
        + Send
        + Sync
        + 'static
{
}

/// A partition: its topic and number.
type PartitionKey = (String, i32);

/// The longest the polling task waits between polls of the consumer: librdkafka leaves the
/// group when the application has not polled for `max.poll.interval.ms`.
const POLL_AT_LEAST_EVERY: Duration = Duration::from_secs(1);

/// How long a seek may take before the partition's task tries it again.
const SEEK_TIMEOUT: Duration = Duration::from_secs(10);

/// What a rebalance did, as the consumer's context tells the polling task.
enum Rebalanced {
    Assigned(Vec<PartitionKey>),
    Revoked(Vec<PartitionKey>),
}

/// The rdkafka context of [`KafkaGroupConsumer`]: forwards each rebalance to the polling
/// task, which runs the callbacks itself (they are served while it polls), so a revoked
/// partition stops being fed before its next record is handed out.
pub struct GroupContext {
    rebalances: mpsc::UnboundedSender<Rebalanced>,
}

impl ClientContext for GroupContext {}

fn partitions(list: &TopicPartitionList) -> Vec<PartitionKey> {
    list.elements()
        .iter()
        .map(|element| (element.topic().to_owned(), element.partition()))
        .collect()
}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            // The polling task is gone only when the loop ends.
            Rebalance::Revoke(list) => {
                let _ = self.rebalances.send(Rebalanced::Revoked(partitions(list)));
            }
            Rebalance::Error(err) => tracing::warn!(error = %err, "Kafka rebalance failed"),
            Rebalance::Assign(_) => {}
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            let _ = self.rebalances.send(Rebalanced::Assigned(partitions(list)));
        }
    }
}

type GroupStream = StreamConsumer<GroupContext>;

/// A record on its way to its partition's task, stamped with the partition's seek count
/// when it was handed out.
struct Fed {
    record: Arc<OwnedMessage>,
    seeks: u64,
}

/// What a partition's task asks of the polling task.
enum Request {
    /// Move the partition's fetch position; the reply is the partition's new seek count
    /// (records stamped below it were fetched before), or `None` when the partition is no
    /// longer this task's (revoked, or the loop is stopping).
    Seek {
        key: PartitionKey,
        generation: u64,
        offset: i64,
        reply: oneshot::Sender<Option<u64>>,
    },
    /// The partition's task worked its backlog down: resume fetching.
    Drained { key: PartitionKey, generation: u64 },
}

/// What the polling task and a partition's task share about the partition.
#[derive(Default)]
struct FeedState {
    /// Records handed to the task and not yet taken by it.
    buffered: AtomicUsize,
    /// The polling task paused the partition's fetching.
    paused: AtomicBool,
    /// The partition was revoked: its task takes no further record.
    revoked: AtomicBool,
}

/// The polling task's view of an assigned partition.
struct Feed {
    sender: mpsc::UnboundedSender<Fed>,
    state: Arc<FeedState>,
    generation: u64,
    seeks: u64,
}

/// What a partition's task counted.
#[derive(Default)]
struct Tally {
    processed: u64,
    duplicates: u64,
    refused: u64,
    fenced: u64,
    failed: u64,
}

impl Tally {
    fn add_to(&self, summary: &mut ConsumerSummary) {
        summary.processed += self.processed;
        summary.duplicates += self.duplicates;
        summary.refused += self.refused;
        summary.fenced += self.fenced;
        summary.failed += self.failed;
        summary.nacked += self.failed;
        summary.acked += self.processed + self.duplicates + self.refused;
    }
}

/// What every partition's task shares.
struct Shared<H> {
    kafka: KafkaInbox,
    db: DatabaseConnection,
    handler: H,
    consumer: Arc<GroupStream>,
    requests: mpsc::UnboundedSender<Request>,
    permits: Semaphore,
    /// Resume fetching once this many records or fewer wait.
    low_water: usize,
    /// The most records of a partition one transaction takes.
    max_batch: usize,
    /// One per partition ever assigned: a partition's next task starts only after the
    /// previous one's record in flight has committed or rolled back.
    owners: Mutex<HashMap<PartitionKey, Arc<tokio::sync::Mutex<()>>>>,
    stopping: watch::Receiver<bool>,
}

/// A consumer group's loop users run as is: it subscribes to its topics, processes each
/// assigned partition in order in a task of its own (at most
/// [`ConsumerOptions::concurrency`] records at once across partitions), each record through
/// [`KafkaInbox::process_record`] (the inbox marker, the business change and the stored
/// offset's compare-and-set advance in one transaction), and commits the offset to Kafka
/// only after the database did, as a hint.
///
/// - **Order and seeks:** a partition's first record after an assignment reads the stored
///   offset and seeks there; a failed record is read again after the inbox's retry delay
///   ([`KafkaInbox::with_retry_delay`]), its partition waiting for it.
/// - **Back-pressure:** a partition with [`ConsumerOptions::prefetch`] records waiting is
///   paused and resumed once half of them are done.
/// - **Rebalances:** a revoked partition's task takes no further record; its record in
///   flight either commits (no other consumer moved the stored offset: it is processed,
///   once) or is fenced by the compare-and-set ([`ConsumerSummary::fenced`]: nothing
///   applied), and its offset is not committed to Kafka. A partition assigned again starts
///   after that record ended, from the stored offset.
/// - **Shutdown:** records waiting are dropped, those in flight finish within the
///   [grace period](ConsumerOptions::with_grace) or are abandoned (their transactions roll
///   back); either way the database holds each record's effects and offset together or
///   neither, and the next consumer starts from the stored offset.
///
/// # The settings that matter
/// The loop sets `group.id` (the [`KafkaInbox`]'s group), `enable.auto.commit=false` and
/// `enable.auto.offset.store=false`; the rest of the [`ClientConfig`] is yours:
/// `bootstrap.servers`; `auto.offset.reset` (where a partition without a stored offset
/// starts: `earliest` to read what was produced before the group's first start);
/// `session.timeout.ms` (how long a killed consumer's partitions wait before the group
/// gives them to another; librdkafka's default 45 s; on Tansu, whose first assignment
/// takes as long, 6000 delivers the first record within seconds) with a
/// `heartbeat.interval.ms` well below it. `max.poll.interval.ms` does not bound your
/// handlers: the polling task polls at least once a second while they run.
///
/// ```no_run
/// # async fn run(db: sea_orm::DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
/// use rdkafka::ClientConfig;
/// use sea_orm_inbox::kafka::{DEFAULT_KAFKA_PREFETCH, KafkaGroupConsumer, KafkaInbox};
/// use sea_orm_inbox::{ConsumerOptions, Inbox};
///
/// let kafka = KafkaInbox::new(Inbox::new("billing")?, "billing-group")?;
/// let mut config = ClientConfig::new();
/// config
///     .set("bootstrap.servers", "127.0.0.1:9092")
///     .set("auto.offset.reset", "earliest")
///     .set("session.timeout.ms", "6000");
/// let summary = KafkaGroupConsumer::new(kafka, &config, ["payments"])
///     .with_options(
///         ConsumerOptions::default()
///             .with_concurrency(4)?
///             .with_prefetch(DEFAULT_KAFKA_PREFETCH.get())?,
///     )
///     .run(
///         db,
///         |txn, record| {
///             Box::pin(async move {
///                 // business writes through `txn`, reading `record.payload()`
///                 let _ = (txn, record);
///                 Ok(())
///             })
///         },
///         std::future::pending::<()>(), // your shutdown signal
///     )
///     .await?;
/// println!("{summary}");
/// # Ok(()) }
/// ```
pub struct KafkaGroupConsumer {
    kafka: KafkaInbox,
    config: ClientConfig,
    topics: Vec<String>,
    options: ConsumerOptions,
    max_batch: u16,
}

/// The records a partition may have waiting before the loop pauses it, unless
/// [`KafkaGroupConsumer::with_options`] says otherwise. A resumed partition waits for
/// librdkafka's next fetch, up to `fetch.wait.max.ms` (500 ms by default), so the half of
/// the backlog left at the resume must cover that wait: with the 16 of
/// [`ConsumerOptions::default`] a single partition ran at 33 records/s against 1,378 with
/// 1,000 (`outbox-bench --kafka`, PostgreSQL, 4,000 records, BENCHMARKS.md).
pub const DEFAULT_KAFKA_PREFETCH: std::num::NonZeroU16 =
    std::num::NonZeroU16::MIN.saturating_add(999);

/// The most records of one partition [`KafkaGroupConsumer`] commits in one transaction,
/// unless [`KafkaGroupConsumer::with_max_batch`] says otherwise: against five round trips
/// a record one at a time, about one (its business write) plus four per batch.
pub const DEFAULT_KAFKA_BATCH: std::num::NonZeroU16 = std::num::NonZeroU16::MIN.saturating_add(99);

impl KafkaGroupConsumer {
    /// The loop of `kafka`'s group over `topics`, a consumer made from `config` (see the
    /// settings above), with the default [`ConsumerOptions`] but a prefetch of
    /// [`DEFAULT_KAFKA_PREFETCH`].
    pub fn new<T: Into<String>>(
        kafka: KafkaInbox,
        config: &ClientConfig,
        topics: impl IntoIterator<Item = T>,
    ) -> Self {
        Self {
            kafka,
            config: config.clone(),
            topics: topics.into_iter().map(Into::into).collect(),
            options: ConsumerOptions::default_with_prefetch(DEFAULT_KAFKA_PREFETCH),
            max_batch: DEFAULT_KAFKA_BATCH.get(),
        }
    }

    /// The most records of one partition a transaction takes (default
    /// [`DEFAULT_KAFKA_BATCH`]; 1 processes each record in a transaction of its own). A
    /// batch is what already waits when a record's turn comes: the loop never waits for
    /// more to arrive. Capped at [`MAX_CLAIM_BATCH`].
    ///
    /// The trade: one record costs BEGIN, its marker, the business write, the offset's
    /// compare-and-set and COMMIT, five round trips; a batch of `n` costs its business
    /// writes and four more (one INSERT claims every marker, one UPDATE advances the
    /// offset), so past a few records a record costs about its business write. Against
    /// that, a record's effects become visible when its whole batch commits (a batch's
    /// handlers run one after the other, in one transaction that holds its row locks until
    /// the end), and a failure rolls the whole batch back and processes it again one
    /// record at a time, so the failing record alone waits or goes to the dead-letter
    /// topic. An inbox with an [admission floor](crate::Inbox::with_admission_floor)
    /// processes one record at a time (a refused record must reach the dead-letter topic
    /// before its offset advances).
    pub fn with_max_batch(mut self, records: std::num::NonZeroU16) -> Self {
        self.max_batch = records.get();
        self
    }

    /// Replaces the loop's settings: the concurrency across partitions, the prefetch (the
    /// records a partition may have waiting before it is paused) and the grace period.
    /// Keep the prefetch in the hundreds or more ([`DEFAULT_KAFKA_PREFETCH`] says why):
    /// [`ConsumerOptions::default`]'s 16 is sized for RabbitMQ and JetStream.
    pub fn with_options(mut self, options: ConsumerOptions) -> Self {
        self.options = options;
        self
    }

    /// Consumes until `shutdown` completes, then stops as described above and returns what
    /// it did. `handler` gets the transaction and the record, as the handler of
    /// [`KafkaInbox::process_record`] does.
    ///
    /// # Errors
    /// [`ConsumerError::Connect`] when the consumer cannot be made or subscribed (a
    /// malformed setting, an empty topic list). An unreachable broker is not an error:
    /// librdkafka keeps reconnecting, and the loop logs what it reports at WARN.
    pub async fn run<H>(
        self,
        db: DatabaseConnection,
        handler: H,
        shutdown: impl Future + Send,
    ) -> Result<ConsumerSummary, ConsumerError>
    where
        H: for<'t> Fn(
                &'t ObservedTransaction,
                Arc<OwnedMessage>,
            ) -> HandlerFuture<'t, (), BoxError>
            + Send
            + Sync
            + 'static,
    {
        let connect_error = |source: BoxError| ConsumerError::Connect {
            broker: "Kafka",
            source,
        };
        let (rebalance_sender, mut rebalances) = mpsc::unbounded_channel();
        let mut config = self.config.clone();
        config
            .set("group.id", self.kafka.group())
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        let consumer: GroupStream = config
            .create_with_context(GroupContext {
                rebalances: rebalance_sender,
            })
            .map_err(|err| connect_error(Box::new(KafkaError::Client(err))))?;
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        if topics.is_empty() {
            return Err(connect_error(
                "no topic to subscribe to: name at least one".into(),
            ));
        }
        consumer
            .subscribe(&topics)
            .map_err(|err| connect_error(Box::new(KafkaError::Client(err))))?;
        let consumer = Arc::new(consumer);
        let (request_sender, mut requests) = mpsc::unbounded_channel();
        let (stop, stopping) = watch::channel(false);
        let prefetch = usize::from(self.options.prefetch());
        let shared = Arc::new(Shared {
            kafka: self.kafka,
            db,
            handler,
            consumer: Arc::clone(&consumer),
            requests: request_sender,
            permits: Semaphore::new(self.options.concurrency()),
            low_water: prefetch / 2,
            max_batch: usize::from(self.max_batch).min(MAX_CLAIM_BATCH),
            owners: Mutex::new(HashMap::new()),
            stopping,
        });
        let mut poller = Poller {
            consumer: &consumer,
            feeds: HashMap::new(),
            generations: 0,
            tasks: JoinSet::new(),
            summary: ConsumerSummary::default(),
            prefetch,
        };
        let mut shutdown = std::pin::pin!(shutdown);
        // rdkafka polls librdkafka only when woken; a poll each tick keeps the group
        // membership while every partition is paused behind slow handlers.
        let mut keep_polling = tokio::time::interval(POLL_AT_LEAST_EVERY);
        keep_polling.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = &mut shutdown => break,
                Some(rebalanced) = rebalances.recv() => poller.rebalanced(rebalanced, &shared),
                Some(request) = requests.recv() => poller.serve(request),
                _ = keep_polling.tick() => {}
                received = consumer.recv() => match received {
                    Ok(record) => poller.feed(Arc::new(record.detach()), &shared),
                    Err(err) => tracing::warn!(error = %err, "the Kafka consumer reported an error; librdkafka retries on its own"),
                },
            }
            while let Some(joined) = poller.tasks.try_join_next() {
                count_joined(&mut poller.summary, joined);
            }
        }
        // Records waiting are dropped (the next consumer reads them again from the stored
        // offset); the tasks' records in flight finish, or are abandoned after the grace.
        let _ = stop.send(true);
        poller.feeds.clear();
        drop(requests);
        let Poller {
            mut tasks,
            mut summary,
            ..
        } = poller;
        let drained = tokio::time::timeout(self.options.grace(), async {
            while let Some(joined) = tasks.join_next().await {
                count_joined(&mut summary, joined);
            }
        })
        .await;
        if drained.is_err() {
            let left = tasks.len();
            tracing::warn!(abandoned = left, grace = ?self.options.grace(), "Kafka records still in flight after the grace period are abandoned: rolled back, read again by the partition's next owner from the stored offset");
            tasks.shutdown().await;
            summary.abandoned += u64::try_from(left).unwrap_or(u64::MAX);
        }
        tracing::info!(%summary, "the Kafka consumer stopped");
        Ok(summary)
    }
}

fn count_joined(summary: &mut ConsumerSummary, joined: Result<Tally, tokio::task::JoinError>) {
    match joined {
        Ok(tally) => tally.add_to(summary),
        Err(err) => {
            tracing::error!(error = %err, "a Kafka partition's task panicked; its record's transaction rolled back, the partition's next owner reads it again");
            summary.abandoned += 1;
        }
    }
}

/// The polling task's state: the partitions it feeds and their tasks.
struct Poller<'c> {
    consumer: &'c GroupStream,
    feeds: HashMap<PartitionKey, Feed>,
    generations: u64,
    tasks: JoinSet<Tally>,
    summary: ConsumerSummary,
    prefetch: usize,
}

fn one_partition(key: &PartitionKey) -> TopicPartitionList {
    let mut list = TopicPartitionList::new();
    list.add_partition(&key.0, key.1);
    list
}

impl Poller<'_> {
    /// Resumes fetching the partition (`which`: why it is resumed, for the log); a failure
    /// loses nothing but leaves the partition paused, so it is logged at WARN.
    fn resume(&self, key: &PartitionKey, which: &str) {
        if let Err(err) = self.consumer.resume(&one_partition(key)) {
            tracing::warn!(topic = key.0, partition = key.1, error = %err, "resuming a {which} partition failed");
        }
    }

    fn rebalanced<H>(&mut self, rebalanced: Rebalanced, shared: &Arc<Shared<H>>)
    where
        H: RecordHandler,
    {
        self.summary.rebalances += 1;
        match rebalanced {
            Rebalanced::Revoked(keys) => {
                for key in keys {
                    if let Some(feed) = self.feeds.remove(&key) {
                        feed.state.revoked.store(true, Ordering::SeqCst);
                    }
                }
            }
            Rebalanced::Assigned(keys) => {
                for key in keys {
                    // A partition paused before it was revoked may come back paused.
                    self.resume(&key, "newly assigned");
                    self.feed_of(&key, shared);
                }
            }
        }
    }

    /// The partition's feed, its task started if it has none (a record can arrive in the
    /// same poll as the assignment that brought it, before the assignment is told).
    fn feed_of<H>(&mut self, key: &PartitionKey, shared: &Arc<Shared<H>>) -> &mut Feed
    where
        H: RecordHandler,
    {
        let generations = &mut self.generations;
        let tasks = &mut self.tasks;
        self.feeds.entry(key.clone()).or_insert_with(|| {
            *generations += 1;
            let (sender, records) = mpsc::unbounded_channel();
            let state = Arc::new(FeedState::default());
            tasks.spawn(partition_task(
                key.clone(),
                *generations,
                records,
                Arc::clone(&state),
                Arc::clone(shared),
            ));
            Feed {
                sender,
                state,
                generation: *generations,
                seeks: 0,
            }
        })
    }

    fn feed<H>(&mut self, record: Arc<OwnedMessage>, shared: &Arc<Shared<H>>)
    where
        H: RecordHandler,
    {
        self.summary.received += 1;
        let key = (record.topic().to_owned(), record.partition());
        let (prefetch, consumer) = (self.prefetch, self.consumer);
        let feed = self.feed_of(&key, shared);
        let seeks = feed.seeks;
        let waiting = feed.state.buffered.fetch_add(1, Ordering::SeqCst) + 1;
        if feed.sender.send(Fed { record, seeks }).is_err() {
            return; // the task ended: the loop is stopping
        }
        if waiting >= prefetch && !feed.state.paused.swap(true, Ordering::SeqCst) {
            match consumer.pause(&one_partition(&key)) {
                Ok(()) => self.summary.pauses += 1,
                Err(err) => {
                    feed.state.paused.store(false, Ordering::SeqCst);
                    tracing::warn!(topic = key.0, partition = key.1, error = %err, "pausing a partition with a backlog failed; its records keep arriving");
                }
            }
        }
    }

    fn serve(&mut self, request: Request) {
        match request {
            Request::Seek {
                key,
                generation,
                offset,
                reply,
            } => {
                let Some(feed) = self
                    .feeds
                    .get_mut(&key)
                    .filter(|feed| feed.generation == generation)
                else {
                    let _ = reply.send(None);
                    return;
                };
                match self
                    .consumer
                    .seek(&key.0, key.1, Offset::Offset(offset), SEEK_TIMEOUT)
                {
                    Ok(()) => {
                        feed.seeks += 1;
                        self.summary.seeks += 1;
                        let _ = reply.send(Some(feed.seeks));
                    }
                    Err(err) => {
                        tracing::warn!(topic = key.0, partition = key.1, offset, error = %err, "seeking failed; the partition's task tries again after the retry delay");
                        // Dropping the reply tells the task to try again.
                    }
                }
            }
            Request::Drained { key, generation } => {
                let current = self
                    .feeds
                    .get(&key)
                    .is_some_and(|feed| feed.generation == generation);
                if current {
                    self.resume(&key, "drained");
                }
            }
        }
    }
}

/// Where a partition's task stands with its stored offset.
enum Position {
    /// Not read since the task started, or since something moved it: the next record
    /// reads it and seeks there.
    Unknown,
    /// The stored offset the next advance expects (`None`: no row yet).
    Known(Option<i64>),
}

/// Processes one partition's records in order until it is revoked or the loop stops.
async fn partition_task<H>(
    key: PartitionKey,
    generation: u64,
    mut records: mpsc::UnboundedReceiver<Fed>,
    state: Arc<FeedState>,
    shared: Arc<Shared<H>>,
) -> Tally
where
    H: RecordHandler,
{
    let mut tally = Tally::default();
    let owner = {
        let Ok(mut owners) = shared.owners.lock() else {
            return tally; // poisoned only by a panic, which ends the loop's tasks anyway
        };
        Arc::clone(owners.entry(key.clone()).or_default())
    };
    let _owner = owner.lock().await;
    let mut stopping = shared.stopping.clone();
    let mut position = Position::Unknown;
    let mut seeks_seen = 0;
    // A record taken from the channel while filling a batch that could not join it.
    let mut held: Option<Fed> = None;
    loop {
        let fed = match held.take() {
            Some(fed) => fed,
            None => match records.recv().await {
                Some(fed) => {
                    took_one(&state, &shared, &key, generation);
                    fed
                }
                None => break,
            },
        };
        if state.revoked.load(Ordering::SeqCst) || *stopping.borrow() {
            break;
        }
        if fed.seeks < seeks_seen {
            continue; // fetched before this task's latest seek
        }
        let record = fed.record;
        let expected = match position {
            Position::Known(expected) => expected,
            Position::Unknown => {
                match stored_offset(&shared.db, shared.kafka.group(), &key.0, key.1).await {
                    Ok(stored) => {
                        position = Position::Known(stored);
                        match stored.filter(|stored| *stored != record.offset()) {
                            Some(stored) => {
                                match seek(&shared, &key, generation, stored, &mut stopping).await {
                                    Some(seeks) => seeks_seen = seeks,
                                    None => break,
                                }
                                continue;
                            }
                            None => stored,
                        }
                    }
                    Err(err) => {
                        tally.failed += 1;
                        tracing::warn!(topic = key.0, partition = key.1, error = %err, "reading the stored offset failed; trying again after the retry delay");
                        match retry_later(&shared, &key, generation, &record, &mut stopping).await {
                            Some(seeks) => seeks_seen = seeks,
                            None => break,
                        }
                        continue;
                    }
                }
            }
        };
        if expected.is_some_and(|expected| record.offset() < expected) {
            continue; // fetched before the seek to a later stored offset
        }
        let permit = tokio::select! {
            biased;
            _ = stopping.wait_for(|stop| *stop) => break,
            permit = shared.permits.acquire() => permit,
        };
        let Ok(_permit) = permit else {
            break; // never closed: the loop owns the semaphore
        };
        if state.revoked.load(Ordering::SeqCst) {
            break;
        }
        // The records already waiting join this one's transaction, up to the batch size:
        // nothing waits for more to arrive.
        let mut batch = vec![record];
        while batch.len() < shared.max_batch {
            let Ok(next) = records.try_recv() else {
                break;
            };
            took_one(&state, &shared, &key, generation);
            if next.seeks < seeks_seen {
                continue;
            }
            if batch
                .last()
                .is_some_and(|last| next.record.offset() <= last.offset())
            {
                held = Some(next);
                break;
            }
            batch.push(next.record);
        }
        let mut handler = &shared.handler;
        if batch.len() > 1 {
            match shared
                .kafka
                .process_batch(&shared.db, &batch, expected, &mut handler)
                .await
            {
                BatchResult::Done {
                    processed,
                    duplicates,
                } => {
                    tally.processed += processed;
                    tally.duplicates += duplicates;
                    if let Some(last) = batch.last() {
                        position = Position::Known(Some(last.offset() + 1));
                        if !state.revoked.load(Ordering::SeqCst) {
                            commit_hint(shared.consumer.as_ref(), last);
                        }
                    }
                    continue;
                }
                BatchResult::OffsetMoved => {
                    tally.fenced += u64::try_from(batch.len()).unwrap_or(u64::MAX);
                    position = Position::Unknown;
                    continue;
                }
                // Rolled back as a whole: one by one below, so only the failing record
                // waits or goes to the dead-letter topic.
                BatchResult::Failed => {}
            }
        }
        let mut expected = expected;
        for record in batch {
            let outcome = shared
                .kafka
                .process_record(&shared.db, &record, expected, &mut handler)
                .await;
            match outcome {
                Ok(RecordOutcome::OffsetMoved) => {
                    // Another consumer took the partition and moved on: nothing was
                    // applied. The rest of the batch is read again after the seek.
                    tally.fenced += 1;
                    position = Position::Unknown;
                    break;
                }
                Ok(outcome) => {
                    match outcome {
                        RecordOutcome::Processed => tally.processed += 1,
                        RecordOutcome::Duplicate => tally.duplicates += 1,
                        _ => tally.refused += 1,
                    }
                    expected = Some(record.offset() + 1);
                    position = Position::Known(expected);
                    if !state.revoked.load(Ordering::SeqCst) {
                        commit_hint(shared.consumer.as_ref(), &record);
                    }
                }
                Err(err) => {
                    tally.failed += 1;
                    tracing::warn!(error = %err, "Kafka record failed: reading it again after the retry delay");
                    // A lost COMMIT reply may have moved the stored offset: read it again.
                    position = Position::Unknown;
                    match retry_later(&shared, &key, generation, &record, &mut stopping).await {
                        Some(seeks) => seeks_seen = seeks,
                        None => return tally,
                    }
                    break;
                }
            }
        }
    }
    tally
}

/// Counts a record taken from the partition's channel, and asks for the partition's
/// fetching to resume once its backlog is down to the low-water mark.
fn took_one<H>(state: &FeedState, shared: &Shared<H>, key: &PartitionKey, generation: u64) {
    let waiting = state.buffered.fetch_sub(1, Ordering::SeqCst) - 1;
    if waiting <= shared.low_water && state.paused.swap(false, Ordering::SeqCst) {
        let _ = shared.requests.send(Request::Drained {
            key: key.clone(),
            generation,
        });
    }
}

/// Seeks the partition back to `record` and waits the retry delay; `None` when the task
/// is to stop.
async fn retry_later<H>(
    shared: &Shared<H>,
    key: &PartitionKey,
    generation: u64,
    record: &OwnedMessage,
    stopping: &mut watch::Receiver<bool>,
) -> Option<u64> {
    let seeks = seek(shared, key, generation, record.offset(), stopping).await?;
    tokio::select! {
        biased;
        _ = stopping.wait_for(|stop| *stop) => None,
        () = tokio::time::sleep(shared.kafka.retry_delay) => Some(seeks),
    }
}

/// Has the polling task seek the partition to `offset`, trying again after the retry delay
/// until it succeeds; the partition's new seek count, or `None` when the partition is no
/// longer this task's or the loop is stopping.
async fn seek<H>(
    shared: &Shared<H>,
    key: &PartitionKey,
    generation: u64,
    offset: i64,
    stopping: &mut watch::Receiver<bool>,
) -> Option<u64> {
    loop {
        let (reply, replied) = oneshot::channel();
        shared
            .requests
            .send(Request::Seek {
                key: key.clone(),
                generation,
                offset,
                reply,
            })
            .ok()?;
        match replied.await {
            Ok(seeks) => return seeks,
            Err(_) if *stopping.borrow() => return None,
            Err(_) => {}
        }
        tokio::select! {
            biased;
            _ = stopping.wait_for(|stop| *stop) => return None,
            () = tokio::time::sleep(shared.kafka.retry_delay) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Inbox;

    /// With `ConsumerOptions`' 16 every resume waited out `fetch.wait.max.ms`: 33 records/s
    /// on one partition (`outbox-bench --kafka`).
    #[test]
    fn the_loop_defaults_to_a_prefetch_that_covers_a_resumes_fetch() {
        let kafka = KafkaInbox::new(Inbox::new("billing").expect("a valid consumer"), "group")
            .expect("a valid group");
        let consumer = KafkaGroupConsumer::new(kafka, &ClientConfig::new(), ["payments"]);
        assert_eq!(consumer.options.prefetch(), DEFAULT_KAFKA_PREFETCH.get());
        assert_eq!(consumer.options.prefetch(), 1_000);
        assert_eq!(
            consumer.options.concurrency(),
            ConsumerOptions::default().concurrency(),
            "only the prefetch differs from the defaults"
        );
    }
}
