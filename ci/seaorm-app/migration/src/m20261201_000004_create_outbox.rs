//! The outbox table, from sea-orm-inbox-migration (independent of the inbox migrations).
pub use sea_orm_inbox_migration::CreateOutbox as Migration;
