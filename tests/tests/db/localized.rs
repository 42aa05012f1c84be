//! A MariaDB server that speaks German (or French, or Japanese...) still has duplicates
//! recognised as duplicates, other unique violations as other unique violations, and a
//! missing inbox table as a missing table: the classifier reads error numbers and quoted
//! names, not the words around them. `lc_messages` is set per session, on the one
//! connection of a pool of the test's own, never globally.
//!
//! PostgreSQL translates its messages too, but `SET lc_messages` needs the operating
//! system's locale (`de_DE.UTF-8`...), which this machine does not have ("invalid value
//! for parameter"): the unit tests in `inbox-core/src/backend/postgres.rs` check the
//! translated texts of PostgreSQL 15's catalogues instead.

use inbox_tests::{
    Backend, TestDb, create_accounts, credit_once, run, scalar_i64, with_fresh_db, with_migrated_db,
};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{DbErrorKind, classify};
use uuid::Uuid;

/// A pool of one connection whose server messages are in `language`; fails loudly if the
/// server did not switch (so the test cannot pass on English messages).
async fn localized_pool(db: &TestDb, language: &str, expect_word: &str) -> DatabaseConnection {
    let conn = db.connect_with(1).await;
    run(&conn, &format!("SET SESSION lc_messages = '{language}'")).await;
    let err = conn
        .execute_unprepared("SELECT * FROM no_such_table_here")
        .await
        .expect_err("the table does not exist");
    assert!(
        err.to_string().contains(expect_word),
        "lc_messages = {language} did not take: {err}"
    );
    conn
}

const LANGUAGES: [(&str, &str); 4] = [
    ("de_DE", "existiert nicht"),
    ("fr_FR", "n'existe pas"),
    ("ja_JP", "存在しません"),
    ("hu_HU", "nem letezik"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
async fn mysql_duplicates_are_duplicates_in_every_language() {
    with_migrated_db(Backend::MySql, async |db| {
        let setup = db.connect().await;
        create_accounts(&setup).await;
        run(
            &setup,
            "CREATE TABLE orders (order_no BIGINT NOT NULL, UNIQUE KEY uq_order_no (order_no))",
        )
        .await;
        run(&setup, "INSERT INTO orders (order_no) VALUES (1)").await;

        for (language, word) in LANGUAGES {
            let conn = localized_pool(db, language, word).await;
            let inbox = Inbox::new(format!("billing.{language}")).expect("valid name");
            let id = Uuid::new_v4();
            for expected_duplicate in [false, true] {
                let result = credit_once(&inbox, &conn, id).await;
                match (&result, expected_duplicate) {
                    (Ok(Outcome::Processed(())), false) | (Ok(Outcome::Duplicate), true) => {}
                    (other, _) => panic!(
                        "{language}: delivery {} got {other:?}",
                        u8::from(expected_duplicate) + 1
                    ),
                }
            }
            let txn = conn
                .begin_with_options(CLAIM_TRANSACTION)
                .await
                .expect("begin");
            let claim = txn
                .claim_message(id, inbox.consumer())
                .await
                .expect("claim");
            assert!(claim.is_duplicate(), "{language}: {claim:?}");
            txn.rollback().await.expect("rollback");

            let other = conn
                .execute_unprepared("INSERT INTO orders (order_no) VALUES (1)")
                .await
                .expect_err("order 1 exists");
            assert_eq!(
                classify(&other),
                DbErrorKind::OtherUniqueViolation,
                "{language}: {other}"
            );
            let result = inbox
                .process(&conn, Uuid::new_v4(), |txn| {
                    Box::pin(async move {
                        txn.execute_unprepared("INSERT INTO orders (order_no) VALUES (1)")
                            .await?;
                        Ok::<_, DbErr>(())
                    })
                })
                .await;
            assert!(
                matches!(&result, Err(ProcessError::Handler(err)) if classify(err) == DbErrorKind::OtherUniqueViolation),
                "{language}: {result:?}"
            );
            conn.close().await.ok();
        }
        assert_eq!(
            scalar_i64(&setup, "SELECT balance FROM account WHERE id = 1").await,
            LANGUAGES.len() as i64,
            "each language's message applied once"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
async fn mysql_missing_table_is_reported_in_every_language() {
    with_fresh_db(Backend::MySql, async |db| {
        for (language, word) in LANGUAGES {
            let conn = localized_pool(db, language, word).await;
            let inbox = Inbox::new("billing.credit").expect("valid name");
            let result = inbox
                .process(&conn, Uuid::new_v4(), |_txn| {
                    Box::pin(async move { Ok::<_, DbErr>(()) })
                })
                .await;
            assert!(
                matches!(
                    &result,
                    Err(ProcessError::Inbox(InboxError::MissingTable { .. }))
                ),
                "{language}: {result:?}"
            );
            let elsewhere = conn
                .execute_unprepared("SELECT * FROM orders")
                .await
                .expect_err("no orders table");
            assert_eq!(
                classify(&elsewhere),
                DbErrorKind::Other,
                "{language}: {elsewhere}"
            );
            conn.close().await.ok();
        }
    })
    .await;
}
