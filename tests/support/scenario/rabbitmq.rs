//! The RabbitMQ half of the demo (with `lapin`): a queue of the run's own, a publisher
//! with confirms that re-sends some messages, and two replicas with manual acks and a
//! prefetch window; one replica closes its connection with deliveries committed but not
//! acked, and RabbitMQ redelivers them (and its unprocessed prefetch) to the other.

use super::{BoxError, CRASH_WHEN_IDLE, Demo, Fate, Plan, Publication, Report};
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer};
use sea_orm::DatabaseConnection;
use sea_orm_inbox::{Settlement, rabbitmq};
use std::time::Duration;

/// Unacked deliveries RabbitMQ hands each replica at once: more than one, so the dying
/// replica also takes unprocessed messages down with it.
const PREFETCH: u16 = 10;

/// A queue left behind by a run that failed half-way deletes itself once unused this long.
const QUEUE_EXPIRES_MS: u32 = 10 * 60 * 1000;

/// Runs the whole scenario against the broker at `amqp_url`; `replicas` are the two
/// replicas' own database pools (the first one dies). Returns the counts; check them with
/// [`Report::check`].
pub async fn run(
    amqp_url: &str,
    replicas: [&DatabaseConnection; 2],
    plan: &Plan,
) -> Result<Report, BoxError> {
    let demo = Demo::prepare(replicas[0], plan).await?;
    let queue = format!("inbox-demo-{}", demo.run_id());
    let admin = connect(amqp_url).await?;
    let channel = admin.create_channel().await?;
    declare_queue(&channel, &queue).await?;

    let work = async {
        // Both consumers exist before the first publish, so both get a share.
        let dying = Replica::start(amqp_url, &queue, "replica-a").await?;
        let healthy = Replica::start(amqp_url, &queue, "replica-b").await?;
        tokio::try_join!(
            publish(&channel, &queue, &demo),
            dying.consume(&demo, replicas[0], Fate::dying(plan)),
            healthy.consume(&demo, replicas[1], Fate::healthy()),
        )
    };
    let pending = async {
        demo.within_deadline(plan, work).await?;
        ready_messages(&channel, &queue).await
    }
    .await;
    // Delete the queue whatever happened; the first error is the one worth reporting.
    let deleted = channel
        .queue_delete(&queue, QueueDeleteOptions::default())
        .await;
    admin.close(200, "demo over").await.ok();
    let pending = pending?;
    deleted.map_err(|e| format!("delete queue {queue}: {e}"))?;
    demo.report(replicas[0], pending).await
}

async fn connect(url: &str) -> Result<Connection, BoxError> {
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current());
    Connection::connect(url, properties)
        .await
        .map_err(|e| format!("connect to RabbitMQ at {url}: {e}").into())
}

async fn declare_queue(channel: &Channel, queue: &str) -> Result<(), BoxError> {
    let mut arguments = FieldTable::default();
    arguments.insert("x-expires".into(), AMQPValue::LongUInt(QUEUE_EXPIRES_MS));
    channel
        .queue_declare(queue, QueueDeclareOptions::default(), arguments)
        .await
        .map_err(|e| format!("declare queue {queue}: {e}"))?;
    Ok(())
}

/// Publishes every copy with its message id in the `message_id` property and waits for
/// the broker's confirmation of each.
async fn publish(channel: &Channel, queue: &str, demo: &Demo) -> Result<(), BoxError> {
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for copy in demo.publications() {
        let properties = BasicProperties::default().with_message_id(copy.id.to_string().into());
        let confirmation = channel
            .basic_publish(
                "",
                queue,
                BasicPublishOptions::default(),
                &copy.payload(),
                properties,
            )
            .await?
            .await?;
        if !matches!(confirmation, Confirmation::Ack(_)) {
            return Err(format!("RabbitMQ did not confirm message {}", copy.id).into());
        }
    }
    Ok(())
}

/// One replica: its own connection, channel and consumer.
struct Replica {
    connection: Connection,
    consumer: Consumer,
}

impl Replica {
    async fn start(url: &str, queue: &str, name: &str) -> Result<Self, BoxError> {
        let connection = connect(url).await?;
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(PREFETCH, BasicQosOptions::default())
            .await?;
        // `no_ack: false` (the default): manual acks, so an unacked delivery comes back.
        let consumer = channel
            .basic_consume(
                queue,
                name,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| format!("{name}: consume from {queue}: {e}"))?;
        Ok(Self {
            connection,
            consumer,
        })
    }

    /// The broker loop: delivery -> message id -> `Inbox::process` -> `Settlement::of` ->
    /// ack or nack. Returns when every copy is acked, or when this replica dies.
    async fn consume(
        mut self,
        demo: &Demo,
        db: &DatabaseConnection,
        mut fate: Fate,
    ) -> Result<(), BoxError> {
        loop {
            let delivery = tokio::select! {
                () = demo.finished() => break,
                next = self.consumer.next() => match next {
                    Some(delivery) => delivery?,
                    None => return Err("RabbitMQ cancelled the consumer".into()),
                },
                () = tokio::time::sleep(CRASH_WHEN_IDLE), if fate.is_crashing() => break,
            };
            let id = delivery
                .properties
                .message_id()
                .as_ref()
                .ok_or("a delivery without a message_id property")?;
            let copy = Publication::read(id.as_str(), &delivery.data)?;
            let result = demo.handle(db, copy, delivery.redelivered).await;
            if !fate.settles_next() {
                demo.withheld();
                if fate.is_dead() {
                    // The crash: the connection goes away with deliveries committed but
                    // not acked; RabbitMQ requeues them for the other replica.
                    break;
                }
                continue;
            }
            let settlement = Settlement::of(&result);
            rabbitmq::settle(&delivery, settlement).await?;
            demo.settled(copy, settlement);
        }
        // Closing waits for the broker, so every ack sent above has been taken.
        self.connection.close(200, "replica stopping").await?;
        Ok(())
    }
}

/// Messages still ready in the queue once both replicas are gone (anything they left
/// unacked is ready again by then).
async fn ready_messages(channel: &Channel, queue: &str) -> Result<u64, BoxError> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    // Requeueing a closed consumer's deliveries is asynchronous on the broker's side:
    // give it a moment before concluding that something is left.
    let mut ready = 0;
    for _ in 0..10 {
        let state = channel
            .queue_declare(queue, passive, FieldTable::default())
            .await?;
        ready = u64::from(state.message_count());
        if ready == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(ready)
}
