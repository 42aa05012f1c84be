use crate::backend::{DbErrorKind, classify, classify_in, missing_migration};
use crate::{InboxMigration, InboxTable, MessageId};
use sea_orm::DbErr;
use std::fmt;
use std::ops::RangeInclusive;
use std::time::Duration;

/// Everything that can go wrong in the inbox, in three groups by what the caller does
/// next ([`InboxError::kind`]):
///
/// - [`ErrorKind::Configuration`]: the setup cannot work (a setting
///   [out of range](Self::OutOfRange), a backend this build lacks, a migration that has
///   not run). Fix it; retrying cannot help.
/// - [`ErrorKind::Input`]: the message or the call's arguments can never succeed (a bad
///   consumer name, a nil message id, an empty batch), found before any SQL runs.
///   Dead-letter the message.
/// - [`ErrorKind::Runtime`]: the database or a task failed. Database failures keep the
///   original [`DbErr`] ([`db_err`](Self::db_err)); [`crate::classify`] tells transient
///   ones from the rest and [`is_permanent`](Self::is_permanent) whether a redelivery helps.
///
/// ```
/// use sea_orm_inbox::{ErrorKind, InboxError};
///
/// let err = InboxError::ConsumerTooLong { chars: 201 };
/// assert!(err.to_string().contains("at most 200"));
/// assert_eq!(err.kind(), ErrorKind::Input);
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    // Configuration (ErrorKind::Configuration): fix the setup, the build or the schema.
    /// The connection's backend is none of PostgreSQL, MySQL/MariaDB and SQLite.
    #[error(
        "the inbox supports PostgreSQL, MySQL/MariaDB and SQLite; this connection's backend is {backend}: connect the inbox to one of those"
    )]
    UnsupportedBackend {
        /// The backend SeaORM reported.
        backend: String,
    },

    /// The connection's backend is one the inbox supports, but this build of the crate was
    /// compiled without its cargo feature.
    #[error(
        "this connection is {backend}, but sea-orm-inbox was built without its `{feature}` feature: enable it in your Cargo.toml"
    )]
    BackendNotEnabled {
        /// The database the connection speaks to.
        backend: &'static str,
        /// The cargo feature of sea-orm-inbox that supports it.
        feature: &'static str,
    },

    /// The inbox table does not exist in the database the transaction runs on.
    #[error(
        "the inbox table does not exist: add sea_orm_inbox_migration::CreateInbox to your Migrator (or run sea_orm_inbox_migration::Migrator::up) before claiming messages ({source})"
    )]
    MissingTable {
        /// The database's own error.
        #[source]
        source: DbErr,
    },

    /// The inbox table lacks a column or the constraint that one of the inbox migrations
    /// adds: that migration has not run on this database.
    /// [`verify_schema`](crate::verify_schema) finds this at startup.
    #[error(
        "the inbox table lacks what {migration} adds: add it to your Migrator after the earlier inbox migrations and run it (or run sea_orm_inbox_migration::Migrator::up), and call sea_orm_inbox::verify_schema at startup ({source})"
    )]
    MissingMigration {
        /// The migration to add and run.
        migration: InboxMigration,
        /// The database's own error.
        #[source]
        source: DbErr,
    },

    /// A setting or value outside what the library or the inbox table accepts: a lease, a
    /// lock or partition timeout, an attempt count (at least 1, at most what the 32-bit
    /// `attempts` column holds), a retry backoff, a nack delay, a listing limit, a broker
    /// timestamp. The message says which value, the range accepted, and what to choose.
    #[error("{what} of {value} is outside {accepted}: {advice}")]
    OutOfRange {
        /// What the value is, e.g. `a lease` or `max_attempts`.
        what: &'static str,
        /// The rejected value.
        value: String,
        /// The values accepted, e.g. `1s..=86400s`.
        accepted: String,
        /// What to choose instead.
        advice: &'static str,
    },

    /// A retention setting that cannot work.
    #[error("invalid retention policy: {reason}")]
    InvalidRetention {
        /// What is wrong and what to change.
        reason: String,
    },

    /// An admission floor's clock-skew margin that is zero or not below the retention
    /// window.
    #[error(
        "an admission floor margin of {margin:?} must be above zero and below the retention window of {window:?}: choose the clock skew you tolerate (seconds to minutes), and size the window with that margin on top"
    )]
    InvalidAdmissionFloor {
        /// The rejected margin.
        margin: Duration,
        /// The retention window it was checked against.
        window: Duration,
    },

    /// [`crate::spawn_purger`] was called outside a tokio runtime.
    #[error("spawn_purger needs a tokio runtime: call it from async code running on tokio")]
    NoTokioRuntime,

    // Input (ErrorKind::Input): the message or the call's arguments can never succeed.
    /// A table or schema name [`InboxTable`](crate::InboxTable) refuses (it would need
    /// escaping in SQL, or is empty or too long).
    ///
    /// ```
    /// use sea_orm_inbox::{ErrorKind, InboxError, InboxTable};
    ///
    /// let err: InboxError = InboxTable::named("x; drop table inbox").unwrap_err().into();
    /// assert_eq!(err.kind(), ErrorKind::Input);
    /// ```
    #[error(transparent)]
    InvalidTableName(#[from] sea_orm_inbox_entity::InvalidTableName),

    /// The consumer name is empty or only white space.
    #[error(
        "the consumer name is empty: give each handler a stable, non-empty name such as \"billing.credit-account\""
    )]
    EmptyConsumer,

    /// The consumer name starts or ends with white space.
    #[error(
        "the consumer name {consumer:?} starts or ends with white space, which MySQL/MariaDB ignore when comparing: trim it"
    )]
    ConsumerNotTrimmed {
        /// The rejected name.
        consumer: String,
    },

    /// The consumer name holds a NUL character, which PostgreSQL cannot store in text.
    #[error(
        "the consumer name {consumer:?} holds a NUL character, which PostgreSQL cannot store: remove it"
    )]
    ConsumerContainsNul {
        /// The rejected name.
        consumer: String,
    },

    /// The consumer name does not fit the `consumer` column.
    #[error(
        "the consumer name is {chars} characters long; the inbox column holds at most 200: use a shorter, stable handler name"
    )]
    ConsumerTooLong {
        /// Length of the rejected name, in characters.
        chars: usize,
    },

    /// The message id is the nil UUID, which usually means an id that was never set.
    #[error(
        "the message id is the nil UUID: derive it from the broker's message id or a business key that stays the same across redeliveries"
    )]
    NilMessageId,

    /// A field a [`MessageId`] key is derived from is empty or only white space.
    #[error(
        "the {field} is empty: a key must come from a value the broker repeats on every redelivery of the message"
    )]
    EmptyKeyField {
        /// Which field was empty.
        field: &'static str,
    },

    /// A Kafka partition or offset is negative (librdkafka uses negative values as
    /// "unset" markers, never as a record's position).
    #[error(
        "Kafka partition {partition} / offset {offset} is not a record position: pass the record's own partition and offset (both >= 0)"
    )]
    NegativeKafkaPosition {
        /// The partition given.
        partition: i32,
        /// The offset given.
        offset: i64,
    },

    /// A batch claim got no message ids.
    #[error("the batch holds no message ids: skip the claim when the broker delivered nothing")]
    EmptyBatch,

    /// A batch claim got more distinct message ids than one statement may carry.
    #[error(
        "the batch holds {len} distinct message ids; claim at most {max} per call: split the batch"
    )]
    BatchTooLarge {
        /// Distinct ids in the rejected batch.
        len: usize,
        /// The largest batch accepted, [`crate::MAX_CLAIM_BATCH`].
        max: usize,
    },

    // Runtime (ErrorKind::Runtime): the database or a task failed; see is_permanent.
    /// The database failed for another reason: a connection problem, a lock timeout, or a
    /// unique violation on an index other than the inbox's (a real bug, never a duplicate).
    /// The message says which, and what to do.
    #[error(
        "handling message {message_id} for consumer {consumer:?}, the database failed: {source}. {}",
        advice(.source)
    )]
    Database {
        /// The message being claimed.
        message_id: MessageId,
        /// The consumer claiming it.
        consumer: String,
        /// The database's own error.
        #[source]
        source: DbErr,
    },

    /// Before COMMIT, the claim's transaction could not prove it still held its markers,
    /// of one message or of a batch: the database had already ended the transaction
    /// (PostgreSQL aborts it after any failed statement and then answers COMMIT with
    /// ROLLBACK; InnoDB rolls it back on a deadlock, on a Galera certification conflict,
    /// and on a lock wait timeout only with `innodb_rollback_on_timeout = ON`), yet the
    /// caller went on; or the check itself failed (`source`, which
    /// [`classify`](crate::classify) tells transient or not). The transaction was rolled
    /// back: nothing of the claim was committed.
    #[error(
        "the transaction claiming {} for consumer {consumer:?} could not prove its markers before COMMIT{}: the database ends a transaction on a failed statement (PostgreSQL), a deadlock or a Galera certification conflict, and the caller went on. Nothing of the claim was committed: nack the message so the broker redelivers it (for a batch: re-run the whole batch in a new transaction or nack it), and return database errors at the first failed statement instead of swallowing them (on MySQL/MariaDB the statements after the end ran outside the transaction and committed on their own)",
        claimed(.message_ids),
        .source.as_ref().map(|err| format!(" (the check said: {err})")).unwrap_or_default()
    )]
    ClaimLost {
        /// The messages whose claims were lost: the one message of
        /// [`claim_message`](crate::InboxTransactionExt::claim_message) or
        /// [`Inbox::process`](crate::Inbox::process), or every id a batch newly claimed
        /// (none for a batch that claimed no new id).
        message_ids: Vec<MessageId>,
        /// The consumer that claimed them.
        consumer: String,
        /// The error the check met (PostgreSQL: 25P02; a lost connection), if it did not
        /// simply find the marker gone.
        #[source]
        source: Option<DbErr>,
    },

    /// A claim's proof ([`ClaimedMessage::commit`](crate::ClaimedMessage::commit),
    /// [`ClaimedMessage::ensure_held`](crate::ClaimedMessage::ensure_held),
    /// [`BatchClaim::commit`](crate::BatchClaim::commit)) was given a transaction other
    /// than the one that claimed: one begun after the claiming transaction committed on
    /// its own, or one that claimed something else. It vouches for nothing of it: `commit`
    /// rolled it back, nothing of it was committed. A bug in the calling code: commit each
    /// claim through the transaction whose `claim_message` (or `claim_batch`) returned it.
    #[error(
        "the claim of {} for consumer {consumer:?} was given a transaction other than the one that claimed it, which it cannot vouch for: nothing of that transaction was committed (commit rolled it back). Commit each claim through the transaction whose claim_message or claim_batch returned it, and never commit the claiming transaction on its own first",
        claimed(.message_ids)
    )]
    NotTheClaimingTransaction {
        /// The messages of the claim.
        message_ids: Vec<MessageId>,
        /// The consumer that claimed them.
        consumer: String,
    },

    /// Before COMMIT, the claim's transaction no longer held its marker although every
    /// statement in it had succeeded: the database ended it on its own (a Galera
    /// brute-force abort by a conflicting write certified on another node, between two
    /// statements). `Inbox::process` retries such an attempt in a fresh transaction; this
    /// error comes back only when the attempts ran out. Nothing of the claim was committed.
    #[error(
        "the transaction claiming message {message_id} for consumer {consumer:?} was ended by the database before COMMIT although none of its statements failed (on Galera: a conflicting write certified on another node aborted it). Nothing of the claim was committed: nack the message so the broker redelivers it"
    )]
    EndedByDatabase {
        /// The message whose claim was lost.
        message_id: MessageId,
        /// The consumer that claimed it.
        consumer: String,
    },

    /// A two-phase completion whose lease is no longer the current one: after it expired,
    /// another claimant took the message over (or it was parked as dead), so this
    /// claimant must not record the outcome.
    #[error(
        "the lease of attempt {attempt} on message {message_id} for consumer {consumer:?} is stale: another claimant took over after it expired, or it was parked as dead; do not record the result (the side effect was called with the same idempotency key, so the provider can deduplicate it)"
    )]
    StaleLease {
        /// The message of the stale lease.
        message_id: MessageId,
        /// The consumer of the stale lease.
        consumer: String,
        /// The attempt the stale lease belonged to.
        attempt: u32,
    },

    /// One step of a claim did not finish within its bound, the partition timeout: the
    /// database stopped answering (the network dropped the flow, or the server hangs), or
    /// the handler ran longer than the bound. The library gave up on the connection (it is
    /// not reused), and the server ends the abandoned transaction after the same timeout,
    /// releasing the claim. For a claim on your own transaction (`txn.claim_message`,
    /// `ClaimedMessage::commit`), drop the transaction; the bound is
    /// [`Inbox::DEFAULT_PARTITION_TIMEOUT`](crate::Inbox::DEFAULT_PARTITION_TIMEOUT), and
    /// on MySQL/MariaDB the server ends the transaction only if the pool sets
    /// `idle_transaction_timeout`.
    #[error(
        "{step} got no answer within {waited:?} for message {message_id} of consumer {consumer:?} (a network partition or a hung database; for the handler, also work slower than the partition timeout): nack the message; the server ends the abandoned transaction after the partition timeout (on MySQL/MariaDB, for a claim on your own transaction, only if the pool sets idle_transaction_timeout), so a redelivery can claim it{}",
        if *commit_in_doubt { ". A COMMIT of this call went unanswered and may have landed: then the redelivery finds the work done" } else { "" }
    )]
    DatabaseUnresponsive {
        /// The message being claimed.
        message_id: MessageId,
        /// The consumer claiming it.
        consumer: String,
        /// What went unanswered: `BEGIN`, `the claim`, `the handler`, `COMMIT`...
        step: &'static str,
        /// How long the library waited.
        waited: Duration,
        /// Whether a COMMIT of this call went unanswered, so the work may have committed
        /// (the redelivery then finds the marker). `false`: nothing of the call committed.
        commit_in_doubt: bool,
    },

    /// A database operation not about one message (a purge statement, a listing) got no
    /// answer within its partition timeout: the network to the database went silent (a
    /// partition that drops packets without a reset) or the server hangs. The library gave
    /// up on the connection (it is not reused); what finished before stays done. Retry
    /// later: a background [`Purger`](crate::Purger) tries again at its next run.
    #[error(
        "{operation} got no answer from the database within {waited:?} (a network partition or a hung database): retry later; what completed before it stays done"
    )]
    DatabaseSilent {
        /// What went unanswered, e.g. `deleting a purge batch`.
        operation: &'static str,
        /// How long the library waited.
        waited: Duration,
    },

    /// A database operation not about one message (a purge, a listing) failed.
    #[error("{operation} failed: {source}")]
    Query {
        /// What the library was doing.
        operation: &'static str,
        /// The database's own error.
        #[source]
        source: DbErr,
    },

    /// The background purger task ended abnormally.
    #[error("the purger task ended abnormally: {reason}")]
    PurgerStopped {
        /// What the runtime reported.
        reason: String,
    },
}

impl InboxError {
    /// The error for a database failure while claiming `message_id` for `consumer` in the
    /// inbox in `table`: [`MissingTable`](Self::MissingTable) or
    /// [`MissingMigration`](Self::MissingMigration) when the database says so of that
    /// table, else [`Database`](Self::Database).
    pub(crate) fn from_claim(
        source: DbErr,
        table: &InboxTable,
        message_id: MessageId,
        consumer: &str,
    ) -> Self {
        if let Some(migration) = missing_migration(&source) {
            return Self::MissingMigration { migration, source };
        }
        match classify_in(&source, table) {
            crate::DbErrorKind::MissingInboxTable => Self::MissingTable { source },
            _ => Self::Database {
                message_id,
                consumer: consumer.to_owned(),
                source,
            },
        }
    }

    /// What the caller does next about this error, by its [`ErrorKind`]: fix the setup
    /// ([`Configuration`](ErrorKind::Configuration)), give up on the message or the call
    /// ([`Input`](ErrorKind::Input)), or treat it as a run-time failure
    /// ([`Runtime`](ErrorKind::Runtime)), which [`is_permanent`](Self::is_permanent) tells
    /// worth a redelivery or not.
    ///
    /// ```
    /// use sea_orm_inbox::{ErrorKind, InboxError, LeaseOptions};
    /// use std::time::Duration;
    ///
    /// let err = LeaseOptions::new(Duration::ZERO).unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::Configuration);
    /// assert_eq!(InboxError::NilMessageId.kind(), ErrorKind::Input);
    /// ```
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::UnsupportedBackend { .. }
            | Self::BackendNotEnabled { .. }
            | Self::MissingTable { .. }
            | Self::MissingMigration { .. }
            | Self::OutOfRange { .. }
            | Self::InvalidRetention { .. }
            | Self::InvalidAdmissionFloor { .. }
            | Self::NoTokioRuntime
            | Self::NotTheClaimingTransaction { .. } => ErrorKind::Configuration,
            Self::InvalidTableName(_)
            | Self::EmptyConsumer
            | Self::ConsumerNotTrimmed { .. }
            | Self::ConsumerContainsNul { .. }
            | Self::ConsumerTooLong { .. }
            | Self::NilMessageId
            | Self::EmptyKeyField { .. }
            | Self::NegativeKafkaPosition { .. }
            | Self::EmptyBatch
            | Self::BatchTooLarge { .. } => ErrorKind::Input,
            Self::Database { .. }
            | Self::ClaimLost { .. }
            | Self::EndedByDatabase { .. }
            | Self::StaleLease { .. }
            | Self::DatabaseUnresponsive { .. }
            | Self::DatabaseSilent { .. }
            | Self::Query { .. }
            | Self::PurgerStopped { .. } => ErrorKind::Runtime,
        }
    }

    /// Whether redelivering the message cannot help: the input is invalid (a nil message
    /// id, a bad consumer name or key field), the configuration or the build cannot work
    /// (a backend whose feature is off, a setting out of range), or the database says the
    /// schema or the data is wrong ([`DbErrorKind::is_permanent`]: a missing table or
    /// column, a unique violation of another index). [`crate::Settlement`] dead-letters
    /// these; everything else (transient failures, a lost claim, an unknown database
    /// error) is worth a redelivery.
    ///
    /// Dead-lettered messages are kept by the broker: replay them once the cause is fixed.
    ///
    /// ```
    /// use sea_orm_inbox::InboxError;
    ///
    /// assert!(InboxError::NilMessageId.is_permanent());
    /// assert!(!InboxError::PurgerStopped { reason: "panicked".into() }.is_permanent());
    /// ```
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::Database { source, .. } | Self::Query { source, .. } => {
                classify(source).is_permanent()
            }
            _ => self.kind() != ErrorKind::Runtime,
        }
    }

    /// The underlying database error, if this error came from the database.
    pub fn db_err(&self) -> Option<&DbErr> {
        match self {
            Self::MissingTable { source }
            | Self::MissingMigration { source, .. }
            | Self::Database { source, .. }
            | Self::Query { source, .. } => Some(source),
            Self::ClaimLost { source, .. } => source.as_ref(),
            _ => None,
        }
    }

    /// The error for `value` outside `accepted`, with `advice` on what to choose.
    pub(crate) fn out_of_range<T: fmt::Debug>(
        what: &'static str,
        value: T,
        accepted: RangeInclusive<T>,
        advice: &'static str,
    ) -> Self {
        Self::OutOfRange {
            what,
            value: format!("{value:?}"),
            accepted: format!("{:?}..={:?}", accepted.start(), accepted.end()),
            advice,
        }
    }
}

/// What a caller does next about an [`InboxError`] ([`InboxError::kind`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The setup cannot work: a setting out of range, a backend this build does not
    /// support, a migration that has not run, no tokio runtime. Retrying cannot help: fix
    /// the code, the build or the schema (ideally at startup, where
    /// [`verify_schema`](crate::verify_schema) and the settings' constructors find these).
    Configuration,
    /// The message or the call's arguments can never succeed: a nil message id, a bad
    /// consumer name or key field, an empty or oversized batch. Dead-letter the message
    /// ([`crate::Settlement`] does) and fix the producer or the call.
    Input,
    /// The database, the network or a background task failed while running: a
    /// transient failure, a lost claim, a stale lease, an unanswered statement.
    /// [`InboxError::is_permanent`] tells whether a redelivery can help (most can).
    Runtime,
}

/// The claim an [`InboxError::ClaimLost`] names: its one message, or a batch by its size.
fn claimed(message_ids: &[MessageId]) -> String {
    match message_ids {
        [message_id] => format!("message {message_id}"),
        ids => format!("a batch of {} new messages", ids.len()),
    }
}

/// What to do about a database failure, by its kind.
fn advice(err: &DbErr) -> &'static str {
    match classify(err) {
        DbErrorKind::Transient => {
            "This failure is transient (lost connection, deadlock, lock timeout or busy database): nack the message so the broker redelivers it (Inbox::process already retried it per its RetryPolicy)"
        }
        DbErrorKind::OtherUniqueViolation => {
            "This unique violation is on another index than the inbox's, so it is not a duplicate delivery: fix the handler's data or writes, and dead-letter the message meanwhile"
        }
        DbErrorKind::MissingInboxTable => {
            "Add sea_orm_inbox_migration::CreateInbox to your Migrator (or run sea_orm_inbox_migration::Migrator::up)"
        }
        DbErrorKind::MissingColumn => {
            "A column is missing: run every migration of your Migrator (sea_orm_inbox_migration's included), and dead-letter the message meanwhile"
        }
        DbErrorKind::InboxDuplicate | DbErrorKind::PossibleInboxDuplicate => {
            "This unique violation names the inbox's index, yet no marker of this message exists: the index is a namesake on another table (MariaDB names the key, not its table; CREATE TABLE ... LIKE inbox copies the name), written by a trigger or the handler. This is not a duplicate delivery: rename that index or fix the write, and dead-letter the message meanwhile"
        }
        _ => {
            "Nack the message so the broker redelivers it; if it keeps failing, check the database error above (permissions, schema, server state)"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sea_orm::{ConnAcquireErr, DbErr};

    fn database(source: DbErr) -> String {
        InboxError::Database {
            message_id: MessageId::from(uuid::Uuid::from_u128(7)),
            consumer: "billing".into(),
            source,
        }
        .to_string()
    }

    /// Every error message says what to do, not only what went wrong.
    #[test]
    fn every_message_tells_the_user_what_to_do() {
        let cases = [
            (InboxError::EmptyConsumer.to_string(), "give each handler"),
            (
                InboxError::ConsumerTooLong { chars: 201 }.to_string(),
                "use a shorter",
            ),
            (InboxError::NilMessageId.to_string(), "derive it from"),
            (
                InboxError::ConsumerContainsNul {
                    consumer: "bill\0ing".into(),
                }
                .to_string(),
                "remove it",
            ),
            (
                InboxError::MissingTable {
                    source: DbErr::Custom("no such table: inbox".into()),
                }
                .to_string(),
                "add sea_orm_inbox_migration::CreateInbox",
            ),
            (
                InboxError::MissingMigration {
                    migration: InboxMigration::AddInboxLeases,
                    source: DbErr::Custom("no such column: claim_token".into()),
                }
                .to_string(),
                "sea_orm_inbox_migration::AddInboxLeases (m20261130_000002_add_inbox_leases) adds: add it to your Migrator",
            ),
            (
                InboxError::UnsupportedBackend {
                    backend: "Oracle".into(),
                }
                .to_string(),
                "connect the inbox to one of those",
            ),
            (
                InboxError::BackendNotEnabled {
                    backend: "SQLite",
                    feature: "sqlite",
                }
                .to_string(),
                "enable it in your Cargo.toml",
            ),
            (
                database(DbErr::ConnectionAcquire(ConnAcquireErr::Timeout)),
                "nack the message so the broker redelivers it",
            ),
            (
                database(DbErr::Custom("permission denied".into())),
                "Nack the message",
            ),
            (
                InboxError::DatabaseUnresponsive {
                    message_id: MessageId::from(uuid::Uuid::from_u128(7)),
                    consumer: "billing".into(),
                    step: "COMMIT",
                    waited: Duration::from_secs(20),
                    commit_in_doubt: true,
                }
                .to_string(),
                "nack the message",
            ),
            (
                InboxError::DatabaseSilent {
                    operation: "deleting a purge batch",
                    waited: Duration::from_secs(20),
                }
                .to_string(),
                "retry later",
            ),
            (
                InboxError::out_of_range(
                    "a partition timeout",
                    Duration::ZERO,
                    Duration::from_secs(1)..=Duration::from_secs(1800),
                    "choose one well below the broker's redelivery timeout (JetStream AckWait, SQS visibility timeout, RabbitMQ consumer timeout) and above your slowest handler",
                )
                .to_string(),
                "choose one well below the broker's redelivery timeout",
            ),
            (
                InboxError::ClaimLost {
                    message_ids: vec![MessageId::from(uuid::Uuid::from_u128(7)); 3],
                    consumer: "projector".into(),
                    source: None,
                }
                .to_string(),
                "re-run the whole batch in a new transaction or nack it",
            ),
            (
                InboxError::ClaimLost {
                    message_ids: vec![MessageId::from(uuid::Uuid::from_u128(7))],
                    consumer: "billing".into(),
                    source: None,
                }
                .to_string(),
                "claiming message 00000000-0000-0000-0000-000000000007 for consumer \"billing\"",
            ),
            (
                InboxError::InvalidAdmissionFloor {
                    margin: Duration::from_secs(7200),
                    window: Duration::from_secs(3600),
                }
                .to_string(),
                "size the window with that margin on top",
            ),
        ];
        for (message, instruction) in cases {
            assert!(
                message.contains(instruction),
                "{message:?} should say {instruction:?}"
            );
        }
    }

    /// Settings out of range share one shape and one kind, and say what was accepted.
    #[test]
    fn settings_out_of_range_are_configuration_errors() {
        let errors = [
            crate::LeaseOptions::new(Duration::ZERO).expect_err("too short"),
            crate::Inbox::new("billing")
                .and_then(|inbox| inbox.with_lock_timeout(Duration::from_secs(60)))
                .expect_err("too long"),
            crate::RetryPolicy::default()
                .backoff(Duration::ZERO, Duration::from_secs(3600))
                .expect_err("too long"),
            crate::LeaseOptions::new(Duration::from_secs(30))
                .and_then(|options| options.with_max_attempts(0))
                .expect_err("zero"),
        ];
        for err in errors {
            assert!(matches!(err, InboxError::OutOfRange { .. }), "{err:?}");
            assert_eq!(err.kind(), ErrorKind::Configuration, "{err}");
            assert!(err.is_permanent(), "{err}");
            assert!(err.to_string().contains("..="), "{err}");
        }
        let zero = crate::LeaseOptions::new(Duration::from_secs(30))
            .and_then(|options| options.with_max_attempts(0))
            .expect_err("zero")
            .to_string();
        assert!(
            zero.starts_with("max_attempts of 0 is outside 1..=")
                && zero.contains("a claim needs one attempt"),
            "{zero}"
        );
    }

    #[test]
    fn runtime_errors_are_permanent_only_when_the_database_says_so() {
        let transient = InboxError::Query {
            operation: "deleting a purge batch",
            source: DbErr::ConnectionAcquire(ConnAcquireErr::Timeout),
        };
        assert_eq!(transient.kind(), ErrorKind::Runtime);
        assert!(!transient.is_permanent());
        let stale = InboxError::StaleLease {
            message_id: MessageId::from(uuid::Uuid::from_u128(7)),
            consumer: "billing".into(),
            attempt: 2,
        };
        assert_eq!(stale.kind(), ErrorKind::Runtime);
        assert!(!stale.is_permanent());
        assert_eq!(InboxError::EmptyBatch.kind(), ErrorKind::Input);
        assert!(InboxError::EmptyBatch.is_permanent());
    }

    #[test]
    fn an_unanswered_commit_says_it_may_have_landed() {
        let unresponsive = |step, commit_in_doubt| InboxError::DatabaseUnresponsive {
            message_id: MessageId::from(uuid::Uuid::from_u128(7)),
            consumer: "billing".into(),
            step,
            waited: Duration::from_secs(20),
            commit_in_doubt,
        };
        let commit = unresponsive("COMMIT", true).to_string();
        assert!(commit.contains("may have landed"), "{commit}");
        let handler = unresponsive("the handler", false).to_string();
        assert!(!handler.contains("may have landed"), "{handler}");
        assert!(
            handler.starts_with("the handler got no answer within 20s"),
            "{handler}"
        );
    }

    #[test]
    fn database_errors_name_the_message_and_consumer() {
        let message = database(DbErr::Custom("boom".into()));
        assert!(
            message.contains("00000000-0000-0000-0000-000000000007"),
            "{message}"
        );
        assert!(message.contains("\"billing\""), "{message}");
        assert!(message.contains("boom"), "{message}");
    }
}
