#!/usr/bin/env bash
# The CI's compile-heavy work, run by .ci/run in the background at the lowest priority
# while the cluster suites wait on their nodes. Each builds with a feature set of its own
# (so it shares nothing with the workspace's test build) into CARGO_TARGET_DIR (.ci/run
# gives it target/ci-apps, so it never holds the build lock the foreground's cargo calls
# need). In order, stopping at the first failure:
#
#  1. ci/check-deps.sh: the feature-selection apps, built, checked and run (the
#     PostgreSQL-only one against INBOX_TEST_POSTGRES_URL).
#  2. ci/seaorm-app.sh prebuild: the SeaORM-tooling app's crates, which .ci/run then
#     drives with sea-orm-cli in the foreground (same CARGO_TARGET_DIR).
#  3. The benchmark (`cargo build -p inbox-bench`: with -p, cargo resolves the bench's
#     own features), for .ci/run's smoke run.
#  4. cargo package of the three library crates, verified against each other's packages
#     (none is published yet), with all three backends, since none is on by default: a
#     missing file or a path dependency without a version fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CARGO_TARGET_DIR:?set CARGO_TARGET_DIR: the background builds keep out of the workspace target}"

timed() { # name, command...
  local name=$1 started=$SECONDS; shift
  echo "background-builds: $name"
  "$@"
  echo "background-builds: $name: $((SECONDS - started)) s"
}

timed "ci/check-deps.sh" bash ci/check-deps.sh
timed "ci/seaorm-app.sh prebuild" bash ci/seaorm-app.sh prebuild
timed "cargo build -p inbox-bench" cargo build --quiet -p inbox-bench
timed "cargo package of the library crates" \
  cargo package --quiet -p sea-orm-inbox-entity -p sea-orm-inbox-migration -p sea-orm-inbox \
  --features sea-orm-inbox/postgres,sea-orm-inbox/mysql,sea-orm-inbox/sqlite,sea-orm-inbox-migration/postgres,sea-orm-inbox-migration/mysql,sea-orm-inbox-migration/sqlite
