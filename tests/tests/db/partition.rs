//! A replica cut off from the database mid-transaction, as a NAT or load balancer does when
//! it silently drops a flow: packets stop both ways, no reset, the sockets stay open. The
//! proxy in `tests/support` plays that partition (`LostReplyProxy::partition`).
//!
//! What must hold, with a short partition timeout so the suite stays fast: the cut-off
//! replica's call returns within the bound with a nack-meaning error; the server ends its
//! abandoned transaction within the same bound (its work rolled back, the claim released),
//! so a redelivery on another replica is processed; the effect exists exactly once.
//!
//! The calls not about one message (a purge and a background purger, the lease listings,
//! the schema check) return within their partition timeout too, with an error that says
//! "retry later"; a purger keeps its schedule. So do the claims on a caller's own
//! transaction (`claim_message`, `ClaimedMessage::commit`, `BatchClaim::commit`), within
//! the default partition timeout, a COMMIT among them reported as in doubt.
//!
//! PostgreSQL and MariaDB only: SQLite is embedded, with no network to lose.

use inbox_tests::{
    Backend, ProxiedDb, create_accounts, credit, credit_once, on_server_backends, run, scalar,
    scalar_i64, stmt, with_migrated_db, with_proxied_db,
};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, DbErr, Statement, TransactionTrait};
use sea_orm_inbox::{
    Claim, Inbox, InboxError, InboxTransactionExt, LeaseClaim, LeaseOptions, Outcome, ProcessError,
    RetentionPolicy, SchemaError, Settlement, bound_connections, claim_lease, list_dead_claims,
    list_expired_leases, purge, spawn_purger, timestamp_value, verify_schema,
};
use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};
use tokio::time::timeout;
use uuid::Uuid;

const CONSUMER: &str = "billing.credit";

/// The partition timeout of every replica in these tests.
const PARTITION_TIMEOUT: Duration = Duration::from_secs(2);

/// Scheduling slack on a loaded machine, added to every bound asserted.
const SLACK: Duration = Duration::from_secs(3);

/// How long a test waits for a call before it reports the call as hung.
const GIVE_UP: Duration = Duration::from_secs(40);

fn replica() -> Inbox {
    Inbox::new(CONSUMER)
        .and_then(|inbox| inbox.with_partition_timeout(PARTITION_TIMEOUT))
        .expect("a valid inbox")
}

/// Whether `result` is the nack of a database that stopped answering during `step`, with
/// a COMMIT of the call in doubt or not.
fn unresponsive_during<T, E>(
    result: &Result<Outcome<T>, ProcessError<E>>,
    step: &str,
    in_doubt: bool,
) -> bool {
    let Err(err) = result else {
        return false;
    };
    matches!(
        err.inbox_error(),
        Some(InboxError::DatabaseUnresponsive { step: seen, commit_in_doubt, .. })
            if *seen == step && *commit_in_doubt == in_doubt
    )
}

/// Runs replica A's call `a` (through the proxy, into the partition) and, once the
/// partition is on, replica B's call `b` (on the direct pool); prints both. Returns each
/// result with how long after the start of the partition its call returned.
async fn a_cut_off_while_b_goes_on<A: Debug, B: Debug>(
    fixture: &ProxiedDb,
    backend: Backend,
    a: impl Future<Output = A>,
    b: impl Future<Output = B>,
) -> ((A, Duration), (B, Duration)) {
    let a = async { (a.await, Instant::now()) };
    let b = async {
        let partitioned_at = fixture.partition_started().await;
        (partitioned_at, b.await, Instant::now())
    };
    let ((a, a_done), (partitioned_at, b, b_done)) = tokio::join!(a, b);
    eprintln!(
        "{backend:?}: A {a:?} after {:?}; B {b:?} after {:?}",
        a_done - partitioned_at,
        b_done - partitioned_at
    );
    ((a, a_done - partitioned_at), (b, b_done - partitioned_at))
}

/// Replica A is cut off after its handler's first write (the marker and the credit are
/// in its open transaction), while the handler goes on with a second statement. A's
/// `process` must return within the partition timeout (nack); the server must end A's
/// transaction within the same bound, so B's redelivery claims the message and credits
/// once, and A's credit is rolled back.
async fn a_replica_cut_off_mid_handler_releases_its_claim(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        cut_off_mid_handler(fixture, backend, &replica(), &fixture.through_proxy, 0).await;
    })
    .await;
}

/// The same cut on a pool whose connections carry A's bounds ([`bound_connections`]),
/// where A's marker INSERT sets none: the server still ends A's transaction within the
/// partition timeout.
async fn a_replica_on_bounded_connections_cut_off_mid_handler_releases_its_claim(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        let replica_a = replica();
        let pool_a = fixture
            .proxy
            .connect_configured(5, |options| {
                bound_connections(options, &replica_a);
            })
            .await;
        let warm_up = credit_once(&replica_a, &pool_a, Uuid::new_v4()).await;
        assert!(matches!(warm_up, Ok(Outcome::Processed(()))), "{warm_up:?}");
        let markers: Vec<String> = fixture
            .proxy
            .statements()
            .iter()
            .map(|statement| statement.sql().to_owned())
            .filter(|sql| sql.contains("INSERT INTO") && sql.contains("inbox"))
            .collect();
        assert!(
            markers
                .iter()
                .all(|sql| !sql.contains("set_config") && !sql.contains("SET SESSION")),
            "the marker INSERT set the bounds itself: {markers:?}"
        );
        cut_off_mid_handler(fixture, backend, &replica_a, &pool_a, 1).await;
        pool_a.close().await.ok();
    })
    .await;
}

/// Cuts replica A (`replica_a` on `pool_a`, through the proxy) off after its handler's
/// first write, and checks that A nacks and B processes the redelivery within the bound,
/// A's credit rolled back (account 1 held `balance_before`).
async fn cut_off_mid_handler(
    fixture: &ProxiedDb,
    backend: Backend,
    replica_a: &Inbox,
    pool_a: &DatabaseConnection,
    balance_before: i64,
) {
    let replica_b = replica();
    let id = Uuid::new_v4();
    let runs_a = AtomicU32::new(0);
    let markers_before = fixture.markers().await;

    let a = timeout(
        GIVE_UP,
        replica_a.process(pool_a, id, |txn| {
            runs_a.fetch_add(1, Ordering::SeqCst);
            let proxy = Arc::clone(&fixture.proxy);
            Box::pin(async move {
                credit(txn, 1).await?;
                proxy.partition();
                // Into the black hole: neither the statement nor an answer gets through.
                credit(txn, 1).await?;
                Ok::<_, DbErr>(())
            })
        }),
    );
    let b = timeout(GIVE_UP, credit_once(&replica_b, &fixture.direct, id));
    let ((a, a_after), (b, b_after)) = a_cut_off_while_b_goes_on(fixture, backend, a, b).await;

    let a = a.expect("A's process is still waiting on the partitioned database");
    assert!(unresponsive_during(&a, "the handler", false), "{a:?}");
    assert_eq!(Settlement::of(&a), Settlement::Nack(None));
    assert!(
        a_after < PARTITION_TIMEOUT + SLACK,
        "A returned {:?} after the partition began",
        a_after
    );
    let b = b.expect("B's redelivery is still waiting for the claim A's zombie holds");
    assert!(matches!(b, Ok(Outcome::Processed(()))), "{b:?}");
    assert!(
        b_after < PARTITION_TIMEOUT + SLACK,
        "B processed the redelivery {:?} after the partition began",
        b_after
    );
    assert_eq!(runs_a.load(Ordering::SeqCst), 1);
    assert_eq!(
        fixture.balance().await,
        balance_before + 1,
        "A's credit rolled back, B's applied once"
    );
    assert_eq!(fixture.markers().await, markers_before + 1);

    // Once the network is back, A's pool serves again: the connection that timed out in
    // the middle of a statement was not handed out in its broken state.
    fixture.proxy.heal();
    let next = credit_once(replica_a, pool_a, Uuid::new_v4()).await;
    assert!(matches!(next, Ok(Outcome::Processed(()))), "{next:?}");
    assert_eq!(fixture.balance().await, balance_before + 2);
}

/// A large result of about 200 MB, far beyond what the socket buffers between the server
/// and the proxy hold: a server sending it into a partition ends up blocked in its write,
/// where an idle-transaction timeout does not apply.
fn large_result(backend: Backend) -> Statement {
    let sql = if backend.is_postgres() {
        "SELECT repeat('x', 1000) FROM generate_series(1, 200000)"
    } else {
        "SELECT REPEAT('x', 1000) FROM seq_1_to_200000"
    };
    Statement::from_string(fixture_backend(backend), sql)
}

fn fixture_backend(backend: Backend) -> DbBackend {
    if backend.is_postgres() {
        DbBackend::Postgres
    } else {
        DbBackend::MySql
    }
}

/// Replica A's handler holds the claim and asks for a large result; the partition starts
/// right behind the query, so the server is busy sending, not idle, when the network goes
/// silent. The server must still give up within the partition timeout (PostgreSQL:
/// `tcp_user_timeout`; MariaDB: `net_write_timeout`) and release the claim for B.
async fn a_replica_cut_off_while_the_server_sends_to_it_releases_its_claim(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        let (replica_a, replica_b) = (replica(), replica());
        let id = Uuid::new_v4();

        let a = timeout(
            GIVE_UP,
            replica_a.process(&fixture.through_proxy, id, |txn| {
                let proxy = Arc::clone(&fixture.proxy);
                let query = large_result(backend);
                Box::pin(async move {
                    credit(txn, 1).await?;
                    proxy.partition_at_next_execute();
                    txn.query_all_raw(query).await?;
                    Ok::<_, DbErr>(())
                })
            }),
        );
        let b = timeout(GIVE_UP, credit_once(&replica_b, &fixture.direct, id));
        let ((a, _), (b, b_after)) = a_cut_off_while_b_goes_on(fixture, backend, a, b).await;
        fixture.proxy.expect_reply_dropped();

        let a = a.expect("A's process is still waiting on the partitioned database");
        assert!(unresponsive_during(&a, "the handler", false), "{a:?}");
        let b = b.expect("B's redelivery is still waiting for the claim A's zombie holds");
        assert!(matches!(b, Ok(Outcome::Processed(()))), "{b:?}");
        assert!(
            b_after < PARTITION_TIMEOUT + SLACK,
            "B processed the redelivery {:?} after the partition began",
            b_after
        );
        assert_eq!(fixture.balance().await, 1, "A's credit rolled back");
        assert_eq!(fixture.markers().await, 1);
    })
    .await;
}

/// The COMMIT reaches the server, which commits; its reply is lost in the partition (the
/// connection stays open, silent). A's COMMIT is in doubt: `process` retries through the
/// lost-reply path, whose fresh connection meets the partition too, and returns a nack
/// within twice the partition timeout. B's redelivery is the duplicate; the credit stays
/// applied once.
async fn a_commit_reply_lost_in_a_partition_nacks_and_the_redelivery_is_a_duplicate(
    backend: Backend,
) {
    with_proxied_db(backend, async |fixture| {
        let (replica_a, replica_b) = (replica(), replica());
        let id = Uuid::new_v4();

        fixture.proxy.partition_at_commit();
        let a = timeout(GIVE_UP, credit_once(&replica_a, &fixture.through_proxy, id));
        let b = timeout(GIVE_UP, credit_once(&replica_b, &fixture.direct, id));
        let ((a, a_after), (b, b_after)) = a_cut_off_while_b_goes_on(fixture, backend, a, b).await;
        fixture.proxy.expect_reply_dropped();

        let a = a.expect("A's process is still waiting for its COMMIT's reply");
        assert!(unresponsive_during(&a, "BEGIN", true), "{a:?}");
        assert_eq!(Settlement::of(&a), Settlement::Nack(None));
        assert!(
            a_after < 2 * PARTITION_TIMEOUT + SLACK,
            "A returned {:?} after the partition began",
            a_after
        );
        assert_eq!(
            replica_a.metrics().snapshot().transient_retries,
            1,
            "the COMMIT in doubt went to the lost-reply path"
        );
        let b = b.expect("B's redelivery hung");
        assert!(matches!(b, Ok(Outcome::Duplicate)), "{b:?}");
        assert!(b_after < SLACK, "{:?}", b_after);
        assert_eq!(fixture.balance().await, 1, "the credit committed once");
        assert_eq!(fixture.markers().await, 1);
    })
    .await;
}

/// As above, but the partition heals while A retries: the retry finds the marker carrying
/// its call's token, and `process` reports `Processed` (not a duplicate), the handler run
/// once.
async fn a_commit_cut_off_by_a_partition_that_heals_settles_as_processed(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        let replica_a = replica();
        let id = Uuid::new_v4();
        let runs = AtomicU32::new(0);

        fixture.proxy.partition_at_commit();
        let a = timeout(
            GIVE_UP,
            replica_a.process(&fixture.through_proxy, id, |txn| {
                runs.fetch_add(1, Ordering::SeqCst);
                Box::pin(async move { credit(txn, 1).await.map(|()| "credited") })
            }),
        );
        let healer = async {
            fixture.partition_started().await;
            // After A's COMMIT timed out, while its retry waits for a new connection.
            tokio::time::sleep(PARTITION_TIMEOUT + PARTITION_TIMEOUT / 2).await;
            fixture.proxy.heal();
        };
        let (a, ()) = tokio::join!(a, healer);
        fixture.proxy.expect_reply_dropped();
        let counts = replica_a.metrics().snapshot();
        eprintln!("{backend:?}: A {a:?}, {counts:?}");

        let a = a.expect("A's process is still waiting for its COMMIT's reply");
        assert_eq!(a.ok(), Some(Outcome::Processed("credited")));
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
        assert_eq!((counts.processed, counts.duplicates), (1, 0), "{counts:?}");
        assert_eq!(fixture.balance().await, 1);
    })
    .await;
}

/// A two-phase lease holder is cut off in the middle of completing (its UPDATE reached the
/// server, inside a transaction that now holds the row). Its call returns within the
/// partition timeout; the server ends the abandoned transaction, so another replica takes
/// the expired lease over instead of waiting on the row; the old holder's completion,
/// once the network is back, is refused.
async fn a_lease_holder_cut_off_while_completing_is_taken_over_and_fenced(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        let options = LeaseOptions::new(PARTITION_TIMEOUT)
            .and_then(|options| options.with_partition_timeout(PARTITION_TIMEOUT))
            .expect("valid lease options");
        let id = Uuid::new_v4();
        let held = match claim_lease(&fixture.through_proxy, id, CONSUMER, &options).await {
            Ok(LeaseClaim::Claimed(lease)) => lease,
            other => panic!("a new message: {other:?}"),
        };

        fixture.proxy.partition_at_next_execute();
        let a = timeout(GIVE_UP, held.complete(&fixture.through_proxy));
        let b = async {
            let expires_in = (held.lease_until() - chrono::Utc::now())
                .to_std()
                .unwrap_or_default();
            tokio::time::sleep(expires_in + Duration::from_millis(50)).await;
            timeout(
                GIVE_UP,
                claim_lease(&fixture.direct, id, CONSUMER, &options),
            )
            .await
        };
        let ((a, a_after), (b, b_after)) = a_cut_off_while_b_goes_on(fixture, backend, a, b).await;
        fixture.proxy.expect_reply_dropped();

        let a = a.expect("A's completion is still waiting on the partitioned database");
        assert!(
            matches!(a, Err(InboxError::DatabaseUnresponsive { .. })),
            "{a:?}"
        );
        assert!(a_after < PARTITION_TIMEOUT + SLACK);
        let b = b.expect("B's takeover is still waiting for the row A's zombie holds");
        let taken = match b {
            Ok(LeaseClaim::TakenOver(lease)) => lease,
            other => panic!("the expired lease is B's to take over: {other:?}"),
        };
        assert_eq!(taken.attempt(), 2);
        assert!(b_after < PARTITION_TIMEOUT + SLACK);

        fixture.proxy.heal();
        let late = held.complete(&fixture.through_proxy).await;
        assert!(
            matches!(late, Err(InboxError::StaleLease { attempt: 1, .. })),
            "{late:?}"
        );
        taken
            .complete(&fixture.direct)
            .await
            .expect("the new holder completes");
        assert_eq!(
            claim_lease(&fixture.direct, id, CONSUMER, &options)
                .await
                .expect("claim again"),
            LeaseClaim::Duplicate
        );
    })
    .await;
}

/// A retention policy of one second of receiving time, bounded by the tests' partition
/// timeout.
fn short_retention() -> RetentionPolicy {
    RetentionPolicy::with_window(Duration::from_secs(1))
        .and_then(|policy| policy.with_partition_timeout(PARTITION_TIMEOUT))
        .expect("a valid retention policy")
}

/// Inserts 31 completed one-phase markers received 100 ms apart, the newest now: the
/// oldest two seconds of them are past a one-second window.
async fn insert_steady_markers(conn: &DatabaseConnection) {
    let backend = conn.get_database_backend();
    let newest = chrono::Utc::now();
    let txn = conn.begin().await.expect("begin the inserts");
    for step in 0..=30 {
        let received_at = newest - chrono::TimeDelta::milliseconds(100 * step);
        txn.execute_raw(stmt(
            backend,
            "INSERT INTO inbox (message_id, consumer, received_at, processed_at) VALUES (?, ?, ?, ?)",
            vec![
                Uuid::new_v4().into(),
                CONSUMER.into(),
                timestamp_value(backend, received_at),
                timestamp_value(backend, received_at),
            ],
        ))
        .await
        .expect("insert a marker");
    }
    txn.commit().await.expect("commit the inserts");
}

/// Whether `result` is the "retry later" of a database that stayed silent for `waited`.
fn silent_for<T>(result: &Result<T, InboxError>, waited: Duration) -> bool {
    matches!(result, Err(InboxError::DatabaseSilent { waited: seen, .. }) if *seen == waited)
}

/// A purge whose database goes silent (its first statement reaches the server, the reply
/// is lost in a partition) returns within its policy's partition timeout, saying "retry
/// later", instead of waiting as long as the kernel keeps the socket.
async fn a_purge_cut_off_returns_within_its_partition_timeout(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        insert_steady_markers(&fixture.direct).await;
        fixture.proxy.partition_at_next_execute();
        let started = Instant::now();
        let result = timeout(GIVE_UP, purge(&fixture.through_proxy, &short_retention())).await;
        let took = started.elapsed();
        fixture.proxy.expect_reply_dropped();
        eprintln!("{backend:?}: {result:?} after {took:?}");

        let result = result.expect("the purge is still waiting on the partitioned database");
        assert!(silent_for(&result, PARTITION_TIMEOUT), "{result:?}");
        assert!(
            took < PARTITION_TIMEOUT + SLACK,
            "the purge returned {took:?} after the partition began"
        );
        assert!(result.is_err_and(|err| !err.is_permanent()));
        assert_eq!(fixture.markers().await, 31, "nothing deleted");
    })
    .await;
}

/// A background purger whose database goes silent in the middle of a run counts each
/// timed-out run as a failure and keeps its schedule (each run ends within the partition
/// timeout, so the next one starts); once the network is back, a purger purges through
/// the same pool.
async fn a_purger_cut_off_fails_its_runs_and_keeps_its_schedule(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        insert_steady_markers(&fixture.direct).await;
        fixture.proxy.partition_at_next_execute();
        let every = Duration::from_millis(500);
        let purger = spawn_purger(fixture.through_proxy.clone(), short_retention(), every)
            .expect("a purger");
        tokio::time::sleep(2 * PARTITION_TIMEOUT + PARTITION_TIMEOUT / 2).await;
        // Stops after the run in progress, which ends within the partition timeout.
        let summary = timeout(GIVE_UP, purger.shutdown()).await;
        fixture.proxy.expect_reply_dropped();
        eprintln!("{backend:?}: {summary:?}");

        let summary = summary
            .expect("the purger's run is still waiting on the partitioned database")
            .expect("the purger stops cleanly");
        assert!(summary.runs >= 2, "a run after the first: {summary:?}");
        assert_eq!(summary.failures, summary.runs, "{summary:?}");
        assert!(
            matches!(
                summary.last_error,
                Some(InboxError::DatabaseSilent { waited, .. }) if waited == PARTITION_TIMEOUT
            ),
            "{summary:?}"
        );
        assert_eq!(
            fixture.markers().await,
            31,
            "nothing deleted in the partition"
        );

        fixture.proxy.heal();
        let purger = spawn_purger(fixture.through_proxy.clone(), short_retention(), every)
            .expect("a purger");
        let purged = timeout(GIVE_UP, async {
            while fixture.markers().await == 31 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        let summary = purger.shutdown().await.expect("the purger stops cleanly");
        purged.expect("no purge after the partition healed");
        assert!(summary.rows > 0, "{summary:?}");
    })
    .await;
}

/// The listings a sweeper polls return within the default partition timeout when the
/// database goes silent in the middle of one (the other meets the partition at once).
async fn listings_cut_off_return_within_the_default_partition_timeout(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        fixture.proxy.partition_at_next_execute();
        let started = Instant::now();
        let (expired, dead) = tokio::join!(
            timeout(
                GIVE_UP,
                list_expired_leases(&fixture.through_proxy, None, 10)
            ),
            timeout(
                GIVE_UP,
                list_dead_claims(&fixture.through_proxy, Some(CONSUMER), 10)
            ),
        );
        let took = started.elapsed();
        fixture.proxy.expect_reply_dropped();
        eprintln!("{backend:?}: {expired:?}, {dead:?} after {took:?}");

        let expired = expired.expect("listing expired leases is still waiting");
        let dead = dead.expect("listing dead claims is still waiting");
        assert!(
            silent_for(&expired, Inbox::DEFAULT_PARTITION_TIMEOUT),
            "{expired:?}"
        );
        assert!(
            silent_for(&dead, Inbox::DEFAULT_PARTITION_TIMEOUT),
            "{dead:?}"
        );
        assert!(took < Inbox::DEFAULT_PARTITION_TIMEOUT + SLACK, "{took:?}");
    })
    .await;
}

/// The startup check returns within the default partition timeout when the database
/// goes silent in the middle of its catalog read, with the schema error that retrying
/// can cure.
async fn verify_schema_cut_off_returns_within_the_default_partition_timeout(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        fixture.proxy.partition_at_next_execute();
        let started = Instant::now();
        let result = timeout(GIVE_UP, verify_schema(&fixture.through_proxy)).await;
        let took = started.elapsed();
        fixture.proxy.expect_reply_dropped();
        eprintln!("{backend:?}: {result:?} after {took:?}");

        let result = result.expect("verify_schema is still waiting on the partitioned database");
        assert!(
            matches!(
                result,
                Err(SchemaError::DatabaseSilent { waited }) if waited == Inbox::DEFAULT_PARTITION_TIMEOUT
            ),
            "{result:?}"
        );
        assert!(took < Inbox::DEFAULT_PARTITION_TIMEOUT + SLACK, "{took:?}");
    })
    .await;
}

/// Whether `result` is the nack of a claim on the caller's transaction whose database
/// stayed silent for the default partition timeout during `step`.
fn claim_unresponsive<T>(result: &Result<T, InboxError>, step: &str, in_doubt: bool) -> bool {
    matches!(
        result,
        Err(InboxError::DatabaseUnresponsive { step: seen, waited, commit_in_doubt, .. })
            if *seen == step && *waited == Inbox::DEFAULT_PARTITION_TIMEOUT && *commit_in_doubt == in_doubt
    )
}

/// Replica A's `claim_message` on its own transaction is cut off mid-statement (the
/// INSERT reached the server, its reply is lost): the call returns within the default
/// partition timeout. On PostgreSQL the INSERT also bounded the transaction on the
/// server, which ends it, so B's redelivery claims the message.
async fn a_claim_on_the_callers_transaction_cut_off_returns_within_the_bound(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        let id = Uuid::new_v4();
        let txn = fixture.through_proxy.begin().await.expect("A begins");
        fixture.proxy.partition_at_next_execute();
        let started = Instant::now();
        let a = timeout(GIVE_UP, txn.claim_message(id, CONSUMER)).await;
        let took = started.elapsed();
        fixture.proxy.expect_reply_dropped();
        eprintln!("{backend:?}: A {a:?} after {took:?}");
        drop(txn);

        let a = a.expect("A's claim is still waiting on the partitioned database");
        assert!(claim_unresponsive(&a, "the claim", false), "{a:?}");
        assert!(took < Inbox::DEFAULT_PARTITION_TIMEOUT + SLACK, "{took:?}");
        if backend == Backend::Postgres {
            let txn = fixture.direct.begin().await.expect("B begins");
            let b = timeout(GIVE_UP, txn.claim_message(id, CONSUMER)).await;
            let b = b.expect("B's claim waits on A's abandoned marker");
            let Ok(Claim::Claimed(claimed)) = b else {
                panic!("B's redelivery is not claimed: {b:?}");
            };
            claimed.commit(txn).await.expect("B commits");
            assert_eq!(fixture.markers().await, 1);
        }
    })
    .await;
}

/// A's `ClaimedMessage::commit` reaches the server, which commits; the reply is lost in
/// the partition. The call returns within the default partition timeout, saying the
/// COMMIT is in doubt; B's redelivery is the duplicate, the credit applied once.
async fn a_claimed_commit_reply_lost_returns_in_doubt_and_the_redelivery_is_a_duplicate(
    backend: Backend,
) {
    with_proxied_db(backend, async |fixture| {
        let id = Uuid::new_v4();
        let txn = fixture.through_proxy.begin().await.expect("A begins");
        let Ok(Claim::Claimed(claimed)) = txn.claim_message(id, CONSUMER).await else {
            panic!("A claims");
        };
        credit(&txn, 1).await.expect("A credits");
        fixture.proxy.partition_at_commit();
        let started = Instant::now();
        let a = timeout(GIVE_UP, claimed.commit(txn)).await;
        let took = started.elapsed();
        fixture.proxy.expect_reply_dropped();
        eprintln!("{backend:?}: A {a:?} after {took:?}");

        let a = a.expect("A's COMMIT is still waiting for its reply");
        assert!(claim_unresponsive(&a, "COMMIT", true), "{a:?}");
        assert!(took < Inbox::DEFAULT_PARTITION_TIMEOUT + SLACK, "{took:?}");
        let txn = fixture.direct.begin().await.expect("B begins");
        let b = timeout(GIVE_UP, txn.claim_message(id, CONSUMER)).await;
        assert!(matches!(b, Ok(Ok(Claim::Duplicate))), "{b:?}");
        drop(txn);
        assert_eq!(fixture.balance().await, 1, "the credit committed once");
        assert_eq!(fixture.markers().await, 1);
    })
    .await;
}

/// The same for a batch: A's `BatchClaim::commit` loses its COMMIT's reply, returns
/// within the default partition timeout with an in-doubt "retry later", and B's
/// redelivery of the batch finds every id already claimed.
async fn a_batch_commit_reply_lost_returns_in_doubt_and_the_redelivery_finds_it_claimed(
    backend: Backend,
) {
    with_proxied_db(backend, async |fixture| {
        let ids = [Uuid::new_v4(), Uuid::new_v4()];
        let txn = fixture.through_proxy.begin().await.expect("A begins");
        let batch = txn.claim_batch(ids, CONSUMER).await.expect("A claims");
        assert_eq!(batch.claimed.len(), 2);
        credit(&txn, 2).await.expect("A credits");
        fixture.proxy.partition_at_commit();
        let started = Instant::now();
        let a = timeout(GIVE_UP, batch.commit(txn)).await;
        let took = started.elapsed();
        fixture.proxy.expect_reply_dropped();
        eprintln!("{backend:?}: A {a:?} after {took:?}");

        let a = a.expect("A's COMMIT is still waiting for its reply");
        assert!(
            matches!(&a, Err(InboxError::DatabaseSilent { operation, waited })
            if operation.contains("in doubt") && *waited == Inbox::DEFAULT_PARTITION_TIMEOUT),
            "{a:?}"
        );
        assert!(took < Inbox::DEFAULT_PARTITION_TIMEOUT + SLACK, "{took:?}");
        let txn = fixture.direct.begin().await.expect("B begins");
        let b = timeout(GIVE_UP, txn.claim_batch(ids, CONSUMER))
            .await
            .expect("B's claim hung")
            .expect("B claims");
        assert!(b.claimed.is_empty() && b.duplicates.len() == 2, "{b:?}");
        drop(txn);
        assert_eq!(fixture.balance().await, 2, "the batch committed once");
        assert_eq!(fixture.markers().await, 2);
    })
    .await;
}

/// A setting of the connection, as text.
async fn setting(conn: &(impl ConnectionTrait + TransactionTrait), name: &str) -> String {
    scalar(conn, &format!("SELECT current_setting('{name}')")).await
}

/// On PostgreSQL `claim_message`'s INSERT asks the server to end the caller's transaction
/// after the default partition timeout of client silence, for that transaction only, and
/// keeps a shorter bound the caller set.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn a_claim_on_the_callers_transaction_bounds_its_silence_on_the_server() {
    with_migrated_db(Backend::Postgres, async |db| {
        let conn = db.connect_with(1).await;
        let txn = conn.begin().await.expect("begin");
        let claim = txn.claim_message(Uuid::new_v4(), CONSUMER).await;
        assert!(matches!(claim, Ok(Claim::Claimed(_))), "{claim:?}");
        assert_eq!(
            setting(&txn, "idle_in_transaction_session_timeout").await,
            "20s"
        );
        assert_eq!(setting(&txn, "tcp_user_timeout").await, "20000");
        txn.rollback().await.expect("roll back");
        assert_eq!(
            setting(&conn, "idle_in_transaction_session_timeout").await,
            "0"
        );

        let txn = conn.begin().await.expect("begin");
        run(&txn, "SET LOCAL idle_in_transaction_session_timeout = '5s'").await;
        let claim = txn.claim_message(Uuid::new_v4(), CONSUMER).await;
        assert!(matches!(claim, Ok(Claim::Claimed(_))), "{claim:?}");
        assert_eq!(
            setting(&txn, "idle_in_transaction_session_timeout").await,
            "5s"
        );
        txn.rollback().await.expect("roll back");
    })
    .await;
}

/// SQLite is embedded: no network can go silent, so the partition timeout bounds nothing
/// there; a handler slower than it still commits (its waits end in the busy timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_has_no_network_to_bound() {
    with_migrated_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let inbox = Inbox::new(CONSUMER)
            .and_then(|inbox| inbox.with_partition_timeout(Inbox::MIN_PARTITION_TIMEOUT))
            .expect("a valid inbox");
        let slow = Inbox::MIN_PARTITION_TIMEOUT + Duration::from_millis(500);
        let result = inbox
            .process(&conn, Uuid::new_v4(), |txn| {
                Box::pin(async move {
                    tokio::time::sleep(slow).await;
                    credit(txn, 1).await
                })
            })
            .await;
        assert!(matches!(result, Ok(Outcome::Processed(()))), "{result:?}");
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            1
        );
    })
    .await;
}

/// The bound is checked before it is used: a zero timeout would turn the server-side
/// bounds off (0 means "never" to both servers), and one beyond every broker's redelivery
/// timeout holds a message hostage for nothing.
#[test]
fn partition_timeout_is_refused_outside_its_range() {
    let inbox = Inbox::new(CONSUMER).expect("valid name");
    let lease = LeaseOptions::new(Duration::from_secs(30)).expect("valid lease");
    let retention = RetentionPolicy::with_window(Duration::from_secs(3_600)).expect("valid");
    assert_eq!(inbox.partition_timeout(), Inbox::DEFAULT_PARTITION_TIMEOUT);
    assert_eq!(lease.partition_timeout(), Inbox::DEFAULT_PARTITION_TIMEOUT);
    assert_eq!(
        retention.partition_timeout(),
        Inbox::DEFAULT_PARTITION_TIMEOUT
    );
    for accepted in [Inbox::MIN_PARTITION_TIMEOUT, Inbox::MAX_PARTITION_TIMEOUT] {
        let set = inbox.clone().with_partition_timeout(accepted);
        assert_eq!(
            set.map(|inbox| inbox.partition_timeout()).ok(),
            Some(accepted)
        );
        let set = lease.with_partition_timeout(accepted);
        assert_eq!(
            set.map(|lease| lease.partition_timeout()).ok(),
            Some(accepted)
        );
        let set = retention.with_partition_timeout(accepted);
        assert_eq!(
            set.map(|retention| retention.partition_timeout()).ok(),
            Some(accepted)
        );
    }
    let refused = [
        Duration::ZERO,
        Inbox::MIN_PARTITION_TIMEOUT - Duration::from_millis(1),
        Inbox::MAX_PARTITION_TIMEOUT + Duration::from_millis(1),
        Duration::MAX,
    ];
    for timeout in refused {
        let message = match inbox.clone().with_partition_timeout(timeout) {
            Err(err @ InboxError::OutOfRange { .. }) => err.to_string(),
            other => panic!("{timeout:?} must be refused: {other:?}"),
        };
        assert!(
            message.contains("below the broker's redelivery timeout"),
            "{message}"
        );
        assert!(matches!(
            lease.with_partition_timeout(timeout),
            Err(InboxError::OutOfRange { .. })
        ));
        assert!(matches!(
            retention.with_partition_timeout(timeout),
            Err(InboxError::OutOfRange { .. })
        ));
    }
}

on_server_backends!(
    a_replica_cut_off_mid_handler_releases_its_claim,
    a_replica_on_bounded_connections_cut_off_mid_handler_releases_its_claim,
    a_replica_cut_off_while_the_server_sends_to_it_releases_its_claim,
    a_commit_reply_lost_in_a_partition_nacks_and_the_redelivery_is_a_duplicate,
    a_commit_cut_off_by_a_partition_that_heals_settles_as_processed,
    a_lease_holder_cut_off_while_completing_is_taken_over_and_fenced,
    a_purge_cut_off_returns_within_its_partition_timeout,
    a_purger_cut_off_fails_its_runs_and_keeps_its_schedule,
    listings_cut_off_return_within_the_default_partition_timeout,
    verify_schema_cut_off_returns_within_the_default_partition_timeout,
    a_claim_on_the_callers_transaction_cut_off_returns_within_the_bound,
    a_claimed_commit_reply_lost_returns_in_doubt_and_the_redelivery_is_a_duplicate,
    a_batch_commit_reply_lost_returns_in_doubt_and_the_redelivery_finds_it_claimed,
);
