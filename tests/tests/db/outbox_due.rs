//! On PostgreSQL the relay's claim walks `ix_outbox_due` (`OutboxDueIndex`), the rows still
//! due in its order, and stops after the batch whatever the table's statistics say. On
//! `ix_outbox_pending` alone, a table never analyzed got a plan reading every unsent row
//! (and the entries sent rows left in the index) at each claim and sorting them all: a
//! drain read the square of its rows.
//!
//! The relay's sent mark finds its batch by primary key for the same reason: its
//! `sent_at IS NULL`, taken as an index condition on `ix_outbox_pending`, made a table
//! without statistics read every unsent row at each mark.

use inbox_tests::{Backend, LostReplyProxy, TestDb, scalar_i64, with_migrated_outbox_db};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement, TransactionTrait};
use sea_orm_inbox::{
    OutboxExt, OutboxMessage, OutgoingMessage, PublishError, Publisher, Relay, RelayOptions,
};
use sea_orm_inbox_migration::{MigratorTrait, MigratorWithOutbox};

/// Rows enqueued, and how many batches of [`BATCH`] the relay sends before the claim is
/// explained: 500 rows are still due then, 2,500 sent.
const ROWS: i64 = 3_000;
const BATCH: u32 = 100;
const SENT_BATCHES: usize = 25;

struct Discard;

impl Publisher for Discard {
    async fn publish(&self, _: &OutboxMessage) -> Result<(), PublishError> {
        Ok(())
    }
}

/// The largest `actual rows=N` of an `EXPLAIN ANALYZE` text: the most rows any step of the
/// plan handled.
fn most_rows(plan: &str) -> u64 {
    plan.match_indices("actual rows=")
        .filter_map(|(at, found)| {
            let digits: String = plan[at + found.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        })
        .max()
        .unwrap_or(0)
}

/// A connection through a recording proxy to `db`, whose outbox autovacuum never analyzes.
async fn proxied_unanalyzed(db: &TestDb) -> (LostReplyProxy, DatabaseConnection) {
    let proxy = LostReplyProxy::start(db).await;
    let conn = proxy.connect_with(1).await;
    conn.execute_unprepared("ALTER TABLE outbox SET (autovacuum_enabled = false)")
        .await
        .expect("keep autovacuum away");
    (proxy, conn)
}

/// Relays [`SENT_BATCHES`] full batches of [`BATCH`].
async fn send_batches(conn: &DatabaseConnection) {
    let relay = Relay::new(Discard)
        .with_options(RelayOptions {
            batch_size: BATCH,
            ..RelayOptions::default()
        })
        .expect("options");
    for _ in 0..SENT_BATCHES {
        let report = relay.relay_once(conn).await.expect("relay");
        assert_eq!(report.published, u64::from(BATCH), "{report:?}");
    }
}

/// The first statement the proxy recorded that contains `part`.
fn recorded(proxy: &LostReplyProxy, part: &str) -> String {
    proxy
        .statements()
        .iter()
        .map(|statement| statement.sql().to_owned())
        .find(|sql| sql.contains(part))
        .unwrap_or_else(|| panic!("no statement with {part} was sent"))
}

/// The `EXPLAIN ANALYZE` text of `sql` run with `values`, in a transaction rolled back
/// (EXPLAIN ANALYZE runs the statement).
async fn explain_analyzed(
    conn: &DatabaseConnection,
    sql: &str,
    values: Vec<sea_orm::Value>,
) -> String {
    let txn = conn.begin().await.expect("begin");
    let plan = txn
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            format!("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) {sql}"),
            values,
        ))
        .await
        .expect("explain")
        .iter()
        .map(|row| row.try_get_by_index::<String>(0).expect("a plan line"))
        .collect::<Vec<_>>()
        .join("\n");
    txn.rollback().await.expect("rollback");
    plan
}

/// The relay's claim as it sent it (recorded by the proxy), explained late in a drain on a
/// table no statistics describe yet (a new install's, until autovacuum first analyzes it;
/// autovacuum is kept away): it reads its batch, not the rows still due, nor the rows
/// already sent, and sorts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn a_claim_late_in_a_drain_reads_its_batch_not_the_backlog() {
    with_migrated_outbox_db(Backend::Postgres, async |db| {
        let (proxy, conn) = proxied_unanalyzed(db).await;
        let txn = conn.begin().await.expect("begin");
        for n in 0..ROWS {
            txn.enqueue(OutgoingMessage::new("due", format!("event {n}")))
                .await
                .expect("enqueue");
        }
        txn.commit().await.expect("commit");
        send_batches(&conn).await;
        let claim = recorded(&proxy, "SKIP LOCKED");
        let now = chrono::Utc::now();
        let plan = explain_analyzed(
            &conn,
            &claim,
            vec![
                (now + chrono::Duration::seconds(60)).into(),
                uuid::Uuid::new_v4().into(),
                now.into(),
                now.into(),
                now.into(),
                i64::from(BATCH).into(),
                "10000ms".into(),
            ],
        )
        .await;
        let most = most_rows(&plan);
        assert!(
            most <= 2 * u64::from(BATCH) && !plan.contains("Sort"),
            "with {} of {ROWS} rows sent a step of the claim handled {most} rows:\n{plan}",
            SENT_BATCHES as u32 * BATCH
        );
        conn.close().await.ok();
    })
    .await;
}

/// Rows in the outbox whose mark is explained: enough that a read of every page costs the
/// planner more than the batch's primary-key lookups (below about 12,000 it reads the
/// table, which is then no more than the old plan read).
const MARK_ROWS: i64 = 20_000;

/// The relay's sent mark as it sent it (recorded by the proxy), explained late in a drain
/// on a table no statistics describe: it finds the batch's rows through the primary key.
/// Through `ix_outbox_pending` (its `sent_at IS NULL` an index condition) a bitmap took
/// every unsent row and visited their pages at each mark: with 20,000 rows unsent, 20,000
/// index entries and 667 heap pages a mark, 6-11 ms against 1.5 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn a_sent_mark_late_in_a_drain_finds_its_rows_by_primary_key() {
    with_migrated_outbox_db(Backend::Postgres, async |db| {
        let (proxy, conn) = proxied_unanalyzed(db).await;
        conn.execute_unprepared(&format!(
            "INSERT INTO outbox (message_id, destination, payload, headers, created_at, \
             available_at) SELECT gen_random_uuid(), 'due', 'event', '{{}}', now(), now() \
             FROM generate_series(1, {MARK_ROWS})"
        ))
        .await
        .expect("enqueue");
        send_batches(&conn).await;
        let mark = recorded(&proxy, "SET sent_at = $1");
        let token = uuid::Uuid::new_v4();
        // The next batch, leased to `token` as a claim would have.
        let ids: Vec<sea_orm::Value> = conn
            .query_all_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "UPDATE outbox SET lease_token = $1 WHERE id IN \
                 (SELECT id FROM outbox WHERE sent_at IS NULL ORDER BY id LIMIT $2) RETURNING id",
                [token.into(), i64::from(BATCH).into()],
            ))
            .await
            .expect("lease the next batch")
            .iter()
            .map(|row| row.try_get_by_index::<i64>(0).expect("id").into())
            .collect();
        let mut values = vec![chrono::Utc::now().into(), token.into()];
        values.extend(ids);
        let plan = explain_analyzed(&conn, &mark, values).await;
        assert!(
            plan.contains("outbox_pkey") && !plan.contains("ix_outbox_pending"),
            "with {} of {MARK_ROWS} rows sent the mark took (a step handled {} rows):\n{plan}",
            SENT_BATCHES as u32 * BATCH,
            most_rows(&plan)
        );
        conn.close().await.ok();
    })
    .await;
}

/// Whether `outbox` has `ix_outbox_due`.
async fn has_due_index(conn: &DatabaseConnection) -> bool {
    scalar_i64(
        conn,
        "SELECT COUNT(*) FROM pg_indexes WHERE tablename = 'outbox' AND indexname = 'ix_outbox_due'",
    )
    .await
        == 1
}

/// An install migrated before `OutboxDueIndex` gets the index with its rows kept, and
/// `down` drops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn an_existing_outbox_gets_its_due_index_and_keeps_its_rows() {
    with_migrated_outbox_db(Backend::Postgres, async |db| {
        let conn = db.connect().await;
        assert!(has_due_index(&conn).await);
        MigratorWithOutbox::down(&conn, Some(1))
            .await
            .expect("roll back OutboxDueIndex");
        assert!(!has_due_index(&conn).await);
        let txn = conn.begin().await.expect("begin");
        txn.enqueue(OutgoingMessage::new("due", "kept"))
            .await
            .expect("enqueue");
        txn.commit().await.expect("commit");
        MigratorWithOutbox::up(&conn, None)
            .await
            .expect("OutboxDueIndex on an existing table");
        assert!(has_due_index(&conn).await);
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM outbox WHERE sent_at IS NULL").await,
            1
        );
        conn.close().await.ok();
    })
    .await;
}
