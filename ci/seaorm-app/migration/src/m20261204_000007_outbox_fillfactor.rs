//! The outbox's fillfactor, from sea-orm-inbox-migration (after the first-publish time): on
//! PostgreSQL room on each page for the relay's lease to be a HOT update.
pub use sea_orm_inbox_migration::OutboxFillfactor as Migration;
