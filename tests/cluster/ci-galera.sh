#!/usr/bin/env bash
# CI step for the Galera suite: installs the packages if they are missing, starts the
# 3-node cluster (tests/cluster/galera.sh), runs the suite `tests/tests/db/galera.rs` against
# it and stops the cluster, also when the tests fail. A cluster that cannot start fails
# the step: the suite is mandatory, never skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."

cluster=tests/cluster/galera.sh
bash tests/cluster/install.sh
trap 'bash "$cluster" stop >/dev/null || true' EXIT
if ! bash "$cluster" start; then
  echo "ci-galera: the Galera cluster did not start; its suite is mandatory" >&2
  exit 1
fi
INBOX_TEST_GALERA_URLS=$(bash "$cluster" urls)
export INBOX_TEST_GALERA_URLS
echo "ci-galera: INBOX_TEST_GALERA_URLS=$INBOX_TEST_GALERA_URLS"

log=$(mktemp)
status=0
cargo test --workspace --test db galera:: -- --ignored --nocapture 2>&1 | tee "$log" || status=$?
echo "ci-galera: counts"
grep -E '^Galera ' "$log" || true
rm -f "$log"
exit "$status"
