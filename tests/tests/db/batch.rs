//! Batch claims: one statement, in the caller's transaction;
//! replicas with their own pools claiming overlapping batches get disjoint winners whose
//! union is every id exactly once.

use inbox_tests::{
    Backend, on_every_backend, on_pgbouncer, run, scalar, scalar_i64, with_migrated_db,
};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, Statement, TransactionTrait,
};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{DbErrorKind, MAX_CLAIM_BATCH, classify};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::Barrier;
use uuid::Uuid;

const CONSUMER: &str = "projector";

/// What a committed batch claim won and found done (a `BatchClaim` is consumed by its
/// commit).
struct Committed {
    claimed: Vec<MessageId>,
    already_claimed: Vec<MessageId>,
}

/// One pump iteration: claim the batch, commit; a transient failure (deadlock) re-runs the
/// whole transaction, as retry loops at the pump level must.
async fn claim_and_commit(db: &DatabaseConnection, ids: &[Uuid]) -> Committed {
    for _ in 0..20 {
        let txn = db.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        match txn.claim_batch(ids.iter().copied(), CONSUMER).await {
            Ok(batch) => {
                let claimed = Committed {
                    claimed: batch.claimed.clone(),
                    already_claimed: batch.duplicates.clone(),
                };
                batch
                    .commit(txn)
                    .await
                    .unwrap_or_else(|err| panic!("commit of a claimed batch failed: {err:?}"));
                return claimed;
            }
            Err(err)
                if err
                    .db_err()
                    .is_some_and(|db| classify(db) == DbErrorKind::Transient) =>
            {
                txn.rollback().await.ok();
            }
            Err(err) => panic!("batch claim failed: {err}"),
        }
    }
    panic!("20 transient failures in a row");
}

async fn overlapping_batches_from_two_replicas_have_disjoint_winners(backend: Backend) {
    // 30 rounds: ON DUPLICATE KEY UPDATE id = id lost ids on MariaDB in ~40% of 10-round runs.
    // On MariaDB 10.5+ this runs the RETURNING path of the MySQL family (the INSERT returns
    // every id's row, written now or met); MySQL 8 reads them back with SELECT ... FOR UPDATE.
    const ROUNDS: usize = 30;
    with_migrated_db(backend, async |db| {
        let replicas = [Arc::new(db.connect().await), Arc::new(db.connect().await)];
        for round in 0..ROUNDS {
            let ids: Vec<Uuid> = (0..60).map(|_| Uuid::new_v4()).collect();
            // A takes 0..40 in order, B takes 20..60 reversed: 20 ids overlap.
            let a: Vec<Uuid> = ids[..40].to_vec();
            let b: Vec<Uuid> = ids[20..].iter().rev().copied().collect();
            let barrier = Arc::new(Barrier::new(2));
            let tasks: Vec<_> = [(0, a), (1, b)]
                .into_iter()
                .map(|(replica, batch)| {
                    let (replica, barrier) = (Arc::clone(&replicas[replica]), Arc::clone(&barrier));
                    tokio::spawn(async move {
                        barrier.wait().await;
                        claim_and_commit(&replica, &batch).await
                    })
                })
                .collect();
            let mut results = Vec::new();
            for task in tasks {
                results.push(task.await.expect("replica task"));
            }
            let won: Vec<BTreeSet<Uuid>> = results
                .iter()
                .map(|r| r.claimed.iter().map(|id| id.as_uuid()).collect())
                .collect();
            assert!(
                won[0].is_disjoint(&won[1]),
                "round {round} on {backend:?}: no id won twice"
            );
            let union: BTreeSet<Uuid> = won[0].union(&won[1]).copied().collect();
            assert_eq!(
                union,
                ids.iter().copied().collect(),
                "round {round} on {backend:?}: every id won once"
            );
            for result in &results {
                assert_eq!(result.claimed.len() + result.already_claimed.len(), 40);
            }
        }
        assert_eq!(
            scalar_i64(replicas[0].as_ref(), "SELECT COUNT(*) FROM inbox").await,
            (ROUNDS * 60) as i64
        );
        for replica in replicas {
            replica.as_ref().clone().close().await.ok();
        }
    })
    .await;
}

async fn batch_reports_new_and_old_ids_and_rolls_back_with_the_transaction(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let mut ids: Vec<MessageId> = (0..5)
            .map(|_| MessageId::from_uuid(Uuid::new_v4()))
            .collect();
        ids.sort();

        // A one-phase claim of ids[1] commits first.
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        assert!(
            txn.claim_message(ids[1], CONSUMER)
                .await
                .unwrap()
                .is_claimed()
        );
        txn.commit().await.unwrap();

        // A batch that rolls back leaves nothing behind.
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        let batch = txn.claim_batch([ids[0], ids[2]], CONSUMER).await.unwrap();
        assert_eq!(batch.claimed, [ids[0], ids[2]]);
        txn.rollback().await.unwrap();

        // Duplicates inside the batch collapse; the transaction stays usable after conflicts.
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        let mut input = ids.clone();
        input.extend(ids.iter().rev().copied());
        let batch = txn.claim_batch(input, CONSUMER).await.unwrap();
        let expected: Vec<MessageId> = ids.iter().copied().filter(|id| *id != ids[1]).collect();
        assert_eq!(batch.claimed, expected);
        assert_eq!(batch.duplicates, [ids[1]]);
        assert!(batch.is_claimed(ids[0]) && !batch.is_claimed(ids[1]));
        assert!(
            txn.claim_message(Uuid::new_v4(), CONSUMER)
                .await
                .unwrap()
                .is_claimed(),
            "the transaction still works after the conflicting row"
        );
        txn.commit().await.unwrap();
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 6);

        // Another consumer claims the same ids independently.
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        let other = txn.claim_batch(ids.clone(), "auditor").await.unwrap();
        assert_eq!(other.claimed, ids);
        txn.commit().await.unwrap();
    })
    .await;
}

async fn bad_batches_are_refused_before_any_sql(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        let none: Vec<Uuid> = Vec::new();
        assert!(matches!(
            txn.claim_batch(none, CONSUMER).await,
            Err(InboxError::EmptyBatch)
        ));
        assert!(matches!(
            txn.claim_batch([Uuid::new_v4(), Uuid::nil()], CONSUMER)
                .await,
            Err(InboxError::NilMessageId)
        ));
        assert!(matches!(
            txn.claim_batch([Uuid::new_v4()], "").await,
            Err(InboxError::EmptyConsumer)
        ));
        assert!(matches!(
            txn.claim_batch([Uuid::new_v4()], &"x".repeat(201)).await,
            Err(InboxError::ConsumerTooLong { chars: 201 })
        ));
        let too_many: Vec<Uuid> = (0..=MAX_CLAIM_BATCH).map(|_| Uuid::new_v4()).collect();
        assert!(matches!(
            txn.claim_batch(too_many, CONSUMER).await,
            Err(InboxError::BatchTooLarge { .. })
        ));
        // The largest batch accepted works in one statement.
        let largest: Vec<Uuid> = (0..MAX_CLAIM_BATCH).map(|_| Uuid::new_v4()).collect();
        let batch = txn.claim_batch(largest, CONSUMER).await.unwrap();
        assert_eq!(batch.claimed.len(), MAX_CLAIM_BATCH);
        txn.commit().await.unwrap();
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await,
            MAX_CLAIM_BATCH as i64
        );
    })
    .await;
}

/// With an extra unique index on the inbox (added by an application, say), a batch row can
/// conflict on that index instead of the inbox's. The batch must then fail: reporting the
/// id as `already_claimed` would ack a message nobody processed. Returns the batch's result
/// and leaves the database as it was.
async fn batch_meeting_another_unique_index(
    backend: Backend,
    index_sql: &str,
    committed_before: Option<(Uuid, &str)>,
    batch: [Uuid; 2],
) -> Result<BatchClaim, InboxError> {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        run(&conn, index_sql).await;
        if let Some((id, consumer)) = committed_before {
            let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
            assert!(txn.claim_message(id, consumer).await.unwrap().is_claimed());
            txn.commit().await.unwrap();
        }
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        let result = txn.claim_batch(batch, CONSUMER).await;
        txn.rollback().await.unwrap();
        result
    })
    .await
}

/// Another consumer's row of the same message sits on a unique index of `message_id`
/// alone: MariaDB's `ON DUPLICATE KEY` used to return that row, and the batch called the id
/// already claimed for this consumer.
async fn another_consumers_row_on_another_key_fails_the_batch(backend: Backend) {
    let (taken, free) = (Uuid::new_v4(), Uuid::new_v4());
    let result = batch_meeting_another_unique_index(
        backend,
        "CREATE UNIQUE INDEX ux_test_message_only ON inbox (message_id)",
        Some((taken, "auditor")),
        [taken, free],
    )
    .await;
    assert!(
        result.is_err(),
        "{backend:?}: the row of consumer \"auditor\" is no claim of {CONSUMER}: {result:?}"
    );
}

/// Both rows of one batch share `received_at`, so with a unique index on it the second row
/// conflicts with the first: MariaDB's `ON DUPLICATE KEY` used to return the first row twice
/// and the batch called the second id already claimed.
async fn two_rows_of_the_batch_colliding_on_another_key_fail_the_batch(backend: Backend) {
    let result = batch_meeting_another_unique_index(
        backend,
        "CREATE UNIQUE INDEX ux_test_received_once ON inbox (received_at)",
        None,
        [Uuid::new_v4(), Uuid::new_v4()],
    )
    .await;
    assert!(
        result.is_err(),
        "{backend:?}: the second id was never written: {result:?}"
    );
}

/// `BatchClaim::commit` returns `Ok` only when the batch's markers committed. A caller
/// that ignores a failed statement: PostgreSQL has aborted the transaction (and a plain
/// COMMIT would answer ROLLBACK without an error), so the commit is refused; MySQL/MariaDB
/// and SQLite keep the transaction after an ordinary failed statement, so it commits. (The
/// Galera suite shows the MariaDB case where the server ends the transaction.)
async fn batch_commit_is_ok_only_when_the_markers_committed(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        let batch = txn
            .claim_batch([Uuid::new_v4(), Uuid::new_v4()], CONSUMER)
            .await
            .unwrap();
        assert_eq!(batch.claimed.len(), 2);
        txn.execute_unprepared("SELECT * FROM no_such_table")
            .await
            .expect_err("a statement that fails, and that the caller ignores");
        let committed = batch.commit(txn).await;
        let markers = scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await;
        match committed {
            Ok(()) => assert_eq!(markers, 2, "Ok means both markers committed"),
            Err(err) => {
                assert!(
                    matches!(err, InboxError::ClaimLost { ref message_ids, .. } if message_ids.len() == 2),
                    "{err}"
                );
                assert_eq!(markers, 0, "refused: nothing committed");
            }
        }
        assert_eq!(
            markers == 0,
            backend == Backend::Postgres,
            "only PostgreSQL aborts the transaction at a failed statement"
        );
    })
    .await;
}

/// Whether the server runs `INSERT ... RETURNING` on the MySQL family: MariaDB 10.5+
/// (MySQL 8 has none). Read from `VERSION()`, e.g. `10.11.19-MariaDB-0+deb12u1`.
async fn mysql_server_returns_rows(conn: &DatabaseConnection) -> bool {
    let version: String = scalar(conn, "SELECT CAST(VERSION() AS CHAR)").await;
    let numbers: Vec<u32> = version
        .split(|c: char| !c.is_ascii_digit())
        .take(2)
        .map(|n| n.parse().unwrap())
        .collect();
    version.contains("MariaDB") && numbers >= vec![10, 5]
}

/// A batch claim is one statement wherever the server returns the rows its INSERT wrote
/// or met (PostgreSQL and SQLite: `ON CONFLICT DO NOTHING RETURNING`; MariaDB 10.5+: `ON
/// DUPLICATE KEY UPDATE ... RETURNING`), and two on MySQL 8, which reads them back.
/// Counted on the wire, with ids claimed before in the batch. (MariaDB ran two until the
/// RETURNING form was taken there: a round trip and an index probe per id more.)
async fn a_batch_claim_is_one_statement_where_the_server_returns_its_rows(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let mut conn = db.connect().await;
        let statements = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&statements);
        conn.set_metric_callback(move |info| {
            if info.statement.sql.contains("inbox") {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        });
        let mut ids: Vec<MessageId> = (0..6)
            .map(|_| MessageId::from_uuid(Uuid::new_v4()))
            .collect();
        ids.sort();
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        for &id in &ids[..2] {
            assert!(txn.claim_message(id, CONSUMER).await.unwrap().is_claimed());
        }
        txn.commit().await.unwrap();

        let expected = match backend {
            Backend::MySql if !mysql_server_returns_rows(&conn).await => 2,
            _ => 1,
        };
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        statements.store(0, Ordering::Relaxed);
        let batch = txn.claim_batch(ids.clone(), CONSUMER).await.unwrap();
        assert_eq!(statements.load(Ordering::Relaxed), expected, "{backend:?}");
        assert_eq!(batch.duplicates, ids[..2]);
        assert_eq!(batch.claimed, ids[2..]);
        batch.commit(txn).await.unwrap();
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 6);
    })
    .await;
}

/// What the server sent on this transaction's connection so far (`Bytes_sent`). The read's
/// own traffic (its savepoint, statement and reply) is the same each time: the caller
/// measures it and takes it off.
async fn bytes_sent(txn: &DatabaseTransaction) -> i64 {
    scalar_i64(
        txn,
        "SELECT CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.SESSION_STATUS \
         WHERE VARIABLE_NAME = 'BYTES_SENT'",
    )
    .await
}

/// The best hand-written batch INSERT on MariaDB, tagged, returning message_id and the tag
/// of each of `ids`' rows: how many came back.
async fn hand_written_batch(txn: &DatabaseTransaction, ids: Vec<Uuid>) -> usize {
    let rows = vec!["(?, ?, NOW(6), ?)"; ids.len()].join(", ");
    let sql = format!(
        "INSERT INTO inbox (message_id, consumer, received_at, claim_token) VALUES {rows} \
         ON DUPLICATE KEY UPDATE consumer = consumer RETURNING message_id, claim_token"
    );
    let tag = Uuid::new_v4();
    let values: Vec<sea_orm::Value> = ids
        .into_iter()
        .flat_map(|id| [id.into(), CONSUMER.into(), tag.into()])
        .collect();
    let statement = Statement::from_sql_and_values(txn.get_database_backend(), sql, values);
    txn.query_all_raw(statement).await.unwrap().len()
}

/// On MariaDB the batch's INSERT returns no more than the hand-written one that returns
/// message_id and the tag only: the consumer of every row it wrote stays on the server (it
/// sent a copy per id, a quarter of what the batch received per id, before it came back
/// as NULL wherever it is the batch's own). Counted by the server's `Bytes_sent`; the
/// third column's definition is the allowance.
async fn a_batch_claim_sends_back_no_consumer_it_wrote(backend: Backend) {
    const IDS: usize = 50;
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        if !mysql_server_returns_rows(&conn).await {
            return;
        }
        let fresh = || (0..IDS).map(|_| Uuid::new_v4()).collect::<Vec<_>>();
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        // Both statements prepared first.
        let warm = txn.claim_batch(fresh(), CONSUMER).await.unwrap();
        assert_eq!(warm.claimed.len(), IDS);
        assert_eq!(hand_written_batch(&txn, fresh()).await, IDS);
        let before = bytes_sent(&txn).await;
        let read = bytes_sent(&txn).await - before;
        let batch = txn.claim_batch(fresh(), CONSUMER).await.unwrap();
        assert_eq!(batch.claimed.len(), IDS);
        let after_batch = bytes_sent(&txn).await;
        assert_eq!(hand_written_batch(&txn, fresh()).await, IDS);
        let after_hand = bytes_sent(&txn).await;
        let ours = after_batch - before - 2 * read;
        let hand = after_hand - after_batch - read;
        assert!(
            ours <= hand + 64,
            "the batch INSERT of {IDS} ids sent {ours} bytes, the hand-written one {hand}"
        );
        txn.rollback().await.unwrap();
    })
    .await;
}

/// MariaDB only: the server's byte count is the evidence.
mod returned_bytes {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
    async fn mysql() {
        a_batch_claim_sends_back_no_consumer_it_wrote(Backend::MySql).await;
    }
}

on_every_backend!(
    a_batch_claim_is_one_statement_where_the_server_returns_its_rows,
    batch_commit_is_ok_only_when_the_markers_committed,
    another_consumers_row_on_another_key_fails_the_batch,
    two_rows_of_the_batch_colliding_on_another_key_fail_the_batch,
    overlapping_batches_from_two_replicas_have_disjoint_winners,
    batch_reports_new_and_old_ids_and_rolls_back_with_the_transaction,
    bad_batches_are_refused_before_any_sql,
);

on_pgbouncer!(
    overlapping_batches_from_two_replicas_have_disjoint_winners,
    batch_reports_new_and_old_ids_and_rolls_back_with_the_transaction,
    bad_batches_are_refused_before_any_sql,
);
