//! [`Inbox::process_batch`]: a Kafka-style batch claimed, handled and committed in one
//! observed transaction, with the rules of [`Inbox::process`].

use super::{AttemptError, Inbox, sort_inbox_error};
use crate::backend::{CLAIM_TRANSACTION, begin_to_completion};
use crate::cause::reported_text;
use crate::claim::sorted_batch;
use crate::metrics::{Counter, Settled, facade};
use crate::observed::ObservedTransaction;
use crate::{
    Delivery, HandlerFuture, InboxError, InboxTransactionExt, MessageId, ProcessError, Refusal,
};
use chrono::Utc;
use sea_orm::DatabaseConnection;
use std::collections::BTreeMap;
use std::time::Instant;
use tracing::Instrument;

/// What [`Inbox::process_batch`] did with a batch: every id of it is in exactly one list.
/// Ack the whole batch (commit the consumer offset); dead-letter `refused` if your broker
/// keeps them apart.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "ack the batch: its new ids are committed"]
pub struct BatchOutcome<T> {
    /// What the handler returned, or `None` when the batch held no new id and the handler
    /// did not run.
    pub value: Option<T>,
    /// Claimed and handled by this call, committed with the handler's work.
    pub processed: Vec<MessageId>,
    /// Claimed before by a committed transaction (another delivery of the batch, or an
    /// attempt of this call whose COMMIT failed after landing): skipped.
    pub duplicates: Vec<MessageId>,
    /// Refused by their [admission floor](crate::AdmissionFloor) and not claimed.
    pub refused: Vec<(MessageId, Refusal)>,
}

/// A batch split by the admission floor: the admitted deliveries, and the refused ids with
/// why.
type Admission = (Vec<Delivery>, Vec<(MessageId, Refusal)>);

impl Inbox {
    /// Claims every new id of `deliveries` in one transaction, runs `handler` with the
    /// [`ObservedTransaction`] and exactly the ids claimed (sorted; never the duplicates),
    /// and commits the markers with the handler's work, by the rules of
    /// [`process`](Self::process): no proof query when every statement succeeded
    /// (PostgreSQL, SQLite), statements after one on which the database ended the
    /// transaction refused (so none of the loop's writes runs on its own after a deadlock),
    /// transient failures retried in a fresh transaction, where the handler then gets the
    /// ids still new. Up to [`MAX_CLAIM_BATCH`](crate::MAX_CLAIM_BATCH) distinct ids.
    ///
    /// Each delivery is admitted as `process` admits one, once, before any SQL runs: by
    /// the inbox's [admission floor](Self::with_admission_floor) and the one it carries.
    /// A refused delivery is listed in [`BatchOutcome::refused`] (an id given twice is
    /// refused if either delivery is), never handed to the handler and never marked; when
    /// every delivery is refused, no transaction begins.
    ///
    /// The handler should apply each id through the transaction and return at the first
    /// error.
    ///
    /// ```
    /// use sea_orm::{ConnectionTrait, DbErr};
    /// use sea_orm_inbox::Inbox;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// # use sea_orm_inbox_migration::{Migrator, MigratorTrait};
    /// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
    /// # Migrator::up(&db, None).await?;
    /// # db.execute_unprepared("CREATE TABLE applied (id TEXT PRIMARY KEY)").await?;
    /// let inbox = Inbox::new("projector")?;
    /// let records = [uuid::Uuid::new_v4(), uuid::Uuid::new_v4()];
    /// for _poll in 0..2 {
    ///     let outcome = inbox
    ///         .process_batch(&db, records, |txn, claimed| {
    ///             Box::pin(async move {
    ///                 for id in claimed {
    ///                     txn.execute_unprepared(&format!("INSERT INTO applied VALUES ('{id}')"))
    ///                         .await?;
    ///                 }
    ///                 Ok::<_, DbErr>(claimed.len())
    ///             })
    ///         })
    ///         .await?;
    ///     // commit the consumer offset: every record is applied once
    ///     # let _ = outcome;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`process`](Self::process): [`ProcessError::Handler`],
    /// [`ProcessError::Inbox`] ([`InboxError::EmptyBatch`], [`InboxError::BatchTooLarge`],
    /// [`InboxError::NilMessageId`] before any SQL runs, [`InboxError::ClaimLost`]
    /// when the handler returned `Ok` after a statement that ended the transaction), and
    /// [`ProcessError::RetriesExhausted`]. Nack (do not commit the offset of) the whole
    /// batch: nothing of it was committed by the failed attempt.
    pub async fn process_batch<T, E, F, I>(
        &self,
        db: &DatabaseConnection,
        deliveries: I,
        mut handler: F,
    ) -> Result<BatchOutcome<T>, ProcessError<E>>
    where
        I: IntoIterator,
        I::Item: Into<Delivery>,
        F: for<'t> FnMut(&'t ObservedTransaction, &'t [MessageId]) -> HandlerFuture<'t, T, E>
            + Send,
        T: Send,
        E: Send + 'static,
    {
        let deliveries: Vec<Delivery> = deliveries.into_iter().map(Into::into).collect();
        let admission = self.admit_batch(&deliveries);
        let span = tracing::info_span!(
            "inbox.process_batch",
            consumer = %self.consumer,
            messages = deliveries.len(),
            attempts = tracing::field::Empty,
        );
        let started = Instant::now();
        async {
            let (admitted, refused) = match admission {
                Ok(admission) => admission,
                Err(err) => {
                    let result = Err(ProcessError::Inbox(err));
                    self.record_batch(&result, started);
                    return result;
                }
            };
            let mut attempt = 0;
            let result = if admitted.is_empty() {
                Ok(BatchOutcome {
                    value: None,
                    processed: Vec::new(),
                    duplicates: Vec::new(),
                    refused,
                })
            } else {
                attempt = 1;
                loop {
                    match self.batch_attempt(db, &admitted, &mut handler).await {
                        Ok(outcome) => break Ok(BatchOutcome { refused, ..outcome }),
                        Err(err) => {
                            if let Err(failed) =
                                self.after_failed_attempt(err, attempt, false).await
                            {
                                break Err(failed);
                            }
                            attempt += 1;
                        }
                    }
                }
            };
            tracing::Span::current().record("attempts", attempt);
            self.record_batch(&result, started);
            result
        }
        .instrument(span)
        .await
    }

    /// Checks the batch's input, then splits it as `process` admits a delivery, at one
    /// instant: the admitted deliveries (stripped of their send time, so that no attempt
    /// judges them again at a later instant) and the refused ids, ascending, each with why.
    fn admit_batch(&self, deliveries: &[Delivery]) -> Result<Admission, InboxError> {
        sorted_batch(
            deliveries.iter().map(Delivery::message_id).collect(),
            &self.consumer,
        )?;
        let now = Utc::now();
        let mut refused = BTreeMap::new();
        for delivery in deliveries {
            if let Err(refusal) = delivery.admit(self.floor, now) {
                refused.entry(delivery.message_id()).or_insert(refusal);
            }
        }
        let admitted = deliveries
            .iter()
            .filter(|delivery| !refused.contains_key(&delivery.message_id()))
            .map(|delivery| Delivery::new(delivery.message_id()))
            .collect();
        Ok((admitted, refused.into_iter().collect()))
    }

    async fn batch_attempt<T, E, F>(
        &self,
        db: &DatabaseConnection,
        deliveries: &[Delivery],
        handler: &mut F,
    ) -> Result<BatchOutcome<T>, AttemptError<E>>
    where
        E: 'static,
        F: for<'t> FnMut(&'t ObservedTransaction, &'t [MessageId]) -> HandlerFuture<'t, T, E>
            + Send,
    {
        let named = deliveries.first().map_or_else(
            || MessageId::from_uuid(uuid::Uuid::nil()),
            Delivery::message_id,
        );
        let mut steps = self.steps(db);
        let silent_end = self.silent_ends.possible(db, steps.bound).await;
        let txn = self
            .bounded(
                &mut steps,
                named,
                "BEGIN",
                begin_to_completion(db, CLAIM_TRANSACTION),
            )
            .await?
            .map_err(|err| self.database_failure(named, err))?;
        let batch = match txn
            .claim_batch_in(self.table(), deliveries.iter().copied(), &self.consumer)
            .await
        {
            Ok(batch) => batch,
            Err(err) => {
                self.roll_back(&mut steps, named, txn).await;
                return Err(match err {
                    // The read-back missed the batch's rows after a silent brute-force
                    // abort: the database's doing, retried like a conflict.
                    err @ InboxError::ClaimLost { source: None, .. } => {
                        AttemptError::Transient(err)
                    }
                    err => sort_inbox_error(err),
                });
            }
        };
        if batch.claimed.is_empty() {
            self.roll_back(&mut steps, named, txn).await;
            return Ok(BatchOutcome {
                value: None,
                processed: Vec::new(),
                duplicates: batch.duplicates,
                refused: batch.refused,
            });
        }
        let observed = ObservedTransaction::new(txn);
        let returned = self
            .bounded(
                &mut steps,
                named,
                "the handler",
                handler(&observed, &batch.claimed),
            )
            .await?;
        let (value, txn) = self
            .conclude(
                &mut steps,
                named,
                observed,
                returned,
                &batch.held(),
                silent_end,
            )
            .await?;
        self.commit_attempt(&mut steps, named, txn).await?;
        Ok(BatchOutcome {
            value: Some(value),
            processed: batch.claimed,
            duplicates: batch.duplicates,
            refused: batch.refused,
        })
    }

    fn record_batch<T, E: 'static>(
        &self,
        result: &Result<BatchOutcome<T>, ProcessError<E>>,
        started: Instant,
    ) {
        match result {
            Ok(outcome) => {
                for (counter, ids) in [
                    (Counter::Processed, outcome.processed.len()),
                    (Counter::Duplicate, outcome.duplicates.len()),
                    (Counter::Refused, outcome.refused.len()),
                ] {
                    for _ in 0..ids {
                        self.metrics.count(counter);
                    }
                }
                facade::settled(&self.metric_keys, Settled::Processed, started.elapsed());
                tracing::debug!(
                    processed = outcome.processed.len(),
                    duplicates = outcome.duplicates.len(),
                    refused = outcome.refused.len(),
                    "batch settled: ack"
                );
            }
            Err(err) => {
                self.metrics.count(Counter::Failure);
                facade::settled(&self.metric_keys, Settled::Failed, started.elapsed());
                let error = match err.inbox_error() {
                    Some(cause) => cause.to_string(),
                    None => err.handler_error().map(reported_text).unwrap_or_default(),
                };
                if err.is_permanent() {
                    tracing::warn!(%error, "batch failed for good: dead-letter");
                } else {
                    tracing::warn!(%error, "batch failed: nack");
                }
            }
        }
    }
}
