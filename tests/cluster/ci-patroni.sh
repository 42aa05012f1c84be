#!/usr/bin/env bash
# CI step for the Patroni failover suite: installs what is missing (etcd, HAProxy, jq, and
# Patroni in a virtual environment), starts etcd + 3 PostgreSQL nodes under Patroni behind
# HAProxy (tests/cluster/patroni.sh), runs tests/tests/db/patroni.rs against it, prints the
# counts of every event, and stops the cluster, also when the tests fail. A cluster that
# cannot start fails the step: the suite is mandatory, never skipped. About 2.5 minutes.
#
#   bash tests/cluster/ci-patroni.sh     # from anywhere, as root
set -euo pipefail
cd "$(dirname "$0")/../.."

cluster=tests/cluster/patroni.sh
started=$SECONDS
trap 'bash "$cluster" stop || true' EXIT
if ! INBOX_TEST_PATRONI_URLS=$(bash "$cluster" start); then
  echo "ci-patroni: the Patroni cluster did not start; its suite is mandatory" >&2
  exit 1
fi
export INBOX_TEST_PATRONI_URLS
echo "ci-patroni: cluster up after $((SECONDS - started)) s: INBOX_TEST_PATRONI_URLS=$INBOX_TEST_PATRONI_URLS"

log=$(mktemp)
status=0
cargo test --workspace --test db patroni:: -- --ignored --test-threads=1 --nocapture 2>&1 | tee "$log" || status=$?
echo "ci-patroni: counts"
grep -o 'Patroni, .*' "$log" || true
rm -f "$log"
trap - EXIT
bash "$cluster" stop
echo "ci-patroni: done in $((SECONDS - started)) s (exit $status)"
exit "$status"
