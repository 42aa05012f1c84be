//! `SeaORM` Entity: one row per credit the consumer applied.

use sea_orm::entity::prelude::*;

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "ledger")]
pub struct Model {
    #[sea_orm(primary_key)]
    pub id: i64,
    pub message_id: Uuid,
    pub amount: i64,
}

impl ActiveModelBehavior for ActiveModel {}
