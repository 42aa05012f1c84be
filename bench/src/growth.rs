//! Fills the inbox with old, processed markers by set-based SQL, one statement per age
//! cohort: millions of rows in seconds, not one INSERT per row.
//!
//! Cohort `k` is received `OLDEST_DAYS - k` days ago, so a purge with a cutoff between
//! two cohorts deletes exactly the oldest remaining one (the purge phase relies on it).

use crate::BoxError;
use crate::db::CONSUMER;
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend};

/// How the seeded markers' message ids are laid out (`--growth-ids`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SeedIds {
    /// Random 16-byte values (the layout of UUIDv4): a day's markers are scattered over
    /// the whole message-id index.
    #[default]
    Random,
    /// The layout of UUIDv7: the marker's `received_at` in milliseconds since the epoch in
    /// the first six bytes, then ten random ones, so a day's markers are adjacent in the
    /// message-id index as they are in the `received_at` one.
    TimeOrdered,
}

impl SeedIds {
    /// The flag's value: `random` or `v7`.
    pub fn parse(value: &str) -> Result<Self, BoxError> {
        match value {
            "random" | "v4" => Ok(SeedIds::Random),
            "v7" => Ok(SeedIds::TimeOrdered),
            other => Err(format!("--growth-ids takes random or v7, not {other}").into()),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SeedIds::Random => "random",
            SeedIds::TimeOrdered => "v7",
        }
    }
}

/// Age in days of the oldest cohort.
pub const OLDEST_DAYS: u64 = 100;

/// How the seeded rows are laid out.
#[derive(Clone, Copy, Debug)]
pub struct Cohorts {
    pub count: u64,
    pub rows_each: u64,
}

impl Cohorts {
    /// `rows` split into `count` cohorts; the last may be smaller than the others.
    pub fn new(rows: u64, count: u64) -> Self {
        let count = count.clamp(1, OLDEST_DAYS - 1);
        Self {
            count,
            rows_each: rows.div_ceil(count),
        }
    }

    /// The row numbers of cohort `k` when `total` rows are seeded (empty past the end).
    pub fn range(&self, k: u64, total: u64) -> std::ops::RangeInclusive<u64> {
        (k * self.rows_each + 1)..=((k + 1) * self.rows_each).min(total)
    }

    /// How many rows cohort `k` holds when `total` rows are seeded.
    pub fn rows_in(&self, k: u64, total: u64) -> u64 {
        let range = self.range(k, total);
        (range.end() + 1).saturating_sub(*range.start())
    }

    /// Age in days of cohort `k`.
    pub fn age_days(k: u64) -> u64 {
        OLDEST_DAYS - k
    }

    /// The row numbers of the markers that take cohort `k`'s place once it is purged: as
    /// many as it held, numbered past every seeded row and every other refill, so their
    /// ids are new.
    pub fn refill_range(&self, k: u64, total: u64) -> std::ops::RangeInclusive<u64> {
        let first = total + k * self.rows_each + 1;
        first..=(first + self.rows_in(k, total)).saturating_sub(1)
    }
}

/// Age in days of the markers that refill a purged cohort: younger than any purge's
/// cutoff (half a day younger than a cohort, the youngest [`OLDEST_DAYS`]` - 98` days old),
/// so they stay while the later purges delete their own cohorts.
pub const REFILL_AGE_DAYS: u64 = 1;

/// Inserts `rows` markers in `cohorts`, then refreshes the planner's statistics so the
/// growth measurement does not meet a pending autovacuum or stale plans.
pub async fn seed(
    db: &DatabaseConnection,
    rows: u64,
    cohorts: Cohorts,
    ids: SeedIds,
) -> Result<(), BoxError> {
    let backend = db.get_database_backend();
    for k in 0..cohorts.count {
        let range = cohorts.range(k, rows);
        if range.is_empty() {
            break;
        }
        let sql = cohort_sql(
            backend,
            *range.start(),
            *range.end(),
            Cohorts::age_days(k),
            ids,
        )?;
        db.execute_unprepared(&sql).await?;
    }
    settle(db).await
}

/// Rows per seeding statement of [`seed_rows`]: a power of ten, so MariaDB's digit tables
/// spell exactly the rows asked, and a transaction small enough for the undo log.
const CHUNK: u64 = 1_000_000;

/// Inserts markers numbered `first..=last` (numbers decide the ids: give each number
/// once), received and processed `age` days ago, with ids laid out as `ids` says, a
/// million per statement.
pub async fn seed_rows(
    db: &DatabaseConnection,
    first: u64,
    last: u64,
    age: u64,
    ids: SeedIds,
) -> Result<(), BoxError> {
    let backend = db.get_database_backend();
    let mut start = first;
    while start <= last {
        let end = last.min(start + CHUNK - 1);
        db.execute_unprepared(&cohort_sql(backend, start, end, age, ids)?)
            .await?;
        start = end + 1;
    }
    Ok(())
}

/// Refreshes the planner's statistics (and, on PostgreSQL, the visibility map) so a
/// measurement after seeding meets no pending autovacuum or stale plans.
pub async fn settle(db: &DatabaseConnection) -> Result<(), BoxError> {
    let settle = match db.get_database_backend() {
        DbBackend::Postgres => "VACUUM ANALYZE inbox",
        DbBackend::MySql => "ANALYZE TABLE inbox",
        _ => "PRAGMA wal_checkpoint(TRUNCATE)",
    };
    db.execute_unprepared(settle).await?;
    Ok(())
}

/// One INSERT ... SELECT of rows `first..=last`, received (and processed) `age` days ago.
/// Message ids are 16-byte values derived from the row number (random, or behind the
/// receipt's milliseconds as `ids` says), inserted in key order: each statement then
/// walks the message-id index once from left to right instead of fetching a random leaf
/// per row, which keeps seeding a table far larger than the buffer pool to minutes. Past
/// the first statement random keys land between existing ones and split leaves as
/// random arrivals do; the first packs its leaves fuller.
fn cohort_sql(
    backend: DbBackend,
    first: u64,
    last: u64,
    age: u64,
    ids: SeedIds,
) -> Result<String, BoxError> {
    const COLUMNS: &str = "INSERT INTO inbox (message_id, consumer, received_at, processed_at)";
    let time_ordered = ids == SeedIds::TimeOrdered;
    match backend {
        DbBackend::Postgres => {
            let id = if time_ordered {
                "(lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') \
                 || substr(md5('seed-' || g), 13))::uuid"
            } else {
                "md5('seed-' || g)::uuid"
            };
            Ok(format!(
                "{COLUMNS} SELECT {id}, '{CONSUMER}', t, t \
                 FROM generate_series({first}::bigint, {last}::bigint) g, \
                 (SELECT now() - interval '{age} days' AS t) at ORDER BY 1"
            ))
        }
        DbBackend::MySql => {
            // Milliseconds counted from a DATETIME literal, not UNIX_TIMESTAMP(), which
            // reads `t` in the session's time zone.
            let id = if time_ordered {
                "CONCAT(UNHEX(LPAD(HEX(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', t) DIV 1000), 12, '0')), \
                 SUBSTRING(UNHEX(MD5(CONCAT('seed-', n))), 7))"
            } else {
                "UNHEX(MD5(CONCAT('seed-', n)))"
            };
            Ok(format!(
                "{COLUMNS} SELECT {id}, '{CONSUMER}', t, t \
                 FROM (SELECT {first} + {offset} AS n, UTC_TIMESTAMP(6) - INTERVAL {age} DAY AS t \
                       FROM {digits}) numbers WHERE n <= {last} ORDER BY 1",
                offset = digit_offset(last - first + 1),
                digits = digit_tables(last - first + 1),
            ))
        }
        // The text form sqlx writes for a UTC DateTime, so the purge's cutoff compares
        // with it correctly as text.
        DbBackend::Sqlite => {
            let id = if time_ordered {
                "unhex(printf('%012x', CAST(round((julianday(t) - 2440587.5) * 86400000) AS INTEGER))) \
                 || randomblob(10)"
            } else {
                "randomblob(16)"
            };
            Ok(format!(
                "WITH RECURSIVE seq(n) AS (SELECT {first} UNION ALL SELECT n + 1 FROM seq WHERE n < {last}) \
                 {COLUMNS} SELECT {id}, '{CONSUMER}', t, t FROM seq, \
                 (SELECT strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now', '-{age} days') AS t)"
            ))
        }
        other => Err(format!("no seeding SQL for {other:?}").into()),
    }
}

/// How many decimal digits it takes to count `rows` rows from 0.
fn digits_for(rows: u64) -> u32 {
    rows.saturating_sub(1)
        .checked_ilog10()
        .map_or(1, |log| log + 1)
}

/// MySQL has no generate_series: cross join one ten-row table per digit.
fn digit_tables(rows: u64) -> String {
    (0..digits_for(rows))
        .map(|i| {
            format!(
                "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                 UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                 UNION ALL SELECT 8 UNION ALL SELECT 9) d{i}"
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The row number the digit tables spell: `d0.d + 10 * d1.d + 100 * d2.d + ...`.
fn digit_offset(rows: u64) -> String {
    (0..digits_for(rows))
        .map(|i| format!("{} * d{i}.d", 10_u64.pow(i)))
        .collect::<Vec<_>>()
        .join(" + ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use sea_orm::Statement;
    use sea_orm_inbox_migration::{Migrator, MigratorTrait};

    /// Each v7 id starts with its marker's `received_at` in milliseconds, so ids sort as
    /// the receipts do: the older day first.
    #[tokio::test]
    async fn time_ordered_ids_begin_with_the_receipt() -> Result<(), BoxError> {
        let db = sea_orm::Database::connect("sqlite::memory:").await?;
        Migrator::up(&db, None).await?;
        seed_rows(&db, 1, 3, 2, SeedIds::TimeOrdered).await?;
        seed_rows(&db, 4, 6, 10, SeedIds::TimeOrdered).await?;
        let rows = db
            .query_all_raw(Statement::from_string(
                DbBackend::Sqlite,
                "SELECT message_id, received_at FROM inbox ORDER BY message_id",
            ))
            .await?;
        let mut receipts = Vec::new();
        for row in rows {
            let id: Vec<u8> = row.try_get_by_index(0)?;
            let received: String = row.try_get_by_index(1)?;
            let millis = chrono::DateTime::parse_from_rfc3339(&received)?.timestamp_millis();
            let mut prefix = [0_u8; 8];
            prefix[2..].copy_from_slice(id.get(..6).ok_or("a short id")?);
            assert_eq!((id.len(), i64::from_be_bytes(prefix)), (16, millis));
            receipts.push(millis);
        }
        assert_eq!(receipts.len(), 6);
        assert!(receipts.is_sorted() && receipts[0] < receipts[5]);
        Ok(())
    }

    #[test]
    fn cohorts_cover_every_row_once() {
        let cohorts = Cohorts::new(1_000_003, 22);
        let total: u64 = (0..cohorts.count)
            .map(|k| cohorts.rows_in(k, 1_000_003))
            .sum();
        assert_eq!(total, 1_000_003);
        assert_eq!(*cohorts.range(0, 1_000_003).start(), 1);
        assert_eq!(cohorts.rows_in(cohorts.count, 1_000_003), 0);
    }

    #[test]
    fn digit_tables_count_far_enough() {
        assert_eq!(digits_for(1), 1);
        assert_eq!(digits_for(10), 1);
        assert_eq!(digits_for(11), 2);
        assert_eq!(digits_for(227_273), 6);
        assert_eq!(digit_offset(100), "1 * d0.d + 10 * d1.d");
    }
}
