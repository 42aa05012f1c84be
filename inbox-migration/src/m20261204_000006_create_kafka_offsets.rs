use crate::m20261201_000004_create_outbox::exact_varchar;
use sea_orm_inbox_entity::{KAFKA_GROUP_MAX_CHARS, KAFKA_OFFSET_TABLE_NAME, KAFKA_TOPIC_MAX_CHARS};
use sea_orm_migration::prelude::*;

/// Creates `inbox_kafka_offset`, where a Kafka consumer of `sea_orm_inbox::kafka` keeps its
/// offsets: the next offset to process per (consumer group, topic, partition), advanced in
/// the same transaction as the inbox marker and the business change.
///
/// Opt-in: no migrator of this crate runs it. Add it to your own `Migrator::migrations()`
/// (`Box::new(CreateKafkaOffsets)`) when you consume from Kafka. Its name,
/// `m20261204_000006_create_kafka_offsets`, never changes.
///
/// | column | type |
/// | --- | --- |
/// | `consumer_group` | varchar(200) (binary collation on MySQL/MariaDB) |
/// | `topic` | varchar(249) (binary collation on MySQL/MariaDB) |
/// | `partition_id` | integer |
/// | `next_offset` | bigint: the offset of the next record to process |
///
/// The primary key is `(consumer_group, topic, partition_id)`. Kafka names are case
/// sensitive, hence the binary collation where the default one ignores case.
pub struct CreateKafkaOffsets;

impl MigrationName for CreateKafkaOffsets {
    fn name(&self) -> &str {
        "m20261204_000006_create_kafka_offsets"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for CreateKafkaOffsets {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let backend = manager.get_database_backend();
        let table = Alias::new(KAFKA_OFFSET_TABLE_NAME);
        let mut partition = ColumnDef::new(Alias::new("partition_id"));
        partition.integer().not_null();
        let mut next_offset = ColumnDef::new(Alias::new("next_offset"));
        next_offset.big_integer().not_null();
        manager
            .create_table(
                Table::create()
                    .table(table)
                    .col(exact_varchar(
                        backend,
                        Alias::new("consumer_group"),
                        KAFKA_GROUP_MAX_CHARS,
                    ))
                    .col(exact_varchar(
                        backend,
                        Alias::new("topic"),
                        KAFKA_TOPIC_MAX_CHARS,
                    ))
                    .col(partition)
                    .col(next_offset)
                    .primary_key(
                        Index::create()
                            .col(Alias::new("consumer_group"))
                            .col(Alias::new("topic"))
                            .col(Alias::new("partition_id")),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(
                Table::drop()
                    .table(Alias::new(KAFKA_OFFSET_TABLE_NAME))
                    .to_owned(),
            )
            .await
    }
}
