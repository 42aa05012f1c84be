//! The inbox index as a named constraint (PostgreSQL), from sea-orm-inbox-migration (after `AddInboxLeases`).
pub use sea_orm_inbox_migration::InboxUniqueConstraint as Migration;
