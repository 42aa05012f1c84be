//! Finding the [`DbErr`] inside a handler's error, whatever type the application gave it:
//! whether a handler failure is transient (retried in place) or permanent (dead-lettered)
//! is the database's verdict, so the error types applications use are looked into.

use sea_orm::DbErr;
use std::any::Any;
use std::error::Error;

/// The [`DbErr`] behind a handler error, if one can be found: the error itself is a
/// `DbErr` (the handler used `?` on a statement); or it is a
/// `Box<dyn Error + Send + Sync>`, an `anyhow::Error` (feature `anyhow`) or an
/// `eyre::Report` (feature `eyre`) with a `DbErr` in its chain of sources, context layers
/// included. An error type of the application's own is not looked into: the compiler
/// cannot ask a generic `E` for its sources without a bound every handler would have to
/// meet.
pub(crate) fn db_cause<E: 'static>(err: &E) -> Option<&DbErr> {
    let any = err as &dyn Any;
    if let Some(db_err) = any.downcast_ref::<DbErr>() {
        return Some(db_err);
    }
    if let Some(boxed) = any.downcast_ref::<Box<dyn Error + Send + Sync>>() {
        let top: &(dyn Error + 'static) = boxed.as_ref();
        return in_chain(std::iter::successors(Some(top), |err| (*err).source()));
    }
    #[cfg(feature = "anyhow")]
    if let Some(report) = any.downcast_ref::<anyhow::Error>() {
        return report
            .downcast_ref::<DbErr>()
            .or_else(|| in_chain(report.chain()));
    }
    #[cfg(feature = "eyre")]
    if let Some(report) = any.downcast_ref::<eyre::Report>() {
        return report
            .downcast_ref::<DbErr>()
            .or_else(|| in_chain(report.chain()));
    }
    None
}

fn in_chain<'e>(mut chain: impl Iterator<Item = &'e (dyn Error + 'static)>) -> Option<&'e DbErr> {
    chain.find_map(|err| err.downcast_ref::<DbErr>())
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

    #[cfg(feature = "anyhow")]
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

    #[cfg(feature = "eyre")]
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
}
