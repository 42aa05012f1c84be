//! The CI's side of RabbitMQ for ci/seaorm-app.sh, not part of the pattern: a producer
//! and a few looks at the queues of `api::topology`.
//!
//! ```text
//! broker publish <queue> <message_id>[:<payload>]...  # one message per id, in order;
//!                                                    # the payload an amount, 10 if not given
//! broker count <queue>                     # "<ready in queue> <ready in dead-letter queue>"
//! broker consumers <queue>                 # how many consumers the queue has
//! broker dead-letters <queue>              # the message_id of each dead letter (takes them)
//! broker delete <queue>                    # the queue, its dead-letter queue and exchange
//! broker proxy <host:port>                 # a TCP proxy in front of the broker (prints its
//!                                          # port): SIGUSR1 cuts every connection and
//!                                          # refuses new ones, SIGUSR2 lets them through
//! ```

use api::{amqp_url, connect_amqp, topology};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel};
use sea_orm_inbox::rabbitmq::{QuorumQueue, declare_quorum_queue};
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::net::{TcpListener, TcpStream};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("broker: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &[String]) -> Result<(), BoxError> {
    let [command, queue, ids @ ..] = args else {
        return Err(
            "usage: broker publish|count|consumers|dead-letters|delete <queue> [message_id[:payload]...] | broker proxy <host:port>"
                .into(),
        );
    };
    if command == "proxy" {
        return proxy(queue).await;
    }
    let topology = topology(queue);
    let amqp = connect_amqp(&amqp_url()).await?;
    let channel = amqp.create_channel().await?;
    match command.as_str() {
        "publish" => publish(&channel, &topology, ids).await?,
        "count" => {
            let ready = inspect(&channel, &topology.queue).await?.message_count();
            let dead = inspect(&channel, &topology.dead_letter_queue)
                .await?
                .message_count();
            println!("{ready} {dead}");
        }
        "consumers" => {
            let consumers = inspect(&channel, &topology.queue).await?.consumer_count();
            println!("{consumers}");
        }
        "dead-letters" => {
            let get = BasicGetOptions { no_ack: false };
            while let Some(message) = channel.basic_get(&topology.dead_letter_queue, get).await? {
                let id = message.delivery.properties.message_id().as_ref();
                println!("{}", id.map_or("(none)", |id| id.as_str()));
                message.delivery.ack(BasicAckOptions::default()).await?;
            }
        }
        "delete" => {
            for queue in [&topology.queue, &topology.dead_letter_queue] {
                channel
                    .queue_delete(queue, QueueDeleteOptions::default())
                    .await?;
            }
            channel
                .exchange_delete(
                    &topology.dead_letter_exchange,
                    ExchangeDeleteOptions::default(),
                )
                .await?;
        }
        other => return Err(format!("unknown command {other}").into()),
    }
    amqp.close(200, "done").await?;
    Ok(())
}

/// Publishes one persistent message per `id[:payload]`, each confirmed by the broker, with
/// the `message_id` and `timestamp` properties the adapter reads.
async fn publish(
    channel: &Channel,
    topology: &QuorumQueue,
    messages: &[String],
) -> Result<(), BoxError> {
    declare_quorum_queue(channel, topology).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let sent = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    for message in messages {
        let (id, payload) = message.split_once(':').unwrap_or((message, "10"));
        let properties = BasicProperties::default()
            .with_message_id(id.into())
            .with_timestamp(sent)
            .with_delivery_mode(2);
        let confirm = channel
            .basic_publish(
                "",
                &topology.queue,
                BasicPublishOptions::default(),
                payload.as_bytes(),
                properties,
            )
            .await?
            .await?;
        if !confirm.is_ack() {
            return Err(format!("RabbitMQ did not confirm message {id}").into());
        }
    }
    Ok(())
}

/// `queue` as a passive declaration sees it: its messages ready (not those a consumer
/// holds unacked) and its consumers.
async fn inspect(channel: &Channel, queue: &str) -> Result<lapin::Queue, BoxError> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    Ok(channel
        .queue_declare(queue, passive, FieldTable::default())
        .await?)
}

/// A TCP proxy on a free loopback port in front of `upstream`, for the app's replicas to
/// reach the broker through: it prints its port, then SIGUSR1 closes every connection and
/// makes it close new ones at once (the broker gone, as far as the replicas can tell, while
/// it runs on for everyone else), SIGUSR2 forwards them again, SIGTERM ends it.
async fn proxy(upstream: &str) -> Result<(), BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    println!("{}", listener.local_addr()?.port());
    let (cuts, _) = watch::channel(0_u64);
    let (mut cut, mut restore) = (
        signal(SignalKind::user_defined1())?,
        signal(SignalKind::user_defined2())?,
    );
    let mut terminate = signal(SignalKind::terminate())?;
    let mut refusing = false;
    loop {
        tokio::select! {
            _ = terminate.recv() => return Ok(()),
            _ = cut.recv() => {
                refusing = true;
                cuts.send_modify(|cuts| *cuts += 1);
            }
            _ = restore.recv() => refusing = false,
            accepted = listener.accept() => {
                let (mut client, _) = accepted?;
                if refusing {
                    continue; // dropped: closed at once
                }
                let Ok(mut server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let mut cut = cuts.subscribe();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        }
    }
}
