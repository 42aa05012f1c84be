//! How long markers must be kept, and a purge that deletes older ones in bounded batches.

mod pacer;
mod policy;
mod purge;
mod purger;
mod walk;

pub use policy::{BrokerRedelivery, PurgePacing, RetentionPolicy};
pub use purge::{PurgeReport, purge};
pub use purger::{Purger, PurgerSummary, spawn_purger};
