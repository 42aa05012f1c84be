//! The startup check: does this build and this database have everything the inbox needs?
//!
//! A database that ran only some of the inbox migrations fails on every delivery, and a
//! redelivery loop then hammers it; [`verify_schema`] finds the gap once, at boot, and
//! names the migration (or cargo feature) to add.

use crate::backend::{self, SchemaCatalog};
use crate::silence::answered_within;
use crate::{Inbox, InboxError};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbErr, QueryResult, Statement, TransactionTrait,
};
use sea_orm::{IdenStatic, Iterable};
use sea_orm_inbox_entity::{INDEX_NAME, InboxTable, outbox};
use std::fmt;
use std::time::Duration;

/// One of the migrations of `sea-orm-inbox-migration`, by the type you add to your
/// `Migrator` and the stable name SeaORM records for it.
///
/// ```
/// use sea_orm_inbox::InboxMigration;
///
/// assert_eq!(InboxMigration::AddInboxLeases.name(), "m20261130_000002_add_inbox_leases");
/// assert_eq!(
///     InboxMigration::AddInboxLeases.to_string(),
///     "sea_orm_inbox_migration::AddInboxLeases (m20261130_000002_add_inbox_leases)"
/// );
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum InboxMigration {
    /// `CreateInbox`: the table and its unique index.
    CreateInbox,
    /// `AddInboxLeases`: the columns of two-phase claims and of `Inbox::process`'s token
    /// (`attempts`, `lease_until`, `claim_token`, `dead_at`) and the purge's index.
    AddInboxLeases,
    /// `InboxUniqueConstraint`: on PostgreSQL, the unique index as a named constraint. No
    /// claim needs it any more (they infer the unique key from its columns, index or
    /// constraint alike), so nothing reports it missing; it stays a migration of the list.
    InboxUniqueConstraint,
}

impl InboxMigration {
    /// The stable name SeaORM records in `seaql_migrations`.
    pub fn name(self) -> &'static str {
        match self {
            Self::CreateInbox => "m20261130_000001_create_inbox",
            Self::AddInboxLeases => "m20261130_000002_add_inbox_leases",
            Self::InboxUniqueConstraint => "m20261201_000003_inbox_unique_constraint",
        }
    }

    /// The migration's type in `sea-orm-inbox-migration`.
    pub fn type_name(self) -> &'static str {
        match self {
            Self::CreateInbox => "CreateInbox",
            Self::AddInboxLeases => "AddInboxLeases",
            Self::InboxUniqueConstraint => "InboxUniqueConstraint",
        }
    }
}

impl fmt::Display for InboxMigration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sea_orm_inbox_migration::{} ({})",
            self.type_name(),
            self.name()
        )
    }
}

/// What [`verify_schema`] found missing or wrong. Each message says what to add or change;
/// none of them goes away by retrying, so stop the application (or keep it from
/// consuming) until it is fixed. The exceptions are about reaching the database, not
/// the schema: [`Catalog`](Self::Catalog) and [`DatabaseSilent`](Self::DatabaseSilent).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchemaError {
    /// The connection's database is one the inbox supports, but this build of the crate
    /// was compiled without its cargo feature.
    #[error(
        "this connection is {backend}, but sea-orm-inbox was built without its `{feature}` feature: enable it in your Cargo.toml"
    )]
    BackendNotEnabled {
        /// The database the connection speaks to.
        backend: &'static str,
        /// The cargo feature of sea-orm-inbox that supports it.
        feature: &'static str,
    },

    /// The connection's backend is none of PostgreSQL, MySQL/MariaDB and SQLite.
    #[error(
        "the inbox supports PostgreSQL, MySQL/MariaDB and SQLite; this connection's backend is {backend}: connect the inbox to one of those"
    )]
    UnsupportedBackend {
        /// The backend SeaORM reported.
        backend: String,
    },

    /// The inbox table does not exist.
    #[error(
        "the inbox table does not exist: add every migration of sea_orm_inbox_migration to your Migrator, starting with {}, and run it (or run sea_orm_inbox_migration::Migrator::up)",
        InboxMigration::CreateInbox
    )]
    MissingTable,

    /// The inbox table lacks what a migration adds: that migration has not run.
    #[error(
        "the inbox table lacks {missing}, which {migration} adds: add it to your Migrator after the earlier inbox migrations and run it (or run sea_orm_inbox_migration::Migrator::up)"
    )]
    MissingMigration {
        /// The migration to add and run.
        migration: InboxMigration,
        /// What is missing (the columns).
        missing: String,
    },

    /// The inbox table has no index named `ix_inbox_message_id_consumer`.
    #[error(
        "the inbox table has no index named {INDEX_NAME}, so nothing stops two deliveries from both claiming a message: create it with CREATE UNIQUE INDEX {INDEX_NAME} ON inbox (message_id, consumer)"
    )]
    MissingIndex,

    /// The index `ix_inbox_message_id_consumer` exists but is not a plain UNIQUE index on
    /// exactly `(message_id, consumer)`.
    #[error(
        "the index {INDEX_NAME} is {found}, not a UNIQUE index on exactly (message_id, consumer), so duplicates are not detected as the inbox expects: drop it and create it with CREATE UNIQUE INDEX {INDEX_NAME} ON inbox (message_id, consumer)"
    )]
    WrongIndex {
        /// What the index is instead.
        found: String,
    },

    /// On MySQL/MariaDB, the `consumer` column compares with a collation that is not
    /// binary, so names differing in case (or accents) would share one marker.
    #[error(
        "the inbox's consumer column has the collation {collation}, under which names differing in case or accents are equal and one consumer would skip the other's messages as duplicates: ALTER TABLE inbox MODIFY consumer varchar(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
    )]
    ConsumerCollation {
        /// The column's collation.
        collation: String,
    },

    /// The outbox table does not exist ([`verify_outbox_schema`]).
    #[error(
        "the outbox table does not exist: add sea_orm_inbox_migration::CreateOutbox (m20261201_000004_create_outbox) to your Migrator and run it (or run sea_orm_inbox_migration::MigratorWithOutbox::up)"
    )]
    MissingOutboxTable,

    /// The outbox table lacks columns the outbox migrations create: a later one
    /// (`AddOutboxFirstPublished`) has not run, or the table was made some other way
    /// ([`verify_outbox_schema`]).
    #[error(
        "the outbox table lacks the column(s) {missing}, which the outbox migrations create: add sea_orm_inbox_migration::CreateOutbox and AddOutboxFirstPublished (m20261204_000005_add_outbox_first_published) to your Migrator and run them (or run MigratorWithOutbox::up); drop the table first if it is not the outbox's"
    )]
    OutboxColumns {
        /// The missing columns.
        missing: String,
    },

    /// The outbox has no UNIQUE index on exactly `(message_id)` named
    /// `ix_outbox_message_id`, so a repeated enqueue would write a second row (MySQL) or
    /// fail (PostgreSQL, SQLite) ([`verify_outbox_schema`]).
    #[error(
        "the outbox's index ix_outbox_message_id is {found}, not a UNIQUE index on exactly (message_id): create it with CREATE UNIQUE INDEX ix_outbox_message_id ON outbox (message_id)"
    )]
    OutboxIndex {
        /// What the index is instead (or `missing`).
        found: String,
    },

    /// The database did not answer the catalog read within
    /// [`Inbox::DEFAULT_PARTITION_TIMEOUT`](crate::Inbox::DEFAULT_PARTITION_TIMEOUT): the
    /// network to it went silent (a partition that drops packets without a reset) or the
    /// server hangs. Unlike the other variants, retrying can help.
    #[error(
        "verifying the inbox schema got no answer from the database within {waited:?} (a network partition or a hung database): check the network to the database and verify again"
    )]
    DatabaseSilent {
        /// How long the check waited.
        waited: Duration,
    },

    /// Reading the database's catalog failed.
    #[error(
        "reading the database catalog to verify the inbox schema failed: {source}. Check the connection and that the user may read the catalog, then verify again"
    )]
    Catalog {
        /// The database's own error.
        #[source]
        source: DbErr,
    },
}

/// Verifies, once at startup, everything a claim needs from this build and this database,
/// so a gap fails the boot with advice instead of every delivery with a database error.
///
/// It checks, in this order: that this build supports the connection's database (its
/// cargo feature); that the `inbox` table exists with the columns of
/// [`CreateInbox`](InboxMigration::CreateInbox) and
/// [`AddInboxLeases`](InboxMigration::AddInboxLeases) (which `Inbox::process`, batches and
/// leases write); that `ix_inbox_message_id_consumer` is a UNIQUE index on exactly
/// `(message_id, consumer)` (on PostgreSQL the index of
/// [`CreateInbox`](InboxMigration::CreateInbox) or the constraint
/// [`InboxUniqueConstraint`](InboxMigration::InboxUniqueConstraint) makes of it: a claim
/// needs either, so the check demands the same migrations on every backend); on
/// MySQL/MariaDB, that `consumer` has a binary collation. It reads the catalog only, in a
/// transaction of its own (so it works behind a transaction pooler), and writes nothing.
/// It waits at most [`Inbox::DEFAULT_PARTITION_TIMEOUT`] for the database to answer (not
/// on SQLite), so a boot behind a network partition fails instead of hanging.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use sea_orm_inbox::{InboxMigration, SchemaError, verify_schema};
/// use sea_orm_inbox_migration::{Migrator, MigratorTrait};
///
/// let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// Migrator::up(&db, Some(1)).await?; // only CreateInbox
/// assert!(matches!(
///     verify_schema(&db).await,
///     Err(SchemaError::MissingMigration { migration: InboxMigration::AddInboxLeases, .. })
/// ));
/// Migrator::up(&db, None).await?;
/// verify_schema(&db).await?; // at boot, before consuming
/// # Ok(()) }
/// ```
///
/// # Errors
/// A [`SchemaError`] naming the migration, index, collation or feature to add or fix, or
/// [`SchemaError::Catalog`] when the catalog could not be read, or
/// [`SchemaError::DatabaseSilent`] when the database did not answer (retry).
pub async fn verify_schema(db: &DatabaseConnection) -> Result<(), SchemaError> {
    verify_schema_in(db, &InboxTable::default()).await
}

/// [`verify_schema`] of the inbox in `table`, an [`InboxTable`] of the application's
/// choice: its columns, and its index [`InboxTable::unique_index`] (on PostgreSQL looked
/// up in the table's schema). The errors' advice names the default
/// table and index; read them as `table`'s.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use sea_orm_inbox::{InboxTable, SchemaError, verify_schema_in};
/// use sea_orm_migration::{MigrationTrait, SchemaManager};
///
/// let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// let table = InboxTable::named("app_inbox")?;
/// assert!(matches!(verify_schema_in(&db, &table).await, Err(SchemaError::MissingTable)));
/// for migration in sea_orm_inbox_migration::inbox_migrations(&table) {
///     migration.up(&SchemaManager::new(&db)).await?;
/// }
/// verify_schema_in(&db, &table).await?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// As [`verify_schema`].
pub async fn verify_schema_in(
    db: &DatabaseConnection,
    table: &InboxTable,
) -> Result<(), SchemaError> {
    let catalog =
        backend::schema_catalog(db.get_database_backend(), table).map_err(backend_error)?;
    let waited = Inbox::DEFAULT_PARTITION_TIMEOUT;
    let (columns, index) =
        answered_within(db, waited, "the schema check", read_catalog(db, &catalog))
            .await
            // The bound's only error: the database stayed silent.
            .map_err(|_| SchemaError::DatabaseSilent { waited })?
            .map_err(|source| SchemaError::Catalog { source })?;
    check_columns(&columns)?;
    check_index(&index)?;
    let consumer = columns.iter().find(|column| column.name == "consumer");
    if let Some(collation) = consumer.and_then(|column| column.collation.as_deref())
        && !catalog.is_exact_consumer_collation(collation)
    {
        return Err(SchemaError::ConsumerCollation {
            collation: collation.to_owned(),
        });
    }
    Ok(())
}

/// Verifies, once at startup, that the outbox is what [`OutboxExt::enqueue`](crate::OutboxExt::enqueue)
/// and the [`Relay`](crate::Relay) need: this build supports the database, the `outbox`
/// table exists with every column of `CreateOutbox` and `AddOutboxFirstPublished`, and `ix_outbox_message_id` is a
/// UNIQUE index on exactly `(message_id)`. Like [`verify_schema`], it reads the catalog
/// only, in a transaction of its own, within [`Inbox::DEFAULT_PARTITION_TIMEOUT`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use sea_orm_inbox::{SchemaError, verify_outbox_schema};
/// use sea_orm_inbox_migration::{Migrator, MigratorTrait, MigratorWithOutbox};
///
/// let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// Migrator::up(&db, None).await?; // the inbox only
/// assert!(matches!(verify_outbox_schema(&db).await, Err(SchemaError::MissingOutboxTable)));
/// MigratorWithOutbox::up(&db, None).await?;
/// verify_outbox_schema(&db).await?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`SchemaError::MissingOutboxTable`], [`SchemaError::OutboxColumns`],
/// [`SchemaError::OutboxIndex`], the backend errors of [`verify_schema`],
/// [`SchemaError::Catalog`] or [`SchemaError::DatabaseSilent`].
pub async fn verify_outbox_schema(db: &DatabaseConnection) -> Result<(), SchemaError> {
    let catalog =
        backend::outbox_schema_catalog(db.get_database_backend()).map_err(backend_error)?;
    let waited = Inbox::DEFAULT_PARTITION_TIMEOUT;
    let (columns, index) = answered_within(
        db,
        waited,
        "the outbox schema check",
        read_catalog(db, &catalog),
    )
    .await
    .map_err(|_| SchemaError::DatabaseSilent { waited })?
    .map_err(|source| SchemaError::Catalog { source })?;
    if columns.is_empty() {
        return Err(SchemaError::MissingOutboxTable);
    }
    let missing: Vec<&str> = outbox::Column::iter()
        .map(|column| column.as_str())
        .filter(|name| !columns.iter().any(|column| column.name == *name))
        .collect();
    if !missing.is_empty() {
        return Err(SchemaError::OutboxColumns {
            missing: missing.join(", "),
        });
    }
    let mut faults = Vec::new();
    match index.first() {
        None => faults.push("missing".to_owned()),
        Some(first) => {
            if !first.unique {
                faults.push("not unique".to_owned());
            }
            if first.partial {
                faults.push("partial (or on a column prefix)".to_owned());
            }
            let names: Vec<&str> = index.iter().map(|key| key.column.as_str()).collect();
            if names != ["message_id"] {
                faults.push(format!("on ({})", names.join(", ")));
            }
        }
    }
    if !faults.is_empty() {
        return Err(SchemaError::OutboxIndex {
            found: faults.join(", "),
        });
    }
    Ok(())
}

/// The schema error for a backend the crate cannot use.
fn backend_error(err: InboxError) -> SchemaError {
    match err {
        InboxError::BackendNotEnabled { backend, feature } => {
            SchemaError::BackendNotEnabled { backend, feature }
        }
        InboxError::UnsupportedBackend { backend } => SchemaError::UnsupportedBackend { backend },
        other => SchemaError::Catalog {
            source: DbErr::Custom(other.to_string()),
        },
    }
}

/// A table's columns (none when it does not exist) and the key columns of the index the
/// catalog names (none when there is no such index), read in a transaction of its own.
async fn read_catalog(
    db: &DatabaseConnection,
    catalog: &SchemaCatalog,
) -> Result<(Vec<InboxColumn>, Vec<InboxIndexKey>), DbErr> {
    let txn = db.begin().await?;
    let backend = db.get_database_backend();
    let read = async {
        let columns = txn
            .query_all_raw(Statement::from_string(
                backend,
                catalog.columns_sql.as_str(),
            ))
            .await?
            .iter()
            .map(InboxColumn::read)
            .collect::<Result<Vec<_>, _>>()?;
        let keys = txn
            .query_all_raw(Statement::from_string(backend, catalog.index_sql.as_str()))
            .await?
            .iter()
            .map(InboxIndexKey::read)
            .collect::<Result<Vec<_>, _>>()?;
        Ok((columns, keys))
    };
    let read = read.await;
    // It wrote nothing: a failed rollback changes nothing.
    txn.rollback().await.ok();
    read
}

/// One column of the inbox table.
struct InboxColumn {
    name: String,
    /// Its collation, where the database reports one that matters (MySQL/MariaDB).
    collation: Option<String>,
}

impl InboxColumn {
    fn read(row: &QueryResult) -> Result<Self, DbErr> {
        Ok(Self {
            name: row.try_get_by_index(0)?,
            collation: row.try_get_by_index(1)?,
        })
    }
}

/// One key column of the inbox index, in key order, with the index's properties.
struct InboxIndexKey {
    column: String,
    unique: bool,
    /// Partial (a WHERE clause) or on a column prefix: not a key on the whole columns.
    partial: bool,
}

impl InboxIndexKey {
    fn read(row: &QueryResult) -> Result<Self, DbErr> {
        Ok(Self {
            column: row.try_get_by_index(0)?,
            unique: row.try_get_by_index::<i64>(1)? != 0,
            partial: row.try_get_by_index::<i64>(2)? != 0,
        })
    }
}

/// The columns each migration adds, in the order the migrations run.
pub(crate) const MIGRATION_COLUMNS: [(InboxMigration, &[&str]); 2] = [
    (
        InboxMigration::CreateInbox,
        &[
            "id",
            "message_id",
            "consumer",
            "received_at",
            "processed_at",
        ],
    ),
    (
        InboxMigration::AddInboxLeases,
        &["attempts", "lease_until", "claim_token", "dead_at"],
    ),
];

fn check_columns(columns: &[InboxColumn]) -> Result<(), SchemaError> {
    if columns.is_empty() {
        return Err(SchemaError::MissingTable);
    }
    for (migration, expected) in MIGRATION_COLUMNS {
        let missing: Vec<&str> = expected
            .iter()
            .copied()
            .filter(|name| !columns.iter().any(|column| column.name == *name))
            .collect();
        if !missing.is_empty() {
            return Err(SchemaError::MissingMigration {
                migration,
                missing: format!("the column(s) {}", missing.join(", ")),
            });
        }
    }
    Ok(())
}

fn check_index(keys: &[InboxIndexKey]) -> Result<(), SchemaError> {
    let Some(first) = keys.first() else {
        return Err(SchemaError::MissingIndex);
    };
    let names: Vec<&str> = keys.iter().map(|key| key.column.as_str()).collect();
    let mut faults = Vec::new();
    if !first.unique {
        faults.push("not unique".to_owned());
    }
    if names != ["message_id", "consumer"] {
        faults.push(format!("on ({})", names.join(", ")));
    }
    if first.partial {
        faults.push("partial (or on a column prefix)".to_owned());
    }
    if !faults.is_empty() {
        return Err(SchemaError::WrongIndex {
            found: faults.join(", "),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(columns: &[&str], unique: bool, partial: bool) -> Vec<InboxIndexKey> {
        columns
            .iter()
            .map(|column| InboxIndexKey {
                column: (*column).to_owned(),
                unique,
                partial,
            })
            .collect()
    }

    fn found(result: Result<(), SchemaError>) -> String {
        match result {
            Err(SchemaError::WrongIndex { found }) => found,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_index_must_be_unique_on_exactly_the_two_columns_in_order() {
        let both = ["message_id", "consumer"];
        assert!(check_index(&keys(&both, true, false)).is_ok());
        assert_eq!(
            found(check_index(&keys(&["consumer", "message_id"], true, false))),
            "on (consumer, message_id)"
        );
        assert_eq!(
            found(check_index(&keys(&both, false, true))),
            "not unique, partial (or on a column prefix)"
        );
        assert!(matches!(check_index(&[]), Err(SchemaError::MissingIndex)));
    }

    #[test]
    fn missing_columns_name_the_first_migration_that_adds_one() {
        let columns = |names: &[&str]| {
            names
                .iter()
                .map(|name| InboxColumn {
                    name: (*name).to_owned(),
                    collation: None,
                })
                .collect::<Vec<_>>()
        };
        let first = [
            "id",
            "message_id",
            "consumer",
            "received_at",
            "processed_at",
        ];
        assert!(matches!(check_columns(&[]), Err(SchemaError::MissingTable)));
        let Err(SchemaError::MissingMigration { migration, missing }) =
            check_columns(&columns(&[&first[..], &["attempts", "dead_at"]].concat()))
        else {
            panic!("lease columns missing")
        };
        assert_eq!(migration, InboxMigration::AddInboxLeases);
        assert_eq!(missing, "the column(s) lease_until, claim_token");
        let all = [
            &first[..],
            &["attempts", "lease_until", "claim_token", "dead_at"],
        ]
        .concat();
        assert!(check_columns(&columns(&all)).is_ok());
    }
}
