//! `outbox-bench --obix <path to obix-bench>`: obix (crates.io `obix` 0.16, a PostgreSQL-only
//! transactional outbox) beside this crate's outbox, on the benchmark's PostgreSQL database,
//! in the same rounds and tables: "UPDATE + obix publish" in the writers' table, and obix's
//! listener in the publishing process and in another under the latency table.
//!
//! obix runs in `obix-bench` (bench/obix), a binary outside this workspace with a Cargo.lock
//! of its own: obix is on sqlx 0.8, whose SQLite driver, once in a lock, pins
//! `libsqlite3-sys` to ^0.30 and would take the whole workspace (the library's SQLite tests
//! and numbers included) from libsqlite3-sys 0.37 (SQLite 3.51) down to 0.30 (SQLite 3.46).
//! So this crate has no obix or sqlx 0.8 in it: it starts `obix-bench` as a child and talks
//! to it in lines (the protocol is in bench/obix/src/main.rs's docs). Build it, then name
//! it to the benchmark:
//!
//! ```text
//! cargo build --release --manifest-path bench/obix/Cargo.toml
//! cargo run --release -p inbox-bench --bin outbox-bench -- --latency \
//!     --postgres postgres://postgres@127.0.0.1:5432/test \
//!     --obix bench/obix/target/release/obix-bench
//! ```
//!
//! `obix-bench` sets obix up as its README shows a new user, nothing tuned: its migration,
//! then `Outbox::init` with every default (`notify_debounce` 25 ms, `event_buffer_size` 100,
//! `event_cache_size` 1000, `backfill_page_size` 1000, `gap_fill_grace` 2 s).
//!
//! - The writers' row: one `obix-bench publisher` child for the whole run (set-up and pool
//!   once, like the benchmark's own pool), asked for `writers <writers> <seconds>` in each
//!   round and rotation slot of the other modes; it times the same loop as
//!   `outbox_enqueue::rate`, each transaction the same `UPDATE` plus one obix publish.
//! - The latency rows: that child publishes on command (`publish`, the commit instant taken
//!   there when `COMMIT` returns) while the parent paces it like our own rows (200 paced
//!   single-event transactions, then 200 transactions of 10 back to back). Its own listener
//!   delivers the same-process row (fed from the commit, no database read); an
//!   `obix-bench listen` child, started per run like our relay child, delivers the
//!   other-process row (woken by the publisher's `NOTIFY` hint, sent at most once per
//!   25 ms, then reading the table).
//!
//! Why a burst can stall the other process's consumer (obix 0.16's source): rows read from
//! the table reach its cache loop through the `cache_fill` broadcast of `event_buffer_size`
//! slots, sent in one loop without waiting (the notified range, up to a page, or a gap-fill
//! stall page). A broadcast keeps the newest, so a lagging cache loop loses the oldest rows,
//! which leaves a hole below rows it holds. The gap filler re-reads the page above the hole
//! after `gap_fill_grace` and sends it the same way, losing the same oldest rows again
//! whenever more than a buffer's worth follows the hole; the catch-up read that paces
//! itself starts only a page (1000 rows) behind. So the row reports a burst not delivered
//! within `outbox_latency::DEADLINE` as stalled rather than failing the run.

use crate::outbox_enqueue::{ExternalWriters, RateStep};
use crate::outbox_latency::{self, Child, Latency};
use std::path::{Path, PathBuf};
use std::time::Duration;
use uuid::Uuid;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How to get the binary `--obix` names.
const BUILD: &str = "build it with `cargo build --release --manifest-path bench/obix/Cargo.toml` \
                     and pass --obix bench/obix/target/release/obix-bench";

/// The latency runs' events are of accounts from here up (one per run), above every
/// writer's (`outbox_enqueue::WRITERS`), so no run waits for another's events.
const FIRST_ACCOUNT: u64 = 1_000;

/// How long a reply that involves no waiting of its own (set-up aside) may take.
const REPLY: Duration = Duration::from_secs(30);

/// Checks that `path` (the `--obix` flag's value) is an executable file.
pub fn binary(path: &str) -> Result<PathBuf, BoxError> {
    let metadata =
        std::fs::metadata(path).map_err(|err| format!("--obix {path}: {err}; {BUILD}"))?;
    #[cfg(unix)]
    let executable = std::os::unix::fs::PermissionsExt::mode(&metadata.permissions()) & 0o111 != 0;
    #[cfg(not(unix))]
    let executable = true;
    if !metadata.is_file() || !executable {
        return Err(format!("--obix {path} is not an executable file; {BUILD}").into());
    }
    Ok(PathBuf::from(path))
}

/// The `obix-bench publisher` child on the benchmark's database, for the whole run.
pub struct Obix {
    program: PathBuf,
    url: String,
    publisher: tokio::sync::Mutex<Child>,
}

/// The rest of `reply` after `word`, or an error naming what was asked.
fn answer<'a>(reply: &'a str, word: &str, asked: &str) -> Result<&'a str, BoxError> {
    reply
        .strip_prefix(word)
        .and_then(|rest| rest.strip_prefix(' '))
        .ok_or_else(|| format!("obix-bench answered {asked:?} with {reply:?}").into())
}

impl Obix {
    /// Starts the publisher, which applies obix's migration to `url`'s database and starts
    /// its outbox.
    pub async fn start(program: &Path, url: &str) -> Result<Self, BoxError> {
        let mut publisher = Child::spawn(program, &["publisher", url])?;
        publisher.expect("ready", Duration::from_secs(60)).await?;
        Ok(Self {
            program: program.to_owned(),
            url: url.to_owned(),
            publisher: tokio::sync::Mutex::new(publisher),
        })
    }

    /// Stops the publisher, which closes its pool: the benchmark can drop its database.
    pub async fn close(self) -> Result<(), BoxError> {
        self.publisher.into_inner().stop()
    }
}

impl ExternalWriters for Obix {
    fn name(&self) -> &str {
        "UPDATE + obix publish"
    }

    fn rate(&self, writers: usize, seconds: f64) -> RateStep<'_> {
        Box::pin(async move {
            let command = format!("writers {writers} {seconds}");
            let within = Duration::from_secs_f64(seconds) + REPLY;
            let reply = self.publisher.lock().await.ask(&command, within).await?;
            let rate = answer(&reply, "rate", &command)?;
            Ok(rate
                .parse()
                .map_err(|err| format!("obix-bench's rate {rate:?}: {err}"))?)
        })
    }
}

/// Where obix's consumer runs.
#[derive(Clone, Copy)]
enum Consumer {
    /// The publisher's own listener.
    SameProcess,
    /// An `obix-bench listen` child.
    OtherProcess,
}

/// Has the publisher commit `transactions` transactions of `events` events of `account`,
/// numbered from `first`; returns when the last `COMMIT` returned there.
async fn publish(
    publisher: &mut Child,
    account: u64,
    first: u64,
    transactions: u64,
    events: u64,
) -> Result<u128, BoxError> {
    let command = format!("publish {account} {first} {transactions} {events}");
    let reply = publisher.ask(&command, REPLY).await?;
    let committed = answer(&reply, "committed", &command)?;
    Ok(committed
        .parse()
        .map_err(|err| format!("obix-bench's commit instant {committed:?}: {err}"))?)
}

/// One latency run, `outbox_latency::run`'s for obix: [`outbox_latency::MESSAGES`] paced
/// single-event transactions, then [`outbox_latency::BURST`] transactions of 10 events,
/// commit to delivery.
async fn run(obix: &Obix, consumer: Consumer, account: u64) -> Result<Latency, BoxError> {
    let mut publisher = obix.publisher.lock().await;
    let listener = match consumer {
        Consumer::SameProcess => {
            publisher.clock().clear();
            publisher.send("listen")?;
            publisher.expect("listening", REPLY).await?;
            None
        }
        Consumer::OtherProcess => {
            Some(outbox_latency::spawn_listener(&obix.program, &["listen", &obix.url]).await?)
        }
    };
    let clock = match &listener {
        Some(child) => child.clock().clone(),
        None => publisher.clock().clone(),
    };
    let id = |n: u64| Uuid::from_u64_pair(account, n);
    let (messages, burst) = (
        outbox_latency::MESSAGES as u64,
        outbox_latency::BURST as u64,
    );

    let mut commits = Vec::with_capacity(outbox_latency::MESSAGES);
    for n in 0..messages {
        commits.push((id(n), publish(&mut publisher, account, n, 1, 1).await?));
        tokio::time::sleep(outbox_latency::PACE).await;
    }
    outbox_latency::wait_for(&clock, outbox_latency::MESSAGES).await?;
    let committed = publish(&mut publisher, account, messages, burst, 10).await?;
    let last = (id(messages + burst * 10 - 1), committed);
    // obix's consumer can stall on a burst (see the module docs): the row says so rather
    // than the run failing.
    let rows = outbox_latency::MESSAGES + outbox_latency::BURST * 10;
    let burst_last = if outbox_latency::wait_until(&clock, rows).await {
        outbox_latency::delay(&clock, &last)?
    } else {
        f64::INFINITY
    };

    let latency = outbox_latency::summarize(&clock, &commits, burst_last)?;
    match listener {
        Some(child) => child.stop()?,
        None => {
            publisher.send("unlisten")?;
            publisher.expect("unlistened", REPLY).await?;
        }
    }
    Ok(latency)
}

/// Measures obix's consumer in the publishing process and in another, interleaved in
/// rotating order over `rounds`, and prints their rows under the table
/// [`outbox_latency::report`] has just printed.
pub async fn latency_report(obix: &Obix, rounds: usize) -> Result<(), BoxError> {
    let consumers = [Consumer::SameProcess, Consumer::OtherProcess];
    let mut results: Vec<Vec<Latency>> = consumers.iter().map(|_| Vec::new()).collect();
    let mut account = FIRST_ACCOUNT;
    for round in 0..rounds {
        for k in 0..consumers.len() {
            let index = (round + k) % consumers.len();
            account += 1;
            results[index].push(run(obix, consumers[index], account).await?);
        }
    }
    for (consumer, latencies) in consumers.iter().zip(results) {
        let name = match consumer {
            Consumer::SameProcess => "obix, same process (its listener)",
            Consumer::OtherProcess => "obix, other process (NOTIFY hint, 25 ms debounce)",
        };
        outbox_latency::print_row(name, &latencies);
    }
    Ok(())
}
