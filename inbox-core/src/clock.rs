//! Instants as the inbox's timestamp columns store them.

use chrono::{DateTime, Timelike, Utc};

/// The current UTC time cut to microseconds, the precision every backend stores, so a
/// value read back equals the value written.
pub(crate) fn now_micros() -> DateTime<Utc> {
    truncate_to_micros(Utc::now())
}

/// `at` cut to whole microseconds, the finest precision the timestamp columns store
/// (PostgreSQL's `timestamptz`, MySQL/MariaDB's `datetime(6)`), so a value the library
/// reports equals the value the database stored and later reads back.
pub(crate) fn truncate_to_micros(at: DateTime<Utc>) -> DateTime<Utc> {
    // `nanosecond()` exceeds 999_999_999 only inside a leap second; cutting it keeps it
    // there, so `with_nanosecond` accepts it.
    at.with_nanosecond(at.nanosecond() / 1_000 * 1_000)
        .unwrap_or(at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn drops_what_is_below_a_microsecond() {
        let at = Utc.timestamp_opt(1_700_000_000, 123_456_789).unwrap();
        assert_eq!(truncate_to_micros(at).nanosecond(), 123_456_000);
        assert_eq!(
            truncate_to_micros(DateTime::<Utc>::MAX_UTC).nanosecond(),
            999_999_000
        );
    }
}
