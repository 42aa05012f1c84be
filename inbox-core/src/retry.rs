use crate::InboxError;
use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// How [`Inbox::process`](crate::Inbox::process) retries transient database failures.
///
/// A transient failure (serialization failure, deadlock, lock wait timeout, SQLite
/// busy/locked, a lost connection) is retried from the top with a fresh transaction: the
/// failed one is never reused. Between attempts the call sleeps a random time up to an
/// exponentially growing cap ("full jitter"), so replicas that collided do not collide
/// again in step.
///
/// ```
/// use sea_orm_inbox::RetryPolicy;
/// use std::time::Duration;
///
/// let policy = RetryPolicy::default()
///     .max_attempts(8)
///     .backoff(Duration::from_millis(5), Duration::from_millis(500))?;
/// assert_eq!(policy.attempts(), 8);
/// # Ok::<(), sea_orm_inbox::InboxError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
}

impl Default for RetryPolicy {
    /// 5 attempts, backoff growing from 10 ms to at most 1 s.
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_secs(1),
        }
    }
}

impl RetryPolicy {
    /// The default of the lease calls
    /// ([`LeaseOptions::DEFAULT_RETRY`](crate::LeaseOptions::DEFAULT_RETRY)).
    pub(crate) const SHORT_TRANSACTIONS: Self = Self {
        max_attempts: 5,
        initial_backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(20),
    };

    /// Never retries: the first transient failure is returned.
    pub fn no_retry() -> Self {
        Self::default().max_attempts(1)
    }

    /// Total attempts, the first one included; `0` counts as `1`.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The longest backoff accepted: a minute. A retry belongs to one delivery, which the
    /// broker redelivers elsewhere once its lock or visibility timeout runs out; sleeping
    /// longer only holds the message.
    pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

    /// The backoff cap before the second attempt, and the cap it doubles up to (raised to
    /// `initial` when smaller).
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] when `initial` or `max` exceeds
    /// [`MAX_BACKOFF`](Self::MAX_BACKOFF).
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Result<Self, InboxError> {
        for backoff in [initial, max] {
            if backoff > Self::MAX_BACKOFF {
                return Err(InboxError::out_of_range(
                    "the retry backoff",
                    backoff,
                    Duration::ZERO..=Self::MAX_BACKOFF,
                    "back off for milliseconds to seconds, and let the broker redeliver a message that keeps failing",
                ));
            }
        }
        self.initial_backoff = initial;
        self.max_backoff = max.max(initial);
        Ok(self)
    }

    /// Total attempts, the first one included.
    pub fn attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The sleep before attempt `next_attempt` (2 for the first retry): uniformly random
    /// up to `initial * 2^(next_attempt - 2)`, capped at the maximum.
    pub(crate) fn delay_before(&self, next_attempt: u32) -> Duration {
        let doublings = next_attempt.saturating_sub(2).min(20);
        let cap = self
            .initial_backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff);
        cap.mul_f64(random_unit())
    }

    /// Runs `attempt` until it succeeds, fails with an error `transient` does not accept,
    /// or has run [`attempts`](Self::attempts) times, sleeping
    /// [`delay_before`](Self::delay_before) the next attempt in between. Each attempt must
    /// start from scratch (a fresh transaction): the failed one is never reused.
    pub(crate) async fn run<T, E, F, Fut>(
        &self,
        mut attempt: F,
        transient: impl Fn(&E) -> bool,
    ) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let mut made = 1;
        loop {
            match attempt().await {
                Err(err) if made < self.max_attempts && transient(&err) => {
                    made += 1;
                    tokio::time::sleep(self.delay_before(made)).await;
                }
                result => return result,
            }
        }
    }
}

/// A uniformly distributed number in `[0, 1)`, from the process's random hasher keys.
fn random_unit() -> f64 {
    let bits = RandomState::new().build_hasher().finish() >> 11;
    bits as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_stays_under_the_cap() {
        let policy = RetryPolicy::default()
            .backoff(Duration::from_millis(10), Duration::from_millis(40))
            .expect("a short backoff");
        for _ in 0..100 {
            assert!(policy.delay_before(2) <= Duration::from_millis(10));
            assert!(policy.delay_before(3) <= Duration::from_millis(20));
            assert!(policy.delay_before(30) <= Duration::from_millis(40));
        }
        let spread: std::collections::HashSet<_> =
            (0..20).map(|_| policy.delay_before(4)).collect();
        assert!(spread.len() > 1, "jittered");
    }

    #[test]
    fn refuses_a_backoff_above_the_maximum() {
        let over = RetryPolicy::MAX_BACKOFF + Duration::from_nanos(1);
        for (initial, max) in [
            (Duration::from_millis(10), Duration::MAX),
            (Duration::MAX, Duration::from_millis(10)),
            (over, over),
        ] {
            assert!(matches!(
                RetryPolicy::default().backoff(initial, max),
                Err(InboxError::OutOfRange {
                    what: "the retry backoff",
                    ..
                })
            ));
        }
        let longest = RetryPolicy::default()
            .backoff(RetryPolicy::MAX_BACKOFF, RetryPolicy::MAX_BACKOFF)
            .expect("the maximum itself");
        assert!(longest.delay_before(30) <= RetryPolicy::MAX_BACKOFF);
    }

    /// Counts the attempts `run` makes when every one fails with `fail`, `transient`
    /// accepting odd numbers.
    async fn attempts_made(policy: RetryPolicy, fail: u32) -> u32 {
        let mut made = 0;
        let result: Result<(), u32> = policy
            .run(
                || {
                    made += 1;
                    async move { Err(fail) }
                },
                |err| err % 2 == 1,
            )
            .await;
        assert_eq!(result, Err(fail));
        made
    }

    #[tokio::test]
    async fn run_retries_transient_failures_up_to_the_attempts() {
        let policy = RetryPolicy::default()
            .max_attempts(4)
            .backoff(Duration::from_micros(1), Duration::from_micros(1))
            .expect("a short backoff");
        assert_eq!(attempts_made(policy, 1).await, 4);
        assert_eq!(attempts_made(policy, 2).await, 1, "not transient");
        assert_eq!(attempts_made(RetryPolicy::no_retry(), 1).await, 1);
    }

    #[tokio::test]
    async fn run_stops_at_the_first_success() {
        let mut made = 0;
        let result: Result<u32, u32> = RetryPolicy::default()
            .run(
                || {
                    made += 1;
                    let now = made;
                    async move { if now < 3 { Err(1) } else { Ok(now) } }
                },
                |_| true,
            )
            .await;
        assert_eq!(result, Ok(3));
    }

    #[test]
    fn the_short_transaction_policy_waits_at_most_20_ms_between_attempts() {
        let policy = RetryPolicy::SHORT_TRANSACTIONS;
        assert_eq!(policy.attempts(), 5);
        for (next, cap_ms) in [(2, 5), (3, 10), (4, 20), (5, 20)] {
            assert!(policy.delay_before(next) <= Duration::from_millis(cap_ms));
        }
    }

    #[test]
    fn at_least_one_attempt() {
        assert_eq!(RetryPolicy::default().max_attempts(0).attempts(), 1);
        assert_eq!(RetryPolicy::no_retry().attempts(), 1);
    }
}
