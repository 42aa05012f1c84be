//! The decision of a lease claim, free of I/O: what the row the claim transaction locked
//! says, read against the clock, the options and the call's fencing token.

use super::{DeadClaim, LeaseOptions};
use chrono::{DateTime, Utc};
use sea_orm_inbox_entity::inbox;
use uuid::Uuid;

/// What a claim does with the row it locked, and what it answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Decision {
    /// The row carries this call's token: just inserted, or written by an earlier try of
    /// this call whose COMMIT landed although its reply was lost. The lease as stored:
    /// `Claimed` on attempt 1, `TakenOver` after.
    Own {
        attempt: u32,
        lease_until: DateTime<Utc>,
    },
    /// Another claimant's lease expired with attempts left: replace its token `from`
    /// with this call's, as attempt `attempt`.
    TakeOver { from: Uuid, attempt: u32 },
    /// Another claimant's lease expired on the last allowed attempt: park the row (still
    /// carrying token `from`) as dead now.
    Park { from: Uuid, dead: DeadClaim },
    /// Parked as dead earlier.
    Dead(DeadClaim),
    /// Another claimant holds a live lease.
    Held {
        attempts: u32,
        lease_until: DateTime<Utc>,
    },
    /// Completed; or a one-phase or batch marker, committed together with its work.
    Duplicate,
}

/// Decides a claim with fencing `token` at `now` on `row`, the pair's row as the claim's
/// INSERT left it and its SELECT locked it.
pub(super) fn decide(
    row: &inbox::Model,
    now: DateTime<Utc>,
    options: &LeaseOptions,
    token: Uuid,
) -> Decision {
    let own = row.claim_token == Some(token) && row.processed_at.is_none() && row.dead_at.is_none();
    if let (true, Some(lease_until)) = (own, row.lease_until) {
        return Decision::Own {
            attempt: attempts_of(row),
            lease_until,
        };
    }
    if let Some(dead_at) = row.dead_at {
        return Decision::Dead(DeadClaim::of_row(row, dead_at));
    }
    let (None, Some(held_until), Some(from)) = (row.processed_at, row.lease_until, row.claim_token)
    else {
        return Decision::Duplicate;
    };
    let attempts = attempts_of(row);
    if held_until > now {
        Decision::Held {
            attempts,
            lease_until: held_until,
        }
    } else if attempts >= options.max_attempts {
        Decision::Park {
            from,
            dead: DeadClaim::of_row(row, now),
        }
    } else {
        Decision::TakeOver {
            from,
            attempt: attempts.saturating_add(1),
        }
    }
}

/// The row's attempt count; 0 for a value the column should never hold (negative).
pub(super) fn attempts_of(row: &inbox::Model) -> u32 {
    u32::try_from(row.attempts).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeDelta;
    use std::time::Duration;

    const MAX_ATTEMPTS: u32 = 3;

    fn options() -> LeaseOptions {
        LeaseOptions::new(Duration::from_secs(30))
            .and_then(|options| options.with_max_attempts(MAX_ATTEMPTS))
            .expect("valid options")
    }

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 0).expect("a valid instant")
    }

    /// A lease row on `attempts`, expiring at `lease_until`, written with `token`.
    fn lease_row(attempts: i32, lease_until: DateTime<Utc>, token: Uuid) -> inbox::Model {
        inbox::Model {
            id: 7,
            message_id: Uuid::from_u128(42),
            consumer: "mailer".into(),
            received_at: now() - TimeDelta::minutes(10),
            processed_at: None,
            attempts,
            lease_until: Some(lease_until),
            claim_token: Some(token),
            dead_at: None,
        }
    }

    /// The decision of a claim with token [`mine`] at [`now`].
    fn decided(row: &inbox::Model) -> Decision {
        decide(row, now(), &options(), mine())
    }

    fn mine() -> Uuid {
        Uuid::from_u128(1)
    }

    fn theirs() -> Uuid {
        Uuid::from_u128(2)
    }

    fn later() -> DateTime<Utc> {
        now() + TimeDelta::seconds(30)
    }

    fn earlier() -> DateTime<Utc> {
        now() - TimeDelta::seconds(1)
    }

    #[test]
    fn the_row_just_inserted_is_the_calls_own_first_attempt() {
        let row = lease_row(1, later(), mine());
        assert_eq!(
            decided(&row),
            Decision::Own {
                attempt: 1,
                lease_until: later()
            }
        );
    }

    /// A retry after a takeover whose COMMIT reply was lost: the row's attempt and
    /// expiry as stored, not a new attempt.
    #[test]
    fn a_row_with_the_calls_token_is_its_own_lease_on_any_attempt() {
        let stored = later() - TimeDelta::seconds(5);
        let row = lease_row(2, stored, mine());
        assert_eq!(
            decided(&row),
            Decision::Own {
                attempt: 2,
                lease_until: stored
            }
        );
    }

    /// The lost-reply retry comes back after its own lease ran out: still its own.
    #[test]
    fn the_calls_own_lease_is_its_own_even_once_expired() {
        let row = lease_row(1, earlier(), mine());
        assert_eq!(
            decided(&row),
            Decision::Own {
                attempt: 1,
                lease_until: earlier()
            }
        );
    }

    #[test]
    fn a_live_lease_of_another_claimant_is_held() {
        let row = lease_row(2, later(), theirs());
        assert_eq!(
            decided(&row),
            Decision::Held {
                attempts: 2,
                lease_until: later()
            }
        );
    }

    #[test]
    fn an_expired_lease_with_attempts_left_is_taken_over_as_the_next_attempt() {
        let row = lease_row(MAX_ATTEMPTS as i32 - 1, earlier(), theirs());
        assert_eq!(
            decided(&row),
            Decision::TakeOver {
                from: theirs(),
                attempt: MAX_ATTEMPTS
            }
        );
    }

    /// `lease_until` is the first instant the lease no longer holds.
    #[test]
    fn a_lease_expiring_right_now_is_expired() {
        let row = lease_row(1, now(), theirs());
        assert_eq!(
            decided(&row),
            Decision::TakeOver {
                from: theirs(),
                attempt: 2
            }
        );
    }

    #[test]
    fn an_expired_last_attempt_is_parked_as_dead_now() {
        let row = lease_row(MAX_ATTEMPTS as i32, earlier(), theirs());
        let Decision::Park { from, dead } = decided(&row) else {
            panic!("the last attempt expired");
        };
        assert_eq!(from, theirs());
        assert_eq!(
            dead,
            DeadClaim {
                message_id: crate::MessageId::from_uuid(row.message_id),
                consumer: "mailer".into(),
                attempts: MAX_ATTEMPTS,
                received_at: row.received_at,
                dead_at: now(),
            }
        );
    }

    /// Options lowered below the attempts already made park at once, too.
    #[test]
    fn an_expired_lease_beyond_the_last_attempt_is_parked() {
        let row = lease_row(MAX_ATTEMPTS as i32 + 2, earlier(), theirs());
        assert!(matches!(
            decided(&row),
            Decision::Park { dead, .. } if dead.attempts == MAX_ATTEMPTS + 2
        ));
    }

    #[test]
    fn a_parked_row_stays_dead_whoever_asks() {
        let dead_at = now() - TimeDelta::hours(1);
        for token in [mine(), theirs()] {
            let row = inbox::Model {
                dead_at: Some(dead_at),
                ..lease_row(MAX_ATTEMPTS as i32, earlier(), token)
            };
            assert_eq!(
                decided(&row),
                Decision::Dead(DeadClaim::of_row(&row, dead_at))
            );
        }
    }

    #[test]
    fn a_completed_lease_is_a_duplicate_whoever_asks() {
        for token in [mine(), theirs()] {
            let row = inbox::Model {
                processed_at: Some(earlier()),
                ..lease_row(1, later(), token)
            };
            assert_eq!(decided(&row), Decision::Duplicate);
        }
    }

    /// One-phase markers have no lease; batch markers carry a tag in `claim_token`.
    #[test]
    fn a_one_phase_or_batch_marker_is_a_duplicate() {
        for claim_token in [None, Some(mine()), Some(theirs())] {
            let row = inbox::Model {
                lease_until: None,
                claim_token,
                ..lease_row(1, later(), theirs())
            };
            assert_eq!(decided(&row), Decision::Duplicate);
        }
    }

    /// A negative count (never written by this crate) reads as no attempts made.
    #[test]
    fn a_negative_attempt_count_reads_as_zero() {
        let row = lease_row(-1, earlier(), theirs());
        assert_eq!(
            decided(&row),
            Decision::TakeOver {
                from: theirs(),
                attempt: 1
            }
        );
    }
}
