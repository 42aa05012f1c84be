//! The inbox table, from sea-orm-inbox-migration. A module file of its own, named after the
//! migration's stable name, so `sea-orm-cli migrate generate` keeps it in `migrations()`.
pub use sea_orm_inbox_migration::CreateInbox as Migration;
