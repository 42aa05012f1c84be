//! Turns the test suites' environment variables into cfgs, so a suite whose server or broker
//! is missing is compiled as `#[ignore]`d with the reason, and the summary
//! line counts it as ignored instead of passed.
//!
//! To gate a new suite: add a row to [`GATES`], then mark its tests
//! `#[cfg_attr(not(inbox_...), ignore = "set INBOX_TEST_...")]` (or list them in
//! `on_every_backend!`, which already gates the Postgres and MySQL suites). Cargo rebuilds
//! the tests when one of these variables changes.
//!
//! The cluster suites and the PostgreSQL restart are not gated here: they are always
//! `#[ignore]`d and run with `--ignored` by their CI scripts, so that setting their
//! variables does not rebuild the whole `db` binary in each CI step.

/// One gate: the variable (a URL: set and not empty opens the gate) and the cfg it sets.
struct Gate {
    var: &'static str,
    cfg: &'static str,
}

const GATES: &[Gate] = &[
    Gate {
        var: "INBOX_TEST_POSTGRES_URL",
        cfg: "inbox_postgres",
    },
    Gate {
        var: "INBOX_TEST_MYSQL_URL",
        cfg: "inbox_mysql",
    },
    Gate {
        var: "INBOX_TEST_AMQP_URL",
        cfg: "inbox_amqp",
    },
    Gate {
        var: "INBOX_TEST_NATS_URL",
        cfg: "inbox_nats",
    },
    Gate {
        var: "INBOX_TEST_KAFKA_BOOTSTRAP",
        cfg: "inbox_kafka",
    },
    Gate {
        var: "INBOX_TEST_SQS_ENDPOINT",
        cfg: "inbox_sqs",
    },
];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    for gate in GATES {
        println!("cargo::rerun-if-env-changed={}", gate.var);
        println!("cargo::rustc-check-cfg=cfg({})", gate.cfg);
        if !std::env::var(gate.var).unwrap_or_default().is_empty() {
            println!("cargo::rustc-cfg={}", gate.cfg);
        }
    }
}
