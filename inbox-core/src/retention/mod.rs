//! How long markers must be kept, and a purge that deletes older ones in bounded batches.

mod pacer;
mod policy;
mod purge;
mod purger;
mod walk;

pub use policy::{BrokerRedelivery, PurgePacing, RetentionPolicy};
pub use purge::{PurgeReport, purge, purge_in};
pub use purger::{Purger, PurgerSummary, spawn_purger, spawn_purger_in};
