#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod m20261130_000001_create_inbox;
mod m20261130_000002_add_inbox_leases;
mod m20261201_000003_inbox_unique_constraint;

pub use m20261130_000001_create_inbox::CreateInbox;
pub use m20261130_000002_add_inbox_leases::AddInboxLeases;
pub use m20261201_000003_inbox_unique_constraint::InboxUniqueConstraint;
/// Re-exported so `Migrator::up(&db, None)` needs no direct `sea-orm-migration` import.
pub use sea_orm_migration::MigratorTrait;
use sea_orm_migration::prelude::*;

/// A ready migrator holding every inbox migration, for applications that have none.
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
