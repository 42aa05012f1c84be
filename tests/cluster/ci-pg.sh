#!/usr/bin/env bash
# CI step for the PostgreSQL scaling-out suites: installs what is missing, starts PgBouncer
# (transaction pooling, in front of the system PostgreSQL on 5432) and runs the claim,
# process, lease, batch, retention, lost-reply and every-public-function scenarios through
# it, then the failover tests (which
# build, fail over and stop their own primary + standby behind HAProxy). Any fixture that
# cannot start fails the step; nothing is skipped. Takes a few minutes.
#
#   bash tests/cluster/ci-pg.sh     # from the workspace root, as root
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."

"$HERE/install-pg.sh"
if ! psql -h 127.0.0.1 -p 5432 -U postgres -d test -Atc 'SELECT 1' >/dev/null; then
    echo "the system PostgreSQL on 127.0.0.1:5432 (database test) must be up for PgBouncer" >&2
    exit 1
fi

cleanup() {
    "$HERE/pgbouncer.sh" stop || true
    "$HERE/pg-failover.sh" stop || true
}
trap cleanup EXIT

INBOX_TEST_PGBOUNCER_URL=$("$HERE/pgbouncer.sh" start)
export INBOX_TEST_PGBOUNCER_URL
echo "== PgBouncer (transaction pooling): $INBOX_TEST_PGBOUNCER_URL"
# Every suite's pgbouncer:: module (claim, process, lease, batch, lock_wait, retention,
# lost_reply, pooler): the scenarios that hold up under transaction pooling.
cargo test --workspace --test db pgbouncer:: -- --ignored

echo "== PostgreSQL failover behind HAProxy (synchronous, asynchronous, standby down)"
INBOX_TEST_PG_FAILOVER=1 cargo test --workspace --test db pg_failover:: -- --ignored \
    --test-threads=1 --nocapture
