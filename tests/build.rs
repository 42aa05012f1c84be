//! Turns the test suites' environment variables into cfgs, so a suite whose server, broker
//! or permission is missing is compiled as `#[ignore]`d with the reason, and the summary
//! line counts it as ignored instead of passed.
//!
//! To gate a new suite: add a row to [`GATES`], then mark its tests
//! `#[cfg_attr(not(inbox_...), ignore = "set INBOX_TEST_...")]` (or list them in
//! `on_every_backend!`, which already gates the Postgres and MySQL suites). Cargo rebuilds
//! the tests when one of these variables changes.

/// One gate: the variable, the cfg it sets, and whether the value must be exactly `1`
/// (a permission to do something disruptive) rather than any non-empty value (a URL).
struct Gate {
    var: &'static str,
    cfg: &'static str,
    needs_one: bool,
}

const GATES: &[Gate] = &[
    Gate {
        var: "INBOX_TEST_POSTGRES_URL",
        cfg: "inbox_postgres",
        needs_one: false,
    },
    Gate {
        var: "INBOX_TEST_MYSQL_URL",
        cfg: "inbox_mysql",
        needs_one: false,
    },
    Gate {
        var: "INBOX_TEST_AMQP_URL",
        cfg: "inbox_amqp",
        needs_one: false,
    },
    Gate {
        var: "INBOX_TEST_NATS_URL",
        cfg: "inbox_nats",
        needs_one: false,
    },
    Gate {
        var: "INBOX_TEST_RESTART_POSTGRES",
        cfg: "inbox_restart_postgres",
        needs_one: true,
    },
    Gate {
        var: "INBOX_TEST_PGBOUNCER_URL",
        cfg: "inbox_pgbouncer",
        needs_one: false,
    },
    Gate {
        var: "INBOX_TEST_PG_FAILOVER",
        cfg: "inbox_pg_failover",
        needs_one: true,
    },
    Gate {
        var: "INBOX_TEST_PATRONI_URLS",
        cfg: "inbox_patroni",
        needs_one: false,
    },
    Gate {
        var: "INBOX_TEST_GALERA_URLS",
        cfg: "inbox_galera",
        needs_one: false,
    },
];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    for gate in GATES {
        println!("cargo::rerun-if-env-changed={}", gate.var);
        println!("cargo::rustc-check-cfg=cfg({})", gate.cfg);
        let value = std::env::var(gate.var).unwrap_or_default();
        let open = if gate.needs_one {
            value == "1"
        } else {
            !value.is_empty()
        };
        if open {
            println!("cargo::rustc-cfg={}", gate.cfg);
        }
    }
}
