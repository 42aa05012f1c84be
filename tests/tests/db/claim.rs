//! Claims: overlap, all-or-nothing, discrimination, fan-out to several
//! consumers, the bypass trap, bad input, and what a transaction may do after `Duplicate`.

use inbox_tests::{
    Backend, create_accounts, credit, credit_once, on_every_backend, on_pgbouncer, run, scalar_i64,
    stmt, with_fresh_db, with_migrated_db,
};
use sea_orm::{ConnectionTrait, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{DbErrorKind, classify};
use std::time::Duration;
use uuid::Uuid;

const CONSUMER: &str = "billing.credit";

async fn claim_in_new_txn(db: &sea_orm::DatabaseConnection, id: Uuid, consumer: &str) -> Claim {
    let txn = db
        .begin_with_options(CLAIM_TRANSACTION)
        .await
        .expect("begin");
    let claim = txn.claim_message(id, consumer).await.expect("claim");
    if claim.is_claimed() {
        txn.commit().await.expect("commit");
    } else {
        txn.rollback().await.expect("rollback");
    }
    claim
}

/// A holds the claim in an open transaction; B's claim (its own pool) must wait for A,
/// then learn A's outcome.
async fn overlap(backend: Backend, a_commits: bool) -> Claim {
    with_migrated_db(backend, async |db| {
        let replica_a = db.connect().await;
        let replica_b = db.connect().await;
        let id = Uuid::new_v4();

        let txn_a = replica_a
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin A");
        assert!(
            txn_a
                .claim_message(id, CONSUMER)
                .await
                .expect("claim A")
                .is_claimed()
        );

        let b = tokio::spawn(async move {
            let txn_b = replica_b
                .begin_with_options(CLAIM_TRANSACTION)
                .await
                .expect("begin B");
            let claim = txn_b.claim_message(id, CONSUMER).await.expect("claim B");
            if claim.is_claimed() {
                txn_b.commit().await.expect("commit B");
            }
            claim
        });
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            !b.is_finished(),
            "B must block while A holds the claim on {backend:?}"
        );

        if a_commits {
            txn_a.commit().await.expect("commit A");
        } else {
            txn_a.rollback().await.expect("rollback A");
        }
        let outcome = tokio::time::timeout(Duration::from_secs(20), b)
            .await
            .expect("B unblocks once A ends")
            .expect("B's task");

        let conn = db.connect().await;
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 1);
        outcome
    })
    .await
}

async fn blocked_claim_sees_duplicate_after_commit(backend: Backend) {
    assert!(overlap(backend, true).await.is_duplicate());
}

async fn blocked_claim_wins_after_rollback(backend: Backend) {
    assert!(overlap(backend, false).await.is_claimed());
}

async fn failed_business_write_leaves_no_marker(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let id = Uuid::new_v4();

        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        assert!(
            txn.claim_message(id, CONSUMER)
                .await
                .expect("claim")
                .is_claimed()
        );
        credit(&txn, 10).await.expect("credit");
        let failed = run_fallible(&txn, "INSERT INTO account (id, balance) VALUES (1, 0)").await;
        assert!(
            failed.is_err(),
            "the business write fails on the account's primary key"
        );
        drop(txn); // a handler error: the transaction goes out of scope and rolls back

        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await,
            0,
            "no marker survives"
        );
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            0
        );

        assert!(
            claim_in_new_txn(&conn, id, CONSUMER).await.is_claimed(),
            "the redelivery wins"
        );
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 1);
    })
    .await;
}

async fn run_fallible(
    conn: &impl sea_orm::ConnectionTrait,
    sql: &str,
) -> Result<(), sea_orm::DbErr> {
    conn.execute_unprepared(sql).await.map(|_| ())
}

async fn other_unique_violations_are_errors_not_duplicates(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        run(
            &conn,
            "CREATE TABLE orders (id BIGINT PRIMARY KEY, order_no VARCHAR(40) NOT NULL)",
        )
        .await;
        run(
            &conn,
            "CREATE UNIQUE INDEX ux_orders_order_no ON orders (order_no)",
        )
        .await;
        // A look-alike of the inbox: same column names, its own unique index.
        run(&conn, "CREATE TABLE processed_message (message_id VARCHAR(36) NOT NULL, consumer VARCHAR(200) NOT NULL)").await;
        run(
            &conn,
            "CREATE UNIQUE INDEX ux_processed_message ON processed_message (message_id, consumer)",
        )
        .await;

        for duplicate_write in [
            "INSERT INTO orders (id, order_no) VALUES (2, 'A-1')",
            "INSERT INTO orders (id, order_no) VALUES (1, 'A-2')",
            "INSERT INTO processed_message (message_id, consumer) VALUES ('m-1', 'billing.credit')",
        ] {
            run(&conn, "DELETE FROM orders").await;
            run(&conn, "DELETE FROM processed_message").await;
            run(&conn, "INSERT INTO orders (id, order_no) VALUES (1, 'A-1')").await;
            run(
                &conn,
                "INSERT INTO processed_message (message_id, consumer) VALUES ('m-1', 'billing.credit')",
            )
            .await;

            let txn = conn
                .begin_with_options(CLAIM_TRANSACTION)
                .await
                .expect("begin");
            assert!(
                txn.claim_message(Uuid::new_v4(), CONSUMER)
                    .await
                    .expect("claim")
                    .is_claimed()
            );
            let err = run_fallible(&txn, duplicate_write)
                .await
                .expect_err("unique violation");
            assert_eq!(
                classify(&err),
                DbErrorKind::OtherUniqueViolation,
                "{duplicate_write} on {backend:?}: {err}"
            );
            assert!(!is_inbox_duplicate(&err));
            drop(txn);
        }

        // A second unique index on the inbox itself: claim_message must surface it as an error.
        run(
            &conn,
            "CREATE UNIQUE INDEX ux_inbox_message_only ON inbox (message_id)",
        )
        .await;
        let id = Uuid::new_v4();
        assert!(
            claim_in_new_txn(&conn, id, "first-consumer")
                .await
                .is_claimed()
        );
        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let result = txn.claim_message(id, "second-consumer").await;
        if let Err(err) = &result {
            let message = err.to_string();
            assert!(
                message.contains("not a duplicate delivery") && message.contains("fix the handler"),
                "the error says what to do: {message}"
            );
        }
        match result {
            Err(InboxError::Database {
                message_id,
                consumer,
                source,
            }) => {
                assert_eq!(message_id, MessageId::from(id));
                assert_eq!(consumer, "second-consumer");
                assert_eq!(
                    classify(&source),
                    DbErrorKind::OtherUniqueViolation,
                    "{source}"
                );
            }
            other => panic!("expected InboxError::Database on {backend:?}, got {other:?}"),
        }
        drop(txn);
    })
    .await;
}

async fn each_consumer_claims_the_same_message(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let id = Uuid::new_v4();
        for consumer in ["billing.credit", "email.receipt", "analytics"] {
            assert!(
                claim_in_new_txn(&conn, id, consumer).await.is_claimed(),
                "{consumer}"
            );
        }
        assert!(
            claim_in_new_txn(&conn, id, "email.receipt")
                .await
                .is_duplicate()
        );
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 3);
    })
    .await;
}

/// Consumer names are compared exactly on every backend: MySQL's default case-insensitive
/// collation would make "Billing" skip every message "billing" processed.
async fn consumer_names_differing_in_case_are_distinct(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let id = Uuid::new_v4();
        for consumer in ["billing", "Billing", "BILLING", "billing-é", "billing-e"] {
            assert!(
                claim_in_new_txn(&conn, id, consumer).await.is_claimed(),
                "{consumer} on {backend:?}"
            );
        }
        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        assert!(matches!(
            txn.claim_message(id, "billing ").await,
            Err(InboxError::ConsumerNotTrimmed { .. })
        ));
        drop(txn);
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 5);
    })
    .await;
}

/// The trap this crate cannot close for you: a write sent to the pool instead of the
/// transaction commits on its own, so a duplicate still moves the money.
async fn write_through_the_pool_bypasses_the_claim(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let pool = db.connect().await;
        // The handler's `db` handle; a pool of its own, since SQLite pools hold one connection.
        let bypass = db.connect().await;
        create_accounts(&pool).await;
        let id = Uuid::new_v4();

        for delivery in 1..=2 {
            let txn = pool.begin().await.expect("begin");
            credit(&bypass, 10)
                .await
                .expect("credit through the pool: the bug");
            let claim = txn.claim_message(id, CONSUMER).await.expect("claim");
            match delivery {
                1 => {
                    assert!(claim.is_claimed());
                    txn.commit().await.expect("commit");
                }
                _ => {
                    assert!(claim.is_duplicate(), "the duplicate is detected...");
                    txn.rollback().await.expect("rollback");
                }
            }
        }
        assert_eq!(scalar_i64(&pool, "SELECT COUNT(*) FROM inbox").await, 1);
        assert_eq!(
            scalar_i64(&pool, "SELECT balance FROM account WHERE id = 1").await,
            20,
            "...and the money still moved twice: handlers must write through `txn`"
        );
    })
    .await;
}

async fn bad_input_is_refused_before_any_sql(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let long = "c".repeat(201);
        assert!(matches!(
            txn.claim_message(Uuid::new_v4(), "").await,
            Err(InboxError::EmptyConsumer)
        ));
        assert!(matches!(
            txn.claim_message(Uuid::new_v4(), "   ").await,
            Err(InboxError::EmptyConsumer)
        ));
        assert!(matches!(
            txn.claim_message(Uuid::new_v4(), &long).await,
            Err(InboxError::ConsumerTooLong { chars: 201 })
        ));
        assert!(matches!(
            txn.claim_message(Uuid::nil(), CONSUMER).await,
            Err(InboxError::NilMessageId)
        ));
        // No statement failed, so the transaction is still usable and commits nothing.
        assert!(
            txn.claim_message(Uuid::new_v4(), &"c".repeat(200))
                .await
                .expect("200 chars fit")
                .is_claimed()
        );
        txn.commit().await.expect("commit");
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await,
            1,
            "only the valid claim was written"
        );
    })
    .await;
}

async fn missing_table_says_to_run_the_migration(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let err = txn
            .claim_message(Uuid::new_v4(), CONSUMER)
            .await
            .expect_err("no table");
        assert!(matches!(err, InboxError::MissingTable { .. }), "{err:?}");
        assert!(
            err.to_string()
                .contains("sea_orm_inbox_migration::CreateInbox"),
            "{err}"
        );
        drop(txn);
    })
    .await;
}

/// After `Duplicate` the handler must roll back: the transaction stays usable on every
/// backend (PostgreSQL's claim raises nothing), so only the rollback undoes a write made
/// after it.
async fn after_duplicate_the_transaction_must_roll_back(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let id = Uuid::new_v4();
        assert!(claim_in_new_txn(&conn, id, CONSUMER).await.is_claimed());

        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        assert!(
            txn.claim_message(id, CONSUMER)
                .await
                .expect("claim")
                .is_duplicate()
        );
        credit(&txn, 10)
            .await
            .expect("the transaction is still usable after Duplicate");
        txn.rollback().await.expect("rollback after Duplicate");
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            0
        );
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 1);
    })
    .await;
}

on_every_backend!(
    blocked_claim_sees_duplicate_after_commit,
    blocked_claim_wins_after_rollback,
    failed_business_write_leaves_no_marker,
    other_unique_violations_are_errors_not_duplicates,
    each_consumer_claims_the_same_message,
    consumer_names_differing_in_case_are_distinct,
    write_through_the_pool_bypasses_the_claim,
    bad_input_is_refused_before_any_sql,
    missing_table_says_to_run_the_migration,
    after_duplicate_the_transaction_must_roll_back,
);

on_pgbouncer!(
    blocked_claim_sees_duplicate_after_commit,
    blocked_claim_wins_after_rollback,
    failed_business_write_leaves_no_marker,
    other_unique_violations_are_errors_not_duplicates,
    each_consumer_claims_the_same_message,
    consumer_names_differing_in_case_are_distinct,
    bad_input_is_refused_before_any_sql,
    missing_table_says_to_run_the_migration,
    after_duplicate_the_transaction_must_roll_back,
);

/// MariaDB's 1062 names the violated key but not its table, and `CREATE TABLE ... LIKE
/// inbox` copies the inbox's index name. With a trigger archiving every marker into such a
/// table, a claim whose pair the archive already holds fails there: no marker is written,
/// so the claim is an error (nack), never `Duplicate` (ack, and the message never
/// processed). A real duplicate with the trigger in place is still `Duplicate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
async fn mysql_namesake_of_the_inbox_index_on_another_table_is_not_a_duplicate() {
    with_migrated_db(Backend::MySql, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        run(&conn, "CREATE TABLE inbox_archive LIKE inbox").await;
        run(
            &conn,
            "CREATE TRIGGER inbox_archived AFTER INSERT ON inbox FOR EACH ROW \
         INSERT INTO inbox_archive (message_id, consumer, received_at) \
         VALUES (NEW.message_id, NEW.consumer, NEW.received_at)",
        )
        .await;
        let archived = Uuid::new_v4();
        let txn = conn.begin().await.expect("begin");
        txn.execute_raw(stmt(
            sea_orm::DbBackend::MySql,
            "INSERT INTO inbox_archive (message_id, consumer, received_at) VALUES (?, ?, NOW(6))",
            vec![archived.into(), CONSUMER.into()],
        ))
        .await
        .expect("archive the pair");
        txn.commit().await.expect("commit the archive row");

        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let claim = txn.claim_message(archived, CONSUMER).await;
        txn.rollback().await.expect("rollback");
        match &claim {
            Err(err @ InboxError::Database { .. }) => {
                let message = err.to_string();
                assert!(
                    message.contains("not a duplicate delivery")
                        && message.contains("another table"),
                    "the error says what happened and what to do: {message}"
                );
            }
            other => panic!("the archive's violation is no duplicate: {other:?}"),
        }

        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let processed = credit_once(&inbox, &conn, archived).await;
        assert!(
            matches!(
                processed,
                Err(ProcessError::Inbox(InboxError::Database { .. }))
            ),
            "{processed:?}"
        );
        assert_eq!(Settlement::of(&processed), Settlement::DeadLetter);
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 0);
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            0
        );

        let fresh = Uuid::new_v4();
        let first = credit_once(&inbox, &conn, fresh).await;
        assert!(matches!(first, Ok(Outcome::Processed(()))), "{first:?}");
        let again = credit_once(&inbox, &conn, fresh).await;
        assert!(matches!(again, Ok(Outcome::Duplicate)), "{again:?}");
        assert_eq!(
            claim_in_new_txn(&conn, fresh, CONSUMER).await,
            Claim::Duplicate
        );
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            1
        );
    })
    .await;
}

/// The public classifier on the same fixture: MariaDB's 1062 names the key, not its table,
/// so `classify` / `is_inbox_duplicate` cannot prove a violation of
/// `ix_inbox_message_id_consumer` is the inbox's. They never answer `InboxDuplicate` for
/// it, neither for the archive's namesake (the trigger's copy) nor, unproven, for the
/// inbox's own: `PossibleInboxDuplicate`, still permanent, for the caller to confirm.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
async fn mysql_classifier_never_calls_a_namesake_violation_an_inbox_duplicate() {
    with_migrated_db(Backend::MySql, async |db| {
        let conn = db.connect().await;
        run(&conn, "CREATE TABLE inbox_archive LIKE inbox").await;
        run(
            &conn,
            "CREATE TRIGGER inbox_archived AFTER INSERT ON inbox FOR EACH ROW \
         INSERT INTO inbox_archive (message_id, consumer, received_at) \
         VALUES (NEW.message_id, NEW.consumer, NEW.received_at)",
        )
        .await;
        let insert = |table: &str, id: Uuid| {
            stmt(
                sea_orm::DbBackend::MySql,
                &format!(
                    "INSERT INTO {table} (message_id, consumer, received_at) VALUES (?, ?, NOW(6))"
                ),
                vec![id.into(), CONSUMER.into()],
            )
        };
        let archived = Uuid::new_v4();
        conn.execute_raw(insert("inbox_archive", archived))
            .await
            .expect("archive the pair");
        let namesake = conn
            .execute_raw(insert("inbox", archived))
            .await
            .expect_err("the trigger's copy violates the archive's index");
        assert!(!is_inbox_duplicate(&namesake), "{namesake}");
        assert_eq!(
            classify(&namesake),
            DbErrorKind::PossibleInboxDuplicate,
            "{namesake}"
        );
        assert!(classify(&namesake).is_permanent());
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 0);

        run(&conn, "DROP TRIGGER inbox_archived").await;
        let marked = Uuid::new_v4();
        conn.execute_raw(insert("inbox", marked))
            .await
            .expect("the marker");
        let duplicate = conn
            .execute_raw(insert("inbox", marked))
            .await
            .expect_err("the inbox's own violation");
        assert!(!is_inbox_duplicate(&duplicate), "unproven: {duplicate}");
        assert_eq!(
            classify(&duplicate),
            DbErrorKind::PossibleInboxDuplicate,
            "{duplicate}"
        );
    })
    .await;
}

/// The read that confirms a MariaDB duplicate must see a marker committed after the
/// claiming transaction took its snapshot (here by an earlier read in it): a plain SELECT
/// under REPEATABLE READ would not, and would turn a real duplicate into an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
async fn mysql_duplicate_newer_than_the_transactions_snapshot_is_a_duplicate() {
    with_migrated_db(Backend::MySql, async |db| {
        let conn = db.connect().await;
        let other_replica = db.connect().await;
        let id = Uuid::new_v4();
        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        assert_eq!(scalar_i64(&txn, "SELECT COUNT(*) FROM inbox").await, 0);
        assert!(
            claim_in_new_txn(&other_replica, id, CONSUMER)
                .await
                .is_claimed()
        );
        let claim = txn.claim_message(id, CONSUMER).await;
        txn.rollback().await.expect("rollback");
        assert!(matches!(claim, Ok(Claim::Duplicate)), "{claim:?}");
    })
    .await;
}
