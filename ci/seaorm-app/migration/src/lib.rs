pub use sea_orm_migration::prelude::*;

mod m20240101_000001_create_ledger;
mod m20261130_000001_create_inbox;
mod m20261130_000002_add_inbox_leases;
mod m20261201_000003_inbox_unique_constraint;
mod m20261201_000004_create_outbox;
mod m20261204_000005_add_outbox_first_published;
mod m20261204_000006_create_kafka_offsets;
mod m20261204_000007_outbox_fillfactor;
mod m20261205_000008_outbox_due_index;

pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m20240101_000001_create_ledger::Migration),
            Box::new(m20261130_000001_create_inbox::Migration),
            Box::new(m20261130_000002_add_inbox_leases::Migration),
            Box::new(m20261201_000003_inbox_unique_constraint::Migration),
            Box::new(m20261201_000004_create_outbox::Migration),
            Box::new(m20261204_000005_add_outbox_first_published::Migration),
            Box::new(m20261204_000006_create_kafka_offsets::Migration),
            Box::new(m20261204_000007_outbox_fillfactor::Migration),
            Box::new(m20261205_000008_outbox_due_index::Migration),
        ]
    }
}
