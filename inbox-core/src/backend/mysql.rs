//! MySQL and MariaDB: `?` placeholders, `ON DUPLICATE KEY UPDATE` in place of DO NOTHING,
//! naive UTC timestamps, and the classifier that reads error numbers and key names.

use super::{DbErrorKind, Dialect};
use chrono::{DateTime, Utc};
use sea_orm::Value;
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::sqlx::mysql::MySqlDatabaseError;
use sea_orm_inbox_entity::INDEX_NAME;

pub(super) struct MySql;

impl Dialect for MySql {
    fn insert_marker(&self) -> &'static str {
        "INSERT INTO `inbox` (`message_id`, `consumer`, `received_at`) VALUES (?, ?, ?)"
    }

    /// MySQL has no DO NOTHING, so it gets a no-op `ON DUPLICATE KEY UPDATE consumer =
    /// consumer` (never count its affected rows: sqlx reports found rows). Not `id = id`:
    /// assigning the auto-increment key in the update clause made MariaDB 10.11 hand a
    /// concurrent multi-row insert auto-increment values that collide with another
    /// transaction's rows, and ON DUPLICATE KEY then silently merged new messages into those
    /// rows (measured: 6 of 15 runs of the two-replica batch race lost ids; 0 of 20 with
    /// this clause). `INSERT IGNORE` is not used either: it would also swallow every other
    /// error (a NOT NULL or a foreign key violation) as a warning.
    fn on_inbox_conflict_do_nothing(&self) -> &'static str {
        " ON DUPLICATE KEY UPDATE consumer = consumer"
    }

    /// MySQL/MariaDB cannot use LIMIT in an `IN (subquery)`, but its single-table DELETE
    /// takes ORDER BY and LIMIT itself (a range scan of the index).
    fn purge_batch(&self, purgeable: &str) -> String {
        format!("DELETE FROM inbox WHERE {purgeable} ORDER BY received_at LIMIT ?")
    }

    /// sqlx sends `DateTime<Utc>` to MySQL/MariaDB typed as TIMESTAMP, which MariaDB turns
    /// into NULL past 2038 even for a `datetime(6)` column; the same instant as a naive UTC
    /// DATETIME is stored exactly.
    fn timestamp_value(&self, at: DateTime<Utc>) -> Value {
        Value::from(at.naive_utc())
    }
}

/// Classifies a MySQL/MariaDB error, or returns `None` when `db` comes from another driver.
///
/// MariaDB reports `... for key 'ix_inbox_message_id_consumer'`; MySQL 8.0.19+ writes
/// `... for key 'inbox.ix_inbox_message_id_consumer'`. The duplicate entry text before it
/// holds raw UUID bytes, so only the key name at the end is matched.
pub(super) fn classify(db: &dyn DatabaseError) -> Option<DbErrorKind> {
    const ER_DUP_ENTRY: u16 = 1062;
    const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
    const ER_LOCK_DEADLOCK: u16 = 1213;
    const ER_NO_SUCH_TABLE: u16 = 1146;
    const ER_SERVER_SHUTDOWN: u16 = 1053;
    const ER_CONNECTION_KILLED: u16 = 1927;
    const ER_QUERY_INTERRUPTED: u16 = 1317;
    // Galera: "WSREP has not yet prepared node for application use", SQLSTATE 08S01. The
    // node is outside the primary component (it lost quorum, is joining, or rejects
    // queries); it serves again once it rejoins. 1047 without 08S01 is "unknown command".
    const ER_UNKNOWN_COM_ERROR: u16 = 1047;
    let err = db.try_downcast_ref::<MySqlDatabaseError>()?;
    Some(match err.number() {
        ER_UNKNOWN_COM_ERROR if err.code() == Some("08S01") => DbErrorKind::Transient,
        ER_DUP_ENTRY if names_inbox_key(err.message()) => DbErrorKind::InboxDuplicate,
        ER_DUP_ENTRY => DbErrorKind::OtherUniqueViolation,
        ER_LOCK_WAIT_TIMEOUT | ER_LOCK_DEADLOCK => DbErrorKind::Transient,
        ER_SERVER_SHUTDOWN | ER_CONNECTION_KILLED | ER_QUERY_INTERRUPTED => DbErrorKind::Transient,
        ER_NO_SUCH_TABLE if names_inbox_table(err.message()) => DbErrorKind::MissingInboxTable,
        _ => DbErrorKind::Other,
    })
}

fn names_inbox_key(message: &str) -> bool {
    let Some(key) = message
        .rsplit_once(" for key '")
        .and_then(|(_, rest)| rest.strip_suffix('\''))
    else {
        return false;
    };
    key == INDEX_NAME || key.strip_prefix("inbox.") == Some(INDEX_NAME)
}

fn names_inbox_table(message: &str) -> bool {
    message.starts_with("Table '") && message.ends_with(".inbox' doesn't exist")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_matches_mariadb_and_mysql8_forms_only() {
        assert!(names_inbox_key(
            "Duplicate entry '\u{1}\u{2}-billing' for key 'ix_inbox_message_id_consumer'"
        ));
        assert!(names_inbox_key(
            "Duplicate entry 'x-billing' for key 'inbox.ix_inbox_message_id_consumer'"
        ));
        assert!(!names_inbox_key(
            "Duplicate entry 'x-billing' for key 'orders.ix_inbox_message_id_consumer'"
        ));
        assert!(!names_inbox_key(
            "Duplicate entry 'x' for key 'ix_inbox_message_id_consumer_2'"
        ));
        assert!(!names_inbox_key(
            "Duplicate entry ' for key 'ix_inbox_message_id_consumer'' for key 'uq_order_no'"
        ));
        assert!(!names_inbox_key("Duplicate entry 'x' for key 'PRIMARY'"));
    }

    #[test]
    fn missing_table_messages_name_the_inbox_table() {
        assert!(names_inbox_table("Table 'test.inbox' doesn't exist"));
        assert!(!names_inbox_table("Table 'test.orders' doesn't exist"));
    }
}
