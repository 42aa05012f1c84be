//! The outbox's first-publish time, from sea-orm-inbox-migration (after the outbox table).
pub use sea_orm_inbox_migration::AddOutboxFirstPublished as Migration;
