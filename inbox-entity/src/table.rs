//! [`InboxTable`]: which table (and on PostgreSQL which schema) an inbox lives in.

use sea_orm::sea_query::{Alias, IntoTableRef, TableRef};
use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, LazyLock, PoisonError, RwLock};

/// Longest table name an [`InboxTable`] takes, in bytes: with the longest index name
/// derived from it (`ix_<table>_message_id_consumer`) it stays within PostgreSQL's 63-byte
/// identifiers and MySQL's 64.
pub const TABLE_NAME_MAX_LEN: usize = 40;

/// Longest PostgreSQL schema name an [`InboxTable`] takes, in bytes (PostgreSQL's limit).
pub const SCHEMA_NAME_MAX_LEN: usize = 63;

/// The table an inbox lives in: its name, on PostgreSQL optionally its schema, and the
/// names of its two indexes, derived from the table's (`ix_<table>_message_id_consumer`,
/// `ix_<table>_received_at`; index and constraint names are unique per schema on
/// PostgreSQL, so a second inbox needs its own).
///
/// The [`Default`] is the table every release so far created: `inbox`, with
/// [`INDEX_NAME`](crate::INDEX_NAME) and [`RECEIVED_AT_INDEX_NAME`](crate::RECEIVED_AT_INDEX_NAME).
/// Choose another name when the application already has a table called `inbox`, or runs
/// two inboxes in one database.
///
/// Names are checked when the value is made, never when SQL is sent: lowercase ASCII
/// letters, digits and `_`, starting with a letter or `_`, at most
/// [`TABLE_NAME_MAX_LEN`] bytes (schemas [`SCHEMA_NAME_MAX_LEN`]). The crate quotes them in
/// every statement, so a name that is also an SQL keyword (`order`) works.
///
/// ```
/// use sea_orm_inbox_entity::{InboxTable, INDEX_NAME};
///
/// let default = InboxTable::default();
/// assert_eq!((default.name(), default.unique_index()), ("inbox", INDEX_NAME));
///
/// let app = InboxTable::named("app_inbox")?.in_schema("messaging")?;
/// assert_eq!(app.schema(), Some("messaging"));
/// assert_eq!(app.unique_index(), "ix_app_inbox_message_id_consumer");
/// assert_eq!(app.received_at_index(), "ix_app_inbox_received_at");
///
/// assert!(InboxTable::named("x; drop table inbox").is_err());
/// # Ok::<(), sea_orm_inbox_entity::InvalidTableName>(())
/// ```
#[derive(Clone)]
pub struct InboxTable {
    inner: Arc<Names>,
}

struct Names {
    schema: Option<String>,
    name: String,
    unique_index: String,
    received_at_index: String,
    /// Statement texts rewritten for this table, by flavour and the address and length of
    /// the `'static` text they were written from (see [`InboxTable::rewritten`]).
    rewritten: RwLock<HashMap<(char, usize, usize), Arc<str>>>,
}

impl InboxTable {
    /// The inbox table `name` in the connection's default schema (PostgreSQL: the first
    /// schema of the `search_path` when migrating, and the one the crate's unqualified
    /// statements resolve through).
    ///
    /// # Errors
    /// [`InvalidTableName`] when `name` is empty, longer than [`TABLE_NAME_MAX_LEN`], or
    /// holds anything but lowercase ASCII letters, digits and `_` (or starts with a digit).
    pub fn named(name: &str) -> Result<Self, InvalidTableName> {
        check(NameOf::Table, name, TABLE_NAME_MAX_LEN)?;
        Ok(Self::from_names(None, name))
    }

    /// The same table in the PostgreSQL schema `schema`, which the application creates
    /// (`CREATE SCHEMA`) before the migrations run. On MySQL/MariaDB and SQLite a schema is
    /// another database: the crate's statements name it, but the migrations and the schema
    /// check expect the connection's own, so use a schema on PostgreSQL only.
    ///
    /// # Errors
    /// [`InvalidTableName`] for a schema name breaking the rules of [`named`](Self::named)
    /// (at most [`SCHEMA_NAME_MAX_LEN`] bytes).
    pub fn in_schema(self, schema: &str) -> Result<Self, InvalidTableName> {
        check(NameOf::Schema, schema, SCHEMA_NAME_MAX_LEN)?;
        Ok(Self::from_names(Some(schema), &self.inner.name))
    }

    fn from_names(schema: Option<&str>, name: &str) -> Self {
        Self {
            inner: Arc::new(Names {
                schema: schema.map(str::to_owned),
                name: name.to_owned(),
                unique_index: format!("ix_{name}_message_id_consumer"),
                received_at_index: format!("ix_{name}_received_at"),
                rewritten: RwLock::default(),
            }),
        }
    }

    /// The table's name, without its schema.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The PostgreSQL schema, if one was given.
    pub fn schema(&self) -> Option<&str> {
        self.inner.schema.as_deref()
    }

    /// The UNIQUE index on `(message_id, consumer)` (on PostgreSQL a UNIQUE constraint of
    /// that name): a unique violation is "already processed" only when it names this one.
    pub fn unique_index(&self) -> &str {
        &self.inner.unique_index
    }

    /// The index on `(received_at)` that the retention purge walks.
    pub fn received_at_index(&self) -> &str {
        &self.inner.received_at_index
    }

    /// Whether this is the default table, `inbox` without a schema.
    pub fn is_default(&self) -> bool {
        self.inner.schema.is_none() && self.inner.name == crate::TABLE_NAME
    }

    /// The table for SeaQuery statements: `inbox::Entity`'s columns with this table.
    pub fn table_ref(&self) -> TableRef {
        match &self.inner.schema {
            Some(schema) => (Alias::new(schema), Alias::new(&self.inner.name)).into_table_ref(),
            None => Alias::new(&self.inner.name).into_table_ref(),
        }
    }

    /// `sql`, a statement written for the default table, as `rewrite` turns it into this
    /// table's for the SQL flavour `flavor` (the dialect's identifier quote), computed once
    /// per flavour, text and table: the statements of a custom table cost one map lookup
    /// per call, not a rewrite. `sea-orm-inbox` passes its statements here; the cache lives
    /// as long as the table value and its clones.
    #[doc(hidden)]
    pub fn rewritten(
        &self,
        flavor: char,
        sql: &'static str,
        rewrite: impl FnOnce(&str) -> String,
    ) -> Arc<str> {
        let key = (flavor, sql.as_ptr() as usize, sql.len());
        let cached = self
            .inner
            .rewritten
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .cloned();
        if let Some(cached) = cached {
            return cached;
        }
        let text: Arc<str> = rewrite(sql).into();
        self.inner
            .rewritten
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key)
            .or_insert(text)
            .clone()
    }
}

impl Default for InboxTable {
    /// A clone of one shared value: the default table costs no allocation per call.
    fn default() -> Self {
        static DEFAULT: LazyLock<InboxTable> =
            LazyLock::new(|| InboxTable::from_names(None, crate::TABLE_NAME));
        DEFAULT.clone()
    }
}

/// Two values are equal when they name the same table in the same schema.
impl PartialEq for InboxTable {
    fn eq(&self, other: &Self) -> bool {
        self.inner.schema == other.inner.schema && self.inner.name == other.inner.name
    }
}

impl Eq for InboxTable {}

impl Hash for InboxTable {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.inner.schema.hash(state);
        self.inner.name.hash(state);
    }
}

impl fmt::Debug for InboxTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InboxTable")
            .field("schema", &self.inner.schema)
            .field("name", &self.inner.name)
            .finish()
    }
}

/// `schema.name`, or `name` without a schema.
impl fmt::Display for InboxTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner.schema {
            Some(schema) => write!(f, "{schema}.{}", self.inner.name),
            None => f.write_str(&self.inner.name),
        }
    }
}

/// What an invalid name was meant to name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NameOf {
    /// The inbox table.
    Table,
    /// The PostgreSQL schema.
    Schema,
}

impl fmt::Display for NameOf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Table => "inbox table",
            Self::Schema => "schema",
        })
    }
}

/// A table or schema name [`InboxTable`] refuses, and why.
///
/// ```
/// use sea_orm_inbox_entity::{InboxTable, NameOf};
///
/// let err = InboxTable::named("").unwrap_err();
/// assert_eq!(err.of(), NameOf::Table);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidTableName {
    of: NameOf,
    name: String,
    reason: &'static str,
}

impl InvalidTableName {
    /// Whether the table's name or its schema's was refused.
    pub fn of(&self) -> NameOf {
        self.of
    }

    /// The refused name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl fmt::Display for InvalidTableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the {} name {:?} {}: choose one of lowercase ASCII letters, digits and _, \
             starting with a letter or _",
            self.of, self.name, self.reason
        )
    }
}

impl std::error::Error for InvalidTableName {}

/// Refuses a name that would need escaping (or folds differently per database).
fn check(of: NameOf, name: &str, max_len: usize) -> Result<(), InvalidTableName> {
    let refuse = |reason| {
        Err(InvalidTableName {
            of,
            name: name.to_owned(),
            reason,
        })
    };
    let mut chars = name.chars();
    match chars.next() {
        None => return refuse("is empty"),
        Some(first) if first.is_ascii_digit() => return refuse("starts with a digit"),
        Some(_) => {}
    }
    if name.len() > max_len {
        return refuse(if max_len == TABLE_NAME_MAX_LEN {
            "is longer than 40 bytes"
        } else {
            "is longer than 63 bytes"
        });
    }
    if !name
        .chars()
        .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '_')
    {
        return refuse("holds a character other than a-z, 0-9 and _");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_would_need_quoting_are_refused() {
        let long = "a".repeat(TABLE_NAME_MAX_LEN + 1);
        for bad in [
            "",
            "x; drop table inbox",
            "App",
            "1st",
            "in\"box",
            "inbox ",
            &long,
        ] {
            assert_eq!(
                InboxTable::named(bad).unwrap_err().of(),
                NameOf::Table,
                "{bad}"
            );
        }
        assert!(InboxTable::named(&"a".repeat(TABLE_NAME_MAX_LEN)).is_ok());
        let schema_err = InboxTable::default().in_schema("my-schema").unwrap_err();
        assert_eq!(schema_err.of(), NameOf::Schema);
    }

    #[test]
    fn the_default_keeps_the_names_of_every_release() {
        let table = InboxTable::default();
        assert!(table.is_default());
        assert_eq!(table.unique_index(), crate::INDEX_NAME);
        assert_eq!(table.received_at_index(), crate::RECEIVED_AT_INDEX_NAME);
        assert_eq!(InboxTable::named("inbox"), Ok(table.clone()));
        assert!(!table.in_schema("public").is_ok_and(|t| t.is_default()));
    }
}
