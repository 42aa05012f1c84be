//! The Kafka consumer's offsets table, from sea-orm-inbox-migration (opt-in: for apps that
//! consume from Kafka; this app lists it so that CI runs it through SeaORM's tooling too).
pub use sea_orm_inbox_migration::CreateKafkaOffsets as Migration;
