#!/usr/bin/env bash
# The proof that the inbox crates let the application choose its drivers: builds and runs
# the two applications of ci/apps (PostgreSQL only with native TLS; SQLite only without
# TLS), each depending on the inbox crates with `default-features = false` and one backend
# feature, and fails if a dependency tree holds a driver or TLS stack that application did
# not ask for (or lacks the one it did: a check that finds nothing must not pass). The same
# rule keeps the benchmark's plotting crate in inbox-bench alone: the examples and the test
# binaries must not build it. A third app names no backend feature at all, and must fail to
# build with the crate's message.
#
# Needs INBOX_TEST_POSTGRES_URL for the PostgreSQL app's run. CARGO_TARGET_DIR, when
# set, is where the apps build (default: the workspace's target). native-tls builds openssl-sys,
# so libssl-dev and pkg-config are installed when missing.
set -euo pipefail
cd "$(dirname "$0")/apps"
# The library's target directory: the dependencies both builds share compile once.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/../../target}"

if ! dpkg -s libssl-dev pkg-config >/dev/null 2>&1; then
  echo "check-deps: installing libssl-dev and pkg-config (native-tls builds openssl-sys)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libssl-dev pkg-config
fi
# `check-deps.sh packages` stops here: .ci/run installs them before it runs the rest in
# the background, beside scripts whose apt-get would otherwise meet this one's dpkg lock.
if [[ ${1:-} == packages ]]; then exit 0; fi

# The names of every package in the app's normal and build dependency tree.
tree_of() {
  cargo tree -p "$1" -e normal,build --prefix none --format '{p}' | awk '{print $1}' | sort -u
}

# app, then "+name" for what must be there and "-name" for what must not.
check_tree() {
  local app=$1; shift
  local tree failed=0
  tree=$(tree_of "$app")
  for rule in "$@"; do
    local name=${rule:1}
    if [[ $rule == -* ]] && grep -qx "$name" <<<"$tree"; then
      echo "check-deps: $app depends on $name, which it did not ask for:" >&2
      cargo tree -p "$app" -e normal,build -i "$name" >&2 || true
      failed=1
    elif [[ $rule == +* ]] && ! grep -qx "$name" <<<"$tree"; then
      echo "check-deps: $app lacks $name, which it asked for: the check would prove nothing" >&2
      failed=1
    fi
  done
  if (( failed )); then return 1; fi
  echo "check-deps: $app: ok ($*)"
}

check_tree postgres-only +sqlx-postgres +native-tls \
  -sqlx-sqlite -sqlx-mysql -libsqlite3-sys -rustls -lapin -async-nats
check_tree sqlite-only +sqlx-sqlite +libsqlite3-sys \
  -sqlx-postgres -sqlx-mysql -rustls -native-tls -openssl-sys -lapin -async-nats
# The workspace's own packages: cargo tree from its root, not from the apps' workspace.
(
  cd ../..
  check_tree inbox-bench +plotters
  check_tree inbox-examples -plotters
  check_tree inbox-tests -plotters
)

# One app at a time: built together, cargo would unify their features.
echo "check-deps: building and running the apps"
cargo run --quiet -p sqlite-only
cargo run --quiet -p postgres-only

# The default features name no backend (as sea-orm's name no driver): an application that
# adds none must fail to build, with the message that says what to add, not at run time.
echo "check-deps: no-backend must fail to build, naming the backend features"
if no_backend=$(cargo check --quiet -p no-backend 2>&1); then
  echo "check-deps: no-backend built without a backend feature; it must not" >&2
  exit 1
fi
if ! grep -q "enable at least one of sea-orm-inbox's backend features: postgres, mysql, sqlite" <<<"$no_backend"; then
  echo "check-deps: no-backend failed to build, but not with the backend message:" >&2
  echo "$no_backend" >&2
  exit 1
fi
echo "check-deps: no-backend: fails to build with the backend message (ok)"
