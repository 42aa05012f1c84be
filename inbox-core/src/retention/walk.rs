//! The receiving-time walk of the downtime rule, free of I/O.

use super::RetentionPolicy;
use crate::clock::truncate_to_micros;
use chrono::{DateTime, TimeDelta, Utc};
use std::time::Duration;

/// The step of the receiving-time walk over `window`: a
/// [`RetentionPolicy::MAX_GAPS_PER_WINDOW`]th of it, rounded up to a whole microsecond,
/// so that the steps of one walk cover a window and land on the timestamps' precision.
pub(super) fn walk_step(window: Duration) -> Duration {
    let per_step = window
        .as_nanos()
        .div_ceil(u128::from(RetentionPolicy::MAX_GAPS_PER_WINDOW));
    let micros = per_step.div_ceil(1_000).max(1);
    // A window of at most MAX_WINDOW makes at most 5e16 microseconds: it fits.
    Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX))
}

/// The receiving-time walk of the downtime rule, one probe at a time, free of I/O.
///
/// Each probe asks for the newest marker at or before `at - step`; the stretch back to it
/// counts in full when it is no longer than the downtime gap, and as one `step` otherwise
/// (the probe cannot see into the last `step` before `at`, so that much may have been
/// receiving). Every probe but the last adds at least `step`, and
/// [`MAX_GAPS_PER_WINDOW`](RetentionPolicy::MAX_GAPS_PER_WINDOW) steps cover the window,
/// so a walk makes at most that many probes, whatever the gap (which the policy keeps no
/// finer than a step: a finer one would count every silence as a step all the same).
#[derive(Clone, Copy, Debug)]
pub(super) struct ReceivingWalk {
    window: TimeDelta,
    gap: TimeDelta,
    step: TimeDelta,
    at: DateTime<Utc>,
    receiving: TimeDelta,
}

/// Where a walk goes next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WalkStep {
    /// Probe for the newest marker at or before this instant.
    Probe(DateTime<Utc>),
    /// Markers received strictly before this instant are past the window.
    Cutoff(DateTime<Utc>),
    /// The walk left the range of representable time: nothing is old enough to delete.
    Exhausted,
}

impl ReceivingWalk {
    pub(super) fn start(
        policy: &RetentionPolicy,
        newest: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> (Self, WalkStep) {
        // `with_window` bounds all three durations to a hundred years: they convert.
        let window = TimeDelta::from_std(policy.window()).unwrap_or(TimeDelta::MAX);
        let gap = TimeDelta::from_std(policy.downtime_gap()).unwrap_or(window);
        let step = TimeDelta::from_std(walk_step(policy.window())).unwrap_or(window);
        let walk = Self {
            window,
            gap,
            step,
            at: newest.min(now),
            receiving: TimeDelta::zero(),
        };
        (walk, walk.probe_before(walk.at))
    }

    /// Takes the answer to the last probe: the newest marker at or before it.
    pub(super) fn advance(&mut self, earlier: DateTime<Utc>) -> WalkStep {
        let span = self.at - earlier;
        let counted = if span <= self.gap { span } else { self.step };
        let missing = self.window - self.receiving;
        if counted >= missing {
            return self
                .at
                .checked_sub_signed(missing)
                .map(truncate_to_micros)
                .map_or(WalkStep::Exhausted, WalkStep::Cutoff);
        }
        self.receiving += counted;
        self.at = earlier;
        self.probe_before(earlier)
    }

    /// Takes the oldest marker when no marker is at or before the last probe: every marker
    /// left lies within one step of where the walk stands, a silence no longer than the
    /// gap, so it all counts. `None` when that is still short of a window.
    pub(super) fn finish(&self, oldest: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let missing = self.window - self.receiving;
        if self.at - oldest < missing {
            return None;
        }
        self.at.checked_sub_signed(missing).map(truncate_to_micros)
    }

    fn probe_before(&self, at: DateTime<Utc>) -> WalkStep {
        at.checked_sub_signed(self.step)
            .map_or(WalkStep::Exhausted, WalkStep::Probe)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::now_micros;
    use crate::retention::policy::tests::hour_window;

    /// Runs a walk over an in-memory timeline as `receiving_time_cutoff` runs it over the
    /// index; returns the cutoff and the timestamps it read (the newest, the probes and
    /// the oldest, if asked for). The tests' instants are whole microseconds
    /// (`now_micros`), as the database returns them.
    fn walk(
        markers: &[DateTime<Utc>],
        policy: &RetentionPolicy,
        now: DateTime<Utc>,
    ) -> (Option<DateTime<Utc>>, usize) {
        let mut sorted = markers.to_vec();
        sorted.sort();
        let newest = *sorted.last().expect("a marker");
        let (mut state, mut next) = ReceivingWalk::start(policy, newest, now);
        let mut reads = 1;
        loop {
            match next {
                WalkStep::Cutoff(cutoff) => return (Some(cutoff), reads),
                WalkStep::Exhausted => return (None, reads),
                WalkStep::Probe(at) => {
                    reads += 1;
                    match sorted.iter().rev().find(|m| **m <= at) {
                        Some(earlier) => next = state.advance(*earlier),
                        None => return (state.finish(sorted[0]), reads + 1),
                    }
                }
            }
        }
    }

    fn step_of(policy: &RetentionPolicy) -> TimeDelta {
        TimeDelta::from_std(policy.finest_downtime_gap()).expect("a short step")
    }

    fn every_minute(from: DateTime<Utc>, minutes: i64) -> Vec<DateTime<Utc>> {
        (0..=minutes)
            .map(|m| from + TimeDelta::minutes(m))
            .collect()
    }

    #[test]
    fn steady_traffic_keeps_exactly_one_window() {
        let end = now_micros();
        let markers = every_minute(end - TimeDelta::hours(3), 180);
        let (cutoff, reads) = walk(&markers, &hour_window(), end);
        assert_eq!(cutoff, Some(end - TimeDelta::hours(1)));
        assert!(reads <= 64, "{reads} reads");
    }

    #[test]
    fn an_outage_does_not_count_towards_the_window() {
        let now = now_micros();
        let outage_began = now - TimeDelta::days(30);
        let mut markers = every_minute(outage_began - TimeDelta::hours(3), 180);
        markers.extend(every_minute(now - TimeDelta::minutes(20), 20));
        let (cutoff, _) = walk(&markers, &hour_window(), now);
        let cutoff = cutoff.expect("a window of receiving time exists");
        // 20 minutes after the outage, one probe step for the silence, the rest before it.
        let step = step_of(&hour_window());
        assert_eq!(cutoff, outage_began - (TimeDelta::minutes(40) - step));
    }

    #[test]
    fn less_than_a_window_of_receiving_deletes_nothing() {
        let now = now_micros();
        let markers = every_minute(now - TimeDelta::minutes(50), 50);
        assert_eq!(walk(&markers, &hour_window(), now).0, None);
    }

    #[test]
    fn sparse_history_costs_at_most_64_reads() {
        let now = now_micros();
        let markers: Vec<_> = (0..10_000).map(|d| now - TimeDelta::days(d)).collect();
        let (cutoff, reads) = walk(&markers, &hour_window(), now);
        assert!(reads <= 64, "{reads} reads");
        assert!(
            cutoff.is_some_and(|c| c < now - TimeDelta::days(60)),
            "{cutoff:?}"
        );
    }

    #[test]
    fn a_clock_behind_the_newest_marker_walks_from_the_clock() {
        let now = now_micros();
        let markers = every_minute(now - TimeDelta::hours(2), 180); // an hour in the future
        assert_eq!(
            walk(&markers, &hour_window(), now).0,
            Some(now - TimeDelta::hours(1))
        );
    }

    /// Daily cohorts 93 to 100 days old and today's traffic: with every silence counted
    /// as receiving, the cutoff lands exactly one window back, even where the last coarse
    /// probe steps past the oldest cohort.
    #[test]
    fn markers_within_the_last_step_still_count() {
        let now = now_micros();
        let mut markers: Vec<_> = (93..=100).map(|d| now - TimeDelta::days(d)).collect();
        markers.push(now);
        let window = TimeDelta::days(100) - TimeDelta::hours(12);
        let policy = RetentionPolicy::with_window(window.to_std().expect("positive"))
            .and_then(|p| p.with_downtime_gap(RetentionPolicy::MAX_WINDOW))
            .expect("valid policy");
        assert_eq!(walk(&markers, &policy, now).0, Some(now - window));
    }

    /// Every window the policy accepts, with its finest, default and coarsest gaps, over
    /// timelines denser and sparser than a step: never more than 64 reads. (A 1 s gap on
    /// an hour made 3,601 when the step followed the gap.)
    #[test]
    fn every_accepted_window_and_gap_costs_at_most_64_reads() {
        let now = now_micros();
        let windows = [
            Duration::from_micros(8),
            Duration::from_nanos(9_500),
            Duration::from_micros(100),
            Duration::from_secs(1),
            Duration::from_secs(3_600),
            Duration::from_secs(3_600) + Duration::from_nanos(1),
            Duration::from_secs(7 * 86_400),
            RetentionPolicy::MAX_WINDOW,
        ];
        for window in windows {
            let policy = RetentionPolicy::with_window(window).expect("a valid window");
            let finest = policy.finest_downtime_gap();
            for gap in [
                finest,
                finest * 3 / 2,
                window / 8,
                RetentionPolicy::MAX_WINDOW,
            ] {
                let policy = policy.with_downtime_gap(gap).expect("a valid gap");
                let step = step_of(&policy);
                for spacing in [step / 3, step / 2, step, step * 3 / 2, step * 5] {
                    let spacing = spacing.max(TimeDelta::microseconds(1));
                    let markers: Vec<_> = (0..400).map(|n| now - spacing * n).collect();
                    let (_, reads) = walk(&markers, &policy, now);
                    assert!(
                        reads <= 64,
                        "{reads} reads: window {window:?}, gap {gap:?}, spacing {spacing:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn cutoffs_are_cut_down_to_whole_microseconds() {
        let at = DateTime::from_timestamp(1_000, 123_456_789).expect("a valid instant");
        assert_eq!(
            Some(truncate_to_micros(at)),
            DateTime::from_timestamp(1_000, 123_456_000)
        );
        let before_1970 = DateTime::from_timestamp(-1, 999_999_500).expect("a valid instant");
        assert_eq!(
            Some(truncate_to_micros(before_1970)),
            DateTime::from_timestamp(-1, 999_999_000),
            "down, not towards zero"
        );
        // A window of an hour and 500 ns over steady traffic: the cutoff lands 1 µs lower.
        let end = DateTime::from_timestamp(1_800_000_000, 0).expect("a valid instant");
        let markers = every_minute(end - TimeDelta::hours(3), 180);
        let policy =
            RetentionPolicy::with_window(Duration::from_secs(3_600) + Duration::from_nanos(500))
                .expect("a valid window");
        assert_eq!(
            walk(&markers, &policy, end).0,
            Some(end - TimeDelta::hours(1) - TimeDelta::microseconds(1))
        );
    }
}
