//! What `Inbox::process` costs on the wire, counted by the proxy between a replica's pool
//! and its server: BEGIN, the marker INSERT, the handler's statements and COMMIT, the
//! round trips of the one-transaction peers. On MySQL/MariaDB the marker's silence bound
//! (session variables the INSERT cannot carry) travels in the INSERT's own text query, and
//! on a server that is no Galera node no pre-commit proof follows a clean handler.

use inbox_tests::{
    Backend, ProxiedDb, SentStatement, create_accounts, credit, credit_once, on_every_backend,
    on_server_backends, scalar_i64, with_migrated_db, with_proxied_db,
};
use sea_orm::{ConnectionTrait, DatabaseConnection, EntityTrait, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{ClaimingTransaction, Inbox, Outcome, bound_connections};
use sea_orm_inbox_entity::inbox;
use uuid::Uuid;

const CONSUMER: &str = "billing.credit";

/// Four round trips a message, every time: BEGIN, the marker INSERT, the handler's one
/// UPDATE, COMMIT (it was six on MariaDB: the silence bound and the proof had their own).
async fn process_costs_begin_marker_handler_and_commit(backend: Backend) {
    const CALLS: u32 = 5;
    with_proxied_db(backend, async |fixture| {
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let replica = fixture.proxy.connect_with(1).await;
        // The connection prepares its statements and the inbox reads the server's kind.
        for _ in 0..2 {
            let outcome = credit_once(&inbox, &replica, Uuid::new_v4()).await;
            assert!(matches!(outcome, Ok(Outcome::Processed(()))), "{outcome:?}");
        }
        fixture.proxy.reset_round_trips();
        for _ in 0..CALLS {
            let outcome = credit_once(&inbox, &replica, Uuid::new_v4()).await;
            assert!(matches!(outcome, Ok(Outcome::Processed(()))), "{outcome:?}");
        }
        let counted = fixture.proxy.round_trips();
        replica.close().await.ok();
        assert_eq!(
            counted,
            4 * CALLS,
            "{backend:?}: round trips of {CALLS} clean calls"
        );
        assert_eq!(fixture.balance().await, i64::from(CALLS) + 2);
    })
    .await;
}

/// On a pool whose connections carry the inbox's bounds ([`bound_connections`]), an
/// attempt runs BEGIN, the marker INSERT, the handler's UPDATE and COMMIT, and no other
/// statement: nothing sets a bound per transaction (PostgreSQL's marker carried three
/// `set_config` calls; MariaDB's went as a text query with a `SET SESSION` in front), and
/// the marker is a prepared statement on every backend.
async fn an_attempt_on_bounded_connections_runs_its_four_statements_only(backend: Backend) {
    const CALLS: usize = 5;
    with_proxied_db(backend, async |fixture| {
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let replica = bounded_replica(fixture, &inbox).await;
        // The connection prepares its statements and the inbox reads what the pool's
        // connections carry.
        for _ in 0..2 {
            let outcome = credit_once(&inbox, &replica, Uuid::new_v4()).await;
            assert!(matches!(outcome, Ok(Outcome::Processed(()))), "{outcome:?}");
        }
        fixture.proxy.reset_round_trips();
        for _ in 0..CALLS {
            let outcome = credit_once(&inbox, &replica, Uuid::new_v4()).await;
            assert!(matches!(outcome, Ok(Outcome::Processed(()))), "{outcome:?}");
        }
        let run: Vec<String> = fixture.proxy.statements().iter().map(step).collect();
        let round_trips = fixture.proxy.round_trips();
        replica.close().await.ok();
        let one_attempt = ["BEGIN", "marker", "handler", "COMMIT"];
        assert_eq!(
            run,
            one_attempt.repeat(CALLS),
            "{backend:?}: the statements of {CALLS} clean calls"
        );
        assert_eq!(round_trips, 4 * CALLS as u32, "{backend:?}: round trips");
        assert_eq!(fixture.balance().await, CALLS as i64 + 2);
    })
    .await;
}

/// On a pool whose connections do not carry the inbox's bounds, the inbox reads what they
/// carry once, before its first BEGIN (again ten seconds later), and the attempts then set
/// the bounds in their marker. On PostgreSQL that read is a text query: one round trip,
/// and no prepared statement, which cost a second round trip on each new connection and
/// which a transaction pooler cannot run outside a transaction (its `Bind` reaches a server
/// connection without the statement: a failed read, and an ERROR in the server's log, at
/// every read).
async fn the_read_of_the_connections_bounds_is_one_statement(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let replica = fixture.proxy.connect_with(1).await;
        fixture.proxy.reset_round_trips();
        for _ in 0..2 {
            let outcome = credit_once(&inbox, &replica, Uuid::new_v4()).await;
            assert!(matches!(outcome, Ok(Outcome::Processed(()))), "{outcome:?}");
        }
        let run = fixture.proxy.statements();
        replica.close().await.ok();
        let is_read = |sent: &SentStatement| {
            let sql = sent.sql();
            sql.contains("pg_settings") || sql.contains("@sea_orm_inbox_bounded = 1, 0")
        };
        let reads: Vec<&SentStatement> = run.iter().filter(|sent| is_read(sent)).collect();
        assert_eq!(reads.len(), 1, "{backend:?}: one read in {run:?}");
        let first_begin = run.iter().position(|sent| sent.sql().trim() == "BEGIN");
        let read_at = run.iter().position(is_read);
        assert!(
            read_at < first_begin,
            "{backend:?}: the read comes before the first BEGIN: {run:?}"
        );
        if backend == Backend::Postgres {
            assert!(
                matches!(reads[0], SentStatement::Text(_)),
                "a text query: {reads:?}"
            );
        }
    })
    .await;
}

/// The manual path on a transaction begun with [`ObservedTransaction::begin_on`]: a claim
/// then `claimed.commit(txn)` runs BEGIN, the marker INSERT, the handler's UPDATE and
/// COMMIT, and no other statement, like `process` (no savepoint after the INSERT, no
/// proof before COMMIT: the transaction saw every statement succeed). A plain
/// `DatabaseTransaction` still costs the savepoint and its `RELEASE`, counted here too.
async fn a_manual_claim_runs_its_four_statements_only(backend: Backend) {
    const CALLS: usize = 5;
    with_proxied_db(backend, async |fixture| {
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let replica = bounded_replica(fixture, &inbox).await;
        let observed = run_counted(fixture, &replica, CALLS, async |db| {
            let txn = ObservedTransaction::begin_on(db).await.expect("BEGIN");
            claim_credit_commit(txn).await;
        })
        .await;
        let one_attempt = ["BEGIN", "marker", "handler", "COMMIT"];
        assert_eq!(
            observed.0,
            one_attempt.repeat(CALLS),
            "{backend:?}: the statements of {CALLS} manual claims"
        );
        assert_eq!(observed.1, 4 * CALLS as u32, "{backend:?}: round trips");
        let batches = run_counted(fixture, &replica, CALLS, async |db| {
            let txn = ObservedTransaction::begin_on(db).await.expect("BEGIN");
            let ids = [Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4()];
            let batch = txn.claim_batch(ids, CONSUMER).await.expect("the batch");
            assert_eq!(batch.claimed.len(), 3, "{backend:?}: fresh ids");
            credit(&txn, 1).await.expect("the handler's UPDATE");
            batch.commit(txn).await.expect("COMMIT");
        })
        .await;
        assert_eq!(
            batches.0,
            one_attempt.repeat(CALLS),
            "{backend:?}: the statements of {CALLS} manual batches"
        );
        let plain = run_counted(fixture, &replica, 1, async |db| {
            let txn = db
                .begin_with_options(CLAIM_TRANSACTION)
                .await
                .expect("BEGIN");
            claim_credit_commit(txn).await;
        })
        .await;
        assert_eq!(
            plain.1, 6,
            "{backend:?}: a claim on a plain transaction: {plain:?}"
        );
        replica.close().await.ok();
        assert_eq!(fixture.balance().await, 2 * (CALLS as i64 + 2) + 3);
    })
    .await;
}

/// Two pools used in turn, as a process with a worker per pool or one inbox shared by two
/// replicas' pools does: what each pool's server and connections are is read once per pool,
/// not again at every switch (which cost `begin_on` and `process` two reads a message when
/// only the pool last used was remembered).
async fn pools_used_in_turn_are_read_once_each(backend: Backend) {
    const CALLS: usize = 4;
    with_proxied_db(backend, async |fixture| {
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let pools = [
            bounded_replica(fixture, &inbox).await,
            bounded_replica(fixture, &inbox).await,
        ];
        let message = async |db: &DatabaseConnection| {
            let txn = ObservedTransaction::begin_on(db).await.expect("BEGIN");
            claim_credit_commit(txn).await;
            let outcome = credit_once(&inbox, db, Uuid::new_v4()).await;
            assert!(matches!(outcome, Ok(Outcome::Processed(()))), "{outcome:?}");
        };
        for db in &pools {
            message(db).await;
        }
        fixture.proxy.reset_round_trips();
        for _ in 0..CALLS {
            for db in &pools {
                message(db).await;
            }
        }
        let run: Vec<String> = fixture.proxy.statements().iter().map(step).collect();
        for db in pools {
            db.close().await.ok();
        }
        let one_attempt = ["BEGIN", "marker", "handler", "COMMIT"];
        assert_eq!(
            run,
            one_attempt.repeat(2 * 2 * CALLS),
            "{backend:?}: manual claims and process calls on two pools in turn"
        );
    })
    .await;
}

/// Claims a fresh id on `txn`, credits through it and commits the claim.
async fn claim_credit_commit<T>(txn: T)
where
    T: InboxTransactionExt + ConnectionTrait + Into<ClaimingTransaction>,
{
    match txn.claim_message(Uuid::new_v4(), CONSUMER).await {
        Ok(Claim::Claimed(claimed)) => {
            credit(&txn, 1).await.expect("the handler's UPDATE");
            claimed.commit(txn).await.expect("COMMIT");
        }
        other => panic!("a fresh id was not claimed: {other:?}"),
    }
}

/// A one-connection pool through the proxy whose connection carries `inbox`'s bounds.
async fn bounded_replica(fixture: &ProxiedDb, inbox: &Inbox) -> DatabaseConnection {
    fixture
        .proxy
        .connect_configured(1, |options| {
            bound_connections(options, inbox);
        })
        .await
}

/// Runs `message` twice (the connection prepares its statements and the inbox reads what
/// the pool's connections carry), then `calls` times counted: the statements by name and
/// the round trips of the counted calls.
async fn run_counted(
    fixture: &ProxiedDb,
    replica: &DatabaseConnection,
    calls: usize,
    message: impl AsyncFn(&DatabaseConnection),
) -> (Vec<String>, u32) {
    for _ in 0..2 {
        message(replica).await;
    }
    fixture.proxy.reset_round_trips();
    for _ in 0..calls {
        message(replica).await;
    }
    let run = fixture.proxy.statements().iter().map(step).collect();
    (run, fixture.proxy.round_trips())
}

/// What a statement of an attempt is, by name, or its whole text when it is none of the
/// four an attempt needs.
fn step(statement: &SentStatement) -> String {
    let sql = statement.sql().trim();
    let name = match statement {
        SentStatement::Text(_) if sql.eq_ignore_ascii_case("BEGIN") => "BEGIN",
        SentStatement::Text(_) if sql.eq_ignore_ascii_case("COMMIT") => "COMMIT",
        SentStatement::Prepared(_)
            if sql.starts_with("INSERT INTO")
                && sql.contains("inbox")
                && !sql.contains("set_config")
                && !sql.to_ascii_uppercase().contains("SET SESSION") =>
        {
            "marker"
        }
        SentStatement::Prepared(_) if sql.starts_with("UPDATE account") => "handler",
        _ => return format!("{statement:?}"),
    };
    name.to_owned()
}

/// A consumer name holding what SQL quotes and escapes (`'`, `\`, `?`) claims, commits and
/// meets its duplicate like any other: on MySQL/MariaDB its marker's values go into the
/// claim's text query as literals.
async fn consumer_with_quotes_and_escapes_claims_and_meets_its_duplicate(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let inbox = Inbox::new("o'brien\\ ? \"x\"").expect("valid name");
        let id = Uuid::new_v4();
        let first = credit_once(&inbox, &conn, id).await;
        assert!(matches!(first, Ok(Outcome::Processed(()))), "{first:?}");
        let again = credit_once(&inbox, &conn, id).await;
        assert!(matches!(again, Ok(Outcome::Duplicate)), "{again:?}");
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            1
        );
        let markers = inbox::Entity::find()
            .all(&conn)
            .await
            .expect("read the markers");
        let consumers: Vec<&str> = markers.iter().map(|row| row.consumer.as_str()).collect();
        assert_eq!(consumers, [inbox.consumer()]);
        conn.close().await.ok();
    })
    .await;
}

on_server_backends!(process_costs_begin_marker_handler_and_commit);

mod bounded_connections {
    use super::*;
    on_server_backends!(an_attempt_on_bounded_connections_runs_its_four_statements_only);
}

mod unbounded_connections {
    use super::*;
    on_server_backends!(the_read_of_the_connections_bounds_is_one_statement);
}

mod manual_claim {
    use super::*;
    on_server_backends!(a_manual_claim_runs_its_four_statements_only);
}

mod pools_in_turn {
    use super::*;
    on_server_backends!(pools_used_in_turn_are_read_once_each);
}

mod quoted_consumer {
    use super::*;
    on_every_backend!(consumer_with_quotes_and_escapes_claims_and_meets_its_duplicate);
}
