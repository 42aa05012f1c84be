//! The guide: one chapter per topic, each a Markdown file in `docs/guide/` of this crate,
//! included here so that every Rust example in it compiles as a doctest and cannot drift
//! from the API.
//!
//! Start with [`getting_started`] (installing, the migrations, a running consumer, the
//! outbox in brief) and [`handlers`], then read the chapter of the feature you use.

/// The chapters link each other by reference labels (`[text][keys]`) that each Markdown
/// file defines as file links (`[keys]: keys.md`) for readers of the repository. These
/// definitions come first in every chapter's docs, and the first definition of a label
/// wins, so in rustdoc the same labels lead to the chapters' modules.
macro_rules! chapter_links {
    () => {
        "[getting-started]: crate::guide::getting_started\n\
         [handlers]: crate::guide::handlers\n\
         [leases]: crate::guide::leases\n\
         [keys]: crate::guide::keys\n\
         [batches]: crate::guide::batches\n\
         [retention]: crate::guide::retention\n\
         [admission-floor]: crate::guide::admission_floor\n\
         [fault-tolerance]: crate::guide::fault_tolerance\n\
         [postgres-failover]: crate::guide::postgres_failover\n\
         [pgbouncer]: crate::guide::pgbouncer\n\
         [galera]: crate::guide::galera\n\
         [partitions]: crate::guide::partitions\n\
         [backend-notes]: crate::guide::backend_notes\n\
         [observability]: crate::guide::observability\n\
         [tests]: crate::guide::tests\n\
         [outbox]: crate::guide::outbox\n\
         [kafka]: crate::guide::kafka\n\
         [sqs]: crate::guide::sqs\n\
         [fault-tolerance#lost-replies]: crate::guide::fault_tolerance#lost-replies\n\
         [retention#table-growth-at-scale]: crate::guide::retention#table-growth-at-scale\n\
         [handlers#the-traps]: crate::guide::handlers#the-traps\n\
         [outbox#next-to-the-peers]: crate::guide::outbox#next-to-the-peers\n\
         [backend-notes#the-table]: crate::guide::backend_notes#the-table\n\
         [backend-notes#the-migrations-in-your-migrator]: crate::guide::backend_notes#the-migrations-in-your-migrator\n\
         [backend-notes#rollbacks-that-refuse-before-they-change-anything]: crate::guide::backend_notes#rollbacks-that-refuse-before-they-change-anything\n\
         [backend-notes#another-table-name-or-several-inboxes]: crate::guide::backend_notes#another-table-name-or-several-inboxes\n"
    };
}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/getting-started.md")]
pub mod getting_started {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/handlers.md")]
pub mod handlers {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/leases.md")]
pub mod leases {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/keys.md")]
pub mod keys {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/batches.md")]
pub mod batches {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/retention.md")]
pub mod retention {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/admission-floor.md")]
pub mod admission_floor {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/fault-tolerance.md")]
pub mod fault_tolerance {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/partitions.md")]
pub mod partitions {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/postgres-failover.md")]
pub mod postgres_failover {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/pgbouncer.md")]
pub mod pgbouncer {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/galera.md")]
pub mod galera {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/backend-notes.md")]
pub mod backend_notes {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/observability.md")]
pub mod observability {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/outbox.md")]
pub mod outbox {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/kafka.md")]
pub mod kafka {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/sqs.md")]
pub mod sqs {}

#[doc = chapter_links!()]
#[doc = include_str!("../docs/guide/tests.md")]
pub mod tests {}
