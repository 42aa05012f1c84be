//! A relay in a process of its own, killed with SIGKILL between the broker's confirmation
//! and its mark: the test binary runs itself again on one `#[ignore]`d test (the child),
//! whose publisher ([`StopsAfterConfirms`]) says on stdout what the broker confirmed and
//! then blocks; the parent ([`run_and_kill_child_relay`]) waits for those lines and kills
//! it. The rows the child claimed stay leased until their lease ends; another relay then
//! publishes them again, with the same message ids.

use sea_orm_inbox::{OutboxMessage, PublishError, Publisher};
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use uuid::Uuid;

/// The child relay's stdout line for each confirmed publish, followed by the message id.
const CONFIRMED: &str = "child relay confirmed ";

/// The child relay's publisher: prints each publish `inner` confirmed, and after the
/// `confirms`th stops before returning, that is before its relay can mark anything sent,
/// until the parent kills the process.
pub struct StopsAfterConfirms<P> {
    inner: P,
    confirms: usize,
    confirmed: AtomicUsize,
}

impl<P> StopsAfterConfirms<P> {
    /// Publishes through `inner` and stops after `confirms` confirmations.
    pub fn new(inner: P, confirms: usize) -> Self {
        Self {
            inner,
            confirms,
            confirmed: AtomicUsize::new(0),
        }
    }
}

impl<P: Publisher> Publisher for StopsAfterConfirms<P> {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        self.inner.publish(message).await?;
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{CONFIRMED}{}", message.message_id).expect("write to stdout");
        stdout.flush().expect("flush stdout");
        drop(stdout);
        if self.confirmed.fetch_add(1, Ordering::SeqCst) + 1 >= self.confirms {
            // Blocks the worker thread, not just this future: the relay's publish timeout
            // cannot fire, so nothing of the batch is ever marked, whenever the kill comes.
            std::thread::sleep(Duration::from_secs(3600));
        }
        Ok(())
    }
}

/// Starts this test binary on the `#[ignore]`d test `test` (exact name) with `envs` set,
/// waits until it printed `confirms` confirmations of its [`StopsAfterConfirms`], and
/// kills it with SIGKILL: returns the ids the broker confirmed to it.
pub async fn run_and_kill_child_relay(
    test: &str,
    envs: &[(&str, &str)],
    confirms: usize,
) -> Vec<Uuid> {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut child = std::process::Command::new(exe)
        .args([test, "--exact", "--ignored", "--nocapture"])
        .envs(envs.iter().copied())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the child relay");
    let stdout = child.stdout.take().expect("the child's stdout");
    let (lines, mut confirmations) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(id) = line.strip_prefix(CONFIRMED) {
                let id = Uuid::parse_str(id.trim()).expect("a message id");
                if lines.send(id).is_err() {
                    break;
                }
            }
        }
    });
    let mut confirmed = Vec::new();
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while confirmed.len() < confirms {
            match confirmations.recv().await {
                Some(id) => confirmed.push(id),
                None => break,
            }
        }
    })
    .await;
    // Stopped inside its publisher: the last message confirmed, none of its batch marked.
    child.kill().expect("SIGKILL the child relay");
    let status = child.wait().expect("reap the child relay");
    assert!(
        waited.is_ok() && confirmed.len() == confirms,
        "the child relay confirmed {} publishes before it ended ({status}); expected {confirms}",
        confirmed.len()
    );
    confirmed
}
