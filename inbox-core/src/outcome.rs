use crate::{InboxError, Refusal};
use std::fmt;

/// What [`Inbox::process`](crate::Inbox::process) did with a delivery. `Processed` and
/// `Duplicate` mean the message is done: acknowledge it. `Refused` means dead-letter it.
/// [`Settlement::of`] says which.
#[must_use = "settle the message: Processed and Duplicate mean ack, Refused means dead-letter"]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome<T> {
    /// This delivery claimed the message, the handler ran, and its transaction committed;
    /// the value is the one of the attempt that committed. That holds when a COMMIT's reply
    /// was lost too: the retry finds the marker carrying this call's token and returns
    /// that attempt's value without running the handler again.
    Processed(T),
    /// Another delivery (an earlier one, or another replica's) already processed the
    /// message for this consumer; the handler did not run in this call, or ran only in
    /// attempts that rolled back.
    Duplicate,
    /// The [admission floor](crate::AdmissionFloor) refused the delivery: it was sent so
    /// long ago that its marker may already be purged, so running it could apply it a
    /// second time. Nothing was written and the handler did not run. Dead-letter it
    /// ([`Settlement::DeadLetter`]); never requeue it.
    Refused(Refusal),
}

impl<T> Outcome<T> {
    /// The handler's value, if this delivery ran it.
    pub fn processed(self) -> Option<T> {
        match self {
            Outcome::Processed(value) => Some(value),
            Outcome::Duplicate | Outcome::Refused(_) => None,
        }
    }

    /// Whether the message had already been processed.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Outcome::Duplicate)
    }

    /// Why the admission floor refused the delivery, if it did.
    pub fn refusal(&self) -> Option<Refusal> {
        match self {
            Outcome::Refused(refusal) => Some(*refusal),
            Outcome::Processed(_) | Outcome::Duplicate => None,
        }
    }
}

/// Why [`Inbox::process`](crate::Inbox::process) did not finish a delivery. Every variant
/// means: do not acknowledge; nack or abandon the message so the broker redelivers it (or
/// dead-letters it after its own limit).
///
/// Nothing of this call committed, with one exception: when a COMMIT of the call failed
/// (its reply lost with the connection, or unanswered in a partition, so the client cannot
/// know) and no later attempt found out, the work may have committed
/// ([`InboxError::DatabaseUnresponsive`] then says `commit_in_doubt`). Nacking is still right: the redelivery then finds the marker
/// and reports [`Outcome::Duplicate`], and the effect stays applied once. (While attempts
/// remain, `process` settles that doubt itself and returns [`Outcome::Processed`].)
#[derive(Debug)]
#[non_exhaustive]
pub enum ProcessError<E> {
    /// The handler returned an error; its transaction rolled back. Not retried here (the
    /// broker's redelivery is the retry), unless it was a transient database error (see
    /// [`Inbox::process`](crate::Inbox::process)), which is returned here once the
    /// attempts run out.
    Handler(E),
    /// A database or input failure that retrying would not fix (a missing table, a unique
    /// violation on another index, a nil message id...).
    Inbox(InboxError),
    /// Every attempt met a transient database failure; `source` is the last one.
    RetriesExhausted {
        /// Attempts made, the first included.
        attempts: u32,
        /// The failure of the last attempt.
        source: InboxError,
    },
}

impl<E> ProcessError<E> {
    /// The handler's error, if the handler failed.
    pub fn handler_error(&self) -> Option<&E> {
        match self {
            ProcessError::Handler(err) => Some(err),
            ProcessError::Inbox(_) | ProcessError::RetriesExhausted { .. } => None,
        }
    }

    /// The inbox's own error, if the failure was not the handler's.
    pub fn inbox_error(&self) -> Option<&InboxError> {
        match self {
            ProcessError::Inbox(err) | ProcessError::RetriesExhausted { source: err, .. } => {
                Some(err)
            }
            ProcessError::Handler(_) => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for ProcessError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProcessError::Handler(err) => {
                write!(
                    f,
                    "the handler failed and its transaction was rolled back: {err}. Nack the message so the broker redelivers it (or dead-letters it after its delivery limit)"
                )
            }
            ProcessError::Inbox(err) => err.fmt(f),
            ProcessError::RetriesExhausted { attempts, source } => write!(
                f,
                "gave up after {attempts} attempts on transient database failures; nack the message so the broker redelivers it later. Last failure: {source}"
            ),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for ProcessError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ProcessError::Handler(err) => Some(err),
            ProcessError::Inbox(err) | ProcessError::RetriesExhausted { source: err, .. } => {
                Some(err)
            }
        }
    }
}

/// What to tell the broker about a delivery: the one place that maps results to acks.
///
/// ```
/// use sea_orm_inbox::{Outcome, ProcessError, Settlement};
///
/// let done: Result<Outcome<()>, ProcessError<String>> = Ok(Outcome::Duplicate);
/// assert_eq!(Settlement::of(&done), Settlement::Ack);
/// let failed: Result<Outcome<()>, ProcessError<String>> = Err(ProcessError::Handler("boom".into()));
/// assert_eq!(Settlement::of(&failed), Settlement::Nack);
/// ```
///
/// Map it to the broker's verbs once, in the consumer loop:
///
/// | settlement | RabbitMQ (lapin) | JetStream (async-nats) | Kafka |
/// | --- | --- | --- | --- |
/// | `Ack` | `basic_ack` | `ack()` | commit the offset |
/// | `Nack` | `basic_nack`, `requeue: true` | `ack_with(AckKind::Nak(None))` | seek back, consume again |
/// | `DeadLetter` | `basic_reject`, `requeue: false` (routes to the dead-letter exchange) | `ack_with(AckKind::Term)` | produce to a dead-letter topic, commit the offset |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Settlement {
    /// Acknowledge: the message was processed now or before ([`Outcome::Processed`],
    /// [`Outcome::Duplicate`]). Never nack a duplicate: it would bounce to the dead-letter
    /// queue.
    Ack,
    /// Negative-acknowledge or abandon: let the broker redeliver. Nothing committed, or
    /// (a lost COMMIT reply on the last attempt) the redelivery will find it committed and
    /// be a duplicate: see [`ProcessError`].
    Nack,
    /// Move the message to the dead-letter queue without requeueing it: running it could
    /// do harm ([`Outcome::Refused`]). Nothing was written; a human decides.
    DeadLetter,
}

impl Settlement {
    /// The settlement for the result of [`Inbox::process`](crate::Inbox::process).
    pub fn of<T, E>(result: &Result<Outcome<T>, ProcessError<E>>) -> Self {
        match result {
            Ok(Outcome::Processed(_) | Outcome::Duplicate) => Settlement::Ack,
            Ok(Outcome::Refused(_)) => Settlement::DeadLetter,
            Err(_) => Settlement::Nack,
        }
    }
}
