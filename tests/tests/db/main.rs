//! The database and broker suites, one module per behaviour, in one test binary so the
//! workspace links the three drivers once instead of once per suite.
//!
//! `cargo test -p inbox-tests --test db claim::` runs one suite, `-- postgres::` one backend
//! of every suite. Three suites stay binaries of their own, because they need the process
//! to themselves: `observability` installs the process-global tracing subscriber and
//! `prometheus` the process-global metrics recorder (either would capture every other
//! suite's spans or counts), and `postgres_restart` restarts the PostgreSQL server every
//! other suite is using, so it must never run alongside them.

mod admission;
mod batch;
mod brokers;
mod claim;
mod ended_transaction;
mod example_loops;
mod faults;
mod galera;
mod input;
mod kafka;
mod kafka_dead_letter;
mod kafka_end_to_end;
mod kafka_group;
mod kafka_outbox;
mod keys;
mod lease;
mod localized;
mod lock_wait;
mod loop_faults;
mod lost_reply;
mod migration;
mod migrators;
mod modes;
mod observed;
mod outbox;
mod outbox_brokers;
mod outbox_due;
mod outbox_hot;
mod outbox_partition;
mod outbox_pooler;
mod outbox_purger;
mod outbox_send_time;
mod outbox_settle;
mod outbox_soak;
mod outbox_wake;
mod partition;
mod patroni;
mod pg_failover;
mod pooler;
mod pre_commit;
mod process;
mod proof;
mod quiet_duplicates;
mod race;
mod retention;
mod round_trips;
mod schema;
mod soak;
mod sqs;
mod table_name;
mod upgrade;
