//! The statements of the lease calls: each call is one short transaction, run again from
//! the top on a transient failure as the lease's [`RetryPolicy`] says.

use super::decide::{Decision, decide};
use super::{Lease, LeaseClaim, LeaseOptions};
use crate::backend::{
    CLAIM_TRANSACTION, DbErrorKind, begin_to_completion, classify, complete_lease_sql,
    entity_select_in, insert_lease_sql, park_lease_sql, release_lease_sql, roll_back,
    silence_statement, take_over_lease_sql, timestamp_value,
};
use crate::clock::now_micros;
use crate::pooler::in_own_transaction;
use crate::silence::{bound_for, within_bound};
use crate::{InboxError, MessageId, RetryPolicy};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbErr, EntityTrait,
    QueryFilter, QuerySelect, Statement, Value,
};
use sea_orm_inbox_entity::{InboxTable, inbox};
use std::time::Duration;
use uuid::Uuid;

/// Why one try of a short transaction failed.
enum TryFailure {
    /// The database left it unanswered for this long.
    Silent(Duration),
    Database(DbErr),
}

/// Runs `attempt` (one whole short transaction) as `policy` says, again from the top on a
/// transient failure, and turns the final failure into an [`InboxError`] naming `step`. An
/// attempt the database leaves unanswered for `bound` is given up and not retried: its
/// abandoned transaction may hold the row until the server ends it.
async fn retried<T, F, Fut>(
    policy: &RetryPolicy,
    table: &InboxTable,
    message_id: MessageId,
    consumer: &str,
    (bound, step): (Option<Duration>, &'static str),
    mut attempt: F,
) -> Result<T, InboxError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, DbErr>>,
{
    let outcome = policy
        .run(
            || {
                let attempt = attempt();
                async move {
                    match within_bound(bound, attempt).await {
                        Ok(result) => result.map_err(TryFailure::Database),
                        Err(waited) => Err(TryFailure::Silent(waited)),
                    }
                }
            },
            |failure| match failure {
                TryFailure::Database(err) => classify(err) == DbErrorKind::Transient,
                TryFailure::Silent(_) => false,
            },
        )
        .await;
    outcome.map_err(|failure| match failure {
        TryFailure::Silent(waited) => InboxError::DatabaseUnresponsive {
            message_id,
            consumer: consumer.to_owned(),
            step,
            waited,
            // The bound covers the whole short transaction, COMMIT included.
            commit_in_doubt: true,
        },
        TryFailure::Database(err) => InboxError::from_claim(err, table, message_id, consumer),
    })
}

/// The statements of a claim, prepared once for all its tries.
struct ClaimSql {
    table: InboxTable,
    insert: String,
    take_over: String,
    park: String,
    silence: Option<String>,
}

/// Claims `message_id` for `consumer` with the fencing `token`, every try of the call
/// writing that same token.
pub(super) async fn claim(
    db: &DatabaseConnection,
    table: &InboxTable,
    message_id: MessageId,
    consumer: &str,
    options: &LeaseOptions,
    token: Uuid,
) -> Result<LeaseClaim, InboxError> {
    let backend = db.get_database_backend();
    let sql = ClaimSql {
        table: table.clone(),
        insert: insert_lease_sql(backend, table)?,
        take_over: take_over_lease_sql(backend, table)?,
        park: park_lease_sql(backend, table)?,
        silence: silence_statement(backend, options.partition_timeout)?,
    };
    let bound = (
        bound_for(backend, options.partition_timeout),
        "the lease claim",
    );
    retried(&options.retry, table, message_id, consumer, bound, || {
        claim_once(db, message_id, consumer, options, &sql, token)
    })
    .await
}

/// One claim transaction with the call's fencing `token`: insert-or-lock the row, decide,
/// commit; or roll back with [`roll_back`] after a failed statement.
async fn claim_once(
    db: &DatabaseConnection,
    message_id: MessageId,
    consumer: &str,
    options: &LeaseOptions,
    sql: &ClaimSql,
    token: Uuid,
) -> Result<LeaseClaim, DbErr> {
    let txn = begin_to_completion(db, CLAIM_TRANSACTION).await?;
    match claim_in(&txn, message_id, consumer, options, sql, token).await {
        Ok(outcome) => {
            txn.commit().await?;
            Ok(outcome)
        }
        Err(err) => {
            roll_back(txn).await;
            Err(err)
        }
    }
}

/// The statements of [`claim_once`] around [`decide`], in its transaction `txn`.
async fn claim_in(
    txn: &DatabaseTransaction,
    message_id: MessageId,
    consumer: &str,
    options: &LeaseOptions,
    sql: &ClaimSql,
    token: Uuid,
) -> Result<LeaseClaim, DbErr> {
    bound_silence(txn, sql.silence.as_deref()).await?;
    let backend = txn.get_database_backend();
    let now = now_micros();
    let lease_until = options.expiry(now);
    let id = Value::from(message_id.as_uuid());
    txn.execute_raw(Statement::from_sql_and_values(
        backend,
        &sql.insert,
        [
            id.clone(),
            Value::from(consumer),
            timestamp_value(backend, now),
            timestamp_value(backend, lease_until),
            Value::from(token),
        ],
    ))
    .await?;
    let select = inbox::Entity::find()
        .filter(inbox::Column::MessageId.eq(message_id.as_uuid()))
        .filter(inbox::Column::Consumer.eq(consumer))
        .lock_exclusive()
        .limit(1);
    let row = entity_select_in(backend, &sql.table, select)
        .map_err(|err| DbErr::Custom(err.to_string()))?
        .one(txn)
        .await?
        .ok_or_else(|| DbErr::RecordNotFound("the inbox row just claimed".into()))?;
    let lease = |attempt, lease_until| Lease {
        table: sql.table.clone(),
        message_id,
        consumer: consumer.to_owned(),
        token,
        attempt,
        lease_until,
        partition_timeout: options.partition_timeout,
        retry: options.retry,
    };
    let current = |from: Uuid| [id.clone(), Value::from(consumer), Value::from(from)];
    let outcome = match decide(&row, now, options, token) {
        Decision::Own {
            attempt,
            lease_until,
        } if attempt <= 1 => LeaseClaim::Claimed(lease(attempt, lease_until)),
        Decision::Own {
            attempt,
            lease_until,
        } => LeaseClaim::TakenOver(lease(attempt, lease_until)),
        Decision::TakeOver { from, attempt } => {
            let mut values = vec![timestamp_value(backend, lease_until), Value::from(token)];
            values.extend(current(from));
            txn.execute_raw(Statement::from_sql_and_values(
                backend,
                &sql.take_over,
                values,
            ))
            .await?;
            LeaseClaim::TakenOver(lease(attempt, lease_until))
        }
        Decision::Park { from, dead } => {
            let mut values = vec![timestamp_value(backend, now)];
            values.extend(current(from));
            txn.execute_raw(Statement::from_sql_and_values(backend, &sql.park, values))
                .await?;
            LeaseClaim::Dead(dead)
        }
        Decision::Dead(dead) => LeaseClaim::Dead(dead),
        Decision::Held {
            attempts,
            lease_until,
        } => LeaseClaim::Held {
            attempts,
            lease_until,
        },
        Decision::Duplicate => LeaseClaim::Duplicate,
    };
    Ok(outcome)
}

/// The compare-and-set UPDATEs on a lease's row.
#[derive(Clone, Copy)]
pub(super) enum LeaseUpdate {
    Complete,
    Release,
}

/// Runs `update` on the row of `lease` as a statement of its own (binds: a timestamp of
/// now, then the current-lease conditions), and reports a stale lease.
///
/// Its affected-row count is exact on every backend: PostgreSQL and SQLite count the rows
/// the WHERE clause found, and on MySQL sqlx reports *found* rows too (so the idempotent
/// repeat of a completion, which finds its row without changing it, counts 1).
pub(super) async fn compare_and_set(
    db: &DatabaseConnection,
    lease: &Lease,
    update: LeaseUpdate,
) -> Result<(), InboxError> {
    let backend = db.get_database_backend();
    let sql = match update {
        LeaseUpdate::Complete => complete_lease_sql(backend, &lease.table)?,
        LeaseUpdate::Release => release_lease_sql(backend, &lease.table)?,
    };
    let silence = silence_statement(backend, lease.partition_timeout)?;
    let bound = (
        bound_for(backend, lease.partition_timeout),
        "the lease update",
    );
    let updated = retried(
        &lease.retry,
        &lease.table,
        lease.message_id,
        &lease.consumer,
        bound,
        || async {
            let update = Statement::from_sql_and_values(
                backend,
                &sql,
                [
                    timestamp_value(backend, now_micros()),
                    Value::from(lease.message_id.as_uuid()),
                    Value::from(lease.consumer.as_str()),
                    Value::from(lease.token),
                ],
            );
            let result = in_own_transaction(db, async |txn| {
                bound_silence(txn, silence.as_deref()).await?;
                txn.execute_raw(update).await
            })
            .await?;
            Ok(result.rows_affected())
        },
    )
    .await?;
    if updated == 1 {
        Ok(())
    } else {
        Err(InboxError::StaleLease {
            message_id: lease.message_id,
            consumer: lease.consumer.clone(),
            attempt: lease.attempt,
        })
    }
}

/// Runs `silence` (see [`silence_statement`]) in `txn` before the transaction takes a row
/// lock, which a holder cut off by a partition would otherwise keep for hours.
async fn bound_silence(txn: &DatabaseTransaction, silence: Option<&str>) -> Result<(), DbErr> {
    if let Some(sql) = silence {
        txn.execute_unprepared(sql).await?;
    }
    Ok(())
}
