//! `SeaORM` Entity, as `sea-orm-cli generate entity --ignore-tables seaql_migrations,inbox`
//! writes it: the inbox table has its entity in `sea-orm-inbox-entity`, never here.

pub mod prelude;

pub mod ledger;
