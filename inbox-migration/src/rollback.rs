//! Rollbacks that refuse before they change anything: [`guard`] and the `down`, `reset`
//! and `refresh` of a migrator that runs it first.

use crate::m20261130_000001_create_inbox::refuse_to_drop_markers;
use crate::m20261201_000004_create_outbox::refuse_to_drop_unsent;
use crate::{CreateInbox, CreateOutbox, table_of};
use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::DynIden;
use sea_orm_migration::{IntoSchemaManagerConnection, Migration, seaql_migrations};
use std::marker::PhantomData;

/// Refuses, before any `down` runs, a rollback that would drop rows still needed.
///
/// `applied` is the migrator's applied migrations in its order
/// (`MigratorTrait::get_applied_migrations`); a rollback of `steps` of them (`None`: all,
/// as `reset` and `refresh` do) undoes the last `steps`, newest first, as SeaORM's does.
/// Among those, it looks for:
///
/// - an inbox's [`CreateInbox`] (the default table's, or any [`CreateInbox::for_table`]'s,
///   known by its name `m20261130_000001_create_inbox:<table>`) while that table holds a
///   marker: each marker is a message that would be applied again when redelivered;
/// - [`CreateOutbox`] while the outbox holds an unsent row: a committed change whose
///   message would never be published.
///
/// Those migrations' own `down` refuses the same; but SeaORM rolls back one migration at
/// a time, newest first, so on their own they refuse only after the migrations after them
/// were undone (the lease columns dropped, PostgreSQL's constraint turned back into an
/// index, the outbox dropped), leaving the schema half rolled back. Checked before the
/// first `down`, nothing changes: the error is the [`DbErr::Migration`] those migrations
/// return, naming the table and the `DELETE` that opts in, one line per table. A rollback
/// that stops short of those migrations (`migrate down -n 2` of the inbox's three) goes
/// through, rows and all.
///
/// The check reads the tables once, before the rollback: a marker written between the
/// check and the rollback is still caught by the migration's own refusal. A migration of
/// yours that delegates to `CreateInbox::for_table` is recognized only under the name of
/// the [`ForTable`](crate::ForTable) (see there).
///
/// The migrators of this crate run it in their `down`, `reset` and `refresh`. In a
/// migrator of your own, override the three with [`down`], [`reset`] and [`refresh`]
/// (this check, then SeaORM's own), so `sea-orm-cli migrate down -n N`, `reset` and
/// `refresh` refuse before they change anything:
///
/// ```no_run
/// use sea_orm_inbox_migration::{Migrator, rollback};
/// use sea_orm_migration::prelude::*;
///
/// pub struct AppMigrator;
///
/// #[async_trait::async_trait]
/// impl MigratorTrait for AppMigrator {
///     fn migrations() -> Vec<Box<dyn MigrationTrait>> {
///         Migrator::migrations() // and your own
///     }
///
///     async fn down<'c, C>(db: C, steps: Option<u32>) -> Result<(), DbErr>
///     where
///         C: IntoSchemaManagerConnection<'c>,
///     {
///         rollback::down::<Self, C>(db, steps).await
///     }
///
///     async fn reset<'c, C>(db: C) -> Result<(), DbErr>
///     where
///         C: IntoSchemaManagerConnection<'c>,
///     {
///         rollback::reset::<Self, C>(db).await
///     }
///
///     async fn refresh<'c, C>(db: C) -> Result<(), DbErr>
///     where
///         C: IntoSchemaManagerConnection<'c>,
///     {
///         rollback::refresh::<Self, C>(db).await
///     }
/// }
/// ```
///
/// # Errors
/// [`DbErr::Migration`] naming every table that would lose rows, or the database's error
/// when a table could not be read.
pub async fn guard<C: ConnectionTrait>(
    db: &C,
    applied: &[Migration],
    steps: Option<u32>,
) -> Result<(), DbErr> {
    let undone = steps.map_or(usize::MAX, |steps| {
        usize::try_from(steps).unwrap_or(usize::MAX)
    });
    let mut refusals = Vec::new();
    for migration in applied.iter().rev().take(undone) {
        let name = migration.name();
        let refusal = if let Some(table) = table_of(&CreateInbox, name) {
            refuse_to_drop_markers(db, &table, name).await
        } else if name == CreateOutbox.name() {
            refuse_to_drop_unsent(db).await
        } else {
            Ok(())
        };
        match refusal {
            Ok(()) => {}
            Err(DbErr::Migration(refused)) => refusals.push(refused),
            Err(other) => return Err(other),
        }
    }
    if refusals.is_empty() {
        Ok(())
    } else {
        Err(DbErr::Migration(refusals.join("\n")))
    }
}

/// `MigratorTrait::down` of `M` behind the [`guard`]: rolls back `steps` of `M`'s applied
/// migrations (`None`: all) as SeaORM does, after checking that none of them drops rows
/// still needed. For `M`'s own `down`; see [`guard`].
///
/// # Errors
/// The [`guard`]'s refusal, before anything changed, or SeaORM's error.
pub async fn down<'c, M, C>(db: C, steps: Option<u32>) -> Result<(), DbErr>
where
    M: MigratorTrait,
    C: IntoSchemaManagerConnection<'c>,
{
    let db = db.into_database_executor();
    guard(&db, &M::get_applied_migrations(&db).await?, steps).await?;
    SeaOrmRollback::<M>::down(db, steps).await
}

/// `MigratorTrait::reset` of `M` behind the [`guard`]: every applied migration rolled
/// back, then `seaql_migrations` dropped, as SeaORM does. For `M`'s own `reset`; see
/// [`guard`].
///
/// # Errors
/// The [`guard`]'s refusal, before anything changed, or SeaORM's error.
pub async fn reset<'c, M, C>(db: C) -> Result<(), DbErr>
where
    M: MigratorTrait,
    C: IntoSchemaManagerConnection<'c>,
{
    let db = db.into_database_executor();
    guard(&db, &M::get_applied_migrations(&db).await?, None).await?;
    SeaOrmRollback::<M>::reset(db).await
}

/// `MigratorTrait::refresh` of `M` behind the [`guard`]: every applied migration rolled
/// back, then every migration applied, as SeaORM does. For `M`'s own `refresh`; see
/// [`guard`].
///
/// # Errors
/// The [`guard`]'s refusal, before anything changed, or SeaORM's error.
pub async fn refresh<'c, M, C>(db: C) -> Result<(), DbErr>
where
    M: MigratorTrait,
    C: IntoSchemaManagerConnection<'c>,
{
    let db = db.into_database_executor();
    guard(&db, &M::get_applied_migrations(&db).await?, None).await?;
    SeaOrmRollback::<M>::refresh(db).await
}

/// `M` with SeaORM's own `down`, `reset` and `refresh`: what `M`'s overrides run once the
/// guard passed (an override cannot call the trait's provided method it replaces). Every
/// method those use is `M`'s.
struct SeaOrmRollback<M>(PhantomData<fn() -> M>);

#[async_trait::async_trait]
impl<M: MigratorTrait> MigratorTrait for SeaOrmRollback<M> {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        M::migrations()
    }

    fn migration_table_name() -> DynIden {
        M::migration_table_name()
    }

    fn get_migration_files() -> Vec<Migration> {
        M::get_migration_files()
    }

    async fn get_migration_models<C>(db: &C) -> Result<Vec<seaql_migrations::Model>, DbErr>
    where
        C: ConnectionTrait,
    {
        M::get_migration_models(db).await
    }

    async fn get_migration_with_status<C>(db: &C) -> Result<Vec<Migration>, DbErr>
    where
        C: ConnectionTrait,
    {
        M::get_migration_with_status(db).await
    }

    async fn get_pending_migrations<C>(db: &C) -> Result<Vec<Migration>, DbErr>
    where
        C: ConnectionTrait,
    {
        M::get_pending_migrations(db).await
    }

    async fn get_applied_migrations<C>(db: &C) -> Result<Vec<Migration>, DbErr>
    where
        C: ConnectionTrait,
    {
        M::get_applied_migrations(db).await
    }

    async fn install<C>(db: &C) -> Result<(), DbErr>
    where
        C: ConnectionTrait,
    {
        M::install(db).await
    }
}
