//! The relay's settle of a batch whose publisher errors the `last_error` column cannot hold
//! as they are (longer than MariaDB's TEXT, a NUL byte PostgreSQL refuses in text) or that
//! the database refuses for a reason of its own (a trigger here): the good rows of the
//! batch are marked sent once, the failing row's attempts are counted and it is parked
//! after `max_attempts`, and nothing is published again and again.

use inbox_tests::{Backend, TestDb, on_every_backend, on_pgbouncer, run, with_migrated_outbox_db};
use sea_orm::{DatabaseConnection, TransactionTrait};
use sea_orm_inbox::{
    OutboxExt, OutboxMessage, OutgoingMessage, PublishError, Publisher, Relay, RelayOptions,
    list_dead_messages, outbox_backlog,
};
use sea_orm_inbox_entity::LAST_ERROR_MAX_CHARS;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

const POISON: &[u8] = b"poison";
const GOOD: [&[u8]; 3] = [b"good-1", b"good-2", b"good-3"];
const MAX_ATTEMPTS: u32 = 3;

/// Fails every publish of [`POISON`] with `error`, confirms the rest; counts every publish
/// per payload.
struct Choking {
    error: String,
    publishes: Mutex<HashMap<Vec<u8>, u32>>,
}

impl Choking {
    fn new(error: String) -> Self {
        Self {
            error,
            publishes: Mutex::default(),
        }
    }

    fn publishes(&self, payload: &[u8]) -> u32 {
        self.publishes
            .lock()
            .expect("publish counts")
            .get(payload)
            .copied()
            .unwrap_or(0)
    }
}

impl Publisher for Choking {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        *self
            .publishes
            .lock()
            .expect("publish counts")
            .entry(message.payload.clone())
            .or_default() += 1;
        if message.payload == POISON {
            return Err(PublishError::Transient(self.error.clone().into()));
        }
        Ok(())
    }
}

/// Enqueues the poison row between good ones, drains in batches of 2 (the marks of a full
/// batch commit with the next claim, the last batch's on their own) until the poison row
/// is parked, and checks what went out and what `last_error` holds; returns that text.
async fn relay_past_the_poison(db: &TestDb, error: String) -> String {
    let conn = db.connect().await;
    enqueue_batch(&conn).await;
    let publisher = Choking::new(error);
    let relay = Relay::new(publisher)
        .with_options(RelayOptions {
            batch_size: 2,
            lease: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(5),
            max_attempts: MAX_ATTEMPTS,
            backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(5),
            poll_interval: Duration::from_millis(20),
        })
        .expect("options");
    for _ in 0..30 {
        relay
            .drain(&conn)
            .await
            .expect("a batch with an unstorable error still settles");
        let backlog = outbox_backlog(&conn).await.expect("backlog");
        if backlog.pending == 0 && backlog.dead == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for good in GOOD {
        assert_eq!(
            relay.publisher().publishes(good),
            1,
            "each good row goes out once"
        );
    }
    assert_eq!(
        relay.publisher().publishes(POISON),
        MAX_ATTEMPTS,
        "the poison row is tried max_attempts times, then parked"
    );
    let backlog = outbox_backlog(&conn).await.expect("backlog");
    assert_eq!((backlog.pending, backlog.dead), (0, 1));
    let dead = list_dead_messages(&conn, 10).await.expect("list");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].attempts, MAX_ATTEMPTS);
    conn.close().await.ok();
    let stored = dead[0].last_error.clone().expect("the error is recorded");
    assert!(!stored.contains('\0'), "no NUL is stored");
    assert!(
        stored.chars().count() <= LAST_ERROR_MAX_CHARS,
        "{} characters stored",
        stored.chars().count()
    );
    stored
}

async fn enqueue_batch(conn: &DatabaseConnection) {
    let txn = conn.begin().await.expect("begin");
    for payload in [GOOD[0], POISON, GOOD[1], GOOD[2]] {
        txn.enqueue(OutgoingMessage::new("events", payload.to_vec()))
            .await
            .expect("enqueue");
    }
    txn.commit().await.expect("commit");
}

async fn an_overlong_publisher_error_is_stored_cut_and_the_batch_settles(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        // Past MariaDB's TEXT (65,535 bytes), in multi-byte characters, so a cut in bytes
        // would split one.
        let error = format!("broker said: {}", "é".repeat(40_000));
        let stored = relay_past_the_poison(db, error).await;
        assert!(stored.starts_with("the broker did not confirm the message: broker said: éé"));
        assert!(stored.ends_with(")"), "{}", &stored[stored.len() - 80..]);
        assert!(stored.contains("cut"), "the text says it was cut");
    })
    .await;
}

async fn a_publisher_error_holding_nul_is_stored_sanitized_and_the_batch_settles(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let stored = relay_past_the_poison(db, "bad\0frame\0".to_owned()).await;
        assert_eq!(
            stored,
            "the broker did not confirm the message: bad\u{FFFD}frame\u{FFFD}"
        );
    })
    .await;
}

/// A trigger refusing any `last_error` that mentions "refuse me": the database itself
/// refuses one row's error text, whatever the relay made of it.
async fn refuse_the_error_text(conn: &DatabaseConnection, backend: Backend) {
    match backend {
        Backend::Postgres | Backend::PgBouncer => {
            run(
                conn,
                "CREATE FUNCTION refuse_error() RETURNS trigger AS $$ BEGIN \
                 IF NEW.last_error LIKE '%refuse me%' THEN RAISE EXCEPTION 'refused by trigger'; \
                 END IF; RETURN NEW; END $$ LANGUAGE plpgsql",
            )
            .await;
            run(
                conn,
                "CREATE TRIGGER refuse_error BEFORE UPDATE ON outbox FOR EACH ROW \
                 EXECUTE FUNCTION refuse_error()",
            )
            .await;
        }
        Backend::MySql => {
            run(
                conn,
                "CREATE TRIGGER refuse_error BEFORE UPDATE ON outbox FOR EACH ROW BEGIN \
                 IF NEW.last_error LIKE '%refuse me%' THEN \
                 SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by trigger'; END IF; END",
            )
            .await;
        }
        Backend::Sqlite => {
            run(
                conn,
                "CREATE TRIGGER refuse_error BEFORE UPDATE ON outbox \
                 WHEN NEW.last_error LIKE '%refuse me%' \
                 BEGIN SELECT RAISE(ABORT, 'refused by trigger'); END",
            )
            .await;
        }
    }
}

async fn a_row_whose_error_the_database_refuses_does_not_stop_the_others(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        refuse_the_error_text(&conn, backend).await;
        conn.close().await.ok();
        let stored = relay_past_the_poison(db, "refuse me".to_owned()).await;
        assert!(
            stored.contains("refused to store its error text"),
            "a fixed text stands in for the refused one: {stored}"
        );
    })
    .await;
}

on_every_backend!(
    an_overlong_publisher_error_is_stored_cut_and_the_batch_settles,
    a_publisher_error_holding_nul_is_stored_sanitized_and_the_batch_settles,
    a_row_whose_error_the_database_refuses_does_not_stop_the_others,
);

// Behind PgBouncer's transaction pooling the row-by-row settle must run each mark in a
// transaction of its own too (a lone one with bound values can fail with 26000).
on_pgbouncer!(
    an_overlong_publisher_error_is_stored_cut_and_the_batch_settles,
    a_publisher_error_holding_nul_is_stored_sanitized_and_the_batch_settles,
    a_row_whose_error_the_database_refuses_does_not_stop_the_others,
);
