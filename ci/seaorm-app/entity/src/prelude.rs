//! `SeaORM` Entity prelude.

pub use super::ledger::Entity as Ledger;
