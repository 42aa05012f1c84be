//! The migrations that create the transactional inbox table and extend it.
//!
//! Add [`CreateInbox`] and then [`AddInboxLeases`] to your own `Migrator` (their names are
//! stable, so each runs once per database whatever else your migrator holds; a database
//! that already ran `CreateInbox` is upgraded in place by `AddInboxLeases`):
//!
//! ```
//! use sea_orm_migration::prelude::*;
//!
//! pub struct Migrator;
//!
//! #[async_trait::async_trait]
//! impl MigratorTrait for Migrator {
//!     fn migrations() -> Vec<Box<dyn MigrationTrait>> {
//!         vec![
//!             // ... your own migrations ...
//!             Box::new(sea_orm_inbox_migration::CreateInbox),
//!             Box::new(sea_orm_inbox_migration::AddInboxLeases), // after CreateInbox
//!         ]
//!     }
//! }
//! ```
//!
//! Applications without a migrator of their own can run [`Migrator`] as it is:
//!
//! ```no_run
//! # async fn run(db: &sea_orm_migration::sea_orm::DatabaseConnection) -> Result<(), sea_orm_migration::sea_orm::DbErr> {
//! use sea_orm_migration::MigratorTrait;
//! sea_orm_inbox_migration::Migrator::up(db, None).await?;
//! # Ok(()) }
//! ```

mod m20261130_000001_create_inbox;
mod m20261130_000002_add_inbox_leases;

pub use m20261130_000001_create_inbox::CreateInbox;
pub use m20261130_000002_add_inbox_leases::AddInboxLeases;
/// Re-exported so `Migrator::up(&db, None)` needs no direct `sea-orm-migration` import.
pub use sea_orm_migration::MigratorTrait;
use sea_orm_migration::prelude::*;

/// A ready migrator holding every inbox migration, for applications that have none.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![Box::new(CreateInbox), Box::new(AddInboxLeases)]
    }
}
