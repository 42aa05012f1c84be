//! The pacing of one purge, free of I/O.

use super::{PurgePacing, RetentionPolicy};
use sea_orm::DbBackend;
use std::time::Duration;

/// The pacing of one purge, free of I/O: the size of the next batch, and the rest after
/// the last one.
///
/// Batches are sized from the DELETE's own time, from the moment its transaction holds
/// the write lock (on SQLite the batch takes it at BEGIN, and the wait behind the
/// claimers before it does not count), and from the fastest rate this purge has seen
/// (seconds per row), not the last batch's: a DELETE that waited for a row lock held
/// nothing meanwhile, and shrinking the next batch for it would only add statements that
/// wait again.
#[derive(Clone, Copy, Debug)]
pub(super) struct Pacer {
    /// The batch budget on the purge's backend, if any.
    budget: Option<Duration>,
    busy_percent: u8,
    ceiling: u64,
    next: u64,
    /// The least time per row measured so far, in seconds.
    fastest_row: Option<f64>,
}

impl Pacer {
    pub(super) fn new(policy: &RetentionPolicy, backend: DbBackend) -> Self {
        let ceiling = u64::from(policy.batch_size());
        let budget = policy.pacing().batch_budget(backend);
        let next = match budget {
            // Start below most budgets and grow: the first batch of a cold purge is its
            // slowest. (At 100 rows, seven batches of doubling went by before a purge on
            // PostgreSQL deleted at its rate: most of a 40,000-row purge, measured.)
            Some(_) => ceiling.min(u64::from(PurgePacing::MIN_BATCH) * 100),
            None => ceiling,
        };
        Self {
            budget,
            busy_percent: policy.pacing().busy_percent(),
            ceiling,
            next,
            fastest_row: None,
        }
    }

    /// Rows the next DELETE may remove.
    pub(super) fn batch(&self) -> u64 {
        self.next
    }

    /// Takes a full batch whose DELETE ran for `took` once its transaction held the write
    /// lock; returns how long to rest before the next.
    pub(super) fn full_batch(&mut self, took: Duration) -> Duration {
        let rows = self.next.max(1) as f64;
        let per_row = took.as_secs_f64() / rows;
        let fastest = self.fastest_row.map_or(per_row, |best| best.min(per_row));
        self.fastest_row = Some(fastest);
        if let Some(budget) = self.budget {
            let floor = u64::from(PurgePacing::MIN_BATCH).min(self.ceiling);
            let fitting = if fastest > 0.0 {
                (budget.as_secs_f64() / fastest)
                    .round()
                    .clamp(0.0, u64::MAX as f64) as u64
            } else {
                u64::MAX
            };
            self.next = fitting
                .clamp(self.next / 2, self.next.saturating_mul(4))
                .clamp(floor, self.ceiling);
        }
        // The rest follows the work the batch did, not the time it waited for locks.
        let worked = took.min(Duration::from_secs_f64(fastest * rows));
        let busy = u32::from(self.busy_percent.clamp(1, 100));
        worked * (100 - busy) / busy
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retention::policy::tests::hour_window;

    fn paced(budget_ms: u64, busy: u8, ceiling: u32) -> Pacer {
        let pacing = PurgePacing::default()
            .with_batch_budget(Duration::from_millis(budget_ms))
            .and_then(|p| p.with_busy_percent(busy))
            .expect("valid pacing");
        let policy = hour_window()
            .with_batch_size(ceiling)
            .expect("valid batch size")
            .with_pacing(pacing);
        Pacer::new(&policy, DbBackend::Sqlite)
    }

    #[test]
    fn unpaced_purges_run_full_batches_back_to_back() {
        let policy = hour_window()
            .with_batch_size(5_000)
            .expect("valid batch size")
            .with_pacing(PurgePacing::UNPACED);
        let mut pacer = Pacer::new(&policy, DbBackend::Sqlite);
        assert_eq!(pacer.batch(), 5_000);
        assert_eq!(pacer.full_batch(Duration::from_secs(3)), Duration::ZERO);
        assert_eq!(pacer.batch(), 5_000);
    }

    #[test]
    fn the_batch_follows_its_time_budget_within_bounds() {
        let mut pacer = paced(20, 100, 100_000);
        assert_eq!(pacer.batch(), 1_000, "a paced purge starts at 1,000 rows");
        // 1,000 rows in 10 ms: 10 us a row, 2,000 fit the 20 ms budget.
        pacer.full_batch(Duration::from_millis(10));
        assert_eq!(pacer.batch(), 2_000);
        // 2,000 rows in 2 ms: 1 us a row, 20,000 fit, but a batch at most quadruples.
        pacer.full_batch(Duration::from_millis(2));
        assert_eq!(pacer.batch(), 8_000);
        // 8,000 rows in 8 ms: 20,000 fit.
        pacer.full_batch(Duration::from_millis(8));
        assert_eq!(pacer.batch(), 20_000);
        // A batch that waited a second for a lock does not shrink the next one.
        pacer.full_batch(Duration::from_secs(1));
        assert_eq!(pacer.batch(), 20_000);
        // 20,000 rows in 200 ms: 10 us a row is no faster than seen, the batch stays.
        pacer.full_batch(Duration::from_millis(200));
        assert_eq!(pacer.batch(), 20_000);
        for _ in 0..20 {
            pacer.full_batch(Duration::from_micros(1));
        }
        assert_eq!(
            pacer.batch(),
            100_000,
            "never above the policy's batch size"
        );
    }

    /// The defaults run a purge in a few batches of the policy's batch size, as a
    /// hand-written batched DELETE does, where the database deletes 10,000 rows within the
    /// budget: the batch count, not the rows, is what a purge pays for.
    #[test]
    fn the_default_pacing_reaches_the_default_batch_size_in_three_batches() {
        let mut pacer = Pacer::new(&hour_window(), DbBackend::Sqlite);
        assert_eq!(pacer.batch(), 1_000);
        // 2 us a row: 10,000 rows fit the default 20 ms budget.
        let rest = pacer.full_batch(Duration::from_millis(2));
        assert_eq!(pacer.batch(), 4_000);
        let ninth = Duration::from_millis(2) / 9;
        assert!(
            rest.max(ninth) - rest.min(ninth) < Duration::from_micros(1),
            "busy 90 %: {rest:?}"
        );
        pacer.full_batch(Duration::from_millis(8));
        assert_eq!(
            pacer.batch(),
            u64::from(RetentionPolicy::DEFAULT_BATCH_SIZE),
            "10,000 rows fit the default budget"
        );
        assert_eq!(RetentionPolicy::DEFAULT_BATCH_SIZE, 10_000);
    }

    /// At MariaDB's measured 10 us a row (its batches stopped near 2,000 rows under a
    /// 20 ms budget), the default pacing on a server reaches the 10,000-row batches of a
    /// hand-written DELETE; on SQLite, where a batch holds the one write lock, it keeps
    /// them within 20 ms.
    #[test]
    fn the_default_budget_lets_server_batches_reach_the_batch_size() {
        let batches = |backend| {
            let mut pacer = Pacer::new(&hour_window(), backend);
            let mut sizes = vec![pacer.batch()];
            for _ in 0..4 {
                let took = Duration::from_micros(10 * pacer.batch());
                pacer.full_batch(took);
                sizes.push(pacer.batch());
            }
            sizes
        };
        for server in [DbBackend::Postgres, DbBackend::MySql] {
            assert_eq!(
                batches(server),
                [1_000, 4_000, 10_000, 10_000, 10_000],
                "{server:?}"
            );
        }
        assert_eq!(
            batches(DbBackend::Sqlite),
            [1_000, 2_000, 2_000, 2_000, 2_000]
        );
    }

    #[test]
    fn slow_rows_shrink_the_batch_to_at_least_min_batch() {
        let mut pacer = paced(20, 100, 10_000);
        // 1 ms a row: 20 rows fit, reached by halving at most.
        for (took_ms, next) in [(1_000, 500), (500, 250), (250, 125), (125, 62), (62, 31)] {
            pacer.full_batch(Duration::from_millis(took_ms));
            assert_eq!(pacer.batch(), next);
        }
        pacer.full_batch(Duration::from_millis(31));
        assert_eq!(pacer.batch(), 20);
        let mut tight = paced(1, 100, 10_000);
        for _ in 0..10 {
            tight.full_batch(Duration::from_secs(1));
        }
        assert_eq!(tight.batch(), u64::from(PurgePacing::MIN_BATCH));
    }

    #[test]
    fn the_rest_is_in_proportion_to_the_batch() {
        let mut pacer = paced(20, 80, 1_000);
        assert_eq!(
            pacer.full_batch(Duration::from_millis(100)),
            Duration::from_millis(25)
        );
        let mut half = paced(20, 50, 1_000);
        assert_eq!(
            half.full_batch(Duration::from_millis(30)),
            Duration::from_millis(30)
        );
        // The rest follows the work: 1,000 rows at 10 us, however long the lock wait was.
        let mut waited = paced(20, 50, 1_000);
        waited.full_batch(Duration::from_millis(10));
        assert_eq!(
            waited.full_batch(Duration::from_secs(1)),
            Duration::from_millis(10)
        );
        let mut tiny = paced(20, 100, 5);
        assert_eq!(tiny.batch(), 5, "a ceiling below the start wins");
        assert_eq!(tiny.full_batch(Duration::from_secs(1)), Duration::ZERO);
        assert_eq!(tiny.batch(), 5, "and below MIN_BATCH too");
    }
}
