//! Galera: replicas talking to different nodes of a MariaDB Galera cluster keep
//! exactly-once. A cross-node conflict does not block: the loser's INSERT succeeds locally
//! and its transaction fails certification, with 1213 at COMMIT or, once the winner's
//! write set has reached the loser's node and aborted it, at its next statement. The retry
//! in a fresh transaction then finds the duplicate.
//!
//! Runs when `INBOX_TEST_GALERA_URLS` is set (`tests/cluster/galera.sh start`, then
//! `export INBOX_TEST_GALERA_URLS=$(tests/cluster/galera.sh urls)`); the soak also kills
//! and restarts node 3 through `tests/cluster/galera.sh`, so the other tests use nodes 1
//! and 2 only.

use inbox_tests::{
    Broker, GaleraDb, Plan, XorShift, assert_exactly_once, create_accounts, create_effects, credit,
    galera_script, run, run_replicas_on, scalar_i64, stmt, with_galera_db,
};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, DbErr, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{DbErrorKind, RetryPolicy, classify};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Barrier;
use uuid::Uuid;

mod outbox;

const CONSUMER: &str = "billing.credit";
const BATCH_CONSUMER: &str = "projector";

/// The ids each round of [`race_overlapping_batches`] draws from, and how many batches of
/// how many ids each replica commits per round.
const RACE_POOL: usize = 300;
const RACE_BATCHES: usize = 15;
const RACE_BATCH: usize = 60;

/// A connection to `node` whose reads wait until the node has applied every write set
/// committed before them (`wsrep_sync_wait = 15`): the place to count rows from.
async fn causal_reader(galera: &GaleraDb, node: usize) -> DatabaseConnection {
    let conn = galera.connect_with(node, 1).await;
    run(&conn, "SET SESSION wsrep_sync_wait = 15").await;
    conn
}

async fn create_applied(conn: &DatabaseConnection) {
    run(
        conn,
        "CREATE TABLE applied (message_id VARCHAR(36) NOT NULL, replica INT NOT NULL)",
    )
    .await;
}

async fn record_applied(
    txn: &impl ConnectionTrait,
    id: MessageId,
    replica: usize,
) -> Result<(), DbErr> {
    txn.execute_raw(stmt(
        DbBackend::MySql,
        "INSERT INTO applied (message_id, replica) VALUES (?, ?)",
        vec![id.as_uuid().to_string().into(), (replica as i32).into()],
    ))
    .await
    .map(|_| ())
}

fn is_transient(err: &InboxError) -> bool {
    err.db_err()
        .is_some_and(|db| classify(db) == DbErrorKind::Transient)
}

/// Two replicas on two nodes race for one message through `Inbox::process`, 200 times:
/// exactly one `Processed` per message, one credit, one marker. The loser's conflict is a
/// transient failure `process` retries; the retry finds the duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-galera.sh runs it (--ignored, with INBOX_TEST_GALERA_URLS)"]
async fn two_nodes_race_for_one_message_200_times() {
    const ROUNDS: i64 = 200;
    with_galera_db(async |galera| {
        let replicas = [
            Arc::new(galera.connect(0).await),
            Arc::new(galera.connect(1).await),
        ];
        create_accounts(replicas[0].as_ref()).await;
        galera.wait_for_replication(&[0, 1]).await;
        let inboxes = [
            Inbox::new(CONSUMER)
                .unwrap()
                .with_retry(RetryPolicy::default().max_attempts(10)),
            Inbox::new(CONSUMER)
                .unwrap()
                .with_retry(RetryPolicy::default().max_attempts(10)),
        ];
        for round in 0..ROUNDS {
            let id = Uuid::new_v4();
            let barrier = Arc::new(Barrier::new(2));
            let tasks: Vec<_> = (0..2)
                .map(|replica| {
                    let (conn, barrier) = (Arc::clone(&replicas[replica]), Arc::clone(&barrier));
                    let inbox = inboxes[replica].clone();
                    tokio::spawn(async move {
                        barrier.wait().await;
                        inbox
                            .process(&conn, id, |txn| Box::pin(credit(txn, 1)))
                            .await
                            .map(|outcome| matches!(outcome, Outcome::Processed(())))
                    })
                })
                .collect();
            let mut processed = Vec::new();
            for task in tasks {
                let result = task.await.expect("replica task");
                processed.push(result.unwrap_or_else(|err| panic!("round {round}: {err:?}")));
            }
            processed.sort();
            assert_eq!(
                processed,
                [false, true],
                "round {round}: one Processed, one Duplicate"
            );
        }
        let reader = causal_reader(galera, 1).await;
        let balance = scalar_i64(&reader, "SELECT balance FROM account WHERE id = 1").await;
        let markers = scalar_i64(&reader, "SELECT COUNT(*) FROM inbox").await;
        let retries: u64 = inboxes
            .iter()
            .map(|inbox| inbox.metrics().snapshot().transient_retries)
            .sum();
        println!(
            "Galera 2-node race: {ROUNDS} messages, balance {balance}, {markers} markers, \
         {retries} cross-node conflicts retried by process"
        );
        assert_eq!(
            (balance, markers),
            (ROUNDS, ROUNDS),
            "one credit and one marker each"
        );
        reader.close().await.ok();
        for replica in replicas {
            replica.as_ref().clone().close().await.ok();
        }
    })
    .await;
}

/// The anatomy of a cross-node conflict, by hand: the claim on node 2 does not block
/// while node 1's claim is open; the transaction that commits second fails with a 1213
/// that `classify` calls transient, and its retry in a fresh transaction is `Duplicate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-galera.sh runs it (--ignored, with INBOX_TEST_GALERA_URLS)"]
async fn claim_message_conflict_across_nodes_is_transient_then_duplicate() {
    const ROUNDS: usize = 20;
    with_galera_db(async |galera| {
        let (first, second) = (galera.connect(0).await, galera.connect(1).await);
        create_accounts(&first).await;
        galera.wait_for_replication(&[0, 1]).await;
        let (mut at_statement, mut at_commit) = (0, 0);
        for round in 0..ROUNDS {
            let id = Uuid::new_v4();
            let loser = first.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
            assert!(
                loser
                    .claim_message(id, CONSUMER)
                    .await
                    .unwrap()
                    .is_claimed()
            );
            let winner = second.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
            assert!(
                winner
                    .claim_message(id, CONSUMER)
                    .await
                    .unwrap()
                    .is_claimed(),
                "round {round}: the second node's INSERT does not wait for the first"
            );
            winner.commit().await.expect("the first COMMIT wins");
            let failure = match credit(&loser, 1).await {
                Err(err) => {
                    at_statement += 1;
                    loser.rollback().await.ok();
                    err
                }
                Ok(()) => {
                    at_commit += 1;
                    loser
                        .commit()
                        .await
                        .expect_err("the loser's COMMIT fails certification")
                }
            };
            assert_eq!(
                classify(&failure),
                DbErrorKind::Transient,
                "round {round}: {failure}"
            );
            // The retry, as `process` does it: a fresh transaction, from the top.
            let mut retry = 0;
            loop {
                let txn = first.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
                match txn.claim_message(id, CONSUMER).await {
                    Ok(Claim::Duplicate) => break,
                    Ok(Claim::Claimed(_)) => {
                        // The winner's write set has not reached this node yet: committing
                        // would fail certification again.
                        let err = txn.commit().await.expect_err("certification conflict");
                        assert_eq!(classify(&err), DbErrorKind::Transient, "{err}");
                    }
                    Ok(Claim::Refused(refusal)) => {
                        panic!("round {round}: no send time, yet {refusal}")
                    }
                    Err(err) if is_transient(&err) => {}
                    Err(err) => panic!("round {round}: retry failed: {err}"),
                }
                retry += 1;
                assert!(
                    retry < 20,
                    "round {round}: the retry never saw the duplicate"
                );
            }
        }
        println!(
            "Galera claim_message conflicts: {ROUNDS} rounds, the loser failed at its next \
         statement {at_statement} times, at COMMIT {at_commit} times"
        );
        let reader = causal_reader(galera, 1).await;
        assert_eq!(
            scalar_i64(&reader, "SELECT COUNT(*) FROM inbox").await,
            ROUNDS as i64
        );
        assert_eq!(
            scalar_i64(&reader, "SELECT balance FROM account WHERE id = 1").await,
            0,
            "no loser's credit committed"
        );
        for conn in [first, second, reader] {
            conn.close().await.ok();
        }
    })
    .await;
}

/// `Inbox::process` meeting the conflict at its own COMMIT: while the handler runs on node
/// 1, a replica on node 2 claims and commits the same message. The handler's credit was
/// made, the handler returned `Ok`, and the COMMIT (or the pre-commit check before it)
/// fails with 1213; `process` retries in a fresh transaction and finds the duplicate. When
/// the abort has already ended the transaction by the time of the pre-commit check without
/// failing a statement, the check finds the marker gone, and since no statement of the
/// observed transaction failed, that is the database's doing: retried too (before the
/// observed transaction it was `ClaimLost`, a nack and a redelivery). Always `Duplicate`,
/// never `Processed`: no credit, one marker (the winner's).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-galera.sh runs it (--ignored, with INBOX_TEST_GALERA_URLS)"]
async fn process_with_1213_at_commit_retries_and_finds_the_duplicate() {
    const ROUNDS: usize = 10;
    with_galera_db(async |galera| {
        let (loser_node, winner_node) =
            (galera.connect(0).await, Arc::new(galera.connect(1).await));
        create_accounts(&loser_node).await;
        galera.wait_for_replication(&[0, 1]).await;
        let inbox = Inbox::new(CONSUMER)
            .unwrap()
            .with_retry(RetryPolicy::default().max_attempts(20));
        for round in 0..ROUNDS {
            let id = Uuid::new_v4();
            let winner_committed = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let outcome = inbox
                .process(&loser_node, id, |txn| {
                    let (winner_node, winner_committed) =
                        (Arc::clone(&winner_node), Arc::clone(&winner_committed));
                    Box::pin(async move {
                        credit(txn, 1).await?;
                        if !winner_committed.swap(true, std::sync::atomic::Ordering::SeqCst) {
                            let winner = winner_node.begin_with_options(CLAIM_TRANSACTION).await?;
                            let claim = winner.claim_message(id, CONSUMER).await;
                            assert!(matches!(claim, Ok(Claim::Claimed(_))), "{claim:?}");
                            winner.commit().await?;
                        }
                        Ok::<_, DbErr>(())
                    })
                })
                .await;
            assert!(
                matches!(outcome, Ok(Outcome::Duplicate)),
                "round {round}: {outcome:?}"
            );
        }
        let retries = inbox.metrics().snapshot().transient_retries;
        println!(
            "Galera 1213 at process's COMMIT: {ROUNDS} rounds, all Duplicate after {retries} \
         transient retries"
        );
        assert!(retries >= ROUNDS as u64, "each round retried at least once");
        let reader = causal_reader(galera, 1).await;
        assert_eq!(
            scalar_i64(&reader, "SELECT balance FROM account WHERE id = 1").await,
            0,
            "no credit of the losing attempts committed"
        );
        assert_eq!(
            scalar_i64(&reader, "SELECT COUNT(*) FROM inbox").await,
            ROUNDS as i64
        );
        reader.close().await.ok();
        loser_node.close().await.ok();
        Arc::try_unwrap(winner_node).unwrap().close().await.ok();
    })
    .await;
}

/// On a Galera node `process` still proves its marker before COMMIT when every statement
/// succeeded (a brute-force abort can end the transaction without failing one); the same
/// handler on a plain MariaDB sends no proof (`observed::clean_handler_commits_without_the_proof`).
/// The server is read once, not per message: 20 calls, 20 proofs, and at most one read of
/// `wsrep_on` per ten seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-galera.sh runs it (--ignored, with INBOX_TEST_GALERA_URLS)"]
async fn clean_process_on_a_galera_node_keeps_the_proof() {
    const CALLS: usize = 20;
    with_galera_db(async |galera| {
        let mut node = galera.connect(0).await;
        create_accounts(&node).await;
        let sent = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let sink = Arc::clone(&sent);
        node.set_metric_callback(move |info| {
            sink.lock()
                .expect("statement log")
                .push(info.statement.sql.clone());
        });
        let inbox = Inbox::new(CONSUMER).unwrap();
        for _ in 0..CALLS {
            let outcome = inbox
                .process(&node, Uuid::new_v4(), |txn| Box::pin(credit(txn, 1)))
                .await;
            assert!(matches!(outcome, Ok(Outcome::Processed(()))), "{outcome:?}");
        }
        let sent = sent.lock().expect("statement log").clone();
        let count = |prefix: &str| sent.iter().filter(|sql| sql.starts_with(prefix)).count();
        assert_eq!(
            count("SELECT 1 FROM inbox WHERE id ="),
            CALLS,
            "one proof per clean call on a Galera node"
        );
        assert!(
            count("SELECT CAST(/*M!100100 @@global.wsrep_on") <= 2,
            "the server's kind is read once per ten seconds, not per call: {sent:?}"
        );
        node.close().await.ok();
    })
    .await;
}

/// One pump iteration on one node: claim the batch, apply exactly the claimed ids through
/// the transaction, commit; stop at the first failed statement, and re-run the whole
/// transaction on a transient failure. Returns the number of transient retries.
async fn claim_apply_commit(db: &DatabaseConnection, ids: &[Uuid], replica: usize) -> u64 {
    for retries in 0..50 {
        let txn = db.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        let batch = match txn.claim_batch(ids.iter().copied(), BATCH_CONSUMER).await {
            Ok(batch) => batch,
            // A brute-force abort between the batch's INSERT and its read-back ends the
            // transaction without failing the read, which then runs on its own: the claim
            // reports the lost batch, and the pump re-runs the whole transaction.
            Err(InboxError::ClaimLost { .. }) => {
                txn.rollback().await.ok();
                continue;
            }
            Err(err) if is_transient(&err) => {
                txn.rollback().await.ok();
                continue;
            }
            Err(err) => panic!("batch claim failed: {err}"),
        };
        let mut applied = Ok(());
        for id in &batch.claimed {
            applied = record_applied(&txn, *id, replica).await;
            if applied.is_err() {
                break;
            }
        }
        if let Err(err) = applied {
            txn.rollback().await.ok();
            assert_eq!(
                classify(&err),
                DbErrorKind::Transient,
                "apply failed: {err}"
            );
            continue;
        }
        match batch.commit(txn).await {
            Ok(()) => return retries,
            Err(InboxError::ClaimLost { .. }) => {}
            Err(err) if is_transient(&err) => {}
            Err(err) => panic!("commit failed: {err}"),
        }
    }
    panic!("50 transient failures in a row");
}

/// Replicas on nodes 0 and 1 race in `rounds` rounds over the same fresh `RACE_POOL` ids:
/// after a barrier, each runs `RACE_BATCHES` batches of `RACE_BATCH` ids drawn at random
/// (seeded by `seed`, the round and the replica) through `apply(pool, batch, replica,
/// round)`, which records what it applies in the `applied` table. Returns the sum of what
/// `apply` returned, and the rows in `applied`, the distinct ids among them and the
/// markers, read causally on node 1.
async fn race_overlapping_batches<A, F>(
    galera: &GaleraDb,
    rounds: usize,
    seed: u64,
    apply: A,
) -> (u64, (i64, i64, i64))
where
    A: Fn(Arc<DatabaseConnection>, Vec<Uuid>, usize, usize) -> F + Clone + Send + 'static,
    F: Future<Output = u64> + Send,
{
    let replicas = [
        Arc::new(galera.connect(0).await),
        Arc::new(galera.connect(1).await),
    ];
    create_applied(&replicas[0]).await;
    galera.wait_for_replication(&[0, 1]).await;
    let mut total = 0;
    for round in 0..rounds {
        let ids: Vec<Uuid> = (0..RACE_POOL).map(|_| Uuid::new_v4()).collect();
        let barrier = Arc::new(Barrier::new(2));
        let tasks: Vec<_> = (0..2)
            .map(|replica| {
                let (conn, barrier) = (Arc::clone(&replicas[replica]), Arc::clone(&barrier));
                let (ids, apply) = (ids.clone(), apply.clone());
                tokio::spawn(async move {
                    let mut rng = XorShift::new((round * 2 + replica) as u64 + seed);
                    barrier.wait().await;
                    let mut sum = 0;
                    for _ in 0..RACE_BATCHES {
                        let batch: Vec<Uuid> = (0..RACE_BATCH)
                            .map(|_| ids[(rng.next_u64() % RACE_POOL as u64) as usize])
                            .collect();
                        sum += apply(Arc::clone(&conn), batch, replica, round).await;
                    }
                    sum
                })
            })
            .collect();
        for task in tasks {
            total += task.await.expect("replica task");
        }
    }
    let reader = causal_reader(galera, 1).await;
    let applied = scalar_i64(&reader, "SELECT COUNT(*) FROM applied").await;
    let distinct = scalar_i64(&reader, "SELECT COUNT(DISTINCT message_id) FROM applied").await;
    let markers = scalar_i64(&reader, "SELECT COUNT(*) FROM inbox").await;
    reader.close().await.ok();
    for replica in replicas {
        replica.as_ref().clone().close().await.ok();
    }
    (total, (applied, distinct, markers))
}

/// Two replicas on two nodes, each committing 15 batches of 60 ids drawn from the same
/// 300 (5 rounds), apply every id exactly once, one marker each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-galera.sh runs it (--ignored, with INBOX_TEST_GALERA_URLS)"]
async fn overlapping_batches_on_two_nodes_apply_every_id_once() {
    let rounds: usize = std::env::var("INBOX_GALERA_BATCH_ROUNDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(5);
    with_galera_db(async |galera| {
        let (retries, (applied, distinct, markers)) =
            race_overlapping_batches(galera, rounds, 7, |conn, batch, replica, _| async move {
                claim_apply_commit(&conn, &batch, replica).await
            })
            .await;
        println!(
            "Galera batch race: {rounds} rounds, {applied} applied rows, {distinct} distinct ids, \
         {markers} markers, {retries} transient retries"
        );
        assert_eq!(
            (applied, markers),
            (distinct, distinct),
            "(applied rows, markers) == distinct applied ids ({retries} transient retries)"
        );
    })
    .await;
}

/// The same race through `Inbox::process_batch`, with a handler that does what
/// `claim_apply_commit` must not: it swallows every failed statement and goes on. The
/// observed transaction refuses every statement after a cross-node abort, so none of them
/// commits on its own, and the attempt is retried: every id applied exactly once, one
/// marker each (a plain loop like this one applied ids twice, see the test below).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-galera.sh runs it (--ignored, with INBOX_TEST_GALERA_URLS)"]
async fn process_batch_going_on_after_aborts_applies_every_id_once() {
    const ROUNDS: usize = 3;
    with_galera_db(async |galera| {
        let inbox = Inbox::new(BATCH_CONSUMER)
            .unwrap()
            .with_retry(RetryPolicy::default().max_attempts(50));
        let handler_inbox = inbox.clone();
        let (_, (applied, distinct, markers)) =
            race_overlapping_batches(galera, ROUNDS, 11, move |conn, batch, replica, round| {
                let inbox = handler_inbox.clone();
                async move {
                    let settled = inbox
                        .process_batch(conn.as_ref(), batch, |txn, claimed| {
                            Box::pin(async move {
                                for id in claimed {
                                    let _ = record_applied(txn, *id, replica).await;
                                }
                                Ok::<_, DbErr>(())
                            })
                        })
                        .await
                        .unwrap_or_else(|err| panic!("round {round}: {err}"));
                    assert_eq!(settled.refused, [], "no admission floor");
                    0
                }
            })
            .await;
        let retries = inbox.metrics().snapshot().transient_retries;
        println!(
            "Galera process_batch race, handler going on after errors: {ROUNDS} rounds, \
         {applied} applied rows, {distinct} distinct ids, {markers} markers, {retries} retries"
        );
        assert_eq!(
            (applied, markers),
            (distinct, distinct),
            "(applied rows, markers) == distinct applied ids"
        );
    })
    .await;
}

/// The trap behind a batch applied twice on Galera: once a cross-node conflict has
/// aborted a transaction, MariaDB has ended it. The statement that meets the abort fails
/// with 1213, and every later statement on that connection runs in autocommit mode and
/// commits on its own, while a plain COMMIT succeeds with nothing to commit. A caller that
/// goes on after the error applies effects without their markers; the ids are claimed
/// again later and applied twice. `BatchClaim::commit` refuses to commit such a batch
/// (`ClaimLost`: nack, never ack), but the statements that already committed on their
/// own stay: stop at the first failed statement (as `claim_apply_commit` does).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-galera.sh runs it (--ignored, with INBOX_TEST_GALERA_URLS)"]
async fn statements_after_a_cross_node_abort_commit_on_their_own() {
    with_galera_db(async |galera| {
        let (loser_node, winner_node) = (galera.connect(0).await, galera.connect(1).await);
        create_applied(&loser_node).await;
        galera.wait_for_replication(&[0, 1]).await;
        let ids: Vec<MessageId> = (0..3)
            .map(|_| MessageId::from_uuid(Uuid::new_v4()))
            .collect();

        let loser = loser_node
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .unwrap();
        let batch = loser
            .claim_batch(ids.clone(), BATCH_CONSUMER)
            .await
            .unwrap();
        assert_eq!(batch.claimed.len(), 3);
        let winner = winner_node
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .unwrap();
        let won = winner
            .claim_batch(ids.clone(), BATCH_CONSUMER)
            .await
            .unwrap();
        assert_eq!(won.claimed.len(), 3, "the other node does not wait");
        winner.commit().await.unwrap();
        // Until the winner's write set is applied on the loser's node, the loser is still open.
        let loser_reader = causal_reader(galera, 0).await;
        scalar_i64(&loser_reader, "SELECT COUNT(*) FROM inbox").await;

        let mut outcomes = Vec::new();
        for id in &batch.claimed {
            outcomes.push(
                record_applied(&loser, *id, 0)
                    .await
                    .map_err(|err| classify(&err)),
            );
        }
        assert_eq!(
            outcomes,
            [Err(DbErrorKind::Transient), Ok(()), Ok(())],
            "the first statement after the abort fails, the next ones run"
        );
        let commit = batch.commit(loser).await;
        assert!(
            matches!(
                commit,
                Err(InboxError::ClaimLost {
                    ref message_ids,
                    source: None,
                    ..
                }) if message_ids.len() == 3
            ),
            "a batch whose markers were rolled back is not committed as if whole: {commit:?}"
        );
        let reader = causal_reader(galera, 1).await;
        assert_eq!(
            scalar_i64(&reader, "SELECT COUNT(*) FROM applied").await,
            2,
            "the two statements after the abort committed on their own"
        );
        assert_eq!(
            scalar_i64(&reader, "SELECT COUNT(*) FROM inbox").await,
            3,
            "only the winner's markers"
        );
        for conn in [loser_node, winner_node, loser_reader, reader] {
            conn.close().await.ok();
        }
    })
    .await;
}

/// Leases across nodes, sequentially: a claim on node 2 while node 1 holds the lease is
/// `Held`; after the expiry node 2 takes over (attempt 2, new token), node 1's late
/// completion is `StaleLease`, node 2's completes. No `wsrep_sync_wait`: a decision made
/// on a stale read always writes the row it read, so certification rejects it when a
/// newer write of that row committed first, and `claim_lease` retries; the only visible
/// staleness is a `Held` right after another node completed (counted, never wrong).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-galera.sh runs it (--ignored, with INBOX_TEST_GALERA_URLS)"]
async fn leases_are_taken_over_across_nodes() {
    const ROUNDS: usize = 10;
    with_galera_db(async |galera| {
        let (first, second) = (galera.connect(0).await, galera.connect(1).await);
        let options = LeaseOptions::new(Duration::from_millis(400)).unwrap();
        let mut stale_held = 0;
        for round in 0..ROUNDS {
            let id = Uuid::new_v4();
            let LeaseClaim::Claimed(crashed) =
                claim_lease(&first, id, "mailer", &options).await.unwrap()
            else {
                panic!("round {round}: a new message is Claimed");
            };
            assert!(
                matches!(
                    claim_lease(&second, id, "mailer", &options).await.unwrap(),
                    LeaseClaim::Held { attempts: 1, .. }
                ),
                "round {round}: the live lease on the other node holds"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
            let LeaseClaim::TakenOver(current) =
                claim_lease(&second, id, "mailer", &options).await.unwrap()
            else {
                panic!("round {round}: the expired lease is taken over");
            };
            assert_eq!(current.attempt(), 2);
            assert_ne!(current.fencing_token(), crashed.fencing_token());
            assert_eq!(current.idempotency_key(), crashed.idempotency_key());
            assert!(
                matches!(
                    crashed.complete(&first).await,
                    Err(InboxError::StaleLease { .. })
                ),
                "round {round}: the crashed claimant cannot finish over the new one"
            );
            current.complete(&second).await.unwrap();
            match claim_lease(&first, id, "mailer", &options).await.unwrap() {
                LeaseClaim::Duplicate => {}
                LeaseClaim::Held { .. } => stale_held += 1,
                other => panic!("round {round}: after completion: {other:?}"),
            }
        }
        println!(
            "Galera leases: {ROUNDS} cross-node takeovers; a claim right after another node's \
         completion read Held (stale) {stale_held} times, Duplicate otherwise"
        );
        for conn in [first, second] {
            conn.close().await.ok();
        }
    })
    .await;
}

/// A completion on one node and a takeover on another, at the same moment after the
/// lease expired: exactly one of them wins, without `wsrep_sync_wait`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-galera.sh runs it (--ignored, with INBOX_TEST_GALERA_URLS)"]
async fn lease_completion_and_takeover_race_across_nodes() {
    const ROUNDS: usize = 30;
    with_galera_db(async |galera| {
        let (first, second) = (
            Arc::new(galera.connect(0).await),
            Arc::new(galera.connect(1).await),
        );
        let options = LeaseOptions::new(Duration::from_millis(100)).unwrap();
        let (mut completed, mut taken_over) = (0, 0);
        for round in 0..ROUNDS {
            let id = Uuid::new_v4();
            let LeaseClaim::Claimed(lease) = claim_lease(&first, id, "mailer", &options).await.unwrap()
            else {
                panic!("round {round}: a new message is Claimed");
            };
            tokio::time::sleep(Duration::from_millis(150)).await;
            let barrier = Arc::new(Barrier::new(2));
            let complete = {
                let (conn, barrier) = (Arc::clone(&first), Arc::clone(&barrier));
                tokio::spawn(async move {
                    barrier.wait().await;
                    lease.complete(&conn).await
                })
            };
            let take_over = {
                let (conn, barrier) = (Arc::clone(&second), Arc::clone(&barrier));
                tokio::spawn(async move {
                    barrier.wait().await;
                    claim_lease(&conn, id, "mailer", &options).await
                })
            };
            let completion = complete.await.unwrap();
            let claim = take_over.await.unwrap().unwrap();
            match (&completion, &claim) {
                (Ok(()), LeaseClaim::Duplicate) => completed += 1,
                (Err(InboxError::StaleLease { .. }), LeaseClaim::TakenOver(_)) => taken_over += 1,
                other => panic!("round {round}: both or neither won: {other:?}"),
            }
        }
        println!(
            "Galera lease race: {ROUNDS} rounds, completion won {completed}, takeover won {taken_over}"
        );
        for conn in [first, second] {
            Arc::try_unwrap(conn).unwrap().close().await.ok();
        }
    })
    .await;
}

/// The soak on a cluster: one replica per node consumes 10,000 messages (30 % delivered
/// twice, the copy a few messages later so replicas on different nodes race; 5 % fail
/// once). At a sixth of the deliveries node 3 rejects queries for a second (1047, what a
/// node outside the primary component answers); at a third it is killed with `kill -9`
/// and restarted (it rejoins by IST). Effects == distinct messages, every message acked,
/// and every database failure was one `process` retries or nacks as transient: no inbox
/// errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-galera.sh runs it (--ignored, with INBOX_TEST_GALERA_URLS)"]
async fn soak_one_replica_per_node_with_a_node_killed() {
    const MESSAGES: usize = 10_000;
    with_galera_db(async |galera| {
        assert_eq!(
            galera.nodes(),
            3,
            "the soak kills node 3 of a 3-node cluster"
        );
        let admin = galera.connect(0).await;
        create_effects(&admin).await;
        galera.wait_for_replication(&[0, 1, 2]).await;
        let plan = Plan::new(MESSAGES, 30, 5, 0x9a1e7a);
        let broker = Broker::new(&plan.deliveries);
        let mut pools = Vec::new();
        for node in 0..3 {
            pools.push(galera.connect(node).await);
        }
        // The cluster is the suite's own (tests/cluster/galera.sh): global settings are ours.
        let node_3_admin = galera.connect_with(2, 1).await;
        let faults = {
            let broker = Arc::clone(&broker);
            let deliveries = plan.deliveries.len() as u64;
            tokio::spawn(async move {
                let acked = |share: u64| {
                    let broker = Arc::clone(&broker);
                    async move {
                        while broker.stats().acks < deliveries / share {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        broker.stats().acks
                    }
                };
                let acks_at_reject = acked(6).await;
                run(&node_3_admin, "SET GLOBAL wsrep_reject_queries = ALL").await;
                tokio::time::sleep(Duration::from_secs(1)).await;
                run(&node_3_admin, "SET GLOBAL wsrep_reject_queries = NONE").await;
                node_3_admin.close().await.ok();
                let acks_at_kill = acked(3).await;
                let killed = tokio::task::spawn_blocking(|| galera_script(&["kill", "3"]))
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_secs(2)).await;
                let restarted = tokio::task::spawn_blocking(|| galera_script(&["restart", "3"]))
                    .await
                    .unwrap();
                format!(
                    "node 3 rejected queries for 1 s at {acks_at_reject} acks; {} at \
                 {acks_at_kill} acks; {}",
                    killed.trim(),
                    restarted.trim()
                )
            })
        };
        let report = run_replicas_on(pools, &broker, &plan, Duration::from_secs(300)).await;
        let faults = faults
            .await
            .expect("node 3 rejected queries, was killed and restarted");
        println!("Galera soak, 3 replicas (one per node): {report}; {faults}");
        let reader = causal_reader(galera, 0).await;
        assert_exactly_once(&reader, &plan, &report).await;
        assert_eq!(
            report.inbox_errors, 0,
            "every failure the faults caused is transient: {report}"
        );
        for conn in [admin, reader] {
            conn.close().await.ok();
        }
    })
    .await;
}
