//! Commit-to-publish latency: the time from a writer's `COMMIT` returning to the
//! publisher being called for that message. Writer and publisher record wall-clock
//! instants by message id, compared after the run, so neither side races the other and a
//! relay in another process (same machine, same clock) is measured the same way.

use sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};
use sea_orm_inbox::{
    OutboxExt, OutboxMessage, OutboxWaker, OutgoingMessage, PublishError, Publisher, Relay,
    RelayOptions,
};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use uuid::Uuid;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The flag the benchmark re-executes itself with to run a listening relay in a child
/// process: `--latency-relay <postgres url>`.
pub const CHILD_FLAG: &str = "--latency-relay";

/// The poll interval of the latency relays: what a message waits without a wake-up.
pub const POLL: Duration = Duration::from_millis(100);

/// Pause between the writer's transactions: latency is measured without load.
pub const PACE: Duration = Duration::from_millis(5);

/// Wall-clock microseconds: writer and relay (or another process) compare instants of
/// the same clock.
pub fn micros_now() -> u128 {
    // A clock before 1970 is a broken machine; zero makes its numbers visibly wrong.
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros())
}

/// Records when each message reached the broker (or another outbox's consumer).
#[derive(Clone, Default)]
pub struct Clock(Arc<Mutex<HashMap<Uuid, u128>>>);

impl Clock {
    /// Notes now as `id`'s delivery, unless it was delivered before.
    pub fn record(&self, id: Uuid) {
        let now = micros_now();
        // A poisoned lock means another recorder panicked; the run then fails on counts.
        if let Ok(mut seen) = self.0.lock() {
            seen.entry(id).or_insert(now);
        }
    }

    /// Messages delivered so far.
    pub fn len(&self) -> usize {
        self.0.lock().map_or(0, |seen| seen.len())
    }

    /// When `id` was delivered, if it was.
    pub fn get(&self, id: &Uuid) -> Option<u128> {
        self.0.lock().ok().and_then(|seen| seen.get(id).copied())
    }

    /// Forgets every delivery, so a long-lived child's clock starts a run empty.
    pub fn clear(&self) {
        if let Ok(mut seen) = self.0.lock() {
            seen.clear();
        }
    }
}

/// A broker that confirms at once and notes the instant.
struct Timed(Clock);

impl Publisher for Timed {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        self.0.record(Uuid::from(message.message_id));
        Ok(())
    }
}

/// Where the publish instants come from: a relay task in this process, or a child process
/// printing `<message id> <micros>` lines.
enum Sink {
    Local(Clock),
    Child(Child),
}

impl Sink {
    fn clock(&self) -> &Clock {
        match self {
            Sink::Local(clock) => clock,
            Sink::Child(child) => child.clock(),
        }
    }
}

/// p50 and p99 of one mode, in milliseconds.
pub struct Latency {
    pub p50: f64,
    pub p99: f64,
    /// The last row of a burst, from its commit; infinite when the burst was not all
    /// delivered within [`DEADLINE`] (only another outbox's rows record that: a stall of
    /// ours fails the run).
    pub burst_last: f64,
}

/// The `p` quantile (0 to 1) of ascending, non-empty `sorted`.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// How the relay learns of a commit.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Wake {
    /// In this process, woken by `OutboxWaker::wake` after each commit.
    InProcess,
    /// In this process, polling only.
    Polling,
    /// In a child process, woken by `LISTEN`/`NOTIFY` (`OutboxWaker::notifying` here,
    /// `Relay::listening` there).
    Notify,
}

/// How long a run waits for its messages before it calls them lost or stalled.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Waits until `rows` messages are delivered, for [`DEADLINE`] at most; false if they
/// were not.
pub async fn wait_until(clock: &Clock, rows: usize) -> bool {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while clock.len() < rows {
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    true
}

/// Waits until `rows` messages are delivered; an error after [`DEADLINE`].
pub async fn wait_for(clock: &Clock, rows: usize) -> Result<(), BoxError> {
    if !wait_until(clock, rows).await {
        return Err(format!("only {} of {rows} messages published", clock.len()).into());
    }
    Ok(())
}

/// Writes `messages` paced single-message transactions, then a burst of `burst`
/// transactions of 10 messages each, and measures commit-to-publish for each.
pub async fn run(
    db: &DatabaseConnection,
    url: &str,
    wake: Wake,
    messages: usize,
    burst: usize,
) -> Result<Latency, BoxError> {
    // One mode's rows must not be the next one's.
    db.execute_unprepared("DELETE FROM outbox").await?;
    let (sink, waker, stop, task) = match wake {
        Wake::InProcess | Wake::Polling => {
            let clock = Clock::default();
            let relay = Arc::new(Relay::new(Timed(clock.clone())).with_options(options())?);
            let waker = (wake == Wake::InProcess).then(|| relay.waker());
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let task_db = db.clone();
            let task = tokio::spawn(async move {
                relay
                    .run(&task_db, async {
                        let _ = stopped.await;
                    })
                    .await;
            });
            (Sink::Local(clock), waker, Some(stop), Some(task))
        }
        Wake::Notify => {
            let child = spawn_listener(&std::env::current_exe()?, &[CHILD_FLAG, url]).await?;
            let waker = OutboxWaker::default().notifying(db.clone())?;
            (Sink::Child(child), Some(waker), None, None)
        }
    };

    let mut commits = Vec::with_capacity(messages + burst * 10);
    for n in 0..messages {
        let id = Uuid::new_v4();
        let txn = db.begin().await?;
        txn.enqueue(OutgoingMessage::new("latency", format!("event {n}")).message_id(id))
            .await?;
        txn.commit().await?;
        commits.push((id, micros_now()));
        if let Some(waker) = &waker {
            waker.wake();
        }
        tokio::time::sleep(PACE).await;
    }
    wait_for(sink.clock(), messages).await?;
    let mut burst_last = 0.0;
    if burst > 0 {
        let mut last = (Uuid::nil(), 0);
        for t in 0..burst {
            let txn = db.begin().await?;
            for m in 0..10 {
                let id = Uuid::new_v4();
                txn.enqueue(
                    OutgoingMessage::new("latency", format!("burst {t}.{m}")).message_id(id),
                )
                .await?;
                last.0 = id;
            }
            txn.commit().await?;
            last.1 = micros_now();
            if let Some(waker) = &waker {
                waker.wake();
            }
        }
        wait_for(sink.clock(), messages + burst * 10).await?;
        burst_last = delay(sink.clock(), &last)?;
    }

    let latency = summarize(sink.clock(), &commits, burst_last)?;
    match sink {
        Sink::Local(_) => {
            if let Some(stop) = stop {
                let _ = stop.send(());
            }
            if let Some(task) = task {
                task.await?;
            }
        }
        Sink::Child(child) => child.stop()?,
    }
    Ok(latency)
}

/// Milliseconds from a message's commit (`(id, micros)`) to its delivery.
pub fn delay(clock: &Clock, (id, committed): &(Uuid, u128)) -> Result<f64, BoxError> {
    let delivered = clock.get(id).ok_or("a message was never delivered")?;
    // Delivery before the COMMIT reply is possible by a few microseconds; count it as 0.
    Ok(delivered.saturating_sub(*committed) as f64 / 1000.0)
}

/// p50 and p99 of the paced `commits` (`(id, micros)` each), with the burst's last row.
pub fn summarize(
    clock: &Clock,
    commits: &[(Uuid, u128)],
    burst_last: f64,
) -> Result<Latency, BoxError> {
    if commits.is_empty() {
        return Err("no paced messages to measure".into());
    }
    let mut latencies = commits
        .iter()
        .map(|commit| delay(clock, commit))
        .collect::<Result<Vec<_>, _>>()?;
    latencies.sort_by(f64::total_cmp);
    Ok(Latency {
        p50: percentile(&latencies, 0.5),
        p99: percentile(&latencies, 0.99),
        burst_last,
    })
}

/// Another process of the benchmark's: this binary as a relay, or another outbox's
/// consumer or publisher (obix's, see `outbox_obix`). It speaks in lines: on its stdout,
/// `<message id> <micros>` per delivery, which fill its [`Clock`] (see [`print_delivery`]),
/// and any other line a reply; on its stdin, commands; closing its stdin tells it to stop.
pub struct Child {
    process: std::process::Child,
    stdin: std::process::ChildStdin,
    clock: Clock,
    replies: tokio::sync::mpsc::UnboundedReceiver<String>,
    /// The program, for errors.
    name: String,
}

impl Child {
    /// Starts `program` with `args`, its stderr on the benchmark's.
    pub fn spawn(program: &Path, args: &[&str]) -> Result<Self, BoxError> {
        let name = program.display().to_string();
        let mut process = std::process::Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|err| format!("starting {name}: {err}"))?;
        let stdin = process.stdin.take().ok_or("the child has no stdin")?;
        let stdout = process.stdout.take().ok_or("the child has no stdout")?;
        let (reply, replies) = tokio::sync::mpsc::unbounded_channel();
        let clock = Clock::default();
        let reader = clock.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some((id, micros)) = line.split_once(' ')
                    && let (Ok(id), Ok(micros)) = (id.parse(), micros.parse())
                {
                    if let Ok(mut seen) = reader.0.lock() {
                        seen.entry(id).or_insert(micros);
                    }
                } else if reply.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            process,
            stdin,
            clock,
            replies,
            name,
        })
    }

    /// The deliveries it reported.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Sends `command`, a line on its stdin.
    pub fn send(&mut self, command: &str) -> Result<(), BoxError> {
        writeln!(self.stdin, "{command}")
            .and_then(|()| self.stdin.flush())
            .map_err(|err| format!("sending {command:?} to {}: {err}", self.name))?;
        Ok(())
    }

    /// Sends `command` and returns the next reply, waiting `within` at most.
    pub async fn ask(&mut self, command: &str, within: Duration) -> Result<String, BoxError> {
        self.send(command)?;
        self.reply(within).await
    }

    /// The next reply, waiting `within` at most.
    pub async fn reply(&mut self, within: Duration) -> Result<String, BoxError> {
        match tokio::time::timeout(within, self.replies.recv()).await {
            Ok(Some(reply)) => Ok(reply),
            Ok(None) => Err(format!("{} ended (its error is on stderr)", self.name).into()),
            Err(_) => Err(format!("{} did not reply within {within:?}", self.name).into()),
        }
    }

    /// Waits for the reply `expected`.
    pub async fn expect(&mut self, expected: &str, within: Duration) -> Result<(), BoxError> {
        let reply = self.reply(within).await?;
        if reply != expected {
            return Err(format!("{} said {reply:?}, not {expected:?}", self.name).into());
        }
        Ok(())
    }

    /// Closes its stdin and waits for it to exit; an error if it failed.
    pub fn stop(self) -> Result<(), BoxError> {
        let Self {
            mut process,
            stdin,
            name,
            ..
        } = self;
        drop(stdin);
        let status = process
            .wait()
            .map_err(|err| format!("waiting for {name}: {err}"))?;
        if !status.success() {
            return Err(format!("{name} failed: {status}").into());
        }
        Ok(())
    }
}

/// Starts a consumer in another process, [`Child::spawn`]'s `program` with `args`, which
/// prints `listening` once it listens. Returns when it does.
pub async fn spawn_listener(program: &Path, args: &[&str]) -> Result<Child, BoxError> {
    let mut child = Child::spawn(program, args)?;
    child.expect("listening", Duration::from_secs(10)).await?;
    // The child's LISTEN connection may still be starting: give it a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(child)
}

/// Resolves when the child's stdin closes: the parent's signal to stop.
async fn stdin_closed() {
    let _ = tokio::task::spawn_blocking(|| {
        let mut sink = String::new();
        while std::io::stdin()
            .read_line(&mut sink)
            .is_ok_and(|read| read > 0)
        {}
    })
    .await;
}

/// The relay child's side of [`Child`]: records `id`'s delivery and prints it as
/// `<message id> <micros>`.
fn print_delivery(clock: &Clock, id: Uuid) {
    clock.record(id);
    if let Some(micros) = clock.get(&id) {
        let mut out = std::io::stdout().lock();
        // A closed stdout means the parent is gone: nothing left to measure.
        let _ = writeln!(out, "{id} {micros}");
        let _ = out.flush();
    }
}

fn options() -> RelayOptions {
    RelayOptions {
        batch_size: 100,
        poll_interval: POLL,
        ..RelayOptions::default()
    }
}

/// The child process: a relay on its own pool, listening on `url`, printing each publish
/// as `<message id> <micros>` until its stdin closes.
pub async fn child(url: &str) -> Result<(), BoxError> {
    let db = sea_orm::Database::connect(url).await?;
    warm_up(&db).await?;
    let clock = Clock::default();
    let relay = Relay::new(Printing(clock))
        .with_options(options())?
        .listening(url)?;
    println!("listening");
    std::io::stdout().flush()?;
    relay.run(&db, stdin_closed()).await;
    db.close().await?;
    Ok(())
}

/// Connections a relay's pool holds open once it has run a while: a finished call's
/// connection goes back to the pool a moment after the call returns, so the next call
/// sometimes opens another one, until the pool has a few.
const WARM_CONNECTIONS: usize = 4;

/// Opens [`WARM_CONNECTIONS`] in the child's pool before it listens, as a relay in a
/// service that has run a while has them. A fresh child opened them during its round
/// instead, each a stall of the relay's claim or mark: 85-89 ms from the server's
/// `connection received` to `authorized` in its log, with TLS (with `sslmode=disable` the
/// p99 fell to 6 ms without this warm-up), and that stall was the whole of the
/// cross-process p99 (BENCHMARKS.md, "The cross-process p99").
async fn warm_up(db: &DatabaseConnection) -> Result<(), BoxError> {
    let holds: Vec<_> = (0..WARM_CONNECTIONS)
        .map(|_| {
            let db = db.clone();
            tokio::spawn(async move { db.execute_unprepared("SELECT pg_sleep(0.05)").await })
        })
        .collect();
    for hold in holds {
        hold.await??;
    }
    Ok(())
}

/// The child's publisher: one stdout line per message.
struct Printing(Clock);

impl Publisher for Printing {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        print_delivery(&self.0, Uuid::from(message.message_id));
        Ok(())
    }
}

/// Messages per latency mode and round, paced by [`PACE`].
pub const MESSAGES: usize = 200;

/// Transactions in the burst after them, 10 messages each.
pub const BURST: usize = 200;

/// Measures every mode the backend has, interleaved in rotating order over `rounds`, and
/// prints one table row per mode: medians over rounds of p50, p99 and the burst's last row.
pub async fn report(
    db: &DatabaseConnection,
    backend: &str,
    url: &str,
    rounds: usize,
) -> Result<(), BoxError> {
    let mut modes = vec![Wake::InProcess, Wake::Polling];
    if backend == "postgres" {
        modes.push(Wake::Notify);
    }
    let mut results: Vec<Vec<Latency>> = modes.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for k in 0..modes.len() {
            let index = (round + k) % modes.len();
            results[index].push(run(db, url, modes[index], MESSAGES, BURST).await?);
        }
    }
    println!();
    println!("| {backend} commit-to-publish | p50 ms | p99 ms | last of {BURST}x10 burst ms |");
    println!("| --- | ---: | ---: | ---: |");
    for (mode, latencies) in modes.iter().zip(results) {
        let name = match mode {
            Wake::InProcess => "same process, woken".to_owned(),
            Wake::Polling => format!("same process, polling every {} ms", POLL.as_millis()),
            Wake::Notify => "other process, LISTEN/NOTIFY".to_owned(),
        };
        print_row(&name, &latencies);
    }
    Ok(())
}

/// One row of the table [`report`] prints: medians over rounds of p50, p99 and the
/// burst's last row, with the rounds whose burst stalled. Other outboxes' rows (printed
/// right after) join the same table.
pub fn print_row(name: &str, latencies: &[Latency]) {
    let median = |pick: fn(&Latency) -> f64| {
        let mut values: Vec<f64> = latencies.iter().map(pick).collect();
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let burst = median(|l| l.burst_last);
    let stalled = latencies
        .iter()
        .filter(|l| l.burst_last.is_infinite())
        .count();
    let burst = match stalled {
        0 => format!("{burst:.1}"),
        _ => format!(
            "{} (stalled > {} s in {stalled} of {} rounds)",
            if burst.is_infinite() {
                "never".to_owned()
            } else {
                format!("{burst:.1}")
            },
            DEADLINE.as_secs(),
            latencies.len()
        ),
    };
    println!(
        "| {name} | {:.1} | {:.1} | {burst} |",
        median(|l| l.p50),
        median(|l| l.p99),
    );
}
