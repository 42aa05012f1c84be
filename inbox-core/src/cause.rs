//! Finding what a handler's error says, whatever type the application gave it: whether a
//! failure is transient (retried, nacked) or permanent (dead-lettered) is the
//! application's verdict where it gave one ([`Permanent`], [`Transient`]), else the
//! database's, so the error types applications use are looked into: the error itself, a
//! `Box<dyn Error + Send + Sync>`, an `anyhow::Error` or an `eyre::Report`, whatever
//! features the application turned on.

use sea_orm::DbErr;
use std::any::Any;
use std::error::Error;
use std::fmt;

/// The [`DbErr`] behind a handler error, if one can be found: the error itself is a
/// `DbErr` (the handler used `?` on a statement); or it is a
/// `Box<dyn Error + Send + Sync>`, an `anyhow::Error` or an `eyre::Report` with a `DbErr`
/// in its chain of sources, context layers included. An error type of the application's
/// own is not looked into: the compiler cannot ask a generic `E` for its sources without
/// a bound every handler would have to meet.
pub(crate) fn db_cause<E: 'static>(err: &E) -> Option<&DbErr> {
    let any = err as &dyn Any;
    if let Some(db_err) = any.downcast_ref::<DbErr>() {
        return Some(db_err);
    }
    if let Some(report) = any.downcast_ref::<anyhow::Error>() {
        return report
            .downcast_ref::<DbErr>()
            .or_else(|| in_chain(report.chain()));
    }
    if let Some(report) = any.downcast_ref::<eyre::Report>() {
        return report
            .downcast_ref::<DbErr>()
            .or_else(|| in_chain(report.chain()));
    }
    in_chain(chain(err)?)
}

/// What the application said of a handler error: `Some(true)` when it (or an error in its
/// chain of sources, outermost first) is a [`Permanent`], `Some(false)` for a
/// [`Transient`], `None` when it said nothing.
pub(crate) fn app_verdict<E: 'static>(err: &E) -> Option<bool> {
    let verdict = |err: &(dyn Error + 'static)| {
        if err.is::<Permanent>() {
            Some(true)
        } else if err.is::<Transient>() {
            Some(false)
        } else {
            None
        }
    };
    let any = err as &dyn Any;
    if let Some(report) = any.downcast_ref::<anyhow::Error>() {
        return report.chain().find_map(verdict);
    }
    if let Some(report) = any.downcast_ref::<eyre::Report>() {
        return report.chain().find_map(verdict);
    }
    chain(err)?.find_map(verdict)
}

/// The text of a handler error, where its type is one the crate can name (a `DbErr`, a
/// `Box<dyn Error + Send + Sync>`, an `anyhow::Error`, an `eyre::Report`, a `String` or
/// `&str`, [`Permanent`], [`Transient`]), with its chain of sources: for the events that
/// report a handler's failure. `None` for an error type of the application's own.
pub(crate) fn error_text<E: 'static>(err: &E) -> Option<String> {
    let any = err as &dyn Any;
    if let Some(report) = any.downcast_ref::<anyhow::Error>() {
        return Some(format!("{report:#}"));
    }
    if let Some(report) = any.downcast_ref::<eyre::Report>() {
        let texts: Vec<String> = report.chain().map(ToString::to_string).collect();
        return Some(texts.join(": "));
    }
    if let Some(text) = any.downcast_ref::<String>() {
        return Some(text.clone());
    }
    if let Some(text) = any.downcast_ref::<&str>() {
        return Some((*text).to_owned());
    }
    if let Some(db_err) = any.downcast_ref::<DbErr>() {
        return Some(db_err.to_string());
    }
    let texts: Vec<String> = chain(err)?.map(ToString::to_string).collect();
    Some(texts.join(": "))
}

/// [`error_text`], or for an error type of the application's own a note saying how to see
/// its text: what the handler-failure events report.
pub(crate) fn reported_text<E: 'static>(err: &E) -> String {
    error_text(err).unwrap_or_else(|| {
        "an error of the application's own type (return a boxed error, anyhow or eyre to see its text here)"
            .to_owned()
    })
}

/// The chain of sources of `err` when it is a standard error the crate can name: a
/// `Box<dyn Error + Send + Sync>`, or one of the crate's own [`Permanent`] or
/// [`Transient`].
fn chain<E: 'static>(err: &E) -> Option<impl Iterator<Item = &(dyn Error + 'static)>> {
    let any = err as &dyn Any;
    let top: &(dyn Error + 'static) =
        if let Some(boxed) = any.downcast_ref::<Box<dyn Error + Send + Sync>>() {
            boxed.as_ref()
        } else if let Some(permanent) = any.downcast_ref::<Permanent>() {
            permanent
        } else {
            any.downcast_ref::<Transient>()?
        };
    Some(std::iter::successors(Some(top), |err| (*err).source()))
}

fn in_chain<'e>(mut chain: impl Iterator<Item = &'e (dyn Error + 'static)>) -> Option<&'e DbErr> {
    chain.find_map(|err| err.downcast_ref::<DbErr>())
}

/// A handler error the application calls permanent: no redelivery can fix it (an order
/// for a product that does not exist, a malformed payload). [`Settlement`](crate::Settlement)
/// dead-letters it on its first delivery, whatever it wraps, instead of nacking it until
/// the broker's delivery limit.
///
/// Return it from the handler, or put it anywhere in the chain of sources of a
/// `Box<dyn Error + Send + Sync>`, an `anyhow::Error` or an `eyre::Report` (`.context(..)`
/// layers included): the outermost of [`Permanent`] and [`Transient`] decides.
///
/// ```
/// use sea_orm_inbox::{Outcome, Permanent, ProcessError, Settlement};
///
/// fn parse(payload: &str) -> Result<u32, Permanent> {
///     payload
///         .parse()
///         .map_err(|err| Permanent::new(format!("payload {payload:?} is no amount: {err}")))
/// }
///
/// let failed: Result<Outcome<()>, ProcessError<Permanent>> =
///     Err(ProcessError::Handler(parse("ten").unwrap_err()));
/// assert_eq!(Settlement::for_delivery(&failed, 1), Settlement::DeadLetter);
///
/// // Inside anyhow, with context:
/// let failed: Result<Outcome<()>, ProcessError<anyhow::Error>> = Err(ProcessError::Handler(
///     anyhow::Error::new(parse("ten").unwrap_err()).context("order 42"),
/// ));
/// assert_eq!(Settlement::for_delivery(&failed, 1), Settlement::DeadLetter);
/// ```
#[derive(Debug)]
pub struct Permanent(Box<dyn Error + Send + Sync>);

impl Permanent {
    /// Marks `err` permanent. A string makes a message of its own.
    pub fn new(err: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self(err.into())
    }

    /// The error it marks.
    pub fn into_inner(self) -> Box<dyn Error + Send + Sync> {
        self.0
    }
}

impl fmt::Display for Permanent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (permanent: no redelivery can fix it)", self.0)
    }
}

impl Error for Permanent {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(self.0.as_ref())
    }
}

/// A handler error the application calls transient: a redelivery may succeed (a
/// downstream service that was down), although the database would call what it wraps
/// permanent. [`Settlement`](crate::Settlement) nacks it with the redelivery delay; the
/// broker's own delivery limit still ends it.
///
/// ```
/// use sea_orm_inbox::{Outcome, ProcessError, Settlement, Transient};
///
/// let failed: Result<Outcome<()>, ProcessError<Transient>> =
///     Err(ProcessError::Handler(Transient::new("the payment service answered 503")));
/// assert!(matches!(Settlement::for_delivery(&failed, 1), Settlement::Nack(Some(_))));
/// ```
#[derive(Debug)]
pub struct Transient(Box<dyn Error + Send + Sync>);

impl Transient {
    /// Marks `err` transient. A string makes a message of its own.
    pub fn new(err: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self(err.into())
    }

    /// The error it marks.
    pub fn into_inner(self) -> Box<dyn Error + Send + Sync> {
        self.0
    }
}

impl fmt::Display for Transient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (transient: a redelivery may succeed)", self.0)
    }
}

impl Error for Transient {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(self.0.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sea_orm::RuntimeErr;
    use std::fmt;

    fn db_err() -> DbErr {
        DbErr::Exec(RuntimeErr::Internal("deadlock".into()))
    }

    #[derive(Debug)]
    struct Wrapper(DbErr);

    impl fmt::Display for Wrapper {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("crediting the account failed")
        }
    }

    impl Error for Wrapper {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn finds_the_db_err_itself_and_in_a_boxed_chain() {
        assert!(db_cause(&db_err()).is_some());
        let boxed: Box<dyn Error + Send + Sync> = Box::new(Wrapper(db_err()));
        assert!(db_cause(&boxed).is_some());
        assert!(db_cause(&Wrapper(db_err())).is_none(), "not looked into");
        assert!(db_cause(&"no database here".to_string()).is_none());
    }

    /// Whatever features the build has: before, without the `anyhow` feature, a permanent
    /// `DbErr` inside an `anyhow::Error` was not found, and the message was nacked until
    /// the broker's limit instead of dead-lettered.
    #[test]
    fn finds_the_db_err_in_anyhow_with_context() {
        let plain = anyhow::Error::from(db_err());
        assert!(db_cause(&plain).is_some());
        let with_context = anyhow::Error::from(db_err()).context("crediting the account");
        assert!(db_cause(&with_context).is_some());
        let wrapped = anyhow::Error::from(Wrapper(db_err()));
        assert!(db_cause(&wrapped).is_some());
        assert!(db_cause(&anyhow::anyhow!("card declined")).is_none());
    }

    #[test]
    fn finds_the_db_err_in_eyre_with_context() {
        use eyre::WrapErr;
        let with_context: Result<(), eyre::Report> =
            Err(db_err()).wrap_err("crediting the account");
        assert!(db_cause(&with_context.expect_err("an error")).is_some());
        let wrapped = eyre::Report::from(Wrapper(db_err()));
        assert!(db_cause(&wrapped).is_some());
        assert!(db_cause(&eyre::eyre!("card declined")).is_none());
    }

    #[test]
    fn the_outermost_verdict_of_the_application_decides() {
        assert_eq!(app_verdict(&Permanent::new("no such product")), Some(true));
        assert_eq!(
            app_verdict(&Transient::new(Permanent::new("x"))),
            Some(false)
        );
        assert_eq!(app_verdict(&db_err()), None);
        let boxed: Box<dyn Error + Send + Sync> = Box::new(Permanent::new(Wrapper(db_err())));
        assert_eq!(app_verdict(&boxed), Some(true));
        assert!(
            db_cause(&boxed).is_some(),
            "the DbErr under the verdict is found too"
        );
        let report = anyhow::Error::new(Transient::new("503")).context("order 42");
        assert_eq!(app_verdict(&report), Some(false));
        let report = eyre::Report::new(Permanent::new("no such product"));
        assert_eq!(app_verdict(&report), Some(true));
        assert_eq!(app_verdict(&"plain".to_string()), None);
    }
}
