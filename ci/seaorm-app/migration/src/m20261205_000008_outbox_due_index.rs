//! The relay's index of due rows, from sea-orm-inbox-migration (after the fillfactor): on
//! PostgreSQL a claim that reads its batch, not the whole backlog.
pub use sea_orm_inbox_migration::OutboxDueIndex as Migration;
