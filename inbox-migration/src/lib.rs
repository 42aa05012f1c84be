#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod m20261130_000001_create_inbox;
mod m20261130_000002_add_inbox_leases;
mod m20261201_000003_inbox_unique_constraint;
mod m20261201_000004_create_outbox;

pub use m20261130_000001_create_inbox::CreateInbox;
pub use m20261130_000002_add_inbox_leases::AddInboxLeases;
pub use m20261201_000003_inbox_unique_constraint::InboxUniqueConstraint;
pub use m20261201_000004_create_outbox::CreateOutbox;
/// Re-exported so `Migrator::up(&db, None)` needs no direct `sea-orm-migration` import.
pub use sea_orm_migration::MigratorTrait;
use sea_orm_migration::prelude::*;

/// A ready migrator holding every inbox migration, for applications that have none.
///
/// It does not hold [`CreateOutbox`]: the outbox is opt-in. Add it to your own migrator,
/// or run [`MigratorWithOutbox`] instead of this one.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(CreateInbox),
            Box::new(AddInboxLeases),
            Box::new(InboxUniqueConstraint),
        ]
    }
}

/// A ready migrator holding every inbox migration and then [`CreateOutbox`], for
/// applications without a migrator of their own that use the outbox.
///
/// It lists [`Migrator`]'s migrations first, so a database [`Migrator`] already migrated
/// upgrades in place. Use one of the two per database: SeaORM refuses to run a migrator
/// that does not list every migration recorded as applied.
///
/// ```no_run
/// # async fn run(db: &sea_orm_migration::sea_orm::DatabaseConnection) -> Result<(), sea_orm_migration::sea_orm::DbErr> {
/// use sea_orm_inbox_migration::{MigratorTrait, MigratorWithOutbox};
/// MigratorWithOutbox::up(db, None).await?;
/// # Ok(()) }
/// ```
pub struct MigratorWithOutbox;

#[async_trait::async_trait]
impl MigratorTrait for MigratorWithOutbox {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        let mut migrations = Migrator::migrations();
        migrations.push(Box::new(CreateOutbox));
        migrations
    }
}
