#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

#[cfg(not(any(feature = "postgres", feature = "mysql", feature = "sqlite")))]
compile_error!("enable at least one of sea-orm-inbox's backend features: postgres, mysql, sqlite");

mod admission;
mod backend;
mod brokers;
mod cause;
mod claim;
mod clock;
mod consumer;
mod error;
pub mod guide;
mod inbox;
mod lease;
mod message_id;
mod metrics;
mod observed;
mod outbox;
mod outcome;
mod pooler;
pub mod prelude;
mod retention;
mod retry;
mod schema;
mod session;
mod silence;

/// The workspace README's code blocks, compiled as doctests (`cargo test -p sea-orm-inbox
/// --doc --features postgres,mysql,sqlite`). Only under `cfg(doctest)`: the README lies outside the package, so a normal or
/// packaged build must not read it.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct WorkspaceReadme;

pub use admission::{AdmissionFloor, Delivery, Refusal};
pub use backend::{
    CLAIM_TRANSACTION, DbErrorKind, classify, classify_in, is_inbox_duplicate,
    is_inbox_duplicate_in, timestamp_value,
};
#[cfg(feature = "async-nats")]
pub use brokers::jetstream;
#[cfg(feature = "rdkafka")]
pub use brokers::kafka;
#[cfg(feature = "lapin")]
pub use brokers::rabbitmq;
#[cfg(feature = "aws-sdk-sqs")]
pub use brokers::sqs;
pub use brokers::{BoxError, PublishError, Publisher};
#[cfg(any(
    feature = "lapin",
    feature = "async-nats",
    feature = "rdkafka",
    feature = "aws-sdk-sqs"
))]
pub use brokers::{ConsumerError, ConsumerOptions, ConsumerSummary};
#[cfg(any(feature = "lapin", feature = "async-nats", feature = "aws-sdk-sqs"))]
pub use brokers::{MessageHandler, Received};
pub use cause::{Permanent, Transient};
pub use claim::{
    BatchClaim, Claim, ClaimedMessage, ClaimingTransaction, InboxTransactionExt, MAX_CLAIM_BATCH,
};
pub use error::{ErrorKind, InboxError};
pub use inbox::{BatchOutcome, HandlerFuture, Inbox};
pub use lease::{
    ClaimToken, DeadClaim, ExpiredLease, Lease, LeaseClaim, LeaseOptions, claim_lease,
    claim_lease_in, claim_lease_with_token, list_dead_claims, list_dead_claims_in,
    list_expired_leases, list_expired_leases_in,
};
pub use message_id::{MESSAGE_ID_NAMESPACE, MessageId};
pub use metrics::{InboxMetrics, MetricsSnapshot, metric_names};
#[cfg(feature = "stream")]
pub use observed::ObservedStream;
pub use observed::ObservedTransaction;
pub use outbox::{
    DeadMessage, OUTBOX_CHANNEL, OutboxBacklog, OutboxError, OutboxExt, OutboxMessage,
    OutboxMetrics, OutboxMetricsSnapshot, OutboxPurger, OutboxPurgerSummary, OutboxWaker,
    OutgoingMessage, Relay, RelayOptions, RelayReport, list_dead_messages, outbox_backlog,
    purge_sent_messages, requeue_dead_message, spawn_outbox_purger,
};
pub use outcome::{NackDelay, Outcome, ProcessError, Settlement};
#[cfg(feature = "postgres")]
pub use pooler::for_transaction_pooler;
pub use retention::{
    BrokerRedelivery, PurgePacing, PurgeReport, Purger, PurgerSummary, RetentionPolicy, purge,
    purge_in, spawn_purger, spawn_purger_in,
};
pub use retry::RetryPolicy;
pub use schema::{
    InboxMigration, SchemaError, verify_outbox_schema, verify_schema, verify_schema_in,
};
pub use sea_orm_inbox_entity::{
    CONSUMER_MAX_CHARS, DESTINATION_MAX_CHARS, INDEX_NAME, InboxTable, InvalidTableName, NameOf,
    OUTBOX_MESSAGE_ID_INDEX_NAME, OUTBOX_TABLE_NAME, PARTITION_KEY_MAX_CHARS,
    RECEIVED_AT_INDEX_NAME, SCHEMA_NAME_MAX_LEN, TABLE_NAME, TABLE_NAME_MAX_LEN,
};
pub use session::bound_connections;
#[cfg(feature = "mysql")]
pub use session::bound_mysql_lock_waits;
