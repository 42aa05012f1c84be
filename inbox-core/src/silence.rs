//! The client-side bound on a database that stops answering, for the calls that are not
//! about one message (a purge, a listing, the schema check), and for the claims on a
//! caller's transaction.

use crate::backend::over_network;
use crate::{Inbox, InboxError};
use sea_orm::{DatabaseConnection, DbBackend};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tokio::task::coop;
use tokio::time::{Instant, Sleep};

/// Awaits `future`, a database call on `db`, at most `timeout`, and reports
/// [`InboxError::DatabaseSilent`] for `operation` past it. Dropping the future gives up
/// its connection: sqlx pings such a connection before the pool hands it out again, and
/// closes it when the ping fails. Unbounded where no network can go silent (SQLite, whose
/// waits end in its busy timeout).
pub(crate) async fn answered_within<F: Future>(
    db: &DatabaseConnection,
    timeout: Duration,
    operation: &'static str,
    future: F,
) -> Result<F::Output, InboxError> {
    within(db.get_database_backend(), timeout, future)
        .await
        .map_err(|waited| InboxError::DatabaseSilent { operation, waited })
}

/// [`answered_within`] with [`Inbox::DEFAULT_PARTITION_TIMEOUT`] on `timer`, for a call on
/// a connection of `backend` that has no option to change it (a batch claim on the
/// caller's transaction).
pub(crate) async fn answered_on<F: Future>(
    timer: &mut StepTimer,
    backend: DbBackend,
    operation: &'static str,
    future: F,
) -> Result<F::Output, InboxError> {
    timer
        .within(backend, Inbox::DEFAULT_PARTITION_TIMEOUT, future)
        .await
        .map_err(|waited| InboxError::DatabaseSilent { operation, waited })
}

/// The bound on one call to `backend`: `timeout` over a network, none for an embedded
/// database, whose waits its busy timeout already ends.
pub(crate) fn bound_for(backend: DbBackend, timeout: Duration) -> Option<Duration> {
    over_network(backend).then_some(timeout)
}

/// Waits for `future` at most `bound` (without one, as long as it takes); past it the
/// future is dropped and the error is the bound waited.
pub(crate) async fn within_bound<F: Future>(
    bound: Option<Duration>,
    future: F,
) -> Result<F::Output, Duration> {
    match bound {
        Some(bound) => tokio::time::timeout(bound, future).await.map_err(|_| bound),
        None => Ok(future.await),
    }
}

/// One timer for the steps of a call, each bounded on its own: a step that finishes at its
/// first poll arms nothing, and the timer armed by the first step that waits serves every
/// later one. A later step's deadline is never earlier than the one armed before it (its
/// bound counts from a later start) unless its bound is shorter, so the timer fires at or
/// before the deadline of the step waiting on it; fired early, it is armed again for that
/// step's deadline. So each step still waits at most its bound, and a call registers one
/// timer with the runtime instead of one per step (each registration takes the time
/// driver's lock twice, to insert and to remove its entry).
#[derive(Debug, Default)]
pub(crate) struct StepTimer {
    timer: Option<Pin<Box<Sleep>>>,
    /// The waker the armed timer holds, from its last poll: while the timer has not
    /// fired and a step is polled with a waker that wakes the same task, the timer is not
    /// asked again (it would store the same waker once more, its cost at every poll of a
    /// step that waits on the network).
    waker: Option<Waker>,
}

impl StepTimer {
    /// The free [`within`] on this timer: waits for `future`, a call to `backend`, at most
    /// `timeout` where a network can go silent, counted from its first wait.
    pub(crate) fn within<F: Future>(
        &mut self,
        backend: DbBackend,
        timeout: Duration,
        future: F,
    ) -> Within<'_, F, fn(Duration) -> Duration> {
        self.within_bound(bound_for(backend, timeout), future)
    }

    /// Waits for `future` at most `bound` (without one, as long as it takes), counted from
    /// its first wait; past it the future is dropped and the error is the bound waited.
    pub(crate) fn within_bound<F: Future>(
        &mut self,
        bound: Option<Duration>,
        future: F,
    ) -> Within<'_, F, fn(Duration) -> Duration> {
        self.within_or(bound, future, std::convert::identity)
    }

    /// [`within_bound`](Self::within_bound) whose error past the bound is `silent` of the
    /// bound waited: the caller's error is made here rather than by a future around this
    /// one, which would hold `future` (a step's whole state) once more and copy it in.
    pub(crate) fn within_or<F: Future, M: FnOnce(Duration) -> E, E>(
        &mut self,
        bound: Option<Duration>,
        future: F,
        silent: M,
    ) -> Within<'_, F, M> {
        Within {
            future,
            timer: self,
            bound,
            deadline: None,
            silent: Some(silent),
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`StepTimer::within_or`]. Written by hand, not as an `async fn`: the
    /// step's future lives in it once, where an `async fn` would keep the argument and a
    /// pinned copy of it (and every move of the larger state copies both).
    pub(crate) struct Within<'t, F, M> {
        #[pin]
        future: F,
        timer: &'t mut StepTimer,
        bound: Option<Duration>,
        deadline: Option<Instant>,
        silent: Option<M>,
    }
}

impl<F: Future, M: FnOnce(Duration) -> E, E> Future for Within<'_, F, M> {
    type Output = Result<F::Output, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let Some(bound) = *this.bound else {
            return this.future.poll(cx).map(Ok);
        };
        let had_budget = coop::has_budget_remaining();
        if let Poll::Ready(output) = this.future.poll(cx) {
            return Poll::Ready(Ok(output));
        }
        let deadline = *this.deadline.get_or_insert_with(|| Instant::now() + bound);
        let StepTimer { timer, waker } = &mut **this.timer;
        let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.deadline() > deadline {
            timer.as_mut().reset(deadline);
            // Re-registered: asked below, so that it holds this task's waker.
            *waker = None;
        }
        if !timer.is_elapsed() && waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            return Poll::Pending;
        }
        loop {
            // As `tokio::time::timeout` does: when the step used up the task's budget,
            // the timer is still asked, so a busy step cannot outlive its bound.
            let fired = if had_budget && !coop::has_budget_remaining() {
                Pin::new(&mut coop::unconstrained(timer.as_mut())).poll(cx)
            } else {
                timer.as_mut().poll(cx)
            };
            match fired {
                Poll::Pending => {
                    if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        *waker = Some(cx.waker().clone());
                    }
                    return Poll::Pending;
                }
                // Armed for an earlier step's deadline: this step's is still to come.
                Poll::Ready(()) if timer.deadline() < deadline => timer.as_mut().reset(deadline),
                Poll::Ready(()) => {
                    return match this.silent.take() {
                        Some(silent) => Poll::Ready(Err(silent(bound))),
                        // Polled again after it finished: as a fused future, never again.
                        None => Poll::Pending,
                    };
                }
            }
        }
    }
}

/// The [`StepTimer`] a claim on a caller's transaction ran on, carried by the claim to its
/// commit, whose steps run on it too: the claim owns it, so neither step shares it through
/// the transaction (which the claim borrows shared) or a lock. Not part of what a claim
/// is: any two compare equal, and it hashes to nothing.
#[derive(Debug, Default)]
pub(crate) struct ClaimTimer(pub(crate) StepTimer);

impl PartialEq for ClaimTimer {
    fn eq(&self, _other: &Self) -> bool {
        true
    }
}

impl Eq for ClaimTimer {}

impl std::hash::Hash for ClaimTimer {
    fn hash<H: std::hash::Hasher>(&self, _state: &mut H) {}
}

/// [`answered_within`] for a call whose error names more than the operation (a claim's
/// message): `Err` carries how long it waited, for the caller to build its error.
pub(crate) async fn within<F: Future>(
    backend: DbBackend,
    timeout: Duration,
    future: F,
) -> Result<F::Output, Duration> {
    within_bound(bound_for(backend, timeout), future).await
}
#[cfg(test)]
mod tests {
    use super::*;

    /// SQLite is embedded: a call slower than the bound is awaited to its end, as the
    /// backend decides for `Inbox::process` too.
    #[tokio::test]
    async fn sqlite_calls_are_not_bounded() {
        let db = sea_orm::Database::connect("sqlite::memory:")
            .await
            .expect("an in-memory database");
        let slow = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            "answered"
        };
        let answer = answered_within(&db, Duration::from_millis(1), "a slow read", slow).await;
        assert_eq!(answer.ok(), Some("answered"));
    }

    /// The steps of one call share a timer and each keeps its own bound: a step longer
    /// than an earlier step's bound but within its own finishes (the timer armed for the
    /// earlier one fires early and is armed again), and a step past its own bound fails
    /// at that bound, not at a later one an earlier step armed.
    #[tokio::test]
    async fn steps_sharing_a_timer_keep_their_own_bounds() {
        let mut timer = StepTimer::default();
        let ms = Duration::from_millis;
        let quick = timer
            .within_bound(Some(ms(50)), tokio::time::sleep(ms(10)))
            .await;
        assert_eq!(quick, Ok(()), "the first step arms the timer for 50 ms");
        let longer = timer
            .within_bound(Some(ms(400)), tokio::time::sleep(ms(150)))
            .await;
        assert_eq!(longer, Ok(()), "150 ms is within this step's own 400 ms");
        let started = std::time::Instant::now();
        let stuck = timer
            .within_bound(Some(ms(30)), std::future::pending::<()>())
            .await;
        assert_eq!(stuck, Err(ms(30)));
        assert!(
            started.elapsed() < ms(250),
            "a step is cut at its own bound, not at the one armed before it ({:?})",
            started.elapsed()
        );
        let mut polls = 0;
        let spinning = std::future::poll_fn(|cx| {
            polls += 1;
            cx.waker().wake_by_ref();
            Poll::<()>::Pending
        });
        let started = std::time::Instant::now();
        let busy = timer.within_bound(Some(ms(30)), spinning).await;
        assert_eq!(
            busy,
            Err(ms(30)),
            "a step that keeps waking its task is cut too"
        );
        assert!(
            polls > 1,
            "the step was polled again while the timer was armed"
        );
        assert!(started.elapsed() < ms(250), "{:?}", started.elapsed());
        let at_once = timer.within_bound(Some(ms(1)), async { 7 }).await;
        assert_eq!(at_once, Ok(7));
        assert_eq!(
            StepTimer::default().within_bound(None, async { 8 }).await,
            Ok(8)
        );
    }
}
