#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod m20261130_000001_create_inbox;
mod m20261130_000002_add_inbox_leases;
mod m20261201_000003_inbox_unique_constraint;
mod m20261201_000004_create_outbox;
mod m20261204_000005_add_outbox_first_published;
mod m20261204_000006_create_kafka_offsets;
mod m20261204_000007_outbox_fillfactor;
mod m20261205_000008_outbox_due_index;
pub mod rollback;

pub use m20261130_000001_create_inbox::CreateInbox;
pub use m20261130_000002_add_inbox_leases::AddInboxLeases;
pub use m20261201_000003_inbox_unique_constraint::InboxUniqueConstraint;
pub use m20261201_000004_create_outbox::CreateOutbox;
pub use m20261204_000005_add_outbox_first_published::AddOutboxFirstPublished;
pub use m20261204_000006_create_kafka_offsets::CreateKafkaOffsets;
pub use m20261204_000007_outbox_fillfactor::{OUTBOX_FILLFACTOR, OutboxFillfactor};
pub use m20261205_000008_outbox_due_index::OutboxDueIndex;
/// Re-exported for [`CreateInbox::for_table`] and its siblings.
pub use sea_orm_inbox_entity::InboxTable;
/// Re-exported so `Migrator::up(&db, None)` needs no direct `sea-orm-migration` import.
pub use sea_orm_migration::MigratorTrait;
use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::{FromQueryResult, Iterable};
use sea_orm_migration::{IntoSchemaManagerConnection, seaql_migrations};

/// One of the inbox migrations for the inbox in an [`InboxTable`] of the application's
/// choice: made by [`CreateInbox::for_table`], [`AddInboxLeases::for_table`] and
/// [`InboxUniqueConstraint::for_table`], or all three at once by [`inbox_migrations`].
///
/// Its name is the migration's own followed by `:` and the table (`schema.table` with a
/// schema), so each inbox of a database has its own records in `seaql_migrations`; for the
/// default table it is the migration's own name, and it does what the unit struct does.
///
/// With `sea-orm-cli`, give it a module file whose `Migration` delegates to it:
/// `migrate generate` lists modules by their `Migration` unit struct. Give that
/// `Migration` the name of the `ForTable` it delegates to: [`rollback::guard`] knows an
/// inbox's `CreateInbox` by that name, and refuses a rollback reaching it while the table
/// holds markers before anything changes. (A migration SeaORM already recorded under
/// another name keeps it, or SeaORM would call it missing; the guard then does not know
/// it, and only the migration's own refusal keeps the markers, after the migrations
/// listed after it were rolled back.)
///
/// ```
/// // migration/src/m20261202_000001_create_app_inbox.rs
/// use sea_orm_inbox_migration::{CreateInbox, InboxTable};
/// use sea_orm_migration::prelude::*;
///
/// fn app_inbox() -> Result<InboxTable, DbErr> {
///     InboxTable::named("app_inbox").map_err(|err| DbErr::Migration(err.to_string()))
/// }
///
/// pub struct Migration;
///
/// impl MigrationName for Migration {
///     /// `CreateInbox::for_table(app_inbox()?).name()`.
///     fn name(&self) -> &str {
///         "m20261130_000001_create_inbox:app_inbox"
///     }
/// }
///
/// #[async_trait::async_trait]
/// impl MigrationTrait for Migration {
///     async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
///         CreateInbox::for_table(app_inbox()?).up(manager).await
///     }
///
///     async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
///         CreateInbox::for_table(app_inbox()?).down(manager).await
///     }
/// }
/// # assert_eq!(Migration.name(), CreateInbox::for_table(app_inbox()?).name());
/// # Ok::<(), DbErr>(())
/// ```
pub struct ForTable<M> {
    migration: M,
    table: InboxTable,
    name: String,
}

impl<M: MigrationName> ForTable<M> {
    fn new(migration: M, table: InboxTable) -> Self {
        let name = if table.is_default() {
            migration.name().to_owned()
        } else {
            format!("{}:{table}", migration.name())
        };
        Self {
            migration,
            table,
            name,
        }
    }

    /// The table the migration works on.
    pub fn table(&self) -> &InboxTable {
        &self.table
    }

    /// The migration itself.
    pub fn migration(&self) -> &M {
        &self.migration
    }
}

impl<M> MigrationName for ForTable<M> {
    fn name(&self) -> &str {
        &self.name
    }
}

/// The table of the [`ForTable`] of `migration` whose name is `name` (the default table
/// for the migration's own name), or `None` when no [`ForTable`] of it has that name.
fn table_of(migration: &impl MigrationName, name: &str) -> Option<InboxTable> {
    let suffix = name.strip_prefix(migration.name())?;
    if suffix.is_empty() {
        return Some(InboxTable::default());
    }
    let table = suffix.strip_prefix(':')?;
    match table.split_once('.') {
        None => InboxTable::named(table).ok(),
        Some((schema, table)) => InboxTable::named(table)
            .and_then(|table| table.in_schema(schema))
            .ok(),
    }
}

/// [`CreateInbox`], [`AddInboxLeases`] and [`InboxUniqueConstraint`] for the inbox in
/// `table`, in the order they run: append them to your migrator's list, once per inbox.
///
/// ```no_run
/// # async fn run(db: &sea_orm_migration::sea_orm::DatabaseConnection) -> Result<(), sea_orm_migration::DbErr> {
/// use sea_orm_inbox_migration::{InboxTable, Migrator, inbox_migrations};
/// use sea_orm_migration::prelude::*;
///
/// struct AppMigrator;
///
/// #[async_trait::async_trait]
/// impl MigratorTrait for AppMigrator {
///     fn migrations() -> Vec<Box<dyn MigrationTrait>> {
///         let mut migrations = Migrator::migrations(); // the default `inbox`, if you keep it
///         let table = InboxTable::named("app_inbox").expect("a name of a-z, 0-9 and _");
///         migrations.extend(inbox_migrations(&table));
///         migrations
///     }
/// }
///
/// AppMigrator::up(db, None).await?;
/// # Ok(()) }
/// ```
pub fn inbox_migrations(table: &InboxTable) -> Vec<Box<dyn MigrationTrait>> {
    vec![
        Box::new(CreateInbox::for_table(table.clone())),
        Box::new(AddInboxLeases::for_table(table.clone())),
        Box::new(InboxUniqueConstraint::for_table(table.clone())),
    ]
}

/// `impl MigratorTrait for $migrator` with the items given and `down`, `reset` and
/// `refresh` behind [`rollback::guard`], so its rollbacks refuse before they change
/// anything.
macro_rules! migrator_refusing_lossy_rollbacks {
    ($migrator:ident { $($items:tt)* }) => {
        #[async_trait::async_trait]
        impl MigratorTrait for $migrator {
            $($items)*

            /// [`rollback::down`]: refuses, before anything changes, a rollback reaching an
            /// inbox table that holds markers (or the outbox while it holds unsent rows).
            async fn down<'c, C>(db: C, steps: Option<u32>) -> Result<(), DbErr>
            where
                C: IntoSchemaManagerConnection<'c>,
            {
                rollback::down::<Self, C>(db, steps).await
            }

            /// [`rollback::reset`]: refuses as [`down`](Self::down) does, before anything
            /// changes.
            async fn reset<'c, C>(db: C) -> Result<(), DbErr>
            where
                C: IntoSchemaManagerConnection<'c>,
            {
                rollback::reset::<Self, C>(db).await
            }

            /// [`rollback::refresh`]: refuses as [`down`](Self::down) does, before anything
            /// changes.
            async fn refresh<'c, C>(db: C) -> Result<(), DbErr>
            where
                C: IntoSchemaManagerConnection<'c>,
            {
                rollback::refresh::<Self, C>(db).await
            }
        }
    };
}

/// A ready migrator holding every inbox migration, for applications that have none.
///
/// It does not hold [`CreateOutbox`], [`AddOutboxFirstPublished`], [`OutboxFillfactor`]
/// and [`OutboxDueIndex`]: the outbox is
/// opt-in. Add them to your own migrator, or run [`MigratorWithOutbox`] instead of this
/// one. On a database that [`MigratorWithOutbox`] migrated, this one still runs: it leaves
/// the outbox's records to that migrator (SeaORM otherwise refuses a migrator that does
/// not list a migration recorded as applied, with "Migration file of version
/// '...create_outbox' is missing").
pub struct Migrator;

migrator_refusing_lossy_rollbacks!(Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(CreateInbox),
            Box::new(AddInboxLeases),
            Box::new(InboxUniqueConstraint),
        ]
    }

    /// The applied migrations, without the records of the outbox's migrations, which belong
    /// to [`MigratorWithOutbox`].
    async fn get_migration_models<C>(db: &C) -> Result<Vec<seaql_migrations::Model>, DbErr>
    where
        C: ConnectionTrait,
    {
        Self::install(db).await?;
        let select = Query::select()
            .from(Self::migration_table_name())
            .columns(seaql_migrations::Column::iter().map(IntoIden::into_iden))
            .order_by(seaql_migrations::Column::Version, Order::Asc)
            .to_owned();
        let inbox: Vec<String> = Self::migrations()
            .iter()
            .map(|migration| migration.name().to_owned())
            .collect();
        let outbox_only: Vec<String> = MigratorWithOutbox::migrations()
            .iter()
            .map(|migration| migration.name().to_owned())
            .filter(|name| !inbox.contains(name))
            .collect();
        db.query_all(&select)
            .await?
            .into_iter()
            .map(|row| seaql_migrations::Model::from_query_result(&row, ""))
            .filter(|model| !matches!(model, Ok(model) if outbox_only.contains(&model.version)))
            .collect()
    }
});

/// A ready migrator holding every inbox migration and then [`CreateOutbox`],
/// [`AddOutboxFirstPublished`], [`OutboxFillfactor`] and [`OutboxDueIndex`], for
/// applications without a migrator of their own that use the outbox.
///
/// It lists [`Migrator`]'s migrations first, so a database [`Migrator`] already migrated
/// upgrades in place, and [`Migrator`] still runs on a database this one migrated.
///
/// ```no_run
/// # async fn run(db: &sea_orm_migration::sea_orm::DatabaseConnection) -> Result<(), sea_orm_migration::sea_orm::DbErr> {
/// use sea_orm_inbox_migration::{MigratorTrait, MigratorWithOutbox};
/// MigratorWithOutbox::up(db, None).await?;
/// # Ok(()) }
/// ```
pub struct MigratorWithOutbox;

migrator_refusing_lossy_rollbacks!(MigratorWithOutbox {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        let mut migrations = Migrator::migrations();
        migrations.push(Box::new(CreateOutbox));
        migrations.push(Box::new(AddOutboxFirstPublished));
        migrations.push(Box::new(OutboxFillfactor));
        migrations.push(Box::new(OutboxDueIndex));
        migrations
    }
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_of_reads_every_create_inbox_name_back() {
        let tables = [
            InboxTable::default(),
            InboxTable::named("app_inbox").expect("a valid name"),
            InboxTable::named("app_inbox")
                .and_then(|table| table.in_schema("messaging"))
                .expect("a valid name"),
            InboxTable::named("inbox")
                .and_then(|table| table.in_schema("messaging"))
                .expect("a valid name"),
        ];
        for table in tables {
            let migration = CreateInbox::for_table(table.clone());
            assert_eq!(table_of(&CreateInbox, migration.name()), Some(table));
        }
        for other in [
            AddInboxLeases.name(),
            "m20261130_000002_add_inbox_leases:app_inbox",
            "m20261130_000001_create_inbox_archive",
            "m20261130_000001_create_inbox:App Inbox",
        ] {
            assert_eq!(table_of(&CreateInbox, other), None, "{other}");
        }
    }
}
