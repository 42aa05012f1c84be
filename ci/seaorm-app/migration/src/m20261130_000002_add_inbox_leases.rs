//! The inbox's lease columns, from sea-orm-inbox-migration (after `CreateInbox`).
pub use sea_orm_inbox_migration::AddInboxLeases as Migration;
