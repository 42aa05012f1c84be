//! The guide: one chapter per topic, each a Markdown file in `docs/guide/` of this crate,
//! included here so that every Rust example in it compiles as a doctest and cannot drift
//! from the API.
//!
//! Start with [`handlers`], then read the chapter of the feature you use.

#[doc = include_str!("../docs/guide/handlers.md")]
pub mod handlers {}

#[doc = include_str!("../docs/guide/leases.md")]
pub mod leases {}

#[doc = include_str!("../docs/guide/keys.md")]
pub mod keys {}

#[doc = include_str!("../docs/guide/batches.md")]
pub mod batches {}

#[doc = include_str!("../docs/guide/retention.md")]
pub mod retention {}

#[doc = include_str!("../docs/guide/admission-floor.md")]
pub mod admission_floor {}

#[doc = include_str!("../docs/guide/fault-tolerance.md")]
pub mod fault_tolerance {}

#[doc = include_str!("../docs/guide/postgres-failover.md")]
pub mod postgres_failover {}

#[doc = include_str!("../docs/guide/pgbouncer.md")]
pub mod pgbouncer {}

#[doc = include_str!("../docs/guide/galera.md")]
pub mod galera {}

#[doc = include_str!("../docs/guide/backend-notes.md")]
pub mod backend_notes {}

#[doc = include_str!("../docs/guide/observability.md")]
pub mod observability {}

#[doc = include_str!("../docs/guide/tests.md")]
pub mod tests {}
